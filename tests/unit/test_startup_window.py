"""The start-up window: elastic engines on one device take their start-up memory measurements
one after another (kvcached_core/startup_memory.py; vLLM's use of it in
integration/vllm/startup_memory.py).

What a user relies on: a second engine on the device waits until the first has finished its
profile, and not longer; a holder that dies or hangs never stops a start; a stock engine and
an engine on another device type never wait.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.integration.vllm.startup_memory import (
    ends_startup_window,
    memory_profile_consistent,
    startup_snapshot,
)
from kvcached_core.settings import KVCachedSettings
from kvcached_core.startup_memory import (
    StartupWindow,
    acquire_startup_window,
    cuda_device_identity,
    holds_startup_window,
    release_startup_windows,
    startup_window_path,
)

DEVICE = "gpu-test-device"
ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@pytest.fixture(autouse=True)
def no_window_left_held() -> Iterator[None]:
    yield
    release_startup_windows()


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


class Holder:
    """Another process that takes the window of DEVICE, then releases it, exits or dies when
    told (each line on its stdin is a command)."""

    SCRIPT = textwrap.dedent("""
        import os, sys, time
        from kvcached_core.startup_memory import acquire_startup_window, release_startup_windows
        window = acquire_startup_window(sys.argv[1], timeout_s=30, holder="neighbour",
                                        directory=sys.argv[2])
        print("held" if window.held else "not held", flush=True)
        for command in sys.stdin:
            command = command.strip()
            if command == "release":
                release_startup_windows()
                print("released", flush=True)
            elif command == "fork-and-exit":
                if os.fork() == 0:  # a child that outlives its parent
                    time.sleep(20)
                    os._exit(0)
                os._exit(0)  # exits holding the window, without releasing it
    """)

    def __init__(self, shm: Path, device: str = DEVICE) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, device, str(shm)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.read() == "held"

    def read(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def holder(shm: Path) -> Iterator[Holder]:
    neighbour = Holder(shm)
    yield neighbour
    neighbour.stop()


class Acquiring(threading.Thread):
    """This process acquiring the window in the background, to see when it gets it."""

    def __init__(self, shm: Path, timeout_s: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.shm, self.timeout_s = shm, timeout_s
        self.window: StartupWindow | None = None
        self.start()

    def run(self) -> None:
        self.window = acquire_startup_window(DEVICE, timeout_s=self.timeout_s, holder="me",
                                             directory=self.shm)


def test_second_engine_waits_until_the_first_releases(shm: Path, holder: Holder) -> None:
    waiting = Acquiring(shm)
    time.sleep(0.5)
    assert waiting.is_alive() and not holds_startup_window(DEVICE)
    holder.send("release")
    assert holder.read() == "released"
    waiting.join(10)
    assert waiting.window is not None and waiting.window.held
    assert waiting.window.waited_s >= 0.5
    assert holder.process.poll() is None  # released by the call, not by an exit
    assert holds_startup_window(DEVICE)


def test_another_device_does_not_wait(shm: Path, holder: Holder) -> None:
    window = acquire_startup_window("gpu-other-device", timeout_s=30, holder="me",
                                    directory=shm)
    assert window.held and window.waited_s < 1.0


def test_waiting_names_the_holder_in_one_line(shm: Path, holder: Holder,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcached_core.startup_memory")
    acquire_startup_window(DEVICE, timeout_s=0.6, holder="me", directory=shm)
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(waits) == 1
    assert f"engine neighbour (pid {holder.process.pid}," in waits[0]
    assert DEVICE in waits[0]


def test_a_dead_holder_frees_the_window(shm: Path, holder: Holder) -> None:
    waiting = Acquiring(shm)
    time.sleep(0.3)
    assert waiting.is_alive()
    holder.process.kill()
    waiting.join(10)
    assert waiting.window is not None and waiting.window.held


def test_a_holder_that_exits_leaves_no_window_in_its_forked_child(shm: Path,
                                                                  holder: Holder) -> None:
    holder.send("fork-and-exit")
    holder.process.wait(10)
    # The holder's child is still alive and has copies of its descriptors.
    window = acquire_startup_window(DEVICE, timeout_s=10, holder="me", directory=shm)
    assert window.held and window.waited_s < 5


def test_a_holder_that_never_releases_delays_the_start_by_the_timeout_only(
        shm: Path, holder: Holder, caplog: pytest.LogCaptureFixture) -> None:
    started = time.monotonic()
    window = acquire_startup_window(DEVICE, timeout_s=0.5, holder="me", directory=shm)
    elapsed = time.monotonic() - started
    assert not window.held and 0.5 <= elapsed < 5
    assert not holds_startup_window(DEVICE)
    assert any(r.levelno == logging.WARNING and "going on without it" in r.getMessage()
               for r in caplog.records)
    release_startup_windows()  # nothing held: nothing to do, nothing released
    assert holder.process.poll() is None


def test_release_is_idempotent_and_a_second_acquire_in_the_process_is_answered_at_once(
        shm: Path) -> None:
    first = acquire_startup_window(DEVICE, timeout_s=5, holder="me", directory=shm)
    again = acquire_startup_window(DEVICE, timeout_s=5, holder="me", directory=shm)
    assert first.held and again.held and again.waited_s == 0.0
    release_startup_windows()
    release_startup_windows()
    assert not holds_startup_window(DEVICE)
    neighbour = Holder(shm)  # the window is free for another process after one release
    neighbour.stop()


def test_an_unusable_lock_file_is_a_warning_not_a_refusal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    window = acquire_startup_window(DEVICE, timeout_s=5, holder="me",
                                    directory=tmp_path / "missing")
    assert not window.held
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_lock_files_are_not_limit_records(shm: Path) -> None:
    from kvcached_core.limits import scan_records

    acquire_startup_window(DEVICE, timeout_s=5, holder="me", directory=shm)
    assert startup_window_path(DEVICE, shm).exists()
    assert scan_records(shm) == ([], [])


# --- the device's name ------------------------------------------------------------------------

def test_device_identity_follows_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert cuda_device_identity(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == "cuda-6"
    assert cuda_device_identity(0, {}) == "cuda-0"
    assert cuda_device_identity(0, {"CUDA_VISIBLE_DEVICES": "GPU-AB12-cd34"}) == \
        "gpu-ab12-cd34"


def test_device_identity_is_the_uuid_when_torch_reports_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports an H200's UUID as `be86...` (a `_CUuuid` whose str is that), nvidia-smi
    and CUDA_VISIBLE_DEVICES as `GPU-be86...`: a process that can read the UUID and one that
    falls back to CUDA_VISIBLE_DEVICES name the device the same way."""
    import torch

    uuid = "be860c2f-7698-6a1f-1e19-15dffda0fad6"

    class CUuuid:
        def __str__(self) -> str:
            return uuid

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid=CUuuid()))
    from_torch = cuda_device_identity(0, {"CUDA_VISIBLE_DEVICES": "1"})
    assert from_torch == f"gpu-{uuid}"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert cuda_device_identity(0, {"CUDA_VISIBLE_DEVICES": f"GPU-{uuid}"}) == from_torch


