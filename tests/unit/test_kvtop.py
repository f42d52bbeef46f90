"""kvtop as its users run it: the README's two lines, literally, through the installed console
script (the live view in a real terminal, tmux, its screen captured; `--once --json` for a
script), over a real pool that another process owns and a real budget."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.budget import set_budget
from kvcached_core.kvtop import main as kvtop_main
from kvcached_core.kvtop import model_in_command
from kvcached_core.limits import read_record
from kvcached_core.settings import format_size
from tests.proof_cells import ROOT

PAGE = 64 << 10
PAGE_ALL = 2 * 2 * PAGE  # a ledger page in both layers, K and V
MODEL = "org/tiny-demo-model"
KVTOP_SCRIPT = Path(sys.executable).with_name("kvtop")  # what `pip install` puts on the PATH


def readme_kvtop_lines() -> list[str]:
    """The commands of the README's kvtop block, without their comments."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## A live view of every pool: `kvtop`", 1)[1].split("```bash\n", 1)[1]
    block = block.split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def user_shell(shm: Path) -> dict[str, str]:
    """The user's environment: the venv's scripts first on the PATH, the records' directory."""
    assert KVTOP_SCRIPT.exists(), f"no {KVTOP_SCRIPT}: install the project (pip install -e .)"
    return dict(os.environ, PATH=f"{KVTOP_SCRIPT.parent}{os.pathsep}{os.environ['PATH']}",
                KVCACHED_SHM_DIR=str(shm))

# The owner: a process whose command line names a model, as `vllm serve MODEL` does, that has
# imported a patched engine build (stand-ins for its package and the `_kvcached_build` module the
# build writes, whose cell is the label), holds
# a pool charged to budget `demo`, and allocates or frees blocks on each line of its input.
OWNER = """
import sys, types
sys.modules["vllm"] = types.ModuleType("vllm")
sys.modules["vllm._kvcached_build"] = types.SimpleNamespace(CELL="vllm-0.32")
sys.path.insert(0, sys.argv[-1])
from tests.unit.pool_factory import create_pool
pool = create_pool("demo-pool", num_layers=2, num_kv_buffers=2, block_bytes=16 << 10,
                   virtual_bytes_per_layer=2 * 16 * (64 << 10), page_size=64 << 10,
                   min_reserve_pages=0, max_reserve_pages=2, budget="demo",
                   export_metrics=False)
held = []
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("alloc"):
        held += pool.alloc(int(line.split()[1]))
    elif line.startswith("free"):
        pool.free(held)
        held = []
    print("done", flush=True)
pool.close()
"""


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(directory))
    return directory


