"""The git workspace: vendor import of a wheel's sources, reproducible commits, cached reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fixtures import ENGINE_PY, POOL_PY, sha256, wheel_bytes, wheel_name

from forge import workspace as workspace_module
from forge.errors import WheelError
from forge.workspace import PATCH_BRANCH, VENDOR_BRANCH, wheel_workspace

WHEEL = wheel_bytes()


def write_wheel(tmp_path: Path, data: bytes = WHEEL) -> Path:
    path = tmp_path / wheel_name()
    path.write_bytes(data)
    return path


def test_vendor_holds_only_source_members(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path)
    with wheel_workspace(wheel, sha256(WHEEL), tmp_path / "cache") as ws:
        tracked = sorted(ws.repo.git.ls_files().splitlines())
        assert tracked == ["fakeeng/__init__.py", "fakeeng/engine.py", "fakeeng/pool.py"]
        assert (ws.root / "fakeeng" / "pool.py").read_text() == POOL_PY
        assert ws.repo.active_branch.name == PATCH_BRANCH
        assert ws.head_commit == ws.vendor_commit


def test_extra_members_are_imported_when_named(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path)
    with wheel_workspace(wheel, sha256(WHEEL), tmp_path / "cache",
                         extra_members=["fakeeng/configs/table.json"]) as ws:
        assert "fakeeng/configs/table.json" in ws.repo.git.ls_files().splitlines()


def test_vendor_commit_is_reproducible(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path)
    commits = []
    for cache in ("one", "two"):
        with wheel_workspace(wheel, sha256(WHEEL), tmp_path / cache) as ws:
            commits.append(ws.vendor_commit)
    assert commits[0] == commits[1]


def test_transform_commits_diff_and_changed_files(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path)
    with wheel_workspace(wheel, sha256(WHEEL), tmp_path / "cache") as ws:
        (ws.root / "fakeeng" / "engine.py").write_text(ENGINE_PY + "\nSTEPS = 1\n")
        assert ws.commit_all("first")
        (ws.root / "fakeeng" / "_new.py").write_text("NEW = True\n")
        assert ws.commit_all("second")
        assert not ws.commit_all("nothing changed")
        assert ws.changed_files() == ["fakeeng/_new.py", "fakeeng/engine.py"]
        diff = ws.diff()
        assert "+STEPS = 1\n" in diff and "+NEW = True\n" in diff
        assert diff.count("diff --git ") == 2
        log = ws.repo.git.log("--format=%an %ad %s", "--date=iso-strict",
                              f"{VENDOR_BRANCH}..{PATCH_BRANCH}").splitlines()
        assert log == ["kvcached forge 2000-01-01T00:00:00+00:00 second",
                       "kvcached forge 2000-01-01T00:00:00+00:00 first"]


def test_cached_import_is_reused_and_reset(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = write_wheel(tmp_path)
    with wheel_workspace(wheel, sha256(WHEEL), tmp_path / "cache") as ws:
        (ws.root / "fakeeng" / "pool.py").write_text("broken = (\n")
        ws.commit_all("left over from an earlier build")
        (ws.root / "stray.py").write_text("x = 1\n")

    def no_import(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached vendor import was not reused")

    monkeypatch.setattr(workspace_module, "_import_wheel", no_import)
    with wheel_workspace(wheel, sha256(WHEEL), tmp_path / "cache") as ws:
        assert ws.head_commit == ws.vendor_commit
        assert (ws.root / "fakeeng" / "pool.py").read_text() == POOL_PY
        assert not (ws.root / "stray.py").exists()
        assert ws.changed_files() == []


def test_half_finished_import_is_redone(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path)
    cache = tmp_path / "cache"
    with wheel_workspace(wheel, sha256(WHEEL), cache) as ws:
        marker = ws.root / ".git" / workspace_module._MARKER
    marker.unlink()
    with wheel_workspace(wheel, sha256(WHEEL), cache) as ws:
        assert (ws.root / "fakeeng" / "pool.py").read_text() == POOL_PY
        assert marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_wheel_is_a_wheel_error(tmp_path: Path, damage: str) -> None:
    data = WHEEL[: len(WHEEL) // 2] if damage == "truncated" else b"not a zip file" * 100
    wheel = write_wheel(tmp_path, data)
    with pytest.raises(WheelError) as caught, \
            wheel_workspace(wheel, sha256(data), tmp_path / "cache"):
        pass
    assert str(caught.value).startswith(f"{wheel.name}: truncated or corrupt wheel")
    assert not any((tmp_path / "cache" / "workspaces").glob("*/.git"))
