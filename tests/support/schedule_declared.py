"""Schedules declared in code next to an agent, as a user's agent module would (synced at worker start)."""

from __future__ import annotations

from worker.schedules import declare

daily_report = declare("daily-report", "reporter", "Send the daily report", cron="0 9 * * *", timezone="Europe/Paris")
heartbeat = declare("heartbeat", "reporter", "Check in", every=300, overlap="allow", catch_up="skip")
