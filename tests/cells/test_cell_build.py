"""L0 for each cell: strict build, tags kept, provenance true, installable, reproducible."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from forge.build import build_cell
from forge.fetch import default_cache_dir
from forge.matrix import Cell
from forge.repack import read_provenance
from forge.transforms import select_transforms
from tests.proof_cells import ROOT, proof_matrix_path, proof_registry


def _engine_wheels(wheel_dir: Path) -> list[Path]:
    return sorted(w for w in wheel_dir.glob("*.whl") if not w.name.startswith("kvcached_"))


def _meta_wheels(wheel_dir: Path) -> list[Path]:
    return sorted(wheel_dir.glob("kvcached_*.whl"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_upstream_wheel_is_rebuilt_with_its_tags_and_a_local_label(
        cell: Cell, wheel_dir: Path) -> None:
    built = {parse_wheel_filename(w.name)[0]: w for w in _engine_wheels(wheel_dir)}
    assert len(built) == len(cell.wheel_artifacts)
    for artifact in cell.wheel_artifacts:
        assert artifact.filename is not None
        name, version, build_tag, tags = parse_wheel_filename(artifact.filename)
        ours = built[name]
        _, new_version, new_build_tag, new_tags = parse_wheel_filename(ours.name)
        assert new_tags == tags, f"{ours.name} lost upstream tags"
        assert new_build_tag == build_tag
        assert new_version.public == version.public
        assert new_version.local is not None
        assert new_version.local.endswith(f"kvcached.{cell.build}")


def test_provenance_names_the_pinned_base_and_the_applied_transforms(
        cell: Cell, wheel_dir: Path) -> None:
    shas = {a.filename: a.sha256 for a in cell.wheel_artifacts}
    for wheel in _engine_wheels(wheel_dir):
        provenance = read_provenance(wheel)
        assert provenance["cell"] == cell.name
        assert shas[provenance["base_artifact"]] == provenance["base_sha256"]
        ids = [t["id"] for t in provenance["transforms"]]
        assert "provenance" in ids
        assert all(t["hits"] >= 1 for t in provenance["transforms"])
        assert len(provenance["patch_set_fingerprint"]) == 64


def test_applied_transforms_cover_each_required_seam_exactly_once(
        cell: Cell, wheel_dir: Path) -> None:
    registry = proof_registry()
    by_id = {t.id: t for t in select_transforms(registry, cell)}
    required = registry.required_for(cell.engine, cell.version)
    assert required, f"{cell.engine} declares no required seams"
    for wheel in _engine_wheels(wheel_dir):
        applied = [t["id"] for t in read_provenance(wheel)["transforms"]]
        assert applied == list(by_id), f"{wheel.name}: applied set differs from the registry's"
        covered = [seam for transform_id in applied for seam in by_id[transform_id].seams]
        assert sorted(covered) == sorted(required), wheel.name


def test_meta_wheel_pins_exactly_the_build_and_the_runtime(cell: Cell, wheel_dir: Path) -> None:
    engines = {parse_wheel_filename(w.name)[0]: parse_wheel_filename(w.name)[1]
               for w in _engine_wheels(wheel_dir)}
    metas = _meta_wheels(wheel_dir)
    assert len(metas) == len(engines)
    for meta in metas:
        meta_name = parse_wheel_filename(meta.name)[0]
        engine = canonicalize_name(str(meta_name).removeprefix("kvcached-"))
        out = subprocess.run([sys.executable, "-c", (
            "import sys, zipfile\n"
            "z = zipfile.ZipFile(sys.argv[1])\n"
            "m = [n for n in z.namelist() if n.endswith('.dist-info/METADATA')][0]\n"
            "print(z.read(m).decode())"), str(meta)], check=True, capture_output=True, text=True)
        requires = [Requirement(line.split(":", 1)[1].strip())
                    for line in out.stdout.splitlines() if line.startswith("Requires-Dist:")]
        pins = {canonicalize_name(r.name): str(r.specifier) for r in requires}
        assert pins[engine] == f"=={engines[engine]}"
        assert pins[canonicalize_name("kvcached-core")].startswith("==")


def test_installed_wheel_matches_record_and_describes_its_build(
        cell: Cell, wheel_dir: Path, tmp_path: Path) -> None:
    for wheel in _engine_wheels(wheel_dir):
        # A prefix install lays files out as a venv would (scripts in bin/, RECORD paths valid).
        prefix = tmp_path / wheel.stem
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-compile", "--prefix", str(prefix), str(wheel)], check=True)
        target = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
            / "site-packages"
        dist_name = str(parse_wheel_filename(wheel.name)[0])
        env = dict(os.environ, PYTHONPATH=str(target))
        verified = subprocess.run([sys.executable, "-m", "forge", "verify-installed", dist_name],
                                  env=env, capture_output=True, text=True, cwd=ROOT)
        assert verified.returncode == 0, verified.stderr
        assert "match RECORD" in verified.stdout
        module = target / cell.engine / "_kvcached_build.py"
        spec = importlib.util.spec_from_file_location("_kvcached_build", module)
        assert spec and spec.loader
        build_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build_module)
        described = build_module.describe()
        provenance = read_provenance(wheel)
        assert described["cell"] == cell.name
        assert described["base_sha256"] == provenance["base_sha256"]
        assert described["built_version"] == str(parse_wheel_filename(wheel.name)[1])
        json.dumps(described)


def test_a_second_build_is_byte_identical(cell: Cell, wheel_dir: Path, tmp_path: Path) -> None:
    again = build_cell(cell.name, matrix_path=proof_matrix_path(), dist_dir=tmp_path / "dist",
                       cache_dir=default_cache_dir(), registry=proof_registry(),
                       progress=lambda line: None)
    first = {w.name: _sha256(w) for w in wheel_dir.glob("*.whl")}
    second = {w.name: _sha256(w) for w in again.wheels}
    assert first == second
