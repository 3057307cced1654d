"""Structured logs: every line written while a call runs carries its context.

The server runtime sets the call's fields when a handler starts (``rpc``, ``peer`` and,
when the request has one, ``session_id``); code deeper down adds its own with
:func:`set_log_fields` (the orchestrator adds the loop's ``session_id``, so one id
follows a request through all three services' logs). :class:`ContextFilter` copies the
fields onto each record, which :class:`TextFormatter` appends as ``key=value`` and
:class:`JsonFormatter` writes as one JSON object per line (``--log-format json``). A
record's own ``extra=`` fields are included too.

Values come from callers (a session id, a policy spec), so both formatters write every
field and every argument of the message through :func:`clean`: control characters
escaped (a newline is the two characters ``\\n``), so a value cannot forge a log line,
and at most :data:`MAX_FIELD_CHARS` characters, so it cannot flood the log. A record is
one line, but for the traceback of ``exc_info`` (below the fields).

NOTE: the fields live in a :class:`contextvars.ContextVar`. The synchronous gRPC server
runs each call on a pool thread, so the runtime *replaces* the fields at the start of
every call instead of restoring them at its end (a streaming handler may be closed from
another thread, where a reset token would not apply).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

_FIELDS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("disco_log_fields", default={})
#: Attributes every LogRecord has; anything else on a record came from ``extra=`` or the context.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
LOG_FORMATS = ("text", "json")
#: Longest field or message argument written (characters); longer ones are cut, with a marker.
MAX_FIELD_CHARS = 200
#: Longest message written (its arguments are cut first).
MAX_MESSAGE_CHARS = 2000
#: C0 and C1 control characters, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


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


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def clean(value: Any, limit: int = MAX_FIELD_CHARS) -> str:
    """``value`` as text fit for one log line: control characters escaped, and cut to
    ``limit`` characters with a marker that says how long it was."""
    text = value if isinstance(value, str) else str(value)
    cut = text[:limit]
    escaped = _CONTROL.sub(_escape, cut)
    if len(text) > limit:
        escaped += f"...[cut, {len(text)} chars]"
    return escaped


def _plain(value: Any) -> bool:
    """A number or None: written as is (a JSON number stays one)."""
    return value is None or isinstance(value, (bool, int, float))


class _Clipped:
    """A message argument formatted through :func:`clean` (``%s`` and ``%r`` alike)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def __str__(self) -> str:
        return clean(self._value)

    def __repr__(self) -> str:
        return clean(repr(self._value))


def _clipped(value: Any) -> Any:
    """A message argument, clipped unless it is a number (numpy's too: ``%d`` and ``%.3f`` must still apply)."""
    return value if _plain(value) or hasattr(value, "__index__") or hasattr(value, "__float__") else _Clipped(value)


def clean_message(record: logging.LogRecord) -> str:
    """The record's message with its arguments cleaned, the whole escaped and cut."""
    args = record.args
    try:
        if isinstance(args, Mapping):
            message = str(record.msg) % {key: _clipped(value) for key, value in args.items()}
        elif args:
            message = str(record.msg) % tuple(_clipped(value) for value in args)
        else:
            message = str(record.msg)
    except (TypeError, ValueError, KeyError):  # an argument that only formats as itself
        message = record.getMessage()
    return clean(message, MAX_MESSAGE_CHARS)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value if _plain(value) else clean(value)
            for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")}


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        extras = _extras(record)
        record = logging.makeLogRecord({**vars(record), "msg": clean_message(record), "args": None})
        line = super().format(record)
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
            "level": record.levelname, "logger": record.name, "message": clean_message(record),
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
