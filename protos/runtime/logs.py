"""Structured logs: every line written while a call runs carries its context.

The server runtime sets the call's fields when a handler starts (``rpc``, ``peer`` and,
when the request has one, ``session_id``); code deeper down adds its own with
:func:`set_log_fields` (the orchestrator adds the loop's ``session_id``, so one id
follows a request through all three services' logs). :class:`ContextFilter` copies the
fields onto each record, which :class:`TextFormatter` appends as ``key=value`` and
:class:`JsonFormatter` writes as one JSON object per line (``--log-format json``). A
record's own ``extra=`` fields are included too.

NOTE: the fields live in a :class:`contextvars.ContextVar`. The synchronous gRPC server
runs each call on a pool thread, so the runtime *replaces* the fields at the start of
every call instead of restoring them at its end (a streaming handler may be closed from
another thread, where a reset token would not apply).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

_FIELDS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("disco_log_fields", default={})
#: Attributes every LogRecord has; anything else on a record came from ``extra=`` or the context.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
LOG_FORMATS = ("text", "json")


def set_log_fields(**fields: Any) -> None:
    """Add ``fields`` to the current call's log context (``None`` removes a field)."""
    merged = {**_FIELDS.get(), **fields}
    _FIELDS.set({key: value for key, value in merged.items() if value is not None})


def replace_log_fields(**fields: Any) -> None:
    """Start a fresh log context (the runtime calls this when a handler starts)."""
    _FIELDS.set({key: value for key, value in fields.items() if value is not None})


def log_fields() -> dict[str, Any]:
    return dict(_FIELDS.get())


class ContextFilter(logging.Filter):
    """Copies the current log context onto each record (without overwriting ``extra=``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _FIELDS.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")}


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        fields = " ".join(f"{key}={value}" for key, value in sorted(extras.items()))
        return f"{head} {fields}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    the context and ``extra=`` fields, and ``exc_info`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str | int = logging.INFO, log_format: str = "text", stream: Any = None) -> None:
    """Log to ``stream`` (stderr) with the context filter and the chosen formatter,
    replacing the root handlers that an earlier ``basicConfig`` installed."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
