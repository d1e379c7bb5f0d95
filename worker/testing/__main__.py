"""``python -m worker.testing replay FILE --agents MODULE``: replay a recording, print the report.

Exit status: 0 when the turns (and with ``--model recorded`` the requests) match the recording, 1 when they diverge,
2 when the recording or the agent cannot be loaded. Needs no service: the replay runs on the in-memory stores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from store import errors
from worker.agents import load_agents
from worker.testing.replays import replay

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, replay, print; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m worker.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    command = sub.add_parser("replay", help="replay a recording through an agent")
    command.add_argument("file")
    command.add_argument("--agents", required=True, help="module(s) defining the agent, comma-separated")
    command.add_argument("--agent", help="the agent's name (default: the recording's)")
    command.add_argument("--model", choices=["recorded"])
    command.add_argument("--tools", choices=["recorded", "execute"], default="recorded")
    command.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        text = Path(args.file).read_text()
        agents = load_agents([m.strip() for m in args.agents.split(",") if m.strip()])
        name = args.agent or _agent_of(text)
        if name not in agents:
            raise errors.ConfigurationError(f"no agent {name!r} in {args.agents} (found: {sorted(agents)})")
        report = replay(text, agents[name], model=args.model, tools=args.tools)
    except (OSError, errors.LoushoError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(report.describe())
    return 1 if report.diverged else 0


def _agent_of(text: str) -> str:
    """The agent a recording names.

    Raises:
        ConfigurationError: it is not a recording.
    """
    try:
        return str(json.loads(text)["agent"])
    except (ValueError, KeyError, TypeError):
        raise errors.ConfigurationError("not a recording (lousho export writes one)") from None


if __name__ == "__main__":
    sys.exit(main())
