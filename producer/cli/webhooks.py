"""``lousho webhooks serve``: the argument parsing of the HTTP server; ``producer.server`` serves.

FastAPI and uvicorn load only when the command runs. The server prints a log: it refuses ``--json``.
"""

from __future__ import annotations

import argparse

from producer.cli.output import refuse_json
from producer.client import Client


def cmd_webhooks_serve(client: Client, args: argparse.Namespace) -> int:
    """``lousho webhooks serve``: uvicorn on ``--host``/``--port`` until Ctrl-C.

    Raises:
        ConfigurationError: the webhook secrets are missing or malformed (checked before the port is bound).
    """
    from producer.server import cmd_serve

    return cmd_serve(client, args)


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho webhooks serve`` to the ``lousho`` parser."""
    webhooks = sub.add_parser("webhooks", help="receive signed webhooks that start runs")
    actions = webhooks.add_subparsers(dest="action", required=True)
    serve = actions.add_parser(
        "serve", help="serve POST /webhooks/{agent}, GET /runs/{id}, POST /approvals/{id} and the run pages under /ui"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    refuse_json(serve, "lousho webhooks serve runs a server and prints its log")
    serve.set_defaults(fn=cmd_webhooks_serve)
