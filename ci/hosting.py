"""The upgrade workflow's word on GitHub: one issue per release the upgrade check could not propose.

    python ci/hosting.py upgrade-issue --report DIR [--artifact-url URL] [--api-url URL]
                                       [--repo OWNER/NAME]

reads DIR/report.json (written by `nox -s upgrade-check`) and, by its "outcome":

- "not-proposable" or "proof-failed": opens an issue labelled `upgrade-check` whose body is the
  report's summary and a link to the report folder (the run's artifact), or, when an open issue
  for the same engine and version exists, rewrites that issue's body (and title) instead: one
  issue per release, however many scheduled runs find it failing;
- "proposed" or "already-a-cell": opens nothing; an open issue for that release is closed with
  a comment saying so.

An issue is recognised by the marker line `<!-- kvcached-upgrade-check: <engine> <version> -->`
at the top of its body, or else by its title's prefix `Upgrade check: <engine> <version>:`.

The API is GitHub's REST API (`--api-url`, else GITHUB_API_URL, else https://api.github.com),
the repository GITHUB_REPOSITORY unless `--repo` says otherwise, the token GITHUB_TOKEN (sent as
a bearer token; the workflow's token needs `issues: write`). Without `--artifact-url` (or with
an empty one) the link goes to the run, GITHUB_SERVER_URL/GITHUB_REPOSITORY/actions/runs/
GITHUB_RUN_ID. An HTTP error, an unreachable API or an unreadable report is one line
`hosting: error: ...` on stderr and exit status 1. Standard library only: the workflow runs it
before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
LABEL = "upgrade-check"
USER_AGENT = "kvcached-ci-hosting"
TIMEOUT_S = 30.0
# GitHub refuses an issue body over 65536 characters; the summary is short, but be safe.
MAX_BODY = 60_000

FAILING = {"not-proposable": "cannot be proposed", "proof-failed": "proposed cell fails its proofs"}
RESOLVED = {"proposed": "a cell was proposed", "already-a-cell": "the release already is a cell"}


class HostingError(Exception):
    """One line for the user: what failed, against which URL."""


# --- the REST API --------------------------------------------------------------------------


def next_link(header: str | None) -> str | None:
    """The rel="next" URL of a Link header (`<url>; rel="next", <url>; rel="last"`), if any."""
    if not header:
        return None
    # Each link is <url> and its parameters up to the next <: a URL may hold commas.
    for match in re.finditer(r"<([^>]*)>([^<]*)", header):
        for param in match.group(2).strip().rstrip(",").split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "rel" and "next" in value.strip().strip('"').split():
                return match.group(1)
    return None


@dataclass(frozen=True)
class Response:
    status: int
    data: Any
    link: str | None


class GitHub:
    """A few documented endpoints of GitHub's REST API, for one repository."""

    def __init__(self, api_url: str, repo: str, token: str, timeout: float = TIMEOUT_S) -> None:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise HostingError(f"repository {repo!r} is not OWNER/NAME")
        self.api_url = api_url.rstrip("/")
        self.repo = repo
        self.token = token
        self.timeout = timeout

    def url(self, path: str, query: Mapping[str, str | int] | None = None) -> str:
        url = f"{self.api_url}/repos/{self.repo}{path}"
        return f"{url}?{urllib.parse.urlencode(query)}" if query else url

    def request(self, method: str, url: str, body: Mapping[str, object] | None = None) -> Response:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": API_VERSION,
            "Authorization": f"Bearer {self.token}",
            "User-Agent": USER_AGENT,
            **({"Content-Type": "application/json"} if data is not None else {}),
        })
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
                link = response.headers.get("Link")
                status = response.status
        except urllib.error.HTTPError as error:
            raise HostingError(f"{method} {url}: HTTP {error.code} "
                               f"{_error_message(error) or error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise HostingError(f"{method} {url}: {reason}") from None
        try:
            parsed = json.loads(raw) if raw.strip() else None
        except ValueError:
            raise HostingError(f"{method} {url}: HTTP {status} with a body that is not JSON") \
                from None
        return Response(status, parsed, link)

    def open_issues(self, label: str) -> Iterator[dict[str, Any]]:
        """Every open issue with `label`, page after page; pull requests (which the endpoint
        lists too, with a "pull_request" key) are left out."""
        url: str | None = self.url("/issues", {"state": "open", "labels": label, "per_page": 100})
        seen: set[str] = set()
        while url is not None and url not in seen:
            seen.add(url)
            response = self.request("GET", url)
            if not isinstance(response.data, list):
                raise HostingError(f"GET {url}: expected a list of issues")
            for item in response.data:
                if isinstance(item, dict) and "pull_request" not in item:
                    yield item
            url = next_link(response.link)

    def create_issue(self, title: str, body: str, labels: Sequence[str]) -> dict[str, Any]:
        return _issue(self.request("POST", self.url("/issues"),
                                   {"title": title, "body": body, "labels": list(labels)}))

    def update_issue(self, number: int, **fields: object) -> dict[str, Any]:
        return _issue(self.request("PATCH", self.url(f"/issues/{number}"), fields))

    def comment(self, number: int, body: str) -> None:
        self.request("POST", self.url(f"/issues/{number}/comments"), {"body": body})


def _error_message(error: urllib.error.HTTPError) -> str:
    """GitHub's error document says {"message": ..., "documentation_url": ...}."""
    try:
        document = json.loads(error.read() or b"null")
    except (ValueError, OSError):
        return ""
    if isinstance(document, dict) and isinstance(document.get("message"), str):
        return " ".join(document["message"].split())
    return ""


def _issue(response: Response) -> dict[str, Any]:
    if not isinstance(response.data, dict) or not isinstance(response.data.get("number"), int):
        raise HostingError(f"HTTP {response.status}: the answer is not an issue")
    return response.data


# --- the upgrade check's issue -------------------------------------------------------------


@dataclass(frozen=True)
class UpgradeReport:
    engine: str
    version: str
    outcome: str
    summary: str
    cell_name: str

    @classmethod
    def load(cls, folder: Path) -> UpgradeReport:
        path = folder / "report.json"
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise HostingError(f"{path}: {error.strerror or error}") from None
        except ValueError as error:
            raise HostingError(f"{path}: not JSON ({error})") from None
        if not isinstance(document, dict):
            raise HostingError(f"{path}: not a JSON object")
        missing = [key for key in ("engine", "version", "outcome")
                   if not isinstance(document.get(key), str) or not document[key]]
        if missing:
            raise HostingError(f"{path}: no {', '.join(missing)}")
        outcome = document["outcome"]
        if outcome not in FAILING and outcome not in RESOLVED:
            raise HostingError(f"{path}: unknown outcome {outcome!r}")
        summary = document.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            markdown = folder / "report.md"
            summary = markdown.read_text(encoding="utf-8") if markdown.is_file() else \
                f"The upgrade check of {document['engine']} {document['version']}: {outcome}."
        return cls(engine=document["engine"], version=document["version"], outcome=outcome,
                   summary=summary.strip(), cell_name=str(document.get("cell_name") or ""))

    @property
    def release(self) -> str:
        return f"{self.engine} {self.version}"

    @property
    def marker(self) -> str:
        return f"<!-- kvcached-upgrade-check: {self.release} -->"

    @property
    def title_prefix(self) -> str:
        return f"Upgrade check: {self.release}:"

    @property
    def title(self) -> str:
        return f"{self.title_prefix} {FAILING.get(self.outcome) or RESOLVED[self.outcome]}"

    def body(self, artifact_url: str) -> str:
        tail = ("\n\n---\nThe report folder (report.md, report.json, the unreviewed diffs, the "
                f"logs) is the artifact of {artifact_url}\n")
        summary = self.summary
        room = MAX_BODY - len(self.marker) - len(tail) - 100
        if len(summary) > room:
            summary = summary[:room].rstrip() + "\n\n(summary cut short; the whole report is " \
                "in the artifact)"
        return f"{self.marker}\n{summary}{tail}"

    def is_its_issue(self, issue: Mapping[str, Any]) -> bool:
        body = issue.get("body") or ""
        title = issue.get("title") or ""
        return (isinstance(body, str) and body.lstrip().startswith(self.marker)) or \
            (isinstance(title, str) and title.startswith(self.title_prefix))


def upgrade_issue(github: GitHub, report: UpgradeReport, artifact_url: str) -> str:
    """Open, update or close the release's issue; returns the one line saying what was done."""
    existing = next((issue for issue in github.open_issues(LABEL) if report.is_its_issue(issue)),
                    None)
    if report.outcome in RESOLVED:
        if existing is None:
            return f"{report.release}: {report.outcome}; no open issue, nothing to do"
        number = existing["number"]
        cell = f", cell {report.cell_name}" if report.cell_name else ""
        github.comment(number, f"The upgrade check of {report.release} now says: "
                               f"{RESOLVED[report.outcome]} ({report.outcome}{cell}); see "
                               f"{artifact_url}. Closing.")
        github.update_issue(number, state="closed", state_reason="completed")
        return f"{report.release}: {report.outcome}; closed issue #{number}"
    body = report.body(artifact_url)
    if existing is None:
        issue = github.create_issue(report.title, body, [LABEL])
        return f"{report.release}: {report.outcome}; opened issue #{issue['number']} " \
               f"{issue.get('html_url', '')}".rstrip()
    number = existing["number"]
    fields: dict[str, object] = {"body": body}
    if existing.get("title") != report.title:
        fields["title"] = report.title
    github.update_issue(number, **fields)
    return f"{report.release}: {report.outcome}; updated issue #{number} " \
           f"{existing.get('html_url', '')}".rstrip()


def run_url(environ: Mapping[str, str]) -> str:
    """This workflow run's page, from the variables every GitHub Actions step has."""
    server = environ.get("GITHUB_SERVER_URL", "https://github.com").rstrip("/")
    repo, run_id = environ.get("GITHUB_REPOSITORY", ""), environ.get("GITHUB_RUN_ID", "")
    if not repo or not run_id:
        raise HostingError("no --artifact-url, and GITHUB_REPOSITORY or GITHUB_RUN_ID is unset")
    return f"{server}/{repo}/actions/runs/{run_id}"


# --- command line --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="hosting", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    issue = commands.add_parser(
        "upgrade-issue", help="open, update or close the issue of an upgrade check's release")
    issue.add_argument("--report", type=Path, required=True,
                       help="the upgrade check's report folder (holds report.json)")
    issue.add_argument("--artifact-url", default="",
                       help="where the report folder can be downloaded (default: the run)")
    issue.add_argument("--api-url", default=env.get("GITHUB_API_URL") or DEFAULT_API_URL,
                       help="GitHub's REST API (default: GITHUB_API_URL, else %(default)s)")
    issue.add_argument("--repo", default=env.get("GITHUB_REPOSITORY", ""),
                       help="OWNER/NAME (default: GITHUB_REPOSITORY)")
    args = parser.parse_args(argv)
    try:
        report = UpgradeReport.load(args.report)
        artifact_url = args.artifact_url or run_url(env)
        token = env.get("GITHUB_TOKEN", "")
        if not token:
            raise HostingError("GITHUB_TOKEN is unset")
        if not args.repo:
            raise HostingError("no --repo, and GITHUB_REPOSITORY is unset")
        print(upgrade_issue(GitHub(args.api_url, args.repo, token), report, artifact_url))
    except HostingError as error:
        print(f"hosting: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
