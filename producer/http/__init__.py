"""The HTTP API: webhook intake (a verified delivery starts one run), runs, events, approvals and health.

Run status, events and approvals need a key; the run pages (``producer.ui``) sit beside it.

Signature checks (``signatures``), configuration from ``Settings`` (``config``), headers and bodies, intake,
routes, the app factory (``app.create_app``) and the server's logging (``serve``); ``producer.server`` adds the run
pages and runs it. Nothing is built at import.
"""

from __future__ import annotations

from producer.http.app import create_app
from producer.http.backend import Backend
from producer.http.bodies import read_body
from producer.http.config import MAX_BODY_BYTES, WebhookConfig, parse_secret
from producer.http.headers import standard_headers
from producer.http.intake import Verified, input_messages
from producer.http.rejections import Rejected
from producer.http.serve import log_config
from producer.http.signatures import TOLERANCE_S, check_timestamp, sign, verify_github, verify_standard

__all__ = [
    "MAX_BODY_BYTES",
    "TOLERANCE_S",
    "Backend",
    "Rejected",
    "Verified",
    "WebhookConfig",
    "check_timestamp",
    "create_app",
    "input_messages",
    "log_config",
    "parse_secret",
    "read_body",
    "sign",
    "standard_headers",
    "verify_github",
    "verify_standard",
]
