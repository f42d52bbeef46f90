"""A `kvrouter serve` process for the router benchmarks (bench_router.py, gpu_router.py,
gpu_router_levels.py): started in its own session, ready once `/health` answers, and stopped
with SIGTERM (which stops its engines) when the block ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STOP_WAIT_S = 150  # the router stops every engine first


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


@contextmanager
def running_router(argv: list[str], env: dict[str, str], log_path: Path, base: str,
                   *, ready_timeout_s: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    with log_path.open("w") as log:
        router = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                try:
                    get_json(f"{base}/health")
                    break
                except OSError:
                    assert router.poll() is None, f"the router exited: see {log_path}"
                    assert time.monotonic() < deadline, "the router did not answer"
                    time.sleep(0.2)
            yield router
        finally:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                router.wait()
