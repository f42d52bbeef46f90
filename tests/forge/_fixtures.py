"""A synthetic engine (``fakeeng``), a simple index serving it, test matrices and registries."""

from __future__ import annotations

import base64
import difflib
import hashlib
import http.server
import io
import json
import threading
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from codemods.base import HitCountingCodemod
from codemods.catalog import CODEMODS, REQUIRED_SEAMS
from codemods.declare import CodemodDeclaration, RequiredSeam
from forge import TOOLKIT_VERSION
from forge.fingerprint import patch_set_fingerprint
from forge.registry import Registry, Transform, codemod_transform

ENGINE = "fakeeng"
CELL = f"{ENGINE}-1.0"
VERSION = "1.0.0"
TAG = "cp311-cp311-manylinux_2_17_x86_64"

POOL_PY = '''"""Block pool of the fake engine."""


def allocate(count):
    return list(range(count))


class Pool:
    def __init__(self, size):
        self.size = size

    def take(self, count):
        return allocate(count)

    def take_pair(self, count):
        return allocate(count * 2)
'''

ENGINE_PY = '''"""Engine loop of the fake engine (no allocation calls here)."""


def step(pool):
    return pool.take(1)
'''

INIT_PY = '"""fakeeng: a tiny engine for build tests."""\n\n__version__ = "1.0.0"\n'


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def wheel_bytes(distribution: str = ENGINE, version: str = VERSION,
                sources: Mapping[str, str] | None = None, tag: str = TAG) -> bytes:
    """A valid wheel: the fakeeng package, a binary member, and a complete dist-info."""
    members: dict[str, bytes] = {
        "fakeeng/__init__.py": INIT_PY.encode(),
        "fakeeng/pool.py": POOL_PY.encode(),
        "fakeeng/engine.py": ENGINE_PY.encode(),
        "fakeeng/_native.so": bytes(range(256)) * 64,
        "fakeeng/configs/table.json": b'{"blocks": 16}\n',
    }
    for path, text in (sources or {}).items():
        members[path] = text.encode()
    dist_info = f"{distribution.replace('-', '_')}-{version}.dist-info"
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
        "Summary: fake engine\n\n"
    ).encode()
    members[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: fakeeng-tests\nRoot-Is-Purelib: false\nTag: {tag}\n"
    ).encode()
    members[f"{dist_info}/top_level.txt"] = b"fakeeng\n"
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in members.items())
    record += f"{dist_info}/RECORD,,\n"
    members[f"{dist_info}/RECORD"] = record.encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path, data in members.items():
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue()


def wheel_name(distribution: str = ENGINE, version: str = VERSION, tag: str = TAG) -> str:
    return f"{distribution.replace('-', '_')}-{version}-{tag}.whl"


# --- a PEP 503 / PEP 691 simple index --------------------------------------------------------


@dataclass
class SimpleIndex:
    """Serves ``files`` under /simple/<project>/ (JSON when asked, else HTML) and /files/."""

    files: dict[str, bytes] = field(default_factory=dict)
    json_api: bool = True
    requests: list[str] = field(default_factory=list)
    url: str = ""

    def add(self, filename: str, data: bytes) -> None:
        self.files[filename] = data


@contextmanager
def serve_index(index: SimpleIndex) -> Iterator[SimpleIndex]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            index.requests.append(self.path)
            parts = [p for p in self.path.split("/") if p]
            if len(parts) == 2 and parts[0] == "files" and parts[1] in index.files:
                self._send(index.files[parts[1]], "application/octet-stream")
            elif len(parts) == 2 and parts[0] == "simple":
                self._project(parts[1])
            else:
                self.send_error(404)

        def _project(self, project: str) -> None:
            names = [n for n in index.files
                     if n.split("-", 1)[0].replace("_", "-").lower() == project]
            if not names:
                self.send_error(404)
                return
            accept = self.headers.get("Accept", "")
            if index.json_api and "application/vnd.pypi.simple.v1+json" in accept:
                document = {
                    "meta": {"api-version": "1.0"}, "name": project,
                    "files": [{"filename": n, "url": f"../../files/{n}",
                               "hashes": {"sha256": sha256(index.files[n])}} for n in names],
                }
                self._send(json.dumps(document).encode(), "application/vnd.pypi.simple.v1+json")
            else:
                links = "".join(
                    f'<a href="../../files/{n}#sha256={sha256(index.files[n])}">{n}</a><br/>\n'
                    for n in names
                )
                page = f"<!DOCTYPE html><html><body>\n{links}</body></html>\n"
                self._send(page.encode(), "text/html")

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    index.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# --- matrices -------------------------------------------------------------------------------


def matrix_text(index_url: str, artifacts: list[tuple[str, str, str]], *, build: int = 1,
                status: str = "supported", extra_cell: str = "",
                proven_fingerprint: str = "0" * 64) -> str:
    """A one-cell matrix for fakeeng 1.0.0; ``artifacts`` are (role, filename, sha256).

    A supported cell carries a [cell.proven] record with ``proven_fingerprint``."""
    lines = [
        "schema = 1", f'index_url = "{index_url}"', "", "[[cell]]",
        'engine = "fakeeng"', 'series = "1.0"', 'version = "1.0.0"', f"build = {build}",
        'python = ">=3.11"', 'torch = "2.13.0"', f'status = "{status}"', extra_cell,
    ]
    if status == "supported":
        lines += ["", "[cell.proven]", f'fingerprint = "{proven_fingerprint}"',
                  "date = 2026-12-01", "l1_passed = 1", "l1_stock_passed = 1", 'l2 = "passed"']
    for role, filename, digest in artifacts:
        lines += ["", "[[cell.artifact]]", f'role = "{role}"', f'filename = "{filename}"',
                  f'sha256 = "{digest}"']
    return "\n".join(lines) + "\n"


