"""``lousho approvals list|approve|reject``: human decisions on gated tool calls, from the command line.

It calls ``Approvals`` of the client and prints; it must not decide anything itself.
"""

from __future__ import annotations

import argparse
import json

from producer.cli.output import accept_json, print_json, print_settled
from producer.client import Client
from store import errors


def cmd_approvals(client: Client, args: argparse.Namespace) -> int:
    """``lousho approvals list`` (pending, oldest first), ``approve ID`` or ``reject ID`` (``--wait`` for the run).

    Raises:
        ConfigurationError: approve or reject without an approval id.
        ApprovalNotFoundError: unknown, already decided, or of another agent (``--agent``).
        ApprovalOrphanedError: the approval's run was deleted or replaced.
    """
    approvals = client.agent(args.agent).approvals if args.agent else client.approvals
    if args.action == "list":
        pending = approvals.list()
        if args.json:
            print_json([a.model_dump(mode="json", exclude={"fingerprint"}) for a in pending])
            return 0
        if not pending:
            print("no pending approvals")
        for a in pending:
            created = a.created_at.isoformat() if a.created_at else "-"
            print(f"{a.approval_id}  {a.agent}  {a.session_id}  {a.tool_name}({json.dumps(a.args)})"
                  f"  call {a.tool_call_id}  since {created}")
        return 0
    if not args.approval_id:
        raise errors.ConfigurationError(f"approvals {args.action} needs an approval id")
    run = approvals.resolve(args.approval_id, approved=args.action == "approve", note=args.note)
    decision = "approved" if args.action == "approve" else "rejected"
    if args.wait:
        return print_settled(run, args, prefix=f"{decision} {args.approval_id}; ")
    if args.json:
        print_json({"approval_id": args.approval_id, "decision": decision, "session_id": run.session_id})
    else:
        print(f"{decision} {args.approval_id} (run {run.session_id})")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho approvals`` to the ``lousho`` parser."""
    approvals = accept_json(sub.add_parser("approvals", help="list, approve or reject gated tool calls"))
    approvals.add_argument("action", choices=["list", "approve", "reject"])
    approvals.add_argument("approval_id", nargs="?")
    approvals.add_argument("--note", default=None, help="a note for the model (with approve/reject)")
    approvals.add_argument("--agent", default=None)
    approvals.add_argument("--wait", action="store_true", help="wait for the run to settle again")
    approvals.add_argument("--timeout", type=float, default=60.0)
    approvals.set_defaults(fn=cmd_approvals)
