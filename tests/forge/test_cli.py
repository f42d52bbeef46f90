"""python -m forge: every bad input gives one clear line, exit status 1, and nothing in dist/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _fixtures import (
    POOL_PY,
    TAKE_LOGGED,
    Project,
    fakeeng_project,
    unified_diff,
    wheel_bytes,
    wheel_name,
    write_patch,
)

from forge.build import read_core_version
from forge.cli import main
from forge.index import LocalIndex
from tests.forge.conftest import Member, WheelRecipe, build_wheel

REPO = Path(__file__).resolve().parents[2]
CELL = "fakeeng-1.0"


def fails_cleanly(args: list[str], capsys: pytest.CaptureFixture[str], project: Project) -> str:
    """Run the CLI, expect exit 1 and a single error line; return the message."""
    assert main(args) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("forge: error: ")
    assert not project.dist.exists() or not any(project.dist.iterdir())
    return lines[0].removeprefix("forge: error: ")


def test_build_and_approve_succeed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        assert main(project.args("approve-diff", CELL)[:-2]) == 0
        assert main(project.args("build", CELL)) == 0
    out = capsys.readouterr().out
    assert f"[{CELL}] built " in out
    assert sorted(p.suffix for p in project.cell_dir.iterdir()) == \
        [".json", ".txt", ".whl", ".whl", ".whl", ".whl"]


def test_unknown_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        message = fails_cleanly(project.args("build", "vllm-9.9"), capsys, project)
    assert message == "unknown cell 'vllm-9.9' (known cells: fakeeng-1.0)"


def test_malformed_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        project.matrix.write_text(project.matrix.read_text().replace('"supported"', '"ok"'))
        message = fails_cleanly(project.args("build", CELL), capsys, project)
    assert message == ("matrix.toml: cell fakeeng-1.0: field 'status' must be one of "
                       "supported|experimental|broken, got 'ok'")


def test_sha256_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path, pins={wheel_name(): "1" * 64}) as project:
        message = fails_cleanly(project.args("build", CELL), capsys, project)
    assert message.startswith(f"sha256 mismatch for {wheel_name()}: expected {'1' * 64}, got ")
    assert not (project.cache / "artifacts" / wheel_name()).exists()


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_truncated_or_corrupt_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    damage: str) -> None:
    good = wheel_bytes()
    if damage == "truncated":
        bad = good[: len(good) - 200]
    else:
        broken = bytearray(good)
        start = good.index(b"fakeeng/pool.py") + len("fakeeng/pool.py") + 8
        broken[start:start + 16] = bytes(16)  # overwrite compressed bytes of a member
        bad = bytes(broken)
    # The matrix pins the damaged file itself, so only the wheel check can catch it.
    with fakeeng_project(tmp_path, served={wheel_name(): bad}) as project:
        message = fails_cleanly(project.args("build", CELL), capsys, project)
    assert message.startswith(f"{wheel_name()}: truncated or corrupt wheel")


def test_transform_with_zero_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        args = project.args("build", CELL, registry="_fixtures:registry_zero_hits")
        message = fails_cleanly(args, capsys, project)
    assert message == ("cell fakeeng-1.0: seam pool-allocate: transform route-allocate: "
                       "fakeeng/engine.py: "
                       "matches nothing (expected 2 hit(s)); "
                       "anchor looked for: fakeeng.pool.allocate")


def test_transform_with_too_many_hits(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        args = project.args("build", CELL, registry="_fixtures:registry_too_many_hits")
        message = fails_cleanly(args, capsys, project)
    assert message == ("cell fakeeng-1.0: seam pool-allocate: transform route-allocate: "
                       "fakeeng/pool.py: "
                       "matched 2 place(s), expected 1; "
                       "anchor looked for: fakeeng.pool.allocate")


def test_diff_that_needs_fuzz(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        # Made against a tree whose `take` had a comment: a context line that differs now.
        old = POOL_PY.replace("def take(self, count):", "def take(self, count):  # n")
        new = TAKE_LOGGED.replace("def take(self, count):", "def take(self, count):  # n")
        write_patch(project.patches, "log-take", unified_diff("fakeeng/pool.py", old, new)
                    .replace("allocate(count)\n", "kvcached_hook.allocate(count)\n"))
        message = fails_cleanly(project.args("build", CELL), capsys, project)
    assert message.startswith(
        "cell fakeeng-1.0: seam take-logging: transform log-take: fakeeng/pool.py:")
    assert "does not apply with zero fuzz" in message


def test_index_unreachable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/simple"
    with fakeeng_project(tmp_path) as project:
        message = fails_cleanly([*project.args("build", CELL), "--index-url", dead], capsys,
                                project)
    assert message.startswith(f"index {dead} unreachable: ")


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["build"])
    assert caught.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_module_entry_point_exit_status(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        done = subprocess.run(
            [sys.executable, "-m", "forge", "build", "nope", "--matrix", str(project.matrix),
             "--dist", str(project.dist)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert done.returncode == 1
    assert done.stderr == "forge: error: unknown cell 'nope' (known cells: fakeeng-1.0)\n"


def test_list_transforms_and_check_matrix(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        common = ["--matrix", str(project.matrix), "--patches-dir", str(project.patches),
                  "--registry", "_fixtures:make_registry"]
        assert main(["list", "--json", "--matrix", str(project.matrix)]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert main(["transforms", CELL, *common]) == 0
        transforms = capsys.readouterr().out
        assert main(["check-matrix", *common]) == 0
        checked = capsys.readouterr().out
    assert [c["name"] for c in listed] == [CELL]
    assert [a["role"] for a in listed[0]["artifacts"]] == ["wheel", "cpu-wheel"]
    assert "  seam          | id             | kind    | hits | targets\n" in transforms
    assert "  pool-allocate | route-allocate | codemod | 2    | fakeeng/pool.py\n" in transforms
    assert ("  route-allocate [pool-allocate]\n"
            "    description:   Route bare allocate() calls through the kvcached hook.\n"
            "    anchor:        fakeeng.pool.allocate\n"
            "    expected hits: 2\n"
            "    why:           allocations must go through kvcached\n"
            "    retire when:   fakeeng gains an allocator API\n") in transforms
    assert "required seams, each covered once: provenance, pool-allocate\n" in transforms
    assert "patch-set fingerprint: " in transforms
    assert checked == "matrix.toml: 1 cells OK (fakeeng-1.0: 2 transforms)\n"


def test_publish_without_a_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        message = fails_cleanly(["publish", CELL, "--repository-url", "http://127.0.0.1:9/",
                                 "--matrix", str(project.matrix), "--dist", str(project.dist)],
                                capsys, project)
    assert message.startswith("cell fakeeng-1.0: no wheels in ")


def _install(wheel: Path, site: Path) -> None:
    """What an installer does with a wheel that has no .data directory: unpack it."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)


