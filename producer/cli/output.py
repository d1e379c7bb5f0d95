"""What the ``lousho`` commands print: JSON with ``--json``, lines otherwise, and errors with their code.

It also owns the ``--json`` option itself: a command either honours it or refuses it as a usage error.
It must not call the client beyond waiting on a ``Run`` it is handed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from producer.client import Run
from store import errors, redaction


def print_json(value: Any) -> None:
    """Print ``value`` as indented JSON (datetimes and other odd values as strings)."""
    print(json.dumps(value, indent=2, default=str))


def print_error(error: errors.LoushoError, as_json: bool) -> None:
    """Print a Lousho error, masked: ``{"error": {code, message, retryable}}`` on stdout, else a line on stderr."""
    message = redaction.redact(error.message)
    if as_json:
        print_json({"error": {"code": error.code, "message": message, "retryable": error.retryable}})
    else:
        print(f"error {error.code}: {message}", file=sys.stderr)


def print_settled(run: Run, args: argparse.Namespace, prefix: str = "") -> int:
    """Wait for ``run`` (``--timeout``) and print how it settled: the result as JSON, or a line and the final text.

    Raises:
        RunTimeoutError: it did not settle in time.
        LoushoError: the typed error the run stopped with.
    """
    result = run.wait(timeout=args.timeout)
    if args.json:
        print_json(result.model_dump(mode="json", exclude_none=True))
    else:
        print(f"{prefix}{result.session_id}: {result.finish_reason} after {result.steps} step(s)")
        if result.text:
            print(result.text)
    return 0


def accept_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give a command that can print JSON its ``--json`` option; returns the parser."""
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


class _RefuseJson(argparse.Action):
    """``--json`` on a command that cannot honour it: a usage error (exit status 2), never ignored."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        parser.error(f"--json is not supported here: {self.reason}")


def refuse_json(parser: argparse.ArgumentParser, reason: str) -> argparse.ArgumentParser:
    """Make ``--json`` a usage error on a command whose output is a log (a long-running command); returns the parser."""
    parser.add_argument("--json", action=_RefuseJson, reason=reason)
    return parser