@pytest.fixture
def owner(shm: Path) -> Iterator[subprocess.Popen[str]]:
    set_budget("demo", 32 * PAGE_ALL, directory=shm)
    process = subprocess.Popen(
        [sys.executable, "-c", OWNER, "--model", MODEL, str(ROOT)],
        env=dict(os.environ, KVCACHED_SHM_DIR=str(shm)), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    yield process
    process.communicate("", timeout=30)


def tell(owner: subprocess.Popen[str], line: str) -> None:
    assert owner.stdin is not None and owner.stdout is not None
    owner.stdin.write(line + "\n")
    owner.stdin.flush()
    assert owner.stdout.readline() == "done\n"


def once_json(shm: Path) -> dict:
    """The README's script line, run as a user's shell runs it."""
    (line,) = [line for line in readme_kvtop_lines() if "--json" in line]
    assert line == "kvtop --once --json"
    done = subprocess.run(line, shell=True, env=user_shell(shm), capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def test_once_json_gives_each_pool_its_engine_model_memory_budget_and_hit_rate(
        owner: subprocess.Popen[str], shm: Path) -> None:
    tell(owner, "alloc 12")  # 4 pages: every new page mapped on the allocation path
    tell(owner, "free")  # the pages go back to the warm reserve (at most 2)
    tell(owner, "alloc 8")
    record = read_record("demo-pool", shm)
    (view,) = once_json(shm)["pools"]
    assert view["pool"] == "demo-pool" and view["state"] == "live"
    assert view["owner_pid"] == owner.pid
    assert view["engine"] == "vllm-0.32"
    assert view["model"] == MODEL
    assert view["in_use_bytes"] == record.used_bytes > 0
    assert view["reserve_bytes"] == record.reserved_bytes
    assert view["mapped_bytes"] == record.used_bytes + record.reserved_bytes
    assert view["limit_bytes"] == record.limit_bytes
    assert view["budget"] == "demo" and view["charged_bytes"] >= view["mapped_bytes"]
    assert 0 < view["reserve_hit_rate"] < 1  # some pages came from the reserve, some not
    (budget,) = once_json(shm)["budgets"]
    assert budget["name"] == "demo" and budget["capacity_bytes"] == 32 * PAGE_ALL


def test_a_dead_owner_shows_stale_and_no_pools_says_so(
        shm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvtop_main(["--once"]) == 0
    assert f"no pools in {shm}" in capsys.readouterr().out
    set_budget("demo", 32 * PAGE_ALL, directory=shm)
    killed = subprocess.Popen([sys.executable, "-c", OWNER, str(ROOT)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, KVCACHED_SHM_DIR=str(shm)))
    assert killed.stdout is not None and killed.stdout.readline() == "ready\n"
    killed.kill()
    killed.wait()
    (view,) = once_json(shm)["pools"]
    assert view["state"] == "stale" and view["model"] == "" and view["budget"] is None


def test_bad_arguments_get_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvtop_main(["--json"]) == 2
    assert capsys.readouterr().err == "kvtop: --json needs --once (one document for a script)\n"
    assert kvtop_main(["-n", "0"]) == 2
    assert capsys.readouterr().err == "kvtop: invalid interval 0.0 (seconds > 0)\n"


def test_the_model_is_read_as_serving_commands_name_it() -> None:
    assert model_in_command(["vllm", "serve", "meta/llama", "--port", "8000"]) == "meta/llama"
    assert model_in_command(["python", "-m", "sglang.launch_server", "--model-path",
                             "/models/qwen"]) == "/models/qwen"
    assert model_in_command(["python", "x.py", "--model=/m"]) == "/m"
    assert model_in_command(["python", "-c", "pass"]) == ""


def _screen(server: str) -> str:
    return subprocess.run(["tmux", "-L", server, "capture-pane", "-p", "-t", "kvtop"],
                          capture_output=True, text=True).stdout


def _wait_screen(server: str, *words: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        screen = _screen(server)
        if all(word in screen for word in words):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"the screen never showed {words}:\n{screen}")
        time.sleep(0.1)


def test_the_live_view_in_a_terminal_follows_the_pool_and_quits_on_q(
        owner: subprocess.Popen[str], shm: Path, tmp_path: Path) -> None:
    assert shutil.which("tmux"), "tmux is needed to run kvtop in a real terminal"
    (line,) = [line for line in readme_kvtop_lines() if "--json" not in line]
    assert line == "kvtop"
    server = f"kvtop-test-{os.getpid()}"
    command = f"{line}; echo exited $? > {tmp_path / 'exit'}"
    subprocess.run(["tmux", "-L", server, "new-session", "-d", "-s", "kvtop", "-x", "220",
                    "-y", "30", "-c", str(tmp_path), command], check=True, env=user_shell(shm))
    try:
        tell(owner, "alloc 4")  # the null block and 4 blocks: 2 pages in use
        mapped = format_size(read_record("demo-pool", shm).used_bytes)
        screen = _wait_screen(server, "demo-pool", "vllm-0.32", MODEL, "q quits", "live")
        row = next(line for line in screen.splitlines() if line.startswith("demo-pool"))
        assert mapped in row and "demo" in row
        assert "budget demo:" in screen
        tell(owner, "alloc 12")  # more pages: the next refresh shows them
        more = format_size(read_record("demo-pool", shm).used_bytes)
        assert more != mapped
        _wait_screen(server, more)
        subprocess.run(["tmux", "-L", server, "send-keys", "-t", "kvtop", "q"], check=True)
        deadline = time.monotonic() + 10
        while not (tmp_path / "exit").exists():
            assert time.monotonic() < deadline, "kvtop did not quit on q"
            time.sleep(0.1)
        assert (tmp_path / "exit").read_text() == "exited 0\n"
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)


def test_an_owner_whose_workers_hold_the_pages_is_charged_what_they_are() -> None:
    """A tensor-parallel vLLM engine's pool lives in the engine process, its pages in its
    worker processes (the budget's members): kvtop charges the pool their sum."""
    from kvcached_core.kvtop import _charge_of

    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
               for _ in range(2)]
    try:
        charges = {workers[0].pid: ("demo", 5 * PAGE), workers[1].pid: ("demo", 3 * PAGE)}
        assert _charge_of(os.getpid(), charges) == ("demo", 8 * PAGE)
        assert _charge_of(workers[0].pid, charges) == ("demo", 5 * PAGE)
        assert _charge_of(1, {}) == (None, None)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