def test_verify_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    with fakeeng_project(tmp_path) as project:
        assert main(project.args("approve-diff", CELL)[:-2]) == 0
        assert main(project.args("build", CELL)) == 0
    capsys.readouterr()
    site = tmp_path / "site"
    _install(next(project.cell_dir.glob("fakeeng-*.whl")), site)
    monkeypatch.syspath_prepend(str(site))
    assert main(["verify-installed", "fakeeng"]) == 0
    out = capsys.readouterr().out
    assert "fakeeng 1.0.0+kvcached.1: 10 installed files match RECORD" in out
    assert "cell: fakeeng-1.0" in out and "route-allocate (2)" in out

    (site / "fakeeng" / "pool.py").write_text(POOL_PY)  # someone undid the rewrite
    assert main(["verify-installed", "fakeeng"]) == 1
    assert capsys.readouterr().err == (
        "forge: error: fakeeng: installed file fakeeng/pool.py differs from its RECORD hash\n"
    )


def _core_wheel(core_dir: Path, tags: str) -> Path:
    recipe = WheelRecipe(name="kvcached_core", version=read_core_version(), tags=tags,
                         wheel_tag_line=tags,
                         package={"kvcached_core/__init__.py": Member(b"CORE = 1\n")})
    return build_wheel(recipe, core_dir)


def test_publish_needs_the_core_wheels_its_meta_wheels_pin(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fakeeng_project(tmp_path) as project:
        assert main(project.args("approve-diff", CELL)[:-2]) == 0
        assert main(project.args("build", CELL)) == 0
        capsys.readouterr()
        assert main(["publish", CELL, "--repository-url", "http://127.0.0.1:9/",
                     "--matrix", str(project.matrix), "--dist", str(project.dist)]) == 1
    assert capsys.readouterr().err == (
        f"forge: error: fakeeng-1.0: its meta wheels pin kvcached-core=={read_core_version()}, "
        f"but {project.dist / 'core'} holds no such wheel; build it with `nox -s build-core`\n")


def test_publish_from_the_environment_url_in_order_then_skips_a_current_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        local_index: LocalIndex) -> None:
    with fakeeng_project(tmp_path) as project:
        assert main(project.args("approve-diff", CELL)[:-2]) == 0
        assert main(project.args("build", CELL)) == 0
        core = _core_wheel(project.dist / "core", "cp311-cp311-manylinux_2_35_x86_64")
        capsys.readouterr()
        monkeypatch.setenv("KVCACHED_INDEX_URL", local_index.url)
        publish_args = ["publish", CELL, *project.args("build", CELL)[2:]]
        assert main(publish_args) == 0
        out = capsys.readouterr().out
        assert main([*publish_args, "--build-if-stale"]) == 0
        again = capsys.readouterr().out
    wheels = sorted(project.cell_dir.glob("*.whl"))
    engines = [w.name for w in wheels if not w.name.startswith("kvcached_")]
    metas = [w.name for w in wheels if w.name.startswith("kvcached_")]
    uploads = [line.split()[1] for line in out.splitlines() if line.startswith("upload ")]
    assert uploads == [*engines, core.name, *metas]
    # the cell allows every Python from 3.11; one core wheel (3.11) covers only that one
    assert (f"note: cell {CELL} allows Python >=3.11, but kvcached-core=="
            f"{core.name.split('-')[1]} has wheels for cp311 only: Python 3.12, 3.13, 3.14 "
            f"cannot install {CELL}'s meta wheels") in out
    assert f"{project.dist / CELL} is current: not rebuilt" in again
    assert f"0 uploaded, {len(uploads)} already there" in again
