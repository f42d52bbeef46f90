"""Fixtures shared by the runtime's unit tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def records(tmp_path: Path) -> Path:
    """A directory for limit records (what KVCACHED_SHM_DIR names), empty."""
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited: the owner of a stale record."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