# --- vLLM's use -------------------------------------------------------------------------------

CUDA0 = types.SimpleNamespace(type="cuda", index=0)


@pytest.fixture
def vllm_env(shm: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"KVCACHED_ENABLE": "1", "KVCACHED_SHM_DIR": str(shm),
           "CUDA_VISIBLE_DEVICES": "2", "KVCACHED_START_WINDOW_TIMEOUT": "0.5"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_snapshot_takes_the_window_and_the_profile_check_releases_it(
        vllm_env: dict[str, str]) -> None:
    snapshot = startup_snapshot(lambda: "snapshot", CUDA0)
    assert snapshot == "snapshot" and holds_startup_window("cuda-2")
    assert memory_profile_consistent(100 * GIB, 90 * GIB)
    assert not holds_startup_window("cuda-2")


def test_the_window_is_taken_before_the_snapshot(vllm_env: dict[str, str]) -> None:
    seen: list[bool] = []
    startup_snapshot(lambda: seen.append(holds_startup_window("cuda-2")), CUDA0)
    assert seen == [True]


def test_a_snapshot_waits_for_the_neighbour_on_its_device(vllm_env: dict[str, str],
                                                          shm: Path) -> None:
    neighbour = Holder(shm, device="cuda-2")
    try:
        started = time.monotonic()
        startup_snapshot(lambda: None, CUDA0)  # waits the 0.5 s timeout, then goes on
        assert time.monotonic() - started >= 0.5
        assert not holds_startup_window("cuda-2")
    finally:
        neighbour.stop()


def test_worker_methods_that_end_the_window_release_it_on_any_exit(
        vllm_env: dict[str, str]) -> None:
    @ends_startup_window
    def determine_available_memory() -> int:
        raise RuntimeError("profile failed")

    startup_snapshot(lambda: None, CUDA0)
    with pytest.raises(RuntimeError, match="profile failed"):
        determine_available_memory()
    assert not holds_startup_window("cuda-2")

    @ends_startup_window
    def initialize_from_config(config: object) -> object:
        """Allocate the KV cache."""
        return config

    startup_snapshot(lambda: None, CUDA0)
    assert initialize_from_config("config") == "config"
    assert initialize_from_config.__doc__ == "Allocate the KV cache."
    assert not holds_startup_window("cuda-2")


def test_stock_engine_takes_no_window(vllm_env: dict[str, str], shm: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    neighbour = Holder(shm, device="cuda-2")
    try:
        started = time.monotonic()
        assert startup_snapshot(lambda: "stock", CUDA0) == "stock"
        assert time.monotonic() - started < 0.4  # no wait for the neighbour's window
        assert not holds_startup_window("cuda-2")
    finally:
        neighbour.stop()


def test_other_device_types_take_no_window(vllm_env: dict[str, str], shm: Path) -> None:
    assert startup_snapshot(lambda: "cpu", types.SimpleNamespace(type="cpu", index=None)) \
        == "cpu"
    assert list(shm.iterdir()) == []


def test_timeout_setting() -> None:
    assert KVCachedSettings.from_env({}).start_window_timeout_s == 300.0
    assert KVCachedSettings.from_env(
        {"KVCACHED_START_WINDOW_TIMEOUT": "12.5"}).start_window_timeout_s == 12.5
    from kvcached_core.errors import KVCachedConfigError

    with pytest.raises(KVCachedConfigError, match="KVCACHED_START_WINDOW_TIMEOUT"):
        KVCachedSettings.from_env({"KVCACHED_START_WINDOW_TIMEOUT": "0"})


def test_the_lock_file_names_its_holder(shm: Path) -> None:
    acquire_startup_window(DEVICE, timeout_s=5, holder="me", directory=shm)
    assert os.path.getsize(startup_window_path(DEVICE, shm)) > 0  # names the holder


def test_a_lock_file_this_user_cannot_write_still_serves_as_the_window(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's engine created the file and a 022 umask took write access away: the
    lock needs no write access, so the window still works (only the holder line is lost)."""
    import select

    open_file = os.open

    def no_write_access(path: str, flags: int, *args: int) -> int:
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", path)
        return open_file(path, flags, *args)

    startup_window_path(DEVICE, shm).write_text("")
    monkeypatch.setattr(os, "open", no_write_access)
    window = acquire_startup_window(DEVICE, timeout_s=5, holder="me", directory=shm)
    monkeypatch.undo()
    assert window.held
    waiting = subprocess.Popen(
        [sys.executable, "-c", Holder.SCRIPT, DEVICE, str(shm)], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout is not None
        assert select.select([waiting.stdout], [], [], 0.5)[0] == []  # it waits for us
        release_startup_windows()
        assert waiting.stdout.readline().strip() == "held"
    finally:
        waiting.kill()
        waiting.wait()


# --- an engine over several ranks -------------------------------------------------------------
# Real processes, real process groups (gloo over a rendezvous file): each rank runs what a
# patched vLLM worker runs at start-up (`startup_snapshot`, then a profile whose collectives
# need every rank of its engine, ended by `ends_startup_window`).

RANK_SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    flavour, rendezvous, world, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, world_size=world,
                            rank=rank)
    if flavour == "vllm":  # what the rewritten Worker.init_device and its profile call
        from kvcached_core.integration.vllm.startup_memory import (ends_startup_window,
                                                                   startup_snapshot)

        class Cuda0:
            type, index = "cuda", 0

        began = startup_snapshot(time.monotonic, Cuda0())
        time.sleep(0.4)  # weights load: device-wide figures move
        measured = time.monotonic()

        @ends_startup_window
        def determine_available_memory():
            dist.barrier()  # the profile's collectives: every rank of this engine

        determine_available_memory()
    else:  # SGLang: the pre-load read over the world's CPU group, then the KV-profile read
        from kvcached_core.integration.sglang.startup import elastic_free_memory_gb

        shm = sys.argv[6]
        seen = []

        def measure(device, gpu_id, distributed=False, cpu_group=None):
            seen.append(time.monotonic())
            return 10.0

        group = dist.new_group(backend="gloo")
        elastic_free_memory_gb(measure, "cuda", 0, distributed=True, cpu_group=group,
                               elastic=True, records_directory=shm, startup_window="begin")
        time.sleep(0.4)
        measured = time.monotonic()
        dist.barrier(group=group)  # the weight load's and profile's collectives
        elastic_free_memory_gb(measure, "cuda", 0, distributed=True, cpu_group=group,
                               elastic=True, records_directory=shm, startup_window="end")
        began = seen[0]
    with open(out, "w") as f:
        json.dump({"began": began, "measured": measured, "done": time.monotonic()}, f)
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads abort a process that exits without this
""")


def start_engine(name: str, ranks: list[tuple[Path, str]], tmp_path: Path,
                 timeout_s: float, flavour: str = "vllm",
                 ) -> list[tuple[subprocess.Popen[str], Path]]:
    """One engine: a rank per (window directory, device), started at once."""
    rendezvous = tmp_path / f"{name}.rendezvous"
    started = []
    for rank, (shm, device) in enumerate(ranks):
        out = tmp_path / f"{name}-{rank}.json"
        env = {**os.environ, "KVCACHED_ENABLE": "1", "KVCACHED_SHM_DIR": str(shm),
               "CUDA_VISIBLE_DEVICES": device, "KVCACHED_POOL_NAME": name,
               "KVCACHED_START_WINDOW_TIMEOUT": str(timeout_s), "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "lo"}  # loopback: the host name may not resolve
        started.append((subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, flavour, str(rendezvous), str(len(ranks)),
             str(rank), str(out), str(shm)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True), out))
    return started


def measurement_span(ranks: list[tuple[subprocess.Popen[str], Path]],
                     deadline_s: float) -> tuple[float, float]:
    """(first snapshot, last end of a weight load) over the engine's ranks, once all exit."""
    import json

    spans = []
    for process, out in ranks:
        output, _ = process.communicate(timeout=deadline_s)
        assert process.returncode == 0, output
        assert "going on without it" not in output, output
        record = json.loads(out.read_text())
        spans.append((record["began"], record["measured"]))
    return min(b for b, _ in spans), max(m for _, m in spans)


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
@pytest.mark.parametrize("layout", ["one host", "two hosts"])
def test_engines_over_the_same_devices_in_crossed_order_measure_in_turns(
        tmp_path: Path, layout: str, flavour: str) -> None:
    """Engine X's ranks run on devices (A, B), engine Y's on (B, A). With a window per rank,
    X's rank 0 and Y's rank 0 would each hold one device and wait in their profiles for a rank
    that waits for the other's device, until the timeout. Taken as one acquisition per engine,
    one engine measures, then the other, and neither waits out the timeout. "two hosts": the
    devices' windows live in two directories (two hosts' /dev/shm). Both engines' start-up
    reads: vLLM's snapshot to profile, SGLang's pre-load read to KV-profile read."""
    first, second = tmp_path / "shm-1", tmp_path / "shm-2"
    first.mkdir(), second.mkdir()
    a = (first, "GPU-aaaaaaaa-0000-0000-0000-000000000000")
    b = (first if layout == "one host" else second, "GPU-bbbbbbbb-0000-0000-0000-000000000000")
    timeout_s = 60.0
    started = time.monotonic()
    x = start_engine("x", [a, b], tmp_path, timeout_s, flavour)
    y = start_engine("y", [b, a], tmp_path, timeout_s, flavour)
    x_span = measurement_span(x, deadline_s=timeout_s)
    y_span = measurement_span(y, deadline_s=timeout_s)
    assert time.monotonic() - started < timeout_s / 2
    earlier, later = sorted([x_span, y_span])
    assert earlier[1] <= later[0], (x_span, y_span)  # no measurement overlaps the other's


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_a_single_device_neighbour_delays_every_rank_of_an_engine(tmp_path: Path, shm: Path,
                                                                   flavour: str) -> None:
    """A neighbour measuring on one of the engine's devices holds back the engine's ranks on
    the other devices too: they all measure together, after it. (With a window per rank, the
    rank on the other device would measure at once, beside the neighbour.)"""
    b = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    neighbour = Holder(shm, device=cuda_device_identity(0, {"CUDA_VISIBLE_DEVICES": b}))
    try:
        engine = start_engine("x", [(shm, "GPU-aaaaaaaa-0000-0000-0000-000000000000"),
                                    (shm, b)], tmp_path, timeout_s=60.0, flavour=flavour)
        lowest_rank = engine[0][0]
        assert lowest_rank.stdout is not None
        for line in lowest_rank.stdout:  # the rank that takes the engine's windows waits
            if "waiting for the start-up window" in line:
                assert "engine neighbour" in line
                break
        time.sleep(0.5)
        released = time.monotonic()
        neighbour.send("release")
        assert neighbour.read() == "released"
        began, _ = measurement_span(engine, deadline_s=60.0)
        assert began >= released
    finally:
        neighbour.stop()


def test_one_timeout_bounds_the_whole_acquisition_of_an_engine(tmp_path: Path,
                                                               shm: Path) -> None:
    """Neighbours that never release hold both of an engine's devices: the engine goes on
    after its one timeout, not after one timeout per device."""
    a, b = ("GPU-aaaaaaaa-0000-0000-0000-000000000000",
            "GPU-bbbbbbbb-0000-0000-0000-000000000000")
    neighbours = [Holder(shm, device=cuda_device_identity(0, {"CUDA_VISIBLE_DEVICES": each}))
                  for each in (a, b)]
    try:
        engine = start_engine("x", [(shm, a), (shm, b)], tmp_path, timeout_s=2.0)
        outputs = []
        for process, out in engine:
            output, _ = process.communicate(timeout=60)
            assert process.returncode == 0, output
            assert out.is_file()
            outputs.append(output)
        gave_up = [line for line in outputs[0].splitlines() if "going on without it" in line]
        assert len(gave_up) == 2, outputs[0]  # the lowest rank waited for both devices
        assert "waited 2 s" in gave_up[0] and "waited 0 s" in gave_up[1], gave_up
        assert "going on without it" not in outputs[1]  # the other rank waited for none
    finally:
        for neighbour in neighbours:
            neighbour.stop()
