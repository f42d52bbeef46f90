"""The router's HTTP endpoint: OpenAI requests routed by `model`, and its own status.

    POST /v1/completions, /v1/chat/completions   proxied to the model's engine (streaming too)
    GET  /v1/models                              every configured model, whatever its state
    GET  /health                                 the router answers
    GET  /metrics                                Prometheus text (`telemetry.py`)
    GET  /router/status                          every engine: state, pid, port, KV mapped
    POST /router/models/NAME/sleep|stop|wake     an operator's hand on one engine

A request waits while its engine starts or wakes (`fleet.py`), up to `request_wait_s`, and is
then proxied byte for byte: a streamed answer is relayed chunk by chunk as the engine writes it.
Errors are OpenAI's shape (`{"error": {"message", "type", "code"}}`): 404 names the models
served, 400 a body that is not a JSON object with a `model`, 503 says why the engine is not
ready. A client that goes away mid-stream closes the engine connection, which aborts the
engine's request.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvcached_core.router.fleet import EngineUnavailable, Fleet
from kvcached_core.router.telemetry import Telemetry

PROXIED = ("/v1/completions", "/v1/chat/completions")
# An engine may take long between tokens under load; the client's own timeout governs.
ENGINE_READ_TIMEOUT_S = 3600.0
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te",
               "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"}


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], fleet: Fleet, telemetry: Telemetry) -> None:
        self.fleet = fleet
        self.telemetry = telemetry
        self.started = time.time()
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up is not the router's error; anything else is printed."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RouterServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass  # the metrics count requests; engine logs hold the detail

    # ------------------------------------------------------------------ replies

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: object) -> None:
        self._send(status, json.dumps(payload).encode())

    def _error(self, status: int, message: str, kind: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": None,
                                      "code": status}})

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:  # noqa: N802 - stdlib's name
        path = self.path.split("?", 1)[0]
        fleet = self.server.fleet
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            created = int(self.server.started)
            self._json(200, {"object": "list", "data": [
                {"id": row["model"], "object": "model", "created": created,
                 "owned_by": "kvrouter", "state": row["state"]} for row in fleet.status()]})
        elif path == "/router/status":
            self._json(200, {"models": fleet.status()})
        elif path == "/metrics":
            fleet.refresh_memory()
            self._send(200, self.server.telemetry.exposition(),
                       "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._error(404, f"no route {path}", "not_found_error")

    def do_POST(self) -> None:  # noqa: N802 - stdlib's name
        path = self.path.split("?", 1)[0]
        try:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        except ValueError:
            self._error(400, "Content-Length is not a number", "invalid_request_error")
            return
        if path in PROXIED:
            self._proxy(path, body)
        elif path.startswith("/router/models/"):
            self._operator(path[len("/router/models/"):])
        else:
            self._error(404, f"no route {path}", "not_found_error")

    def _operator(self, rest: str) -> None:
        name, _, action = rest.rpartition("/")
        fleet = self.server.fleet
        if name not in fleet.names():
            self._error(404, self._unknown(name), "not_found_error")
            return
        if action == "sleep":
            state = fleet.sleep(name)
        elif action == "stop":
            state = fleet.stop(name)
        elif action == "wake":
            try:
                with fleet.use(name):
                    pass
            except EngineUnavailable as exc:
                self._error(503, str(exc), "service_unavailable")
                return
            state = "awake"
        else:
            self._error(404, f"no action {action!r} (sleep, stop, wake)", "not_found_error")
            return
        self._json(200, {"model": name, "state": state})

    def _unknown(self, name: str) -> str:
        return (f"model {name!r} is not served here; models: "
                f"{', '.join(self.server.fleet.names())}")

    # ------------------------------------------------------------------ the proxy

    def _proxy(self, path: str, body: bytes) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            self._error(400, "the body is not JSON", "invalid_request_error")
            return
        name = request.get("model") if isinstance(request, dict) else None
        if not isinstance(name, str):
            self._error(400, "the body names no model", "invalid_request_error")
            return
        fleet = self.server.fleet
        if name not in fleet.names():
            self._error(404, self._unknown(name), "not_found_error")
            return
        started = time.monotonic()
        status = 502
        try:
            with fleet.use(name) as engine:
                status = self._relay(engine.port, path, body)
        except EngineUnavailable as exc:
            status = 503
            self._error(503, str(exc), "service_unavailable")
        except _ClientGone:
            status = 499  # nginx's "client closed request": nothing left to answer
            self.close_connection = True
        finally:
            self.server.telemetry.observe_request(name, status, time.monotonic() - started)

    def _relay(self, port: int, path: str, body: bytes) -> int:
        upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=ENGINE_READ_TIMEOUT_S)
        try:
            try:
                upstream.request("POST", path, body=body, headers={
                    "Content-Type": self.headers.get("Content-Type", "application/json"),
                    "Accept": self.headers.get("Accept", "*/*")})
                response = upstream.getresponse()
            except OSError as exc:
                self._error(502, f"the engine did not answer: {exc}", "bad_gateway")
                return 502
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            if response.length is not None and not response.chunked:
                data = response.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self._write(data)
                return response.status
            # Streamed (server-sent events): relay each piece as the engine writes it.
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                piece = response.read1(65536)
                if not piece:
                    break
                self._write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self._write(b"0\r\n\r\n")
            return response.status
        finally:
            upstream.close()

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as exc:  # the client went away: the finally closes the engine's side
            raise _ClientGone() from exc


def serve_in_thread(server: RouterServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="kvrouter-http", daemon=True)
    thread.start()
    return thread

