"""Building blocks of the vLLM L1 contract: the pinned sdist, its patched tree, a test venv.

The patched tree is the sdist's `vllm/` with the cell's transform set applied by forge's own
runner; the venv (cached under the forge cache, keyed by its pins and not by the vLLM version, so
every cell with the same pins shares one) holds the cell's proof torch (CPU build), vLLM's
pure-Python dependencies and the cell's test pins. The unpacked tree, which the tests put on
PYTHONPATH, carries a stub `vllm-<version>+cpu.dist-info` so vLLM sees its own version and picks
its CPU platform. A dependency that does not install is an error, never a silently smaller suite.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tarfile
import venv
import zipfile
from pathlib import Path

import git
from packaging.specifiers import SpecifierSet

from codemods.base import BuildContext
from forge import TOOLKIT_VERSION
from forge.fetch import default_cache_dir, fetch_artifact, resolve_index_url
from forge.matrix import Artifact, Cell, Matrix, load_matrix
from forge.transforms import patch_set_fingerprint, run_transforms, select_transforms
from forge.workspace import GIT_ENV, VENDOR_BRANCH, Workspace
from tests.proof_cells import proof_matrix_path, proof_of, proof_registry

ROOT = Path(__file__).resolve().parents[2]

# vLLM's imports for tests/v1/core, without torch: the local CPU torch of the cell's proof
# is installed first and kept. Every one must install (one pip command, checked afterwards).
CONTRACT_DEPS = (
    "numpy", "pydantic", "msgspec", "pyzmq", "cachetools", "psutil", "regex", "blake3", "cbor2",
    "pyyaml", "requests", "tqdm", "huggingface_hub", "tokenizers", "pillow", "sentencepiece",
    "prometheus_client", "cloudpickle", "gguf", "aiohttp", "pybase64", "py-cpuinfo", "openai",
    "fastapi", "diskcache", "einops", "protobuf", "partial-json-parser", "pytest", "setproctitle",
    "typing_extensions", "filelock", "jinja2", "watchfiles", "python-json-logger", "lark",
    "outlines_core", "lm-format-enforcer", "compressed-tensors", "depyf", "openai-harmony",
    "llguidance", "xgrammar", "ninja", "scipy", "mistral_common", "opencv-python-headless",
    "tblib", "ijson", "model-hosting-container-standards", "anthropic", "grpcio",
    "pytest-asyncio", "uvloop", "fastsafetensors", "safetensors", "numba",
)


def cache_dir() -> Path:
    return default_cache_dir()


def unpacked_sdist(cell: Cell, where: Path) -> Path:
    """The cell's pinned sdist (fetched and sha256-checked by forge), unpacked under `where`.

    A release without an sdist (vLLM 0.15) is put together the same way from what is pinned:
    its wheel's `vllm/` package without the compiled extensions (the sources the transforms
    read), and `tests/` and `pyproject.toml` from the sdist of the cell its
    `proof.l1_tests_from` names."""
    matrix = load_matrix(proof_matrix_path())
    target = where / f"vllm-{cell.version}"
    artifact = cell.artifact("sdist")
    if artifact is None:
        lender = proof_of(cell).l1_tests_from
        assert lender is not None, (f"cell {cell.name} pins no sdist and names no "
                                    "proof.l1_tests_from")
        if not target.exists():
            lender_sdist = matrix.get_cell(lender).artifact("sdist")
            assert lender_sdist is not None
            _extract_sdist(_fetched(matrix, lender_sdist), target, ("tests", "pyproject.toml"))
            wheel = cell.artifact("wheel")
            assert wheel is not None, f"cell {cell.name} pins no wheel"
            with zipfile.ZipFile(_fetched(matrix, wheel)) as archive:
                archive.extractall(target, members=[
                    name for name in archive.namelist()
                    if name.startswith("vllm/") and not name.endswith((".so", "/"))])
    elif not target.exists():
        _extract_sdist(_fetched(matrix, artifact), target, ("vllm", "tests", "pyproject.toml"))
    write_version_stub(cell, target)
    return target


def _fetched(matrix: Matrix, artifact: Artifact) -> Path:
    return fetch_artifact(artifact, index_url=resolve_index_url(matrix), cache_dir=cache_dir())


def _extract_sdist(archive: Path, target: Path, tops: tuple[str, ...]) -> None:
    """The sdist's top-level entries `tops`, into `target` (its own top directory dropped)."""
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) == 2 and parts[1].split("/")[0] in tops:
                member.name = f"{target.name}/{parts[1]}"
                members.append(member)
        tar.extractall(target.parent, members=members, filter="data")


