"""kpng's log lines: text, or one JSON object a line as Kubernetes components write them."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


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


REPEAT_WINDOW_S = 10.0
"""How long a warning that repeats another is dropped (``RepeatFilter``)."""


@dataclass
class _Window:
    until: float
    dropped: int = 0


class RepeatFilter(logging.Filter):
    """Lets the first of identical warnings (and errors) through, and drops the ones repeating
    it within ``window_s``; the next one let through says how many were dropped. A peer can make
    a warning repeat as fast as it connects (asyncio failing to accept for want of descriptors,
    a connection cap reached): 37 MB of the same traceback in 30 s, unfiltered."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._window_s = window_s
        self._clock = clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            text = record.getMessage()
        except Exception:
            return True  # a malformed call: the handler reports it, as for any record
        # The first line: asyncio's reports name the connection on the lines after it.
        key = (record.name, record.levelno, text.partition("\n")[0])
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now < window.until:
            window.dropped += 1
            return False
        if window is not None and window.dropped:
            record.msg, record.args = f"{text} ({window.dropped} more like it not logged)", None
        if len(self._windows) >= 1024:  # a burst of distinct warnings: forget the windows past
            self._windows = {k: w for k, w in self._windows.items() if now < w.until}
        self._windows[key] = _Window(now + self._window_s)
        return True


def configure_logging(level: str, style: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RepeatFilter())
    handler.setFormatter(
        JsonFormatter()
        if style == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # watchfiles reports every batch of file events at INFO; kpng says what it reloads itself.
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, logging.getLogger().level))


_ESCAPED = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x09}
"""Control characters but the tab, as ``\\xNN``."""


def printable(text: str, limit: int = 1024) -> str:
    """Text a peer wrote (a plugin, a program's stderr, an API server's message), fit for the
    log: its control characters escaped, so that it cannot drive the operator's terminal or
    forge a line, and cut to ``limit`` characters."""
    cut = text[:limit].translate(_ESCAPED)
    return cut + " [cut]" if len(text) > limit else cut
