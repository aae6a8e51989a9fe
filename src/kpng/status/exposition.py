"""Prometheus' text format (version 0.0.4), and the process' own metrics, written by kpng.

kpng reads every value when it is scraped (``status/metrics.py``), so it needs families of samples
and their text, not a client library's registry of live metrics. prometheus_client cost a node
agent some 40 ms of imports at each start (it brings ``http.server``, ``email`` and ``urllib``
along) and 8 ms of CPU per scrape of 410 lines, where this takes 4. The text is the one
prometheus_client wrote, byte for byte, so that nothing a scraper or a dashboard reads changes:
counters take ``_total``, labels are sorted by name, numbers are written as Python's shortest
``repr`` but with an exponent from 10^6 up, as Go writes them.

``process_families`` gives the ``process_*``, ``python_info`` and ``python_gc_*`` metrics every
Prometheus client library exports (Linux only, as kpng).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import resource
import sys
from collections.abc import Iterable, Sequence
from typing import Literal

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Kind = Literal["gauge", "counter", "histogram"]


class Family:
    """One metric: its name, help, type, label names and samples (suffix, labels, value)."""

    __slots__ = ("help", "kind", "labels", "name", "samples")

    def __init__(
        self,
        kind: Kind,
        name: str,
        help: str,
        *,
        labels: Sequence[str] = (),
        value: float | None = None,
    ) -> None:
        self.kind = kind
        # A counter's samples take _total here: a name that has it already (a backend's own
        # sample may) keeps one, as prometheus_client kept one.
        self.name = name.removesuffix("_total") if kind == "counter" else name
        self.help = help
        self.labels = tuple(labels)
        self.samples: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
        if value is not None:
            self.add((), value)

    def add(self, values: Sequence[str], value: float) -> None:
        """A sample of a gauge or a counter, with these label values."""
        suffix = "_total" if self.kind == "counter" else ""
        self.samples.append((suffix, self._labelled(values), value))

    def add_histogram(
        self, values: Sequence[str], buckets: Sequence[tuple[str, float]], total: float
    ) -> None:
        """A histogram's cumulative ``buckets`` (upper bound as written, count; the last one
        ``+Inf``) and the ``total`` of what it observed."""
        labelled = self._labelled(values)
        for bound, count in buckets:
            self.samples.append(("_bucket", (*labelled, ("le", bound)), count))
        self.samples.append(("_count", labelled, buckets[-1][1]))
        self.samples.append(("_sum", labelled, total))

    def _labelled(self, values: Sequence[str]) -> tuple[tuple[str, str], ...]:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: labels {self.labels}, values {tuple(values)}")
        return tuple(zip(self.labels, values, strict=True))


def gauge(
    name: str, help: str, *, labels: Sequence[str] = (), value: float | None = None
) -> Family:
    return Family("gauge", name, help, labels=labels, value=value)


def counter(
    name: str, help: str, *, labels: Sequence[str] = (), value: float | None = None
) -> Family:
    return Family("counter", name, help, labels=labels, value=value)


def histogram(name: str, help: str, *, labels: Sequence[str] = ()) -> Family:
    return Family("histogram", name, help, labels=labels)


def render(families: Iterable[Family]) -> bytes:
    """The text of ``families``, in their order."""
    out: list[str] = []
    for family in families:
        name = f"{family.name}_total" if family.kind == "counter" else family.name
        help = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {help}\n# TYPE {name} {family.kind}\n")
        for suffix, labels, value in family.samples:
            if labels:
                pairs = ",".join(f'{k}="{_escaped(v)}"' for k, v in sorted(labels))
                out.append(f"{family.name}{suffix}{{{pairs}}} {_number(value)}\n")
            else:
                out.append(f"{family.name}{suffix} {_number(value)}\n")
    return "".join(out).encode()


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    digits = text.find(".")  # digits before the point; -1 if repr chose an exponent already
    if value > 0 and digits > 6:
        significant = (text[:digits] + text[digits + 1 :]).rstrip("0")
        mantissa = significant[0] + ("." + significant[1:] if len(significant) > 1 else "")
        return f"{mantissa}e+{digits - 1:02d}"
    return text


def process_families() -> list[Family]:
    """CPU, memory, file descriptors and start time of this process; the interpreter; its
    garbage collector."""
    return [*_process(), *_python()]


_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _boot_time() -> float:
    # The boot time does not move: read once, not at every scrape.
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("/proc/stat has no btime")


def _process() -> list[Family]:
    try:
        with open("/proc/self/stat", "rb") as f:
            # The command name, in parentheses, may hold spaces: fields count from after it.
            fields = f.read().rpartition(b")")[2].split()
        boot = _boot_time()
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return []
    # proc(5) numbers fields from 1 with the pid and the command as 1 and 2.
    utime, stime, start = (float(fields[i - 3]) for i in (14, 15, 22))
    vsize, rss = float(fields[23 - 3]), float(fields[24 - 3]) * _PAGE
    max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [
        gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", value=vsize),
        gauge("process_resident_memory_bytes", "Resident memory size in bytes.", value=rss),
        gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=start / _TICKS + boot,
        ),
        counter(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            value=(utime + stime) / _TICKS,
        ),
        gauge("process_open_fds", "Number of open file descriptors.", value=open_fds),
        gauge(
            "process_max_fds",
            "Maximum number of open file descriptors.",
            value=math.inf if max_fds == resource.RLIM_INFINITY else max_fds,
        ),
    ]


_IMPLEMENTATIONS = {"cpython": "CPython", "pypy": "PyPy"}


def _python() -> list[Family]:
    version = sys.version_info
    info = gauge(
        "python_info",
        "Python platform information",
        labels=("implementation", "major", "minor", "patchlevel", "version"),
    )
    # What the platform module says, without its import (a few ms of a node agent's start).
    implementation = _IMPLEMENTATIONS.get(sys.implementation.name, sys.implementation.name)
    numbers = (str(version.major), str(version.minor), str(version.micro))
    info.add((implementation, *numbers, sys.version.split()[0]), 1)
    collected = counter(
        "python_gc_objects_collected", "Objects collected during gc", labels=("generation",)
    )
    uncollectable = counter(
        "python_gc_objects_uncollectable",
        "Uncollectable objects found during GC",
        labels=("generation",),
    )
    collections = counter(
        "python_gc_collections",
        "Number of times this generation was collected",
        labels=("generation",),
    )
    for generation, stats in enumerate(gc.get_stats()):
        collected.add((str(generation),), stats["collected"])
        uncollectable.add((str(generation),), stats["uncollectable"])
        collections.add((str(generation),), stats["collections"])
    return [info, collected, uncollectable, collections]
