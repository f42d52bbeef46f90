"""`kvrouter`: serve the models of a configuration file behind one OpenAI endpoint.

    kvrouter serve CONFIG      # until SIGINT or SIGTERM; then every engine is stopped
    kvrouter check CONFIG      # validate the file and print what would be served

Errors print one line to stderr: exit status 2 for a bad configuration or usage, 1 when the
endpoint cannot listen.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kvcached_core.router.config import RouterConfigError, load_config
from kvcached_core.router.fleet import STATES, Fleet
from kvcached_core.router.frontend import RouterServer, serve_in_thread
from kvcached_core.router.telemetry import Telemetry

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"kvrouter: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvrouter", description="Serve many models behind one OpenAI "
                     "endpoint, starting, sleeping and waking their elastic engines.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in (("serve", "serve the configured models"),
                       ("check", "validate the configuration and print the plan")):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="the YAML configuration file")
    return parser


def serve(config_path: str) -> int:
    config = load_config(config_path)
    telemetry = Telemetry(STATES)
    fleet = Fleet(config, telemetry)
    try:
        server = RouterServer((config.host, config.port), fleet, telemetry)
    except OSError as exc:
        print(f"kvrouter: cannot listen on {config.host}:{config.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet.open()
    serve_in_thread(server)
    print(f"kvrouter: serving {len(config.models)} models at "
          f"http://{config.host}:{config.port}/v1 (engine logs in {config.log_dir})",
          flush=True)
    try:
        stop.wait()
    finally:
        print("kvrouter: stopping every engine", flush=True)
        server.shutdown()
        server.server_close()
        fleet.close()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            print(load_config(args.config).describe())
            return EXIT_OK
        return serve(args.config)
    except RouterConfigError as exc:
        print(f"kvrouter: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
