"""`python -m kvcached_core.doctor`: is the engine installed here the patched build, and intact?

Run it with the python of the environment the engine was installed into. It checks, and prints
one line per check (`ok` / `FAIL` / `note`):

- which installed distribution is a patched engine build (its dist-info carries the build's
  provenance), and that the engine's own `_kvcached_build` module agrees with it;
- that every installed file of that build still matches its RECORD hash;
- which transforms the build applied;
- that the runtime (`kvcached_core` and its native extension) imports, in the version the build
  pins;
- that the host backend loads, and whether the CUDA driver backend can be used here (a machine
  without a GPU is a note, not a failure).

The engine package itself is never imported (importing vLLM takes seconds and needs its whole
dependency tree); its provenance module is read by path. Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "kvcached_provenance.json"
BUILD_MODULE = "_kvcached_build.py"
_HASH_CHUNK = 1 << 20


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append(("ok", text))

    def fail(self, text: str) -> None:
        self.lines.append(("FAIL", text))

    def note(self, text: str) -> None:
        self.lines.append(("note", text))

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for status, _ in self.lines)


def patched_distributions() -> list[importlib.metadata.Distribution]:
    """Installed distributions whose dist-info carries a patched build's provenance."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and dist.read_text(PROVENANCE_FILE) is not None:
            found.setdefault(name.lower(), dist)
    return [found[key] for key in sorted(found)]


def _record_mismatches(dist: importlib.metadata.Distribution) -> tuple[int, list[str]]:
    checked, bad = 0, []
    for entry in dist.files or ():
        if entry.hash is None:
            continue  # RECORD itself and files written at install time carry no hash
        path = Path(str(dist.locate_file(entry)))
        digest = hashlib.new(entry.hash.mode)
        try:
            with open(path, "rb") as handle:
                while block := handle.read(_HASH_CHUNK):
                    digest.update(block)
        except OSError:
            bad.append(f"{entry} is missing")
            continue
        actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        if actual != entry.hash.value:
            bad.append(f"{entry} differs from its RECORD hash")
        checked += 1
    return checked, bad


def _build_module(dist: importlib.metadata.Distribution) -> dict[str, Any] | None:
    """`describe()` of the engine's `_kvcached_build` module, loaded by path."""
    for entry in dist.files or ():
        if entry.name == BUILD_MODULE and len(entry.parts) == 2:
            path = Path(str(dist.locate_file(entry)))
            spec = importlib.util.spec_from_file_location("_kvcached_build_probe", path)
            if spec is None or spec.loader is None:
                return None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            described: dict[str, Any] = module.describe()
            return described
    return None


def check_engine(dist: importlib.metadata.Distribution, report: Report) -> dict[str, Any]:
    name, version = dist.metadata["Name"], dist.version
    provenance: dict[str, Any] = json.loads(dist.read_text(PROVENANCE_FILE) or "{}")
    if "+kvcached." in version and provenance.get("built_version") == version:
        report.ok(f"{name} {version} is the patched build of cell {provenance.get('cell')} "
                  f"(from {provenance.get('base_artifact')})")
    else:
        report.fail(f"{name} {version}: version does not match its provenance "
                    f"({provenance.get('built_version')})")
    module = _build_module(dist)
    if module is None:
        report.fail(f"{name}: its {BUILD_MODULE} module is not installed")
    elif module.get("patch_set_fingerprint") != provenance.get("patch_set_fingerprint"):
        report.fail(f"{name}: {BUILD_MODULE} says fingerprint "
                    f"{module.get('patch_set_fingerprint')}, the dist-info says "
                    f"{provenance.get('patch_set_fingerprint')}")
    else:
        report.ok(f"{name}: patch-set fingerprint {provenance.get('patch_set_fingerprint')}")
    checked, bad = _record_mismatches(dist)
    if bad:
        report.fail(f"{name}: {len(bad)} of {checked + len(bad)} installed files do not match "
                    f"RECORD, first: {bad[0]}")
    else:
        report.ok(f"{name}: {checked} installed files match RECORD")
    applied = ", ".join(f"{t['id']} ({t['hits']})" for t in provenance.get("transforms", []))
    report.ok(f"{name}: transforms {applied or '(none)'}")
    return provenance


def check_runtime(core_requirement: str | None, report: Report) -> None:
    try:
        from kvcached_core import _version, native
    except ImportError as exc:
        report.fail(f"kvcached_core does not import: {exc}")
        return
    where = Path(native.__file__).parent
    wanted = core_requirement.partition("==")[2] if core_requirement else None
    if wanted and wanted != _version.__version__:
        report.fail(f"kvcached_core {_version.__version__} is installed, the build pins "
                    f"{core_requirement}")
    else:
        report.ok(f"kvcached_core {_version.__version__} imports (native extension) from {where}")
    try:
        native.host_backend(1 << 20)
    except Exception as exc:  # noqa: BLE001 - any failure to load is what we report
        report.fail(f"host backend does not load: {exc}")
    else:
        report.ok("host backend loads")
    available, reason = native.cuda_driver_status()
    if available:
        report.ok("CUDA driver backend can be used")
    else:
        report.note(f"CUDA driver backend unavailable here: {reason}")


def diagnose(engine: str | None = None) -> tuple[Report, list[dict[str, Any]]]:
    report = Report()
    engines = patched_distributions()
    if engine is not None:
        engines = [d for d in engines if (d.metadata["Name"] or "").lower() == engine.lower()]
    provenances: list[dict[str, Any]] = []
    if not engines:
        wanted = f" named {engine}" if engine else ""
        report.fail(f"no patched engine build{wanted} is installed in {sys.prefix}")
    for dist in engines:
        provenances.append(check_engine(dist, report))
    core = next((p.get("core_requirement") for p in provenances if p.get("core_requirement")),
                None)
    check_runtime(core, report)
    return report, provenances


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcached_core.doctor",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine", default=None,
                        help="distribution to check (default: every patched build installed)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    report, provenances = diagnose(args.engine)
    if args.json:
        print(json.dumps({"ok": not report.failed,
                          "checks": [{"status": s, "text": t} for s, t in report.lines],
                          "builds": provenances}, indent=2))
    else:
        for status, text in report.lines:
            print(f"{status:<4}  {text}")
        print("doctor: " + ("FAILED" if report.failed else "all checks passed"))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
