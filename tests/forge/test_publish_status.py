"""`forge publish` and a cell's status: experimental only when asked, never its meta wheels;
broken never. Published to a real local index (pypiserver)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _fixtures import Project, fakeeng_project

from forge.build import read_core_version
from forge.cli import main
from forge.index import LocalIndex
from tests.forge.conftest import Member, WheelRecipe, build_wheel

CELL = "fakeeng-1.0"
REASON = "new release, transforms unreviewed"


def set_status(project: Project, status: str) -> None:
    text = project.matrix.read_text()
    assert 'status = "supported"' in text
    project.matrix.write_text(
        text.replace('status = "supported"', f'status = "{status}"\nreason = "{REASON}"'))


def build_cell_and_core(project: Project) -> Path:
    """The cell's wheels in dist/fakeeng-1.0/ and the kvcached-core wheel its metas pin."""
    assert main(project.args("approve-diff", CELL)[:-2]) == 0
    assert main(project.args("build", CELL)) == 0
    tags = "cp311-cp311-manylinux_2_35_x86_64"
    recipe = WheelRecipe(name="kvcached_core", version=read_core_version(), tags=tags,
                         wheel_tag_line=tags,
                         package={"kvcached_core/__init__.py": Member(b"CORE = 1\n")})
    return build_wheel(recipe, project.dist / "core")


def publish_args(project: Project, index: LocalIndex, *extra: str) -> list[str]:
    return ["publish", CELL, "--repository-url", index.url, *project.args("build", CELL)[2:],
            *extra]


def on_index(index: LocalIndex) -> list[str]:
    return sorted(p.name for p in index.packages_dir.iterdir()) \
        if index.packages_dir.is_dir() else []


def test_an_experimental_cell_is_refused_unless_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], local_index: LocalIndex) -> None:
    with fakeeng_project(tmp_path) as project:
        set_status(project, "experimental")
        build_cell_and_core(project)
        capsys.readouterr()
        assert main(publish_args(project, local_index)) == 1
    assert capsys.readouterr().err == (
        f"forge: error: cell {CELL} is experimental ({REASON}): not published unless asked "
        "with --allow-experimental, and then without its meta wheels\n")
    assert on_index(local_index) == []


def test_an_allowed_experimental_cell_goes_up_without_the_meta_name_users_install(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], local_index: LocalIndex) -> None:
    with fakeeng_project(tmp_path) as project:
        set_status(project, "experimental")
        core = build_cell_and_core(project)
        capsys.readouterr()
        assert main(publish_args(project, local_index, "--allow-experimental")) == 0
    out = capsys.readouterr().out
    wheels = sorted(project.cell_dir.glob("*.whl"))
    engines = [w.name for w in wheels if not w.name.startswith("kvcached_")]
    metas = [w.name for w in wheels if w.name.startswith("kvcached_")]
    assert engines and metas
    assert on_index(local_index) == sorted([*engines, core.name])
    assert (f"note: cell {CELL} is experimental: its meta wheels are not published "
            f"({', '.join(metas)})") in out

    # What a user types finds nothing: the meta project does not exist on the index.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    looked_up = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--no-cache-dir", "--index-url", local_index.simple_url, "--dest", str(tmp_path / "dl"),
         "kvcached-fakeeng"],
        env=env, capture_output=True, text=True)
    assert looked_up.returncode != 0
    assert "No matching distribution found for kvcached-fakeeng" in looked_up.stderr


@pytest.mark.parametrize("extra", [(), ("--allow-experimental",)])
def test_a_broken_cell_is_never_published(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], local_index: LocalIndex,
        extra: tuple[str, ...]) -> None:
    with fakeeng_project(tmp_path) as project:
        set_status(project, "broken")
        build_cell_and_core(project)
        capsys.readouterr()
        assert main(publish_args(project, local_index, *extra)) == 1
    assert capsys.readouterr().err == (
        f"forge: error: cell {CELL} is broken ({REASON}): a broken cell is never published\n")
    assert on_index(local_index) == []


def test_a_refused_cell_is_not_built_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], local_index: LocalIndex) -> None:
    with fakeeng_project(tmp_path) as project:
        set_status(project, "experimental")
        assert main(publish_args(project, local_index, "--build-if-stale")) == 1
    assert capsys.readouterr().err.startswith(f"forge: error: cell {CELL} is experimental")
    assert not project.dist.exists() or not any(project.dist.iterdir())
    assert on_index(local_index) == []
