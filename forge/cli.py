"""``python -m forge``: build, review and publish the patched engine wheels of matrix.toml.

Every ForgeError is printed as one line, ``forge: error: <message>``, with exit status 1;
usage errors exit with status 2 (argparse).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from forge.errors import ForgeError, PublishError, WheelError
from forge.fetch import default_cache_dir
from forge.matrix import Cell, Matrix, load_matrix
from forge.registry import PATCHES_ROOT, Registry, Transform, default_registry
from forge.repack import PROVENANCE_FILE

PASSWORD_ENV = "KVCACHED_FORGE_INDEX_PASSWORD"
INDEX_URL_ENV = "KVCACHED_INDEX_URL"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--matrix", type=Path, default=Path("matrix.toml"),
                        help="the compatibility matrix (default: ./matrix.toml)")
    common.add_argument("--patches-dir", type=Path, default=PATCHES_ROOT,
                        help="root of patches/<engine>/<series>/ (default: the toolkit's own)")
    common.add_argument("--registry", default=None, metavar="MODULE:NAME",
                        help="use another transform registry: a Registry, or a function of the "
                             "patches dir returning one (default: forge.registry)")
    build_opts = argparse.ArgumentParser(add_help=False)
    build_opts.add_argument("--cache-dir", type=Path, default=None,
                            help="artifact and workspace cache (default: $KVCACHED_FORGE_CACHE "
                                 "or ~/.cache/kvcached-forge)")
    build_opts.add_argument("--index-url", default=None,
                            help="simple index to fetch upstream artifacts from (overrides "
                                 "$KVCACHED_FORGE_INDEX_URL and matrix index_url)")

    parser = argparse.ArgumentParser(prog="python -m forge", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser("build", parents=[common, build_opts],
                                help="build a cell's patched wheels into dist/<cell>/")
    build.add_argument("cell")
    build.add_argument("--dist", type=Path, default=Path("dist"), help="output root (./dist)")

    approve = commands.add_parser("approve-diff", parents=[common, build_opts],
                                  help="rebuild a cell's change and write it as the reviewed diff")
    approve.add_argument("cell")

    transforms = commands.add_parser("transforms", parents=[common],
                                     help="list the transform set of a cell, seam by seam")
    transforms.add_argument("cell")

    commands.add_parser("check-matrix", parents=[common],
                        help="validate matrix.toml, lint the transform registry and check "
                             "that every supported cell's [cell.proven] record is current")

    record = commands.add_parser(
        "record-proven", parents=[common],
        help="write a cell's [cell.proven] record from the results its heavy proofs wrote "
             "(run by nox -s verify-<cell> once they all passed)")
    record.add_argument("cell")
    record.add_argument("--results", type=Path, required=True,
                        help="the --proof-results directory of the cell's test runs")
    record.add_argument("--l2-not-run", default=None, metavar="REASON",
                        help="the cell has no L2 run here, for this reason")

    listing = commands.add_parser("list", parents=[common], help="list the cells")
    listing.add_argument("--json", action="store_true", help="machine-readable output")

    publish = commands.add_parser(
        "publish", parents=[common, build_opts],
        help="upload a cell's engine wheels, the kvcached-core wheels its meta wheels pin, and "
             "its meta wheels (last) to an index")
    publish.add_argument("cell")
    publish.add_argument("--repository-url", default=None,
                         help=f"the index's upload URL (default: ${INDEX_URL_ENV})")
    publish.add_argument("--dist", type=Path, default=Path("dist"))
    publish.add_argument("--core-dist", type=Path, default=None,
                         help="where the kvcached-core wheels are (default: <dist>/core)")
    publish.add_argument("--username", default=None,
                         help=f"index user; the password is read from ${PASSWORD_ENV} "
                              "(or TWINE_USERNAME/TWINE_PASSWORD, or the keyring)")
    publish.add_argument("--build-if-stale", action="store_true",
                         help="build the cell first unless dist/<cell>/ is already the build "
                              "the matrix and transforms describe")
    publish.add_argument("--allow-experimental", action="store_true",
                         help="publish an experimental cell: its engine and kvcached-core "
                              "wheels only, never its meta wheels (a broken cell is never "
                              "published)")

    upgrade = commands.add_parser(
        "upgrade-check", parents=[common, build_opts],
        help="try every registered transform of an engine on an upstream release the matrix "
             "lacks; write report.md/report.json and propose an experimental cell")
    upgrade.add_argument("engine")
    upgrade.add_argument("version", help="an exact release, or 'latest'")
    upgrade.add_argument("--out", type=Path, default=None,
                         help="report folder (default: reports/upgrade/<engine>-<version>/)")
    upgrade.add_argument("--write-cell", action="store_true",
                         help="append the proposed experimental cell to the matrix (default: "
                              "only <out>/matrix-entry.toml)")
    upgrade.add_argument("--no-build", action="store_true",
                         help="do not build the proposed cell's trial wheels (in <out>/dist/)")
    upgrade.add_argument("--no-l1", action="store_true",
                         help="run only L0 on the trial build, not the L1 contract suite "
                              "(the report says L1 was left out on purpose)")

    scan = commands.add_parser("upgrade-scan", parents=[common, build_opts],
                               help="list releases on the index newer than each engine's "
                                    "newest cell")
    scan.add_argument("--json", action="store_true", help="machine-readable output")

    verify = commands.add_parser("verify-installed",
                                 help="check an installed patched distribution against RECORD")
    verify.add_argument("dist", metavar="DIST")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ForgeError as exc:
        print(f"forge: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("forge: error: interrupted", file=sys.stderr)
        return 130


def _registry(args: argparse.Namespace) -> Registry:
    if args.registry is None:
        return default_registry(patches_root=args.patches_dir)
    module_name, _, attribute = args.registry.partition(":")
    if not module_name or not attribute:
        raise ForgeError(f"--registry {args.registry}: expected MODULE:NAME")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ForgeError(f"--registry {args.registry}: {exc}") from None
    registry = found(args.patches_dir) if callable(found) else found
    if not isinstance(registry, Registry):
        raise ForgeError(f"--registry {args.registry}: not a Registry")
    return registry


def _dispatch(args: argparse.Namespace) -> int:
    from forge import build as build_module

    command = args.command
    if command == "build":
        build_module.build_cell(
            args.cell, matrix_path=args.matrix, dist_dir=args.dist,
            cache_dir=args.cache_dir or default_cache_dir(), registry=_registry(args),
            index_url=args.index_url,
        )
    elif command == "approve-diff":
        build_module.approve_diffs(
            args.cell, matrix_path=args.matrix, cache_dir=args.cache_dir or default_cache_dir(),
            registry=_registry(args), index_url=args.index_url,
        )
    elif command == "transforms":
        _print_transforms(load_matrix(args.matrix), args.cell, _registry(args))
    elif command == "check-matrix":
        return _check_matrix(load_matrix(args.matrix), _registry(args))
    elif command == "record-proven":
        _record_proven(args)
    elif command == "list":
        _list(load_matrix(args.matrix), as_json=args.json)
    elif command == "publish":
        _publish(args)
    elif command == "upgrade-check":
        return _upgrade_check(args)
    elif command == "upgrade-scan":
        _upgrade_scan(args)
    elif command == "verify-installed":
        _verify_installed(args.dist)
    return 0


def _print_transforms(matrix: Matrix, name: str, registry: Registry) -> None:
    from forge import TOOLKIT_VERSION
    from forge.transforms import patch_set_fingerprint, select_transforms

    cell = matrix.get_cell(name)
    transforms = select_transforms(registry, cell)
    rows = [("seam", "id", "kind", "hits", "targets")] + [
        (_seams(t), t.id, str(t.kind), str(t.expected_hits),
         ", ".join(t.target_paths(cell.engine)))
        for t in transforms
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"transform set of {cell.name} ({cell.engine} {cell.version}), in application order:")
    for row in rows:
        print("  " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    for t in transforms:
        print(f"\n  {t.id} [{_seams(t)}]")
        for label, value in (("description", t.description),
                             ("anchor", t.anchor.replace("{package}", cell.engine)),
                             ("expected hits", str(t.expected_hits)), ("why", t.why),
                             ("retire when", t.retire_when)):
            print(f"    {label + ':':<14} {value}")
    required = ", ".join(registry.required_for(cell.engine, cell.version))
    print(f"\nrequired seams, each covered once: {required}")
    print(f"patch-set fingerprint: {patch_set_fingerprint(transforms, TOOLKIT_VERSION)}")


def _seams(transform: Transform) -> str:
    return " + ".join(transform.seams)


def _check_matrix(matrix: Matrix, registry: Registry) -> int:
    """Every problem, one line each: the registry's, each cell whose transforms do not resolve,
    each supported cell whose record is stale. A first bad cell hides none of the others."""
    from forge.proven import stale_records
    from forge.transforms import select_transforms

    problems = [f"registry: {problem}" for problem in registry.lint()]
    counts: list[str] = []
    resolved: list[Cell] = []
    for cell in matrix.cells:
        try:
            counts.append(f"{cell.name}: {len(select_transforms(registry, cell))} transforms")
            resolved.append(cell)
        except ForgeError as exc:  # names the cell
            problems.append(str(exc))
    # A record is only compared with transforms that resolve.
    problems += stale_records(replace(matrix, cells=tuple(resolved)), registry)
    for line in problems:
        print(f"forge: error: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"{matrix.path.name}: {len(matrix.cells)} cells OK ({', '.join(counts)})")
    return 0


def _record_proven(args: argparse.Namespace) -> None:
    import datetime as dt

    from forge.proven import proven_from_results, render_proven, write_proven

    matrix = load_matrix(args.matrix)
    cell = matrix.get_cell(args.cell)
    proven = proven_from_results(cell, _registry(args), args.results,
                                 l2_not_run=args.l2_not_run, today=dt.date.today())
    write_proven(args.matrix, cell.name, proven)
    print(f"{args.matrix.name}: cell {cell.name}: recorded\n{render_proven(proven)}", end="")


def _list(matrix: Matrix, *, as_json: bool) -> None:
    if as_json:
        document = [
            {
                "name": c.name, "engine": c.engine, "series": c.series, "version": c.version,
                "build": c.build, "status": c.status, "reason": c.reason,
                "python": c.python, "torch": c.torch,
                "verified": c.verified.isoformat() if c.verified else None,
                "artifacts": [
                    {"role": a.role, "filename": a.filename, "git": a.git, "tag": a.tag}
                    for a in c.artifacts
                ],
            }
            for c in matrix.cells
        ]
        print(json.dumps(document, indent=2))
        return
    for c in matrix.cells:
        flavours = ", ".join(a.distribution for a in c.wheel_artifacts)
        reason = f" ({c.reason})" if c.reason else ""
        print(f"{c.name:<14} {c.version:<10} {c.status}{reason}  wheels: {flavours}")


def _publish(args: argparse.Namespace) -> None:
    from forge import TOOLKIT_VERSION
    from forge import build as build_module
    from forge.publish import (
        cell_release,
        check_publishable,
        meta_wheels_published,
        publish,
        stale_reason,
        uncovered_pythons,
    )
    from forge.transforms import patch_set_fingerprint, select_transforms

    url = args.repository_url or os.environ.get(INDEX_URL_ENV)
    if not url:
        raise PublishError(f"give the index's upload URL: --repository-url <url> "
                           f"(or set {INDEX_URL_ENV})")
    matrix = load_matrix(args.matrix)
    cell = matrix.get_cell(args.cell)
    check_publishable(cell.name, cell.status, cell.reason,
                      allow_experimental=args.allow_experimental)
    folder = args.dist / cell.name
    if args.build_if_stale:
        registry = _registry(args)
        reason = stale_reason(
            folder, built_version=f"{cell.version}+kvcached.{cell.build}",
            base_sha256s=[a.sha256 for a in cell.wheel_artifacts if a.sha256],
            fingerprint=patch_set_fingerprint(select_transforms(registry, cell),
                                              TOOLKIT_VERSION),
            core_requirement=f"kvcached-core=={build_module.read_core_version()}")
        if reason is None:
            print(f"{folder} is current: not rebuilt")
        else:
            print(f"building {cell.name}: {reason}")
            build_module.build_cell(
                cell.name, matrix_path=args.matrix, dist_dir=args.dist,
                cache_dir=args.cache_dir or default_cache_dir(), registry=registry,
                index_url=args.index_url)
    if not any(folder.glob("*.whl")):
        raise PublishError(f"cell {cell.name}: no wheels in {folder}; run `python -m forge "
                           f"build {cell.name}` first")
    release = cell_release(folder, args.core_dist or args.dist / "core")
    with_meta = meta_wheels_published(cell.status)
    missing = uncovered_pythons(cell.python, release.core_pythons)
    if missing and with_meta:
        print(f"note: cell {cell.name} allows Python {cell.python}, but {release.core_requirement} "
              f"has wheels for {', '.join(release.core_pythons)} only: Python "
              f"{', '.join(missing)} cannot install {cell.name}'s meta wheels")
    if not with_meta:
        held_back = ", ".join(meta.name for meta in release.meta_wheels)
        version = f"{cell.version}+kvcached.{cell.build}"
        print(f"note: cell {cell.name} is {cell.status}: its meta wheels are not published "
              f"({held_back}); install a build by its exact version, e.g. "
              f"'{cell.engine}=={version}' '{release.core_requirement}'")
    result = publish(release.ordered if with_meta else release.without_meta, url,
                     username=args.username, password=os.environ.get(PASSWORD_ENV),
                     progress=print)
    print(f"published {cell.name} to {url}: {len(result.uploaded)} uploaded, "
          f"{len(result.skipped)} already there")


def _verify_installed(name: str) -> None:
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise WheelError(f"distribution {name!r} is not installed in {sys.prefix}") from None
    text = dist.read_text(PROVENANCE_FILE)
    if text is None:
        raise WheelError(f"{name} {dist.version} has no {PROVENANCE_FILE}: not a patched build")
    provenance = json.loads(text)
    checked = 0
    for entry in dist.files or ():
        if entry.hash is None:
            continue  # RECORD itself and files written at install time carry no hash
        path = Path(str(dist.locate_file(entry)))
        try:
            data = path.read_bytes()
        except OSError:
            raise WheelError(f"{name}: installed file {entry} is missing") from None
        digest = hashlib.new(entry.hash.mode, data).digest()
        actual = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        if actual != entry.hash.value:
            raise WheelError(f"{name}: installed file {entry} differs from its RECORD hash")
        checked += 1
    print(f"{name} {dist.version}: {checked} installed files match RECORD")
    for key in ("cell", "built_version", "base_artifact", "base_sha256",
                "patch_set_fingerprint", "toolkit_version"):
        print(f"  {key}: {provenance.get(key)}")
    applied = ", ".join(f"{t['id']} ({t['hits']})" for t in provenance.get("transforms", []))
    print(f"  transforms: {applied}")


def _upgrade_check(args: argparse.Namespace) -> int:
    from forge.fetch import resolve_index_url
    from forge.upgrade import run_upgrade_check

    matrix = load_matrix(args.matrix)
    registry = _registry(args)
    report = run_upgrade_check(
        matrix=matrix, registry=registry, engine=args.engine, requested=args.version,
        index_url=resolve_index_url(matrix, args.index_url),
        cache_dir=args.cache_dir or default_cache_dir(), out_dir=args.out,
        write_cell=args.write_cell, build_wheels=not args.no_build, skip_l1=args.no_l1,
        progress=lambda line: print(line, flush=True))
    for row in report.seams:
        print(f"  seam {row.seam:<24} {row.chosen or '-':<28} {row.result}"
              + (f" ({row.note})" if row.note else ""))
    out = args.out or Path("reports") / "upgrade" / f"{report.engine}-{report.version}"
    print(f"{report.engine} {report.version}: {report.verdict}")
    print(f"report: {out / 'report.md'} (build: {report.build})")
    status = report.outcome.exit_status
    print(f"outcome: {report.outcome} (exit status {status})")
    return status


def _upgrade_scan(args: argparse.Namespace) -> None:
    from forge.fetch import resolve_index_url
    from forge.upgrade import scan

    matrix = load_matrix(args.matrix)
    lines = scan(matrix, resolve_index_url(matrix, args.index_url))
    if args.json:
        print(json.dumps([line.to_json() for line in lines], indent=2))
        return
    for line in lines:
        newer = ", ".join(line.newer) or "none"
        print(f"{line.engine}: newer than {line.newest_cell} ({line.newest_cell_version}): "
              f"{newer}")
        for version in line.unchecked:
            print(f"  to check: {line.engine} {version}: {line.why[version]}")
        for series, reason in line.skipped.items():
            print(f"  skipped: series {series}: {reason}")
