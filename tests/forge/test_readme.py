"""The README's command lines are the ones the tests run (the e2e journey runs them for real)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from forge.index import server_arguments

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_PORT_URL = "http://127.0.0.1:8080/"


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def readme_commands() -> list[str]:
    """Every line of the README's bash blocks, without its trailing comment."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                lines.append(command)
    return lines


def _line(prefix: str) -> str:
    found = sorted({line for line in readme_commands() if line.startswith(prefix)})
    assert len(found) == 1, f"README: {len(found)} different lines start with {prefix!r}"
    return found[0]


def test_first_lines_build_a_cell_and_run_the_tests() -> None:
    first = readme_commands()[:2]
    assert first == ["pip install nox && nox -s build-vllm-0.9",
                     "pip install nox && nox -s lint tests"]


def test_index_line_is_the_server_the_tests_start() -> None:
    expected = shlex.join(["pypi-server", *server_arguments(8080, "packages",
                                                            "https://pypi.org/simple/")]) + " &"
    assert _line("pypi-server ") == expected


def test_publish_and_install_lines_are_the_ones_the_journey_runs() -> None:
    e2e = _load("e2e_conftest", ROOT / "tests" / "e2e" / "conftest.py")
    publish = _line("nox -s publish-vllm-0.32")
    assert shlex.split(publish) == e2e.readme_publish_args(README_PORT_URL)
    assert _line("pip install kvcached-vllm-cpu") == shlex.join(
        e2e.readme_install_args(README_PORT_URL + "simple/"))
    assert "python -m kvcached_core.doctor" in readme_commands()
    assert "KVCACHED_INDEX_URL=<url> nox -s publish-vllm-0.32" in README


def test_in_place_build_lines_are_what_the_test_session_runs() -> None:
    noxfile = _load("project_noxfile", ROOT / "noxfile.py")
    assert _line("pip install 'setuptools") == shlex.join(["pip", "install",
                                                           *noxfile.NATIVE_BUILD_DEPS])
    assert "pip install --no-build-isolation -e ." in readme_commands()


def test_too_old_setuptools_fails_the_in_place_build_with_one_clear_line(tmp_path: Path) -> None:
    env_dir = tmp_path / "old-setuptools"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    probe = [str(python), "-c", "import setuptools; print(setuptools.__version__)"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        # Python 3.12+ venvs come without setuptools; 3.11's bring pip's bundled 65.
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "setuptools<70"],
                       check=True, capture_output=True)
    old = subprocess.run(probe, check=True, capture_output=True, text=True).stdout.strip()
    assert int(old.split(".")[0]) < 70
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation",
                           "--no-deps", "-e", str(ROOT)], capture_output=True, text=True)
    assert done.returncode != 0
    assert (f"kvcached_core: building needs setuptools>=70 (this environment has {old}): "
            "pip install 'setuptools>=70' 'pybind11>=2.12' nvidia-cuda-runtime-cu12"
            ) in done.stdout + done.stderr


@pytest.mark.slow
def test_forge_session_reaches_the_toolkit_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "nox", "-s", "forge", "--", "transforms",
                           "vllm-0.9"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "transform set of vllm-0.9 (vllm 0.9.2), in application order:" in done.stdout
    assert "patch-set fingerprint: " in done.stdout
    assert "nox -s forge -- transforms vllm-0.9" in README


def test_readme_runtime_example_runs_as_written(tmp_path: Path) -> None:
    """The README's Python block creates, uses and closes a real host pool."""
    (block,) = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
    script = tmp_path / "readme_runtime.py"
    script.write_text(block + "\nprint('ran')\n", encoding="utf-8")
    env = {**os.environ, "KVCACHED_SHM_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    assert not list(tmp_path.glob("kvcached.*"))  # close() removed the pool's record