# --- transforms ---------------------------------------------------------------------------------


class RouteAllocate(HitCountingCodemod):
    DESCRIPTION = "Route bare allocate() calls through the kvcached hook."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if m.matches(updated_node.func, m.Name("allocate")):
            self.record_hit()
            return updated_node.with_changes(func=cst.parse_expression("kvcached_hook.allocate"))
        if m.matches(updated_node.func,
                     m.Attribute(value=m.Name("kvcached_hook"), attr=m.Name("allocate"))):
            self.record_already_applied()
        return updated_node


def route_allocate(expected_hits: str | int = 2,
                   targets: tuple[str, ...] = ("{package}/pool.py",)) -> Transform:
    return codemod_transform(CodemodDeclaration(
        id="route-allocate", engine=ENGINE, versions=">=1.0,<2", seam="pool-allocate",
        anchor="fakeeng.pool.allocate", targets=targets, expected_hits=expected_hits,
        why="allocations must go through kvcached", retire_when="fakeeng gains an allocator API",
        codemod=RouteAllocate,
    ))


#: The toolkit's seam table plus fakeeng's one seam (the provenance seam applies to every engine).
FAKEENG_SEAMS = (*REQUIRED_SEAMS, RequiredSeam(ENGINE, "pool-allocate"))


def make_registry(patches_root: Path, *extra: Transform) -> Registry:
    return Registry(codemods=[*(codemod_transform(d) for d in CODEMODS),
                              *(extra or (route_allocate(),))],
                    patches_root=patches_root, required_seams=FAKEENG_SEAMS)


def patch_header(**overrides: str) -> str:
    fields = {
        "Description": "Log every pool take",
        "Seam": "take-logging",
        "Why": "the test needs a diff-kind transform",
        "Anchor": "fakeeng/pool.py @@ class Pool",
        "Expected-Hits": "1",
        "Forwarded": "not-needed",
        "Retire-When": "never",
        "Last-Update": "2026-11-30",
    }
    fields.update(overrides)
    return "".join(f"{k}: {v}\n" for k, v in fields.items() if v) + "\n"


def unified_diff(path: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile=f"a/{path}", tofile=f"b/{path}")
    return "".join(lines)


def write_patch(patches_root: Path, name: str, body: str, *, series: str = "1.0",
                header: str | None = None) -> Path:
    folder = patches_root / ENGINE / series
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.patch"
    path.write_text((patch_header() if header is None else header) + body, encoding="utf-8")
    with (folder / "series").open("a", encoding="utf-8") as series_file:
        series_file.write(f"{name}.patch\n")
    return path


TAKE_LOGGED = POOL_PY.replace(
    "    def take(self, count):\n        return allocate(count)\n",
    "    def take(self, count):\n        print('take', count)\n        return allocate(count)\n",
)


# Registries for ``python -m forge --registry _fixtures:<name>`` (functions of the patches dir).
def registry_zero_hits(patches_root: Path) -> Registry:
    return make_registry(patches_root, route_allocate(targets=("{package}/engine.py",)))


def registry_too_many_hits(patches_root: Path) -> Registry:
    return make_registry(patches_root, route_allocate(expected_hits=1))


@dataclass
class Project:
    """A matrix, an index serving the fakeeng wheels, a patches dir, a cache and a dist dir."""

    root: Path
    index: SimpleIndex
    matrix: Path
    patches: Path
    cache: Path
    dist: Path

    @property
    def cell_dir(self) -> Path:
        return self.dist / "fakeeng-1.0"

    def args(self, *command: str, registry: str = "_fixtures:make_registry") -> list[str]:
        return [*command, "--matrix", str(self.matrix), "--patches-dir", str(self.patches),
                "--registry", registry, "--cache-dir", str(self.cache), "--dist", str(self.dist)]


@contextmanager
def fakeeng_project(root: Path, *, pins: Mapping[str, str] | None = None,
                    served: Mapping[str, bytes] | None = None,
                    index_url: str | None = None) -> Iterator[Project]:
    """Serve a fakeeng wheel (role wheel) and a fakeeng-cpu wheel (role cpu-wheel)."""
    gpu, cpu = wheel_name(), wheel_name("fakeeng-cpu")
    files = {gpu: wheel_bytes(), cpu: wheel_bytes("fakeeng-cpu")}
    files.update(served or {})
    digests = {name: sha256(data) for name, data in files.items()}
    digests.update(pins or {})
    with serve_index(SimpleIndex(files=files)) as index:
        matrix = root / "matrix.toml"
        # The record of the cell's heavy proofs names its transform set as it is now.
        transforms = make_registry(root / "patches").select(CELL, ENGINE, "1.0", "1.0.0")
        matrix.write_text(matrix_text(index_url or index.url, [
            ("wheel", gpu, digests[gpu]), ("cpu-wheel", cpu, digests[cpu]),
        ], proven_fingerprint=patch_set_fingerprint(transforms, TOOLKIT_VERSION)),
            encoding="utf-8")
        yield Project(root=root, index=index, matrix=matrix, patches=root / "patches",
                      cache=root / "cache", dist=root / "dist")


def registry_duplicate_seam(patches_root: Path) -> Registry:
    """Two codemods for fakeeng's one seam."""
    again = replace(route_allocate(), id="route-allocate-again")
    return make_registry(patches_root, route_allocate(), again)


def registry_missing_seam(patches_root: Path) -> Registry:
    """fakeeng's only codemod implements a seam fakeeng does not require; pool-allocate is
    left uncovered."""
    return make_registry(patches_root, replace(route_allocate(), seams=("pool-logging",)))
