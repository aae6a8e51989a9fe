"""Durations as Kubernetes components write them (Go's ``time.Duration``: ``1h0m0s``, ``500ms``,
``1.5s``), also accepted as plain seconds where kpng took seconds before."""

from __future__ import annotations

import math
import re

_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"-?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+|-?0")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``, a Go duration or a number of seconds; ValueError if it is neither,
    is negative, or is not finite (``inf``, ``nan``, ``1e400``: float() reads them, and no
    period or timeout can be written from one)."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        if not _GO_DURATION.fullmatch(text):
            raise ValueError(f"not a duration: {text!r} (e.g. 1s, 1m30s, 24h0m0s)") from None
        magnitude = sum(float(n) * _UNITS_S[unit] for n, unit in _PART.findall(text))
        seconds = -magnitude if text.startswith("-") else magnitude
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {text!r}")
    if seconds < 0:
        raise ValueError(f"negative duration: {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Go's spelling (``1h0m0s``), the one kubeadm and kubectl show, to the nanosecond as a Go
    duration is. Never in exponent notation (``3e-192s``), which no Go duration is."""
    nanoseconds = round(seconds * 1e9)
    if nanoseconds % 1_000_000_000:
        return f"{nanoseconds / 1e9:.9f}".rstrip("0") + "s"
    seconds = nanoseconds // 1_000_000_000
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s" if m else f"{s}s"
