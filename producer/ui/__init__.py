"""The run pages: a browser view of runs, their timelines, approvals and questions, fork and compare.

Served under ``/ui`` by the project's HTTP server (``producer.http.app.create_app`` calls ``mount``), signed in
with an API key or a trusted proxy's header. Pages are rendered on the server; ``static/ui.js`` only follows runs.
"""

from __future__ import annotations

from producer.ui.routes import mount

__all__ = ["mount"]
