"""``lousho export RUN`` (a run written down for replay) and ``lousho replay FILE --agents MODULE``.

``export`` calls ``Client.export`` and writes the recording's JSON. ``replay`` runs ``python -m worker.testing
replay`` (producers import nothing of the worker: the replay runs in a process of its own, on the in-memory
stores, with no service) and exits with its status: 0 when the turns match, 1 on a divergence, 2 on bad input.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from producer.cli.output import accept_json
from producer.client import Client

__all__ = ["add_commands", "cmd_export", "cmd_replay"]


def cmd_export(client: Client, args: argparse.Namespace) -> int:
    """``lousho export RUN [-o FILE]``: the run's recording as JSON, on stdout or in ``FILE``."""
    text = client.export(args.run).model_dump_json(indent=2, exclude_none=True)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def cmd_replay(client: Client, args: argparse.Namespace) -> int:
    """``lousho replay FILE --agents MODULE``: replay a recording through the agent of these modules."""
    command = [sys.executable, "-m", "worker.testing", "replay", args.file, "--agents", args.agents]
    if args.agent:
        command += ["--agent", args.agent]
    if args.model:
        command += ["--model", args.model]
    command += ["--tools", args.tools]
    if args.json:
        command.append("--json")
    return subprocess.run(command).returncode


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` and ``replay`` to the ``lousho`` parser."""
    # Its output is JSON with or without --json (the option is accepted, as by every command).
    export = accept_json(sub.add_parser("export", help="write a run down as JSON, for lousho replay (secrets masked)"))
    export.add_argument("run", help="the run's id")
    export.add_argument("-o", "--output", help="write to this file instead of stdout")
    export.set_defaults(fn=cmd_export)
    replay = sub.add_parser("replay", help="replay a recorded run through an agent; exit 1 when its turns diverge")
    replay.add_argument("file", help="a recording written by lousho export")
    replay.add_argument("--agents", required=True, help="the module(s) defining the agent, comma-separated")
    replay.add_argument("--agent", help="the agent's name (default: the recording's)")
    replay.add_argument("--model", choices=["recorded"], help="serve the recorded turns; compare the requests")
    replay.add_argument(
        "--tools", choices=["recorded", "execute"], default="recorded", help="recorded results, or run the tools"
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.set_defaults(fn=cmd_replay)