def write_version_stub(cell: Cell, tree: Path) -> None:
    """A `vllm-<version>+cpu.dist-info` beside `tree/vllm`: on PYTHONPATH ahead of the shared
    venv, it is the version vLLM reads for itself, and `+cpu` selects its CPU platform."""
    stub = tree / f"vllm-{cell.version}+cpu.dist-info"
    stub.mkdir(exist_ok=True)
    (stub / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {cell.version}+cpu\n", encoding="utf-8")


def tree_workspace(tree: Path, *, patched: bool, cell: Cell) -> None:
    """Make `tree/vllm` the stock sources, or apply the cell's transforms with forge's runner."""
    repo = git.Repo.init(tree / "vllm", initial_branch=VENDOR_BRANCH)
    repo.git.update_environment(**GIT_ENV)
    repo.git.add("--all", "--force")
    repo.git.commit("--quiet", "--no-verify", "-m", f"vendor: vllm {cell.version} sdist")
    if not patched:
        return
    workspace = Workspace(tree / "vllm")
    workspace.reset()
    registry = proof_registry()
    transforms = select_transforms(registry, cell)
    # The workspace root is the package itself, so targets are relative to it.
    build = BuildContext(
        cell=cell.name, engine=cell.engine, package=".", upstream_version=cell.version,
        built_version=f"{cell.version}+kvcached.{cell.build}", base_artifact="sdist",
        base_sha256="", transform_ids=tuple(t.id for t in transforms),
        fingerprint=patch_set_fingerprint(transforms, TOOLKIT_VERSION),
        toolkit_version=TOOLKIT_VERSION,
    )
    run_transforms(workspace, transforms, build, flavour="sdist")


def run_on_patched_tree(python: Path, tree: Path, script: str, where: Path
                        ) -> subprocess.CompletedProcess[str]:
    """`python -c script` in `tree` (patched) with this checkout's kvcached_core, elastic on,
    as a CPU process with no other `KVCACHED_*` / `VLLM_*` setting of the caller's."""
    imports = where / "imports"
    imports.mkdir()
    (imports / "kvcached_core").symlink_to(ROOT / "kvcached_core")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VLLM_"))}
    env.update({"PYTHONPATH": f"{tree}{os.pathsep}{imports}", "KVCACHED_ENABLE": "1",
                "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"})
    return subprocess.run([str(python), "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tree)


def torch_requirement(cell: Cell) -> str:
    """The CPU build of the cell's proof torch (a local file; never a CUDA build from an index)."""
    return f"torch=={proof_of(cell).torch}+cpu"


def venv_pins_key(cell: Cell) -> str:
    """What the contract venv holds, without the vLLM version: cells with equal keys share it."""
    pins = {"deps": CONTRACT_DEPS, "torch": torch_requirement(cell),
            "test_pins": dict(cell.test_pins)}
    return hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:16]


class ContractVenvError(RuntimeError):
    """The cell's contract venv cannot hold what its L1 suite needs."""


def _pip_install(python: Path, cell: Cell, *requirements: str) -> None:
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run([*pip, *requirements], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ContractVenvError(
            f"{cell.name}: pip could not install the contract dependencies "
            f"({' '.join(requirements)}): {done.stderr.strip()[-2000:]}")


def _missing_distributions(python: Path, names: tuple[str, ...]) -> list[str]:
    """Which of `names` the venv lacks (a venv an older, lenient build left behind)."""
    probe = ("import importlib.metadata as m, json, sys\n"
             "missing = []\n"
             "for name in json.loads(sys.argv[1]):\n"
             "    try:\n"
             "        m.distribution(name)\n"
             "    except m.PackageNotFoundError:\n"
             "        missing.append(name)\n"
             "print(json.dumps(missing))\n")
    done = subprocess.run([str(python), "-c", probe, json.dumps(list(names))],
                          capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout))


def contract_venv(cell: Cell) -> Path:
    """The cell's contract venv (built once, reused by every cell with the same pins).

    It holds no vLLM distribution: the version stub lives in the unpacked tree."""
    python_version = platform.python_version()
    if python_version not in SpecifierSet(cell.python):
        raise ContractVenvError(f"{cell.name}: the release needs Python {cell.python}; the "
                                f"contract venv would be built with {python_version}")
    root = cache_dir() / "test-venvs" / f"vllm-contract-{venv_pins_key(cell)}"
    root.parent.mkdir(parents=True, exist_ok=True)
    python = root / "bin" / "python"
    required = (*cell.test_pins, *CONTRACT_DEPS)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "READY").exists():
            missing = _missing_distributions(python, required)
            if missing:
                raise ContractVenvError(
                    f"{cell.name}: the cached contract venv {root} lacks {', '.join(missing)}; "
                    "delete it to rebuild, or drop what cannot install here from CONTRACT_DEPS")
            return python
        shutil.rmtree(root, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(root)
        pins = [f"{name}=={version}" for name, version in sorted(cell.test_pins.items())]
        torch = torch_requirement(cell)
        _pip_install(python, cell, torch)
        _pip_install(python, cell, *pins, *CONTRACT_DEPS, torch)
        missing = _missing_distributions(python, required)
        if missing:
            raise ContractVenvError(f"{cell.name}: pip finished but {', '.join(missing)} "
                                    "is not installed")
        (root / "READY").write_text("ok\n", encoding="utf-8")
    return python


def l1_verdict(cell_name: str, stock: dict[str, str], patched: dict[str, str],
               floor: int) -> list[str]:
    """What is wrong with an L1 run (test id -> "passed", "skipped" or the failure), if anything.

    Both trees must collect the same tests, every test passing on the stock tree must pass on
    the patched one, and the patched tree must pass at least `floor` tests.
    """
    problems = []
    if set(stock) != set(patched):
        only = sorted(set(stock) ^ set(patched))
        problems.append(f"{cell_name}: the trees collected different tests: {only[:10]}")
    lost = {t: patched.get(t, "not collected") for t, r in stock.items()
            if r == "passed" and patched.get(t) != "passed"}
    if lost:
        problems.append(f"{cell_name}: pass on the stock tree only: {lost}")
    passed = sum(r == "passed" for r in patched.values())
    if passed < floor:
        problems.append(
            f"{cell_name}: {passed} L1 tests passed on the patched tree, below the recorded "
            f"floor proof.l1_min_passed = {floor} (a test file, dependency or collection was "
            "lost)")
    return problems
