"""The command line of the embedded servers: ``python -m devkit.embedded start|stop|status|exec``.

It parses arguments and prints; starting and stopping is ``EmbeddedServices``'s. Errors print their
stable code (``LOUSHO_EMBEDDED_FAILED``), masked, since they may quote a server's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from devkit.embedded.services import EmbeddedServices, exported
from devkit.errors import EmbeddedError


def _exec(services: EmbeddedServices, command: list[str]) -> int:
    """Run ``command`` with the servers' URLs exported; stop the servers started for it.

    A URL already set in the environment is kept and its server is not started.
    """
    if not command:
        raise EmbeddedError("exec needs a command after --")
    env = dict(os.environ)
    try:
        if not env.get("LOUSHO_DATABASE_URL"):
            env["LOUSHO_DATABASE_URL"] = services.start_postgres()
        if not env.get("LOUSHO_REDIS_URL"):
            env["LOUSHO_REDIS_URL"] = services.start_redis()
    except BaseException:
        services.release()
        raise
    print(
        f"[embedded] postgres {env['LOUSHO_DATABASE_URL'].split('@')[-1]}  "
        f"redis {env['LOUSHO_REDIS_URL'].split('@')[-1]}  (embedded data in {services.home})",
        flush=True,
    )
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends Ctrl-C to the child too
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, old_int)
        services.release()
    return code


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=None, help="project folder (data in ROOT/.lousho)")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("--fast", action="store_true", help="no fsync (throwaway data)")
    parser = argparse.ArgumentParser(
        prog="python -m devkit.embedded", description="Embedded PostgreSQL and Redis for development."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("start", parents=[common], help="start (or reuse) both servers; print their URLs")
    sub.add_parser("stop", parents=[common], help="stop both servers of the folder")
    sub.add_parser("status", parents=[common], help="show what runs")
    run = sub.add_parser(
        "exec", parents=[common], help="run a command with the URLs exported, then stop the servers started for it"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def _run(services: EmbeddedServices, args: argparse.Namespace) -> int:
    if args.action == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return _exec(services, command)
    if args.action == "start":
        urls = services.start()
        if args.json:
            print(json.dumps({**urls._asdict(), "started": sorted(services.started), "home": str(services.home)}))
        else:
            print(exported(urls))
        return 0
    if args.action == "stop":
        services.stop()
        if args.json:
            print(json.dumps({"stopped": True, "root": str(services.root)}))
        else:
            print(f"stopped the embedded servers of {services.root}")
        return 0
    report = {name: vars(item) for name, item in services.status().items()}
    print(
        json.dumps(report, indent=2)
        if args.json
        else "\n".join(
            f"{name:8} {'running' if s['running'] else 'stopped'}"
            + (f"  pid {s['pid']}  port {s['port']}" if s["running"] else "")
            for name, s in report.items()
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m devkit.embedded start|stop|status|exec``; returns the exit status."""
    from store import redaction

    redaction.install()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.action == "exec" and args.json:
        parser.error("--json is not supported by exec: it prints the command's own output")
    services = EmbeddedServices(args.root, durable=not args.fast)
    try:
        return _run(services, args)
    except EmbeddedError as exc:
        print(f"error {exc.code}: {redaction.redact(exc.message)}", file=sys.stderr)  # it may quote a server's log
        return 1
