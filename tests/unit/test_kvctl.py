"""kvctl through main([...]) and once as a real process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.kvctl import main
from kvcached_core.limits import (
    RECORD_SIZE,
    LimitRecord,
    LimitSegment,
    read_record,
    record_path,
)
from kvcached_core.settings import parse_size

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def pool(shm: Path) -> Iterator[LimitSegment]:
    segment = LimitSegment.create("llama", capacity_bytes=8 * GIB, directory=shm)
    yield segment
    segment.close()


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 * MIB),
        ("2G", 2 * GIB),
        ("2gb", 2 * GIB),
        ("1.5GiB", 3 * GIB // 2),
        ("1_000_000", 1_000_000),
        ("4096", 4096),
        ("64KiB", 64 * 1024),
        ("0", 0),
    ],
)
def test_sizes_use_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "1.5", "2X", "1.2.3G", "G"])
def test_bad_sizes_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_list_shows_table_and_json(pool: LimitSegment) -> None:
    pool.update_usage(2 * GIB, 256 * MIB)
    code, text = run("list")
    assert code == 0
    header, row = text.strip().splitlines()
    assert header.split()[:3] == ["POOL", "LIMIT", "USED"]
    assert row.split()[:6] == ["llama", "8.0GiB", "2.0GiB", "256.0MiB", "25.0%", "8.0GiB"]
    assert row.split()[-1] == "live"
    code, text = run("list", "--json")
    assert code == 0
    (entry,) = json.loads(text)
    assert entry["pool"] == "llama"
    assert entry["used_bytes"] == 2 * GIB
    assert entry["stale"] is False


def test_limit_sets_bytes_and_revision(pool: LimitSegment) -> None:
    code, text = run("limit", "llama", "2G")
    assert code == 0
    assert "revision 1" in text
    record = read_record("llama")
    assert (record.limit_bytes, record.revision) == (2 * GIB, 1)
    code, _ = run("limit", "llama", "1.5GiB", "--revision", "1")
    assert code == 0
    assert read_record("llama").limit_bytes == 3 * GIB // 2


def test_limit_percent_uses_pool_capacity(pool: LimitSegment) -> None:
    code, _ = run("limit-percent", "llama", "25")
    assert code == 0
    assert read_record("llama").limit_bytes == 2 * GIB


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("limit", "llama", "lots"), "invalid size"),
        (("limit", "ghost", "1G"), "no pool named 'ghost'"),
        (("limit", "llama", "1G", "--revision", "7"), "revision 0, not 7"),
        (("limit-percent", "llama", "150"), "invalid percent"),
        (("limit-percent", "ghost", "10"), "no pool named 'ghost'"),
        (("delete", "llama"), "live process"),
    ],
)
def test_errors_print_one_line_and_fail(
    pool: LimitSegment, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, _ = run(*argv)
    assert code != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert message in err
    assert read_record("llama").limit_bytes == 8 * GIB


def test_usage_errors_exit_2(shm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("frobnicate")[0] == 2
    assert run()[0] == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def _make_stale(shm: Path, name: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    record_path(name, shm).write_bytes(LimitRecord(name, GIB, 0, 0, 0, proc.pid, GIB).pack())
    os.chmod(record_path(name, shm), 0o600)


def test_stale_records_are_marked_and_removed(
    pool: LimitSegment, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _make_stale(shm, "gone")
    _make_stale(shm, "gone2")
    code, text = run("list")
    rows = {line.split()[0]: line.split()[-1] for line in text.strip().splitlines()[1:]}
    assert rows == {"gone": "stale", "gone2": "stale", "llama": "live"}
    assert run("delete", "gone")[0] == 0
    code, text = run("list", "--gc")
    assert code == 0
    assert "removed stale pool gone2" in capsys.readouterr().err
    assert [line.split()[0] for line in text.strip().splitlines()[1:]] == ["llama"]


def test_watch_prints_count_tables(pool: LimitSegment) -> None:
    code, text = run("watch", "-n", "0.01", "--count", "2")
    assert code == 0
    assert text.count("POOL") == 2
    assert run("watch", "-n", "0")[0] != 0


def test_real_process_limit_and_list(pool: LimitSegment, shm: Path) -> None:
    env = {**os.environ, "KVCACHED_SHM_DIR": str(shm)}
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "kvcached_core.kvctl"]
    done = subprocess.run(
        [*command, "limit", "llama", "512M"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert read_record("llama").limit_bytes == 512 * MIB
    done = subprocess.run(
        [*command, "limit", "llama", "bogus"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.strip().startswith("kvctl limit: invalid size")
    done = subprocess.run(
        [*command, "list", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert json.loads(done.stdout)[0]["limit_bytes"] == 512 * MIB


def _kvctl(shm: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real command line: a separate process, as an operator runs it."""
    env = {**os.environ, "KVCACHED_SHM_DIR": str(shm)}
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "kvcached_core.kvctl", *argv], env=env,
                          capture_output=True, text=True, timeout=60)


def test_corrupt_records_are_listed_with_their_owner_and_gc_says_what_it_removes(
    pool: LimitSegment, shm: Path
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # A default-named pool truncated to nothing: its owner pid is in its name (and gone).
    record_path(f"vllm-{dead.pid}", shm).write_bytes(b"")
    # Foreign bytes under a user-chosen name, untouched for a minute: owner unknown.
    junk = record_path("junk", shm)
    junk.write_bytes(b"x" * RECORD_SIZE)
    os.utime(junk, (junk.stat().st_mtime - 60,) * 2)
    # A record of a format this code does not read, whose owner (this process) is alive.
    newer = bytearray(LimitRecord("newer", GIB, 0, 0, 0, os.getpid(), GIB).pack())
    newer[8] = 99  # format version
    record_path("newer", shm).write_bytes(bytes(newer))

    done = _kvctl(shm, "list")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: (line.split()[-2], line.split()[-1])
            for line in done.stdout.strip().splitlines()[1:]}
    assert rows == {
        "junk": ("unknown", "corrupt"),
        "llama": (str(os.getpid()), "live"),
        "newer": (str(os.getpid()), "corrupt"),
        f"vllm-{dead.pid}": (str(dead.pid), "corrupt"),
    }
    listed = json.loads(_kvctl(shm, "list", "--json").stdout)
    by_pool = {entry["pool"]: entry for entry in listed}
    assert by_pool[f"vllm-{dead.pid}"]["corrupt"] is True
    assert by_pool[f"vllm-{dead.pid}"]["owner_pid"] == dead.pid
    assert by_pool["junk"]["owner_pid"] is None
    assert "format version 99" in by_pool["newer"]["reason"]

    done = _kvctl(shm, "list", "--gc")
    assert done.returncode == 0, done.stderr
    removed = sorted(done.stderr.strip().splitlines())
    assert len(removed) == 2, removed
    assert removed[0].startswith("removed corrupt pool junk (pid unknown): corrupt (")
    assert "owner unknown" in removed[0]
    assert removed[1].startswith(f"removed corrupt pool vllm-{dead.pid} (pid {dead.pid}): ")
    assert f"owner pid {dead.pid} is gone" in removed[1] and "0 bytes" in removed[1]
    # The live owner's corrupt record stays for its owner to rewrite.
    assert [line.split()[0] for line in done.stdout.strip().splitlines()[1:]] == [
        "llama", "newer"]
    assert not junk.exists()
