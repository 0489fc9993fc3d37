"""`--log-format`: the server's log lines as text, or as one JSON object per line (time,
level, logger, message, the request id where known, the traceback when there is one) for log
pipelines. The request id is the one `server.edge` gives each HTTP request (the client's
x-request-id, or a new one); whatever runs on its behalf (its route, the tasks of its choices)
logs it.
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_LINE = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # `logging.basicConfig`'s format
# The id of the HTTP request being served in this context (tasks inherit it); None outside one.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "canvas_request_id", default=None
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def use_log_format(name: str) -> None:
    """Format the root logger's handlers' lines as `name` says (`LOG_FORMATS`); text leaves
    them as they are. uvicorn's loggers reach the root's handlers when uvicorn is given no
    logging config of its own (`server.serve.uvicorn_logging`)."""
    if name == "text":
        return
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
