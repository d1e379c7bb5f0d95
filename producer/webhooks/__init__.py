"""The webhook receiver: a verified delivery starts one run; run status and approvals need a key.

Signature checks (``signatures``), configuration from ``Settings`` (``config``), headers and bodies, intake,
routes, the app factory (``app.create_app``) and the server's logging (``serve``); ``producer.server`` adds the run
pages and runs it. Nothing is built at import.
"""

from __future__ import annotations

from producer.webhooks.app import create_app
from producer.webhooks.backend import Backend
from producer.webhooks.bodies import read_body
from producer.webhooks.config import MAX_BODY_BYTES, WebhookConfig, parse_secret
from producer.webhooks.headers import standard_headers
from producer.webhooks.intake import Verified, input_messages
from producer.webhooks.rejections import Rejected
from producer.webhooks.serve import log_config
from producer.webhooks.signatures import TOLERANCE_S, check_timestamp, sign, verify_github, verify_standard

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
