"""Stopping on SIGTERM or SIGINT, always: the signal cancels the main task, and a process that
has not exited within a grace period (a task that swallows its cancellation, a thread blocked
in a read, the event loop itself blocked) is ended anyway, with a line saying what still ran.

An orchestrator sends SIGTERM and waits; a kpng that never exits holds a node's rollout until
the SIGKILL, and says nothing of why.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable
from types import FrameType
from typing import Any

from kpng.errors import EXIT_ERROR

GRACE_S = 5.0
"""How long a signalled kpng may take to stop before it is ended."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_WATCHDOG = "kpng-stop-watchdog"


async def until_signalled(work: Awaitable[None], *, grace: float = GRACE_S) -> None:
    """Run ``work`` until it returns or a signal cancels it (then quietly). From the first
    signal on, the process exits within ``grace`` seconds whatever happens; a second signal
    ends it at once."""
    task = asyncio.ensure_future(work)
    watchdog = _Watchdog(asyncio.get_running_loop(), task, grace)
    # signal.signal, not loop.add_signal_handler: a Python handler runs between bytecodes even
    # while the event loop is blocked, so the watchdog starts whatever the loop is doing. The
    # cancellation itself is handed to the loop, as asyncio's own SIGINT handler does.
    previous = {sig: signal.signal(sig, watchdog.on_signal) for sig in SIGNALS}
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # A signal during the rest of the teardown (asyncio.run waiting for the executor's
        # threads, the interpreter's exit) still ends the process: its default action, and
        # the watchdog already armed if one came before.


class _Watchdog:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, task: asyncio.Future[None], grace: float
    ) -> None:
        self._loop = loop
        self._task = task
        self._grace = grace
        self._signalled: str | None = None
        self._outer = asyncio.current_task(loop)
        """The task awaiting ``task``: not one of those that did not stop."""

    def on_signal(self, signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._signalled is not None:
            _exit(f"{name} after {self._signalled}: exiting now", self._loop, self._outer)
        self._signalled = name
        threading.Thread(target=self._expire, args=(name,), name=_WATCHDOG, daemon=True).start()
        self._loop.call_soon_threadsafe(self._task.cancel)

    def _expire(self, name: str) -> None:
        threading.Event().wait(self._grace)
        _exit(f"did not stop within {self._grace:g} s of {name}", self._loop, self._outer)


def _exit(why: str, loop: asyncio.AbstractEventLoop, outer: asyncio.Task[Any] | None) -> None:
    """End the process now, saying what still ran. Written straight to the file descriptor: the
    main thread may be stuck holding the logging or stderr lock."""
    running = _still_running(loop, outer)
    line = f"kpng: error: {why}" + (f" (still running: {'; '.join(running)})" if running else "")
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), (line + "\n").encode(errors="backslashreplace"))
    # The exit handlers remove what must not outlive kpng (a kubeconfig's key files, written
    # out for the TLS library): given a moment in a thread of their own, as one of them (the
    # logs' flush) may wait on a lock the stuck thread holds.
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="kpng-exit", daemon=True)
    handlers.start()
    handlers.join(_EXIT_HANDLERS_S)
    os._exit(EXIT_ERROR)


_EXIT_HANDLERS_S = 1.0


def _still_running(loop: asyncio.AbstractEventLoop, outer: asyncio.Task[Any] | None) -> list[str]:
    """The loop's unfinished tasks, each with where it waits, and the threads besides this one
    and the main thread. Read from another thread, racing the loop: best effort."""
    found: list[str] = []
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done() and t is not outer]
    except RuntimeError:  # the loop changed its tasks while they were read
        tasks = []
    for task in tasks:
        found.append(f"task {task.get_name()} at {_where(task.get_coro())}")
    for thread in threading.enumerate():
        if thread.name != _WATCHDOG and thread is not threading.main_thread():
            found.append(f"thread {thread.name}")
    return found


def _where(coro: Any) -> str:
    """The innermost frame ``coro`` waits in outside asyncio's own (``asyncio.sleep`` says
    nothing of who sleeps), as ``function (file:line)``."""
    frame = None
    while coro is not None:
        inner = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if inner is not None and (frame is None or not _in_asyncio(inner)):
            frame = inner
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


_ASYNCIO = os.path.dirname(asyncio.__file__)


def _in_asyncio(frame: FrameType) -> bool:
    return os.path.dirname(frame.f_code.co_filename) == _ASYNCIO
