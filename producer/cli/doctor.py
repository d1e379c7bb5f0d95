"""``lousho doctor`` (every unfinished run explained, invariant I19) and ``lousho limits`` (limits in conflict).

``doctor`` calls ``Client.doctor`` and prints the unfinished runs nothing moves; its exit status says it to
scripts: 0 when every run has an owner, a timer or a waiter, 3 when some run has none (1 stays a Lousho error, 2 a
usage error). ``limits`` calls ``Client.limit_conflicts`` and exits 3 when live workers disagree on a limit.
"""

from __future__ import annotations

import argparse
from typing import Any

from producer.cli.output import accept_json, print_json
from producer.client import Client
from store.doctor import Finding

#: The exit status when some run is unexplained.
UNEXPLAINED_EXIT = 3


def _finding(finding: Finding) -> dict[str, Any]:
    return {**finding.summary.model_dump(mode="json"), "first_seen": finding.first_seen.isoformat()}


def cmd_doctor(client: Client, args: argparse.Namespace) -> int:
    """``lousho doctor``: look for unfinished runs that nothing moves; exit 3 when there are some."""
    report = client.doctor(wait=not args.no_wait)
    if args.json:
        print_json(
            {
                "checked": report.checked,
                "complete": report.complete,
                "unexplained": [_finding(f) for f in report.unexplained],
                "suspects": [_finding(f) for f in report.suspects],
            }
        )
        return UNEXPLAINED_EXIT if report.unexplained else 0
    grace = client.settings.lease_ttl_ms / 1000 + client.settings.recover_interval_s
    print(
        f"checked {report.checked} unfinished run(s) quiet for more than {grace:g} s (a lease TTL plus a sweep"
        f" interval){'' if report.complete else '; the look stopped early, there are more'}"
    )
    for finding in report.unexplained:
        run = finding.summary
        print(
            f"unexplained: {run.session_id}  {run.agent}  {run.state}  since {finding.first_seen.isoformat()}"
            f"\n  next: {run.next_action}"
        )
    for finding in report.suspects:
        print(f"suspect (look again to confirm): {finding.summary.session_id}  {finding.summary.state}")
    if not report.unexplained:
        print("every unfinished run has an owner, a timer or a waiter")
    return UNEXPLAINED_EXIT if report.unexplained else 0


def cmd_limits(client: Client, args: argparse.Namespace) -> int:
    """``lousho limits``: each model limit key live workers give different numbers, and what holds; exit 3 if any."""
    found = client.limit_conflicts()
    if args.json:
        print_json({"conflicts": [conflict.model_dump(mode="json") for conflict in found]})
        return UNEXPLAINED_EXIT if found else 0
    for conflict in found:
        print(f"conflict: model limit {conflict.key!r} is given different numbers by live workers")
        for given, workers in conflict.given.items():
            print(f"  {given}  by {', '.join(workers)}")
        print(f"  holds meanwhile (the smallest of each): {conflict.holds.describe()}")
    if not found:
        print("live workers agree on every model limit they hold")
    return UNEXPLAINED_EXIT if found else 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``doctor`` and ``limits`` to the ``lousho`` parser."""
    doctor = accept_json(sub.add_parser("doctor", help="find unfinished runs that nothing moves (exit 3 if any)"))
    doctor.add_argument(
        "--no-wait",
        action="store_true",
        help="look once: runs nothing explains now are reported as suspects, unconfirmed",
    )
    doctor.set_defaults(fn=cmd_doctor)
    limits = accept_json(
        sub.add_parser("limits", help="model limit keys live workers give different numbers (exit 3 if any)")
    )
    limits.set_defaults(fn=cmd_limits)


__all__ = ["UNEXPLAINED_EXIT", "add_command", "cmd_doctor", "cmd_limits"]
