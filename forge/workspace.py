"""A build's git workspace: upstream sources on `vendor`, one commit per transform on `kvcached`.

For a wheel, the tree holds its source members (``.py`` and the other text files transforms may
touch), never its binaries: the re-packer copies every unchanged member straight from the
upstream wheel. The vendor import is cached per base sha256 and member selection, so a second
build of the same wheel only resets the ``kvcached`` branch (a fraction of a second for vLLM's
855 ``.py`` files).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

import git

from forge.errors import TransformError, WheelError

Progress = Callable[[str], None]

VENDOR_BRANCH = "vendor"
PATCH_BRANCH = "kvcached"
SOURCE_SUFFIXES = (".py", ".pyi", ".jinja", ".txt", ".md", ".typed")
# Bump when the import changes shape, so old cached imports are not reused.
_IMPORT_FORMAT = 1
_MARKER = "kvcached-vendor.json"

# Fixed identity and dates: the same inputs give the same commit ids on every machine.
_FIXED_DATE = "2000-01-01T00:00:00+0000"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "kvcached forge",
    "GIT_AUTHOR_EMAIL": "forge@kvcached.invalid",
    "GIT_AUTHOR_DATE": _FIXED_DATE,
    "GIT_COMMITTER_NAME": "kvcached forge",
    "GIT_COMMITTER_EMAIL": "forge@kvcached.invalid",
    "GIT_COMMITTER_DATE": _FIXED_DATE,
    # The user's own git configuration (hooks, signing, excludes, autocrlf) must not leak in.
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
}
_REPO_CONFIG = {
    "core.autocrlf": "false",
    "core.filemode": "true",
    "core.safecrlf": "false",
    "commit.gpgsign": "false",
    "gc.auto": "0",
}


def _quiet(_line: str) -> None:
    return None


def is_source_member(name: str) -> bool:
    """Whether a wheel member is imported into the workspace by default."""
    top = name.split("/", 1)[0]
    if top.endswith((".dist-info", ".data")):
        return False
    return name.endswith(SOURCE_SUFFIXES)


def _safe_member_path(name: str, wheel: Path) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise WheelError(f"{wheel.name}: member {name!r} escapes the wheel root")
    return path


class Workspace:
    """A checked-out repository whose ``kvcached`` branch starts at the ``vendor`` import."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.repo = git.Repo(root)
        self.repo.git.update_environment(**GIT_ENV)

    @property
    def vendor_commit(self) -> str:
        return self.repo.git.rev_parse(VENDOR_BRANCH).strip()

    @property
    def head_commit(self) -> str:
        return self.repo.git.rev_parse("HEAD").strip()

    def reset(self) -> None:
        """Point ``kvcached`` at ``vendor`` and remove every change in the work tree."""
        self.repo.git.checkout("--force", "-B", PATCH_BRANCH, VENDOR_BRANCH)
        self.repo.git.clean("-ffdxq")

    def commit_all(self, message: str) -> bool:
        """Commit every change of the work tree on ``kvcached``; False if nothing changed."""
        self.repo.git.add("--all", "--force")
        if not self.repo.git.diff("--cached", "--name-only").strip():
            return False
        self.repo.git.commit("--quiet", "--no-verify", "-m", message)
        return True

    def status_paths(self) -> list[str]:
        """Paths changed in the work tree (tracked or not) relative to HEAD."""
        self.repo.git.add("--all", "--force")
        out = self.repo.git.diff("--cached", "--name-only", "--no-renames")
        return [line for line in out.splitlines() if line]

    def unstage(self) -> None:
        self.repo.git.reset("--quiet")

    def diff(self) -> str:
        """The whole change of the cell (vendor..kvcached) as one unified diff."""
        text = self.repo.git.diff(
            "--no-color", "--no-ext-diff", "--no-renames", "--full-index",
            f"{VENDOR_BRANCH}..{PATCH_BRANCH}", strip_newline_in_stdout=False,
        )
        return text

    def changed_files(self) -> list[str]:
        """Paths added or rewritten on ``kvcached`` relative to ``vendor``, sorted."""
        out = self.repo.git.diff(
            "--name-status", "--no-renames", f"{VENDOR_BRANCH}..{PATCH_BRANCH}"
        )
        paths: list[str] = []
        for line in out.splitlines():
            status, _, path = line.partition("\t")
            if status.startswith("D"):
                raise TransformError(
                    f"the transforms deleted {path}; deleting files is not supported"
                )
            paths.append(path)
        return sorted(paths)

    def read_bytes(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()


def _selection_key(sha256: str, extra_members: Iterable[str]) -> str:
    selection = json.dumps(
        {"format": _IMPORT_FORMAT, "suffixes": SOURCE_SUFFIXES, "extra": sorted(set(extra_members))}
    )
    return f"{sha256[:24]}-{hashlib.sha256(selection.encode()).hexdigest()[:10]}"


@contextlib.contextmanager
def wheel_workspace(wheel: Path, sha256: str, cache_dir: Path, *,
                    extra_members: Iterable[str] = (),
                    progress: Progress = _quiet) -> Iterator[Workspace]:
    """Yield a reset workspace for ``wheel``, importing it once per (sha256, selection).

    The workspace is locked while in use, so two builds of the same wheel do not interleave.
    """
    extra = sorted(set(extra_members))
    root = cache_dir / "workspaces" / _selection_key(sha256, extra)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _valid_import(root, sha256):
            shutil.rmtree(root, ignore_errors=True)
            _import_wheel(wheel, sha256, root, extra, progress)
        workspace = Workspace(root)
        workspace.reset()
        yield workspace


def _valid_import(root: Path, sha256: str) -> bool:
    marker = root / ".git" / _MARKER
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
        repo = git.Repo(root)
        vendor = repo.git.rev_parse("--verify", "--quiet", VENDOR_BRANCH).strip()
    except (OSError, ValueError, git.GitError):
        return False
    return recorded == {"sha256": sha256, "vendor": vendor}


def _commit_vendor(root: Path, message: str) -> git.Repo:
    """A new repository at ``root`` whose ``vendor`` branch commits every file there."""
    repo = git.Repo.init(root, initial_branch=VENDOR_BRANCH)
    repo.git.update_environment(**GIT_ENV)
    with repo.config_writer() as config:
        for key, value in _REPO_CONFIG.items():
            section, option = key.split(".")
            config.set_value(section, option, value)
    repo.git.add("--all", "--force")
    repo.git.commit("--quiet", "--no-verify", "--allow-empty", "-m", message)
    return repo


def directory_workspace(root: Path, label: str) -> Workspace:
    """The files under ``root`` (sources that are not a wheel: an unpacked sdist) as the
    ``vendor`` commit of a new workspace there, reset and ready for the transforms."""
    _commit_vendor(root, f"vendor: {label}").close()
    workspace = Workspace(root)
    workspace.reset()
    return workspace


def _import_wheel(wheel: Path, sha256: str, root: Path, extra: list[str],
                  progress: Progress) -> None:
    temp = root.with_name(root.name + ".importing")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        count = _extract_sources(wheel, temp, set(extra))
        repo = _commit_vendor(
            temp, f"vendor: {wheel.name}\n\nsha256 {sha256}\nsource members: {count}")
        vendor = repo.git.rev_parse(VENDOR_BRANCH).strip()
        (temp / ".git" / _MARKER).write_text(
            json.dumps({"sha256": sha256, "vendor": vendor}), encoding="utf-8"
        )
        repo.close()
        os.replace(temp, root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    progress(f"workspace: imported {count} source files of {wheel.name} as {VENDOR_BRANCH}")


def _extract_sources(wheel: Path, dest: Path, extra: set[str]) -> int:
    count = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                name = info.filename
                if info.is_dir() or not (is_source_member(name) or name in extra):
                    continue
                relative = _safe_member_path(name, wheel)
                target = dest.joinpath(*relative.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(info))
                target.chmod(0o644)
                count += 1
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise WheelError(f"{wheel}: no such wheel") from None
        raise WheelError(f"{wheel.name}: truncated or corrupt wheel: {exc}") from None
    return count
