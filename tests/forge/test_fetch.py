"""Fetching pinned artifacts: simple API, sha256 verification, the cache and its stamp."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import git
import pytest
from _fixtures import SimpleIndex, serve_index, sha256, wheel_bytes, wheel_name

from forge import fetch
from forge.errors import FetchError
from forge.fetch import fetch_artifact, fetch_git_source, find_on_index, resolve_index_url
from forge.matrix import Artifact, Matrix

WHEEL = wheel_bytes()
NAME = wheel_name()


def artifact(digest: str = sha256(WHEEL)) -> Artifact:
    return Artifact(role="wheel", filename=NAME, sha256=digest)


def cached_files(cache: Path) -> list[str]:
    folder = cache / "artifacts"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("json_api", [True, False], ids=["pep691-json", "pep503-html"])
def test_fetch_resolves_downloads_and_verifies(tmp_path: Path, json_api: bool) -> None:
    lines: list[str] = []
    with serve_index(SimpleIndex(files={NAME: WHEEL}, json_api=json_api)) as index:
        found = find_on_index(index.url, NAME)
        assert found.url.endswith(f"/files/{NAME}") and found.sha256 == sha256(WHEEL)
        path = fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path,
                              progress=lines.append)
    assert path == tmp_path / "artifacts" / NAME
    assert path.read_bytes() == WHEEL
    assert cached_files(tmp_path) == [NAME, f"{NAME}.verified"]
    assert "100%" in lines[-1] and "MB/s" in lines[-1]


def test_cached_file_is_used_without_the_index(tmp_path: Path) -> None:
    with serve_index(SimpleIndex(files={NAME: WHEEL})) as index:
        fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path)
        url = index.url
    # The server is gone: a second fetch must come from the cache.
    assert fetch_artifact(artifact(), index_url=url, cache_dir=tmp_path).read_bytes() == WHEEL


def test_stamp_skips_rehashing_an_unchanged_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with serve_index(SimpleIndex(files={NAME: WHEEL})) as index:
        fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(fetch, "sha256_file", no_hashing)
    fetch_artifact(artifact(), index_url="http://127.0.0.1:9/simple", cache_dir=tmp_path)


def test_changed_cached_file_is_detected_even_with_its_mtime_restored(tmp_path: Path) -> None:
    with serve_index(SimpleIndex(files={NAME: WHEEL})) as index:
        path = fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path)
        before = path.stat()
        tampered = bytearray(WHEEL)
        tampered[100] ^= 0xFF
        path.write_bytes(bytes(tampered))  # same size
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        lines: list[str] = []
        again = fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path,
                               progress=lines.append)
        assert again.read_bytes() == WHEEL
        assert any("does not match its pin" in line for line in lines)
        assert index.requests.count(f"/files/{NAME}") == 2


def test_sha256_mismatch_is_refused_and_deleted(tmp_path: Path) -> None:
    pinned = "0" * 64
    with serve_index(SimpleIndex(files={NAME: WHEEL})) as index, \
            pytest.raises(FetchError) as caught:
        fetch_artifact(artifact(pinned), index_url=index.url, cache_dir=tmp_path)
    message = str(caught.value)
    assert f"expected {pinned}" in message and f"got {sha256(WHEEL)}" in message
    assert f"{index.url.removesuffix('/simple')}/files/{NAME}" in message
    assert cached_files(tmp_path) == []


def test_unreachable_index_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/simple"
    with pytest.raises(FetchError) as caught:
        fetch_artifact(artifact(), index_url=url, cache_dir=tmp_path)
    assert str(caught.value).startswith(f"index {url} unreachable: ")
    assert "refused" in str(caught.value).lower()
    assert "\n" not in str(caught.value)


def test_file_missing_from_index(tmp_path: Path) -> None:
    other = wheel_name(version="1.0.1")
    with serve_index(SimpleIndex(files={other: WHEEL})) as index, \
            pytest.raises(FetchError, match=f"does not list {NAME}"):
        fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path)


def test_index_url_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    matrix = Matrix(path=tmp_path / "m.toml", schema=1, index_url="https://matrix/simple",
                    cells=())
    monkeypatch.delenv(fetch.INDEX_URL_ENV, raising=False)
    assert resolve_index_url(matrix) == "https://matrix/simple"
    monkeypatch.setenv(fetch.INDEX_URL_ENV, "https://env/simple/")
    assert resolve_index_url(matrix) == "https://env/simple"
    assert resolve_index_url(matrix, "https://flag/simple") == "https://flag/simple"


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "c"))
    assert fetch.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(fetch.CACHE_ENV)
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "kvcached-forge"


def _upstream(tmp_path: Path) -> tuple[git.Repo, str]:
    repo = git.Repo.init(tmp_path / "upstream")
    (tmp_path / "upstream" / "a.py").write_text("x = 1\n")
    repo.index.add(["a.py"])
    first = repo.index.commit("one").hexsha
    repo.create_tag("v1.0.0")
    return repo, first


def test_git_source_tag_resolving_to_pinned_commit(tmp_path: Path) -> None:
    _repo, commit = _upstream(tmp_path)
    source = Artifact(role="source", git=str(tmp_path / "upstream"), tag="v1.0.0", commit=commit)
    path, resolved = fetch_git_source(source, cache_dir=tmp_path / "cache")
    assert resolved == commit
    assert git.Repo(path).git.cat_file("-t", commit) == "commit"


def test_git_source_moved_tag_names_both_commits(tmp_path: Path) -> None:
    repo, pinned = _upstream(tmp_path)
    (tmp_path / "upstream" / "a.py").write_text("x = 2\n")
    repo.index.add(["a.py"])
    moved = repo.index.commit("two").hexsha
    repo.create_tag("v1.0.0", force=True)
    source = Artifact(role="source", git=str(tmp_path / "upstream"), tag="v1.0.0", commit=pinned)
    with pytest.raises(FetchError) as caught:
        fetch_git_source(source, cache_dir=tmp_path / "cache")
    assert pinned in str(caught.value) and moved in str(caught.value)


def test_wrong_pin_keeps_the_good_cached_copy_and_downloads_nothing(tmp_path: Path) -> None:
    with serve_index(SimpleIndex(files={NAME: WHEEL})) as index:
        fetch_artifact(artifact(), index_url=index.url, cache_dir=tmp_path)
        typo = sha256(WHEEL)[:-1] + ("0" if sha256(WHEEL)[-1] != "0" else "1")
        lines: list[str] = []
        with pytest.raises(FetchError) as caught:
            fetch_artifact(artifact(typo), index_url=index.url, cache_dir=tmp_path,
                           progress=lines.append)
        message = str(caught.value)
        assert "\n" not in message
        assert f"expected {typo}" in message and f"got {sha256(WHEEL)}" in message
        assert "nothing downloaded" in message
        kept = tmp_path / "artifacts" / "by-sha256" / sha256(WHEEL) / NAME
        assert kept.read_bytes() == WHEEL
        assert not (tmp_path / "artifacts" / NAME).exists()
        assert index.requests.count(f"/files/{NAME}") == 1
        # The pin is corrected: the kept copy comes back without a download.
        server_url = index.url
    restored = fetch_artifact(artifact(), index_url=server_url, cache_dir=tmp_path,
                              progress=lines.append)
    assert restored == tmp_path / "artifacts" / NAME and restored.read_bytes() == WHEEL
    assert not kept.exists()
    assert any("restored" in line for line in lines)
