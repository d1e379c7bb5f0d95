"""JSON log lines (``LOUSHO_LOG_FORMAT=json``): one object per line, with the step's run, agent, seq and task id.

Log shippers (Loki, Elasticsearch, Cloud Logging) index fields rather than parse sentences: a line written
during a step carries ``session_id``, ``agent``, ``seq``, ``step`` (the run's step number), ``kind`` and
``task_id`` as fields of their own, from the step's ``store.telemetry`` report. The message is the one the
text format prints, after ``store.redaction`` masked it (the masking happens when the record is made, so
the JSON holds only masked text).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from store import telemetry


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as JSON: time, level, logger, process, message, the step's fields, and the exception."""
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": record.processName,
            "pid": record.process,
            "message": record.getMessage(),
        }
        report = telemetry.current()
        if report is not None:
            line.update(
                session_id=report.session_id,
                agent=report.agent,
                seq=report.seq,
                kind=report.kind,
                task_id=report.task_id,
            )
            checkpoint = report.checkpoint
            if checkpoint is not None:
                line["step"] = checkpoint.step
        task_id = getattr(record, "task_id", None)  # Celery's task logger sets it on its records
        if isinstance(task_id, str) and task_id != "???" and line.get("task_id") is None:
            line["task_id"] = task_id
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps({key: value for key, value in line.items() if value is not None}, default=str)


def use_json(logger: logging.Logger | None = None) -> None:
    """Give every handler of ``logger`` (the root logger by default) the JSON format."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not isinstance(handler.formatter, JsonFormatter):
            handler.setFormatter(JsonFormatter())


__all__ = ["JsonFormatter", "use_json"]
