"""A program's stderr as log lines: cut into lines, and rate-limited. Pure."""

from __future__ import annotations

from kpng.logs import printable


class BoundedLineSplitter:
    """Cuts a byte stream into lines; a line longer than ``max_bytes`` is cut there, the rest of
    it dropped, so a program writing without newlines cannot make kpng buffer without end."""

    def __init__(self, *, max_bytes: int = 4096) -> None:
        self._max = max_bytes
        self._buffer = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[str]:
        lines: list[str] = []
        self._buffer += data
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > self._max:
                    if not self._skipping:
                        lines.append(self._decode(self._buffer[: self._max]) + " [cut]")
                    self._skipping = True
                    self._buffer.clear()
                return lines
            if not self._skipping:
                cut = " [cut]" if end > self._max else ""
                lines.append(self._decode(self._buffer[: min(end, self._max)]) + cut)
            self._skipping = False
            del self._buffer[: end + 1]

    def finish(self) -> list[str]:
        """The last line, if the stream ended without a newline."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return [] if not rest or self._skipping else [self._decode(rest)]

    @staticmethod
    def _decode(data: bytes | bytearray) -> str:
        # Escaped: a program's control characters (a terminal's escape sequences, a CR that
        # rewrites the line) must not reach the operator's terminal or forge log lines. The
        # line is already cut to its bound (in bytes, so never shorter in characters).
        return printable(bytes(data).decode(errors="replace").rstrip("\r"), limit=len(data))


class LineLimiter:
    """At most ``lines`` lines per window of ``window`` seconds; the others are counted, and
    the count is reported once the window is over: a flood costs the log ``lines`` + 1 lines per
    window. Times are the caller's clock (seconds, monotonic)."""

    def __init__(self, *, lines: int = 100, window: float = 10.0) -> None:
        self._lines = lines
        self._window = window
        self._start: float | None = None
        self._count = 0
        self.suppressed = 0
        """Lines suppressed in the current window, not yet reported."""

    def admit(self, now: float) -> tuple[bool, int]:
        """(log this line?, suppressed lines of a finished window, to report before it)."""
        report = self.expire(now)
        if self._start is None:
            self._start = now
        if self._count < self._lines:
            self._count += 1
            return True, report
        self.suppressed += 1
        return False, report

    def expire(self, now: float) -> int:
        """If the window is over, start afresh and return what it suppressed (else 0)."""
        if self._start is None or now - self._start < self._window:
            return 0
        report, self.suppressed = self.suppressed, 0
        self._start, self._count = None, 0
        return report

    def due(self, now: float) -> float | None:
        """Seconds until suppressed lines are to be reported, or None if there are none."""
        if not self.suppressed or self._start is None:
            return None
        return max(0.0, self._start + self._window - now)
