"""Where a thread is running, in kpng's terms: what ``/healthz`` names when the pipeline's event
loop has not run for a while."""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep
"""kpng's own directory."""


def where_running(thread: int | None) -> str:
    """The innermost of kpng's own frames ``thread`` is running (else the innermost outside
    Python's standard library): what keeps a loop busy."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    stdlib = sysconfig.get_paths()["stdlib"]
    for entry in reversed(stack):
        if entry.filename.startswith(_PACKAGE):
            return f"{entry.name} ({entry.filename.removeprefix(_PACKAGE)}:{entry.lineno})"
    outside = [e for e in stack if not e.filename.startswith(stdlib)] or stack
    return f"{outside[-1].name} ({outside[-1].filename}:{outside[-1].lineno})"
