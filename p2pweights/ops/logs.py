"""Logs: one JSON object per log line (``--log-format json``: ``JsonFormatter``), with the process's context
(``LogContext``: model id, rank) on each."""
from __future__ import annotations

import json
import logging
import sys

from .progress import progress_log
RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class LogContext:
    """Fields every JSON log line carries: model_id and rank, once the node knows them."""

    def __init__(self):
        self.handle = None

    def fields(self) -> dict:
        h = self.handle
        if h is None:
            return {"model_id": None, "rank": None}
        rank = getattr(h, "rank", 0)
        member = getattr(h.node, "member", None)
        return {"model_id": h.model_id, "rank": h.node.rank if member is not None else rank}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "event", "model_id", "rank", "message", ...extra}`` on one line."""

    def __init__(self, context: LogContext):
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime, timezone  # only for --log-format json
        doc = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
               .replace("+00:00", "Z"),
               "level": record.levelname.lower(), "event": getattr(record, "event", "log"),
               **self.context.fields(), "message": record.getMessage()}
        for k, v in vars(record).items():
            if k not in RESERVED and k != "event" and k not in doc:
                doc[k] = v
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str, level: int, context: LogContext) -> None:
    """Log lines to stderr, as text or (``fmt == "json"``) one JSON object per line.

    Like ``logging.basicConfig``: a process whose root logger already has
    handlers of its own (an embedding application, pytest) keeps them."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "p2pw", False)]
    for h in ours:
        root.removeHandler(h)
    progress_log.setLevel(logging.INFO)
    logging.getLogger("p2pw.events").setLevel(logging.INFO)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.p2pw = True
    if fmt == "json":
        handler.setFormatter(JsonFormatter(context))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s p2pw %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
