"""kpng's log lines: text, or one JSON object a line as Kubernetes components write them."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object a line, the shape of Kubernetes components' ``--logging-format=json``
    (``ts`` in seconds, ``msg``), so log pipelines that read kube-proxy read kpng."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["err"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, style: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if style == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # watchfiles reports every batch of file events at INFO; kpng says what it reloads itself.
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, logging.getLogger().level))
