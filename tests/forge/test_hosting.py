"""ci/hosting.py against a local HTTP server that answers like GitHub's REST API: issues listed
page by page through Link headers (pull requests mixed in), created, updated, commented on and
closed; errors as GitHub sends them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ci import hosting

REPO = Path(__file__).resolve().parents[2]
OWNER_REPO = "kvcached/engines"
TOKEN = "ghs_test-token"
RUN_URL = "https://github.example/kvcached/engines/actions/runs/42"
ARTIFACT_URL = "https://github.example/kvcached/engines/actions/runs/42/artifacts/7"
SUMMARY = ("**vllm 0.33.0: no cell proposed.**\n\n"
           "| seam | result | code now in |\n|---|---|---|\n"
           "| kv_allocator | no working variant | vllm/v1/core/kv_cache_manager.py |")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class FakeGitHub:
    """The state behind the server: issues (pull requests among them) and what was asked."""

    page_size: int = 2
    issues: list[dict[str, Any]] = field(default_factory=list)
    comments: dict[int, list[str]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    # method -> (status, message): answer every request of that method with this error
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)
    base: str = ""

    def add(self, title: str, body: str = "", labels: tuple[str, ...] = ("upgrade-check",),
            pull_request: bool = False, state: str = "open") -> dict[str, Any]:
        number = len(self.issues) + 1
        issue: dict[str, Any] = {
            "number": number, "title": title, "body": body, "state": state,
            "labels": [{"name": name} for name in labels],
            "html_url": f"https://github.example/{OWNER_REPO}/"
                        f"{'pull' if pull_request else 'issues'}/{number}",
        }
        if pull_request:
            issue["pull_request"] = {"url": f"{self.base}/repos/{OWNER_REPO}/pulls/{number}"}
        self.issues.append(issue)
        return issue

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method != "GET"]


class Handler(BaseHTTPRequestHandler):
    fake: FakeGitHub

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _answer(self, status: int, document: object, link: str | None = None) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if link:
            self.send_header("Link", link)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        fake = self.fake
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        fake.requests.append(Request(self.command, url.path, parse_qs(url.query),
                                     # header names are case-insensitive: kept lower-case
                                     {k.lower(): v for k, v in self.headers.items()}, body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"message": "Bad credentials",
                                      "documentation_url": "https://docs.github.com/rest"})
        if self.command in fake.errors:
            status, message = fake.errors[self.command]
            return self._answer(status, {"message": message,
                                         "documentation_url": "https://docs.github.com/rest"})
        prefix = f"/repos/{OWNER_REPO}/issues"
        parts = url.path.removeprefix(prefix).strip("/").split("/") \
            if url.path.startswith(prefix) else None
        if parts == [""] and self.command == "GET":
            return self._list(parse_qs(url.query))
        if parts == [""] and self.command == "POST":
            issue = fake.add(body["title"], body.get("body", ""), tuple(body.get("labels", ())))
            return self._answer(201, issue)
        if parts and parts[0].isdigit() and int(parts[0]) <= len(fake.issues):
            issue = fake.issues[int(parts[0]) - 1]
            if len(parts) == 1 and self.command == "PATCH":
                issue.update({key: body[key] for key in ("title", "body", "state")
                              if key in body})
                return self._answer(200, issue)
            if parts[1:] == ["comments"] and self.command == "POST":
                fake.comments.setdefault(issue["number"], []).append(body["body"])
                return self._answer(201, {"id": 1, "body": body["body"]})
        return self._answer(404, {"message": "Not Found"})

    def _list(self, query: dict[str, list[str]]) -> None:
        fake = self.fake
        state = query.get("state", ["open"])[0]
        labels = set(query.get("labels", [""])[0].split(",")) - {""}
        selected = [issue for issue in fake.issues
                    if issue["state"] == state
                    and labels <= {label["name"] for label in issue["labels"]}]
        page = int(query.get("page", ["1"])[0])
        pages = max(1, -(-len(selected) // fake.page_size))
        chunk = selected[(page - 1) * fake.page_size:page * fake.page_size]

        def page_url(n: int) -> str:
            return (f"{fake.base}/repos/{OWNER_REPO}/issues?state={state}"
                    f"&labels={','.join(sorted(labels))}&per_page=100&page={n}")

        links = []
        if page < pages:
            links.append(f'<{page_url(page + 1)}>; rel="next"')
            links.append(f'<{page_url(pages)}>; rel="last"')
        if page > 1:
            links.append(f'<{page_url(1)}>; rel="first"')
        self._answer(200, chunk, ", ".join(links) or None)

    do_GET = do_POST = do_PATCH = _handle


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    fake = FakeGitHub()
    handler = type("BoundHandler", (Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    # Other issues with the label fill the first pages; a pull request whose title looks like
    # the release's issue is among them and must never be taken for it.
    fake.add("Upgrade check: sglang 0.5.24: cannot be proposed",
             "<!-- kvcached-upgrade-check: sglang 0.5.24 -->\nother")
    fake.add("Upgrade check: vllm 0.33.0: cannot be proposed",
             "<!-- kvcached-upgrade-check: vllm 0.33.0 -->\na pull request", pull_request=True)
    fake.add("Upgrade check: vllm 0.33.1: cannot be proposed",
             "<!-- kvcached-upgrade-check: vllm 0.33.1 -->\nother")
    fake.add("Upgrade check: vllm 0.33.0: cannot be proposed (closed)",
             "<!-- kvcached-upgrade-check: vllm 0.33.0 -->\nclosed", state="closed")
    fake.add("Unrelated bug", "", labels=("bug",))
    fake.add("Upgrade check: vllm 0.32.5: proposed cell fails its proofs",
             "<!-- kvcached-upgrade-check: vllm 0.32.5 -->\nother")
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def write_report(folder: Path, outcome: str, summary: str = SUMMARY,
                 version: str = "0.33.0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({
        "engine": "vllm", "version": version, "cell_name": f"vllm-{version.rsplit('.', 1)[0]}",
        "outcome": outcome, "summary": summary, "verdict": "whatever", "seams": [],
    }))
    (folder / "report.md").write_text(f"# Upgrade check: vllm {version}\n\nthe full report\n")
    return folder


def run(github: FakeGitHub, report: Path, *extra: str,
        env: dict[str, str] | None = None) -> int:
    environ = {"GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": OWNER_REPO,
               "GITHUB_SERVER_URL": "https://github.example", "GITHUB_RUN_ID": "42"}
    environ.update(env or {})
    return hosting.main(["upgrade-issue", "--report", str(report), "--api-url", github.base,
                         *extra], environ)


def release_issues(github: FakeGitHub) -> list[dict[str, Any]]:
    return [issue for issue in github.issues if "pull_request" not in issue
            and issue["title"].startswith("Upgrade check: vllm 0.33.0:")
            and issue["state"] == "open"]


def test_a_failing_release_gets_one_issue_and_a_second_run_updates_it(
        github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = len(github.issues)
    report = write_report(tmp_path / "report", "not-proposable")

    assert run(github, report, "--artifact-url", ARTIFACT_URL) == 0
    [created] = release_issues(github)
    assert len(github.issues) == before + 1
    assert created["title"] == "Upgrade check: vllm 0.33.0: cannot be proposed"
    assert [label["name"] for label in created["labels"]] == ["upgrade-check"]
    assert created["body"].startswith("<!-- kvcached-upgrade-check: vllm 0.33.0 -->\n")
    assert SUMMARY in created["body"] and ARTIFACT_URL in created["body"]
    [post] = github.writes()
    assert (post.method, post.path) == ("POST", f"/repos/{OWNER_REPO}/issues")
    assert set(post.body) == {"title", "body", "labels"}
    # every page of the open issues with the label was read before deciding to create
    pages = [r.query.get("page", ["1"])[0] for r in github.requests if r.method == "GET"]
    assert pages == ["1", "2"]
    listed = github.requests[0]
    assert listed.path == f"/repos/{OWNER_REPO}/issues"
    assert {k: v[0] for k, v in listed.query.items()} == \
        {"state": "open", "labels": "upgrade-check", "per_page": "100"}
    out = capsys.readouterr().out
    assert out.strip() == f"vllm 0.33.0: not-proposable; opened issue #{created['number']} " \
                          f"{created['html_url']}"

    # The next scheduled run: the proposed cell now fails its proofs; the issue (on the third
    # page now) is rewritten, not duplicated.
    github.requests.clear()
    again = write_report(tmp_path / "again", "proof-failed", summary="L1 failed: test_x")
    assert run(github, again) == 0
    assert [r.query.get("page", ["1"])[0] for r in github.requests if r.method == "GET"] == \
        ["1", "2", "3"]
    assert len(github.issues) == before + 1
    assert release_issues(github) == [created]
    [patch] = github.writes()
    assert (patch.method, patch.path) == \
        ("PATCH", f"/repos/{OWNER_REPO}/issues/{created['number']}")
    assert set(patch.body) == {"title", "body"}
    assert created["title"] == "Upgrade check: vllm 0.33.0: proposed cell fails its proofs"
    assert "L1 failed: test_x" in created["body"] and SUMMARY not in created["body"]
    assert RUN_URL in created["body"]  # no --artifact-url: the run's page
    assert f"updated issue #{created['number']}" in capsys.readouterr().out
    # the pull request that looks like the release's issue was never written to
    pull = github.issues[1]
    assert pull["body"].endswith("a pull request") and pull["number"] not in github.comments


def test_the_same_outcome_again_rewrites_only_the_body(github: FakeGitHub,
                                                       tmp_path: Path) -> None:
    report = write_report(tmp_path / "report", "not-proposable")
    assert run(github, report) == 0
    github.requests.clear()
    assert run(github, report) == 0
    [patch] = github.writes()
    assert patch.method == "PATCH" and set(patch.body) == {"body"}
    assert len(release_issues(github)) == 1


def test_an_issue_is_found_by_its_title_when_its_body_lost_the_marker(
        github: FakeGitHub, tmp_path: Path) -> None:
    edited = github.add("Upgrade check: vllm 0.33.0: cannot be proposed", "edited by hand")
    assert run(github, write_report(tmp_path / "r", "not-proposable")) == 0
    [patch] = github.writes()
    assert patch.path.endswith(f"/issues/{edited['number']}")
    assert edited["body"].startswith("<!-- kvcached-upgrade-check: vllm 0.33.0 -->")


@pytest.mark.parametrize("outcome", ["proposed", "already-a-cell"])
def test_a_release_that_needs_no_issue_opens_none(github: FakeGitHub, tmp_path: Path,
                                                  outcome: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    before = [dict(issue) for issue in github.issues]
    assert run(github, write_report(tmp_path / "r", outcome)) == 0
    assert github.writes() == []
    assert github.issues == before
    assert capsys.readouterr().out.strip() == \
        f"vllm 0.33.0: {outcome}; no open issue, nothing to do"


def test_a_release_proposed_after_failing_closes_its_issue_with_a_comment(
        github: FakeGitHub, tmp_path: Path) -> None:
    assert run(github, write_report(tmp_path / "failed", "proof-failed")) == 0
    [issue] = release_issues(github)
    github.requests.clear()

    assert run(github, write_report(tmp_path / "ok", "proposed"),
               "--artifact-url", ARTIFACT_URL) == 0
    assert [(r.method, r.path) for r in github.writes()] == [
        ("POST", f"/repos/{OWNER_REPO}/issues/{issue['number']}/comments"),
        ("PATCH", f"/repos/{OWNER_REPO}/issues/{issue['number']}"),
    ]
    assert issue["state"] == "closed"
    [comment] = github.comments[issue["number"]]
    assert "a cell was proposed (proposed, cell vllm-0.33)" in comment
    assert ARTIFACT_URL in comment
    assert release_issues(github) == []
    # the other releases' issues stay open
    assert all(other["state"] == "open" for other in github.issues
               if other is not issue and "(closed)" not in other["title"]
               and "upgrade-check" in [label["name"] for label in other["labels"]])


@pytest.mark.parametrize(("method", "status", "message"), [
    ("GET", 403, "Resource not accessible by integration"),
    ("POST", 500, "Server Error"),
])
def test_an_http_error_is_one_line_and_a_failure(github: FakeGitHub, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 method: str, status: int,
                                                 message: str) -> None:
    github.errors[method] = (status, message)
    assert run(github, write_report(tmp_path / "r", "not-proposable")) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"hosting: error: {method} {github.base}/repos/{OWNER_REPO}/issues")
    assert line.endswith(f": HTTP {status} {message}")
    assert TOKEN not in captured.err


def test_a_wrong_token_is_refused_by_the_server_and_reported(
        github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(github, write_report(tmp_path / "r", "not-proposable"),
               env={"GITHUB_TOKEN": "wrong"}) == 1
    assert capsys.readouterr().err.rstrip().endswith("HTTP 401 Bad credentials")


def test_every_request_carries_the_token_and_the_api_version(github: FakeGitHub,
                                                             tmp_path: Path) -> None:
    report = write_report(tmp_path / "r", "not-proposable")
    assert run(github, report) == 0
    assert run(github, report) == 0
    assert {r.method for r in github.requests} == {"GET", "POST", "PATCH"}
    for request in github.requests:
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        assert request.headers["x-github-api-version"] == hosting.API_VERSION == "2022-11-28"
        assert request.headers["accept"] == "application/vnd.github+json"
        assert request.headers["user-agent"]
        if request.body is not None:
            assert request.headers["content-type"] == "application/json"


@pytest.mark.parametrize(("env", "message"), [
    ({"GITHUB_TOKEN": ""}, "GITHUB_TOKEN is unset"),
    ({"GITHUB_RUN_ID": ""}, "no --artifact-url, and GITHUB_REPOSITORY or GITHUB_RUN_ID is unset"),
])
def test_missing_settings_are_one_line_before_any_request(
        github: FakeGitHub, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        env: dict[str, str], message: str) -> None:
    assert run(github, write_report(tmp_path / "r", "not-proposable"), env=env) == 1
    assert capsys.readouterr().err == f"hosting: error: {message}\n"
    assert github.requests == []


@pytest.mark.parametrize(("document", "message"), [
    (None, "report.json: No such file or directory"),
    ("{", "report.json: not JSON"),
    ({"engine": "vllm", "version": "0.33.0"}, "report.json: no outcome"),
    ({"engine": "vllm", "version": "0.33.0", "outcome": "maybe"}, "unknown outcome 'maybe'"),
])
def test_an_unreadable_report_is_one_line(github: FakeGitHub, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          document: object, message: str) -> None:
    folder = tmp_path / "r"
    folder.mkdir()
    if document is not None:
        text = document if isinstance(document, str) else json.dumps(document)
        (folder / "report.json").write_text(text)
    assert run(github, folder) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("hosting: error: ") and message in line
    assert github.requests == []


def test_an_api_that_does_not_answer_is_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    report = write_report(tmp_path / "r", "not-proposable")
    assert hosting.main(["upgrade-issue", "--report", str(report), "--api-url",
                         f"http://127.0.0.1:{port}", "--artifact-url", ARTIFACT_URL],
                        {"GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": OWNER_REPO}) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hosting: error: GET http://127.0.0.1:{port}/repos/")


def test_a_report_without_a_summary_uses_report_md(github: FakeGitHub, tmp_path: Path) -> None:
    report = write_report(tmp_path / "r", "not-proposable", summary="")
    assert run(github, report) == 0
    [issue] = release_issues(github)
    assert "the full report" in issue["body"]


def test_a_long_summary_is_cut_to_what_github_takes(github: FakeGitHub, tmp_path: Path) -> None:
    report = write_report(tmp_path / "r", "not-proposable", summary="x" * 100_000)
    assert run(github, report) == 0
    [issue] = release_issues(github)
    assert len(issue["body"]) <= 65_536 and issue["body"].rstrip().endswith(RUN_URL)


@pytest.mark.parametrize(("header", "expected"), [
    (None, None),
    ("", None),
    ('<https://api.github.com/repositories/1/issues?page=2>; rel="next", '
     '<https://api.github.com/repositories/1/issues?page=5>; rel="last"',
     "https://api.github.com/repositories/1/issues?page=2"),
    ('<https://x/i?page=1>; rel="prev", <https://x/i?labels=a,b&page=3>; rel="next"',
     "https://x/i?labels=a,b&page=3"),
    ('<https://x/i?page=1>; rel="first", <https://x/i?page=1>; rel="prev"', None),
    ('<https://x/i?page=2>; rel="next last"', "https://x/i?page=2"),
])
def test_next_link(header: str | None, expected: str | None) -> None:
    assert hosting.next_link(header) == expected


def test_the_script_runs_on_its_own(github: FakeGitHub, tmp_path: Path) -> None:
    """The workflow runs `python ci/hosting.py`: no package import, the standard library only."""
    report = write_report(tmp_path / "r", "proof-failed")
    done = subprocess.run(
        [sys.executable, "-I", str(REPO / "ci" / "hosting.py"), "upgrade-issue",
         "--report", str(report), "--artifact-url", ARTIFACT_URL],
        capture_output=True, text=True, cwd=tmp_path,
        env={"GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": OWNER_REPO,
             "GITHUB_API_URL": github.base},
    )
    assert done.returncode == 0, done.stderr
    [issue] = release_issues(github)
    assert done.stdout.startswith(f"vllm 0.33.0: proof-failed; opened issue #{issue['number']}")
