"""A throwaway package index: a real pypiserver on 127.0.0.1, for tests and local trials.

No authentication; packages kept in `<root>/packages`, the server's log in
`<root>/pypi-server.log`. Without `fallback_url` a name it does not hold is simply not found;
with it (`https://pypi.org/simple/`), pip is sent there for every project the index does not
hold, which is what the README's install line relies on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from forge.errors import ForgeError

_HOST = "127.0.0.1"
_POLL_S = 0.05
_STOP_TIMEOUT_S = 10.0


class LocalIndex:
    """Context manager running `pypi-server run` for as long as the block lasts."""

    def __init__(self, root: Path, port: int = 0, *, startup_timeout_s: float = 30.0,
                 fallback_url: str | None = None) -> None:
        self.root = root
        self.fallback_url = fallback_url
        self._requested_port = port
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._last_port: int | None = None

    @property
    def packages_dir(self) -> Path:
        return self.root / "packages"

    @property
    def log_path(self) -> Path:
        return self.root / "pypi-server.log"

    @property
    def port(self) -> int:
        if self._port is None:
            raise ForgeError("local index is not running")
        return self._port

    @property
    def url(self) -> str:
        """Where uploads go (the legacy upload API lives at the server's root)."""
        return f"http://{_HOST}:{self.port}/"

    @property
    def simple_url(self) -> str:
        return f"http://{_HOST}:{self.port}/simple/"

    def __enter__(self) -> LocalIndex:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._process is not None:
            raise ForgeError(f"local index on port {self._port} is already running")
        self.packages_dir.mkdir(parents=True, exist_ok=True)
        # A restart keeps its port, so URLs handed out before stay valid.
        port = self._requested_port or self._last_port or _free_port()
        command = [sys.executable, "-m", "pypiserver",
                   *server_arguments(port, str(self.packages_dir), self.fallback_url)]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._port = self._last_port = port
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self._process is not None
        health = f"http://{_HOST}:{self._port}/health"
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise ForgeError(
                    f"pypi-server on port {self._port} exited with code {code}: {self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(health, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ForgeError(
                    f"pypi-server on port {self._port} not healthy after "
                    f"{self._startup_timeout_s:.0f} s: {self._log_tail()}"
                )
            time.sleep(_POLL_S)

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "empty log"

    def kill(self) -> None:
        """Ends the server at once (SIGKILL), as a crash would; `start()` brings it back."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
        self._port = None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._port = None


def server_arguments(port: int, packages: str, fallback_url: str | None) -> list[str]:
    """`pypi-server` arguments: no authentication, sha256 links, PyPI fallback or none.

    The README's index line is exactly these (tests/forge/test_readme.py holds it to that)."""
    fallback = ["--fallback-url", fallback_url] if fallback_url else ["--disable-fallback"]
    return ["run", "-i", _HOST, "-p", str(port), "-a", ".", "-P", ".", "--hash-algo", "sha256",
            *fallback, packages]


def _free_port() -> int:
    """A port the kernel just considered free; pypiserver cannot be handed a bound socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((_HOST, 0))
        return int(probe.getsockname()[1])
