"""Running the program of ``to-exec``: started, fed, restarted, its stderr relayed.

One task supervises the program and is the only writer to its stdin. ``apply`` folds a state into
the backend's copy of the node's state and waits until the writer has put it in the pipe: a
program that reads slowly holds ``apply`` in ``drain()``, and the states that arrive meanwhile are
coalesced upstream (the Feeder, or the store for a lone backend). The pipe's buffer is bounded
by asyncio's flow control, so kpng holds at most one encoded state beyond it.

A program that dies (or cannot be started) is started again after a jittered, growing delay, and
the new process gets the whole current state, starting with ``reset`` in the ops format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from kpng.backends.exec.formats import Format
from kpng.backends.exec.output import BoundedLineSplitter, LineLimiter
from kpng.client import Backoff, NodeFacts, NodeState, ServiceEndpoints, ServiceKey

log = logging.getLogger(__name__)

STABLE_S = 10.0
"""A program that ran this long was working: the next restart starts from the shortest delay."""
SLOW_S = 5.0
"""A state still being written after this long is logged: the program is not reading."""
STOP_S = 2.0
"""On close, how long the program gets to exit after EOF on stdin, then after SIGTERM: both
within kpng's own grace after a SIGTERM (``kpng.stopping.GRACE_S``), so a program that ignores
both is still killed, not left behind by kpng's forced exit."""
STDERR_DRAIN_S = 1.0
"""After the program exited, how long to wait for the rest of its stderr (a child it left
behind may hold the pipe open)."""


class ExecBackend:
    """A Backend feeding the node-local state to a program's stdin (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        make_format: Callable[[], Format],
        backoff: Backoff | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        limiter: Callable[[], LineLimiter] = LineLimiter,
        slow_s: float = SLOW_S,
        stable_s: float = STABLE_S,
    ) -> None:
        self.argv = list(argv)
        self.name = Path(self.argv[0]).name
        self._make_format = make_format
        self._backoff = backoff or Backoff.for_backends()
        self._sleep = sleep
        self._limiter = limiter
        self._slow_s = slow_s
        self._stable_s = stable_s
        # The node's state as last applied: what a newly started program is given.
        self._node = ""
        self._revision = 0
        self._facts = NodeFacts()
        self._services: dict[ServiceKey, ServiceEndpoints] = {}
        self._updated: set[ServiceKey] = set()
        self._deleted: set[ServiceKey] = set()
        self._applied = 0  # states applied ...
        self._written = 0  # ... and how many of them are in a program's pipe
        self._progress = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.process: asyncio.subprocess.Process | None = None
        """The running program, if any (for tests and logs)."""
        self.starts = 0

    async def apply(self, state: NodeState) -> bool:
        for key in state.deleted:
            self._services.pop(key, None)
            self._updated.discard(key)
            self._deleted.add(key)
        for key in state.updated:
            self._services[key] = state.services[key]
            self._deleted.discard(key)
            self._updated.add(key)
        self._node, self._revision, self._facts = state.node, state.revision, state.facts
        self._applied += 1
        wanted = self._applied
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"to-exec {self.name}")
        self._wake.set()
        async with self._progress:
            await self._progress.wait_for(lambda: self._written >= wanted)
        return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # --- the supervisor

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    stdin=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    # Its own session: a Ctrl-C meant for kpng does not kill it behind kpng's
                    # back; kpng ends it on close.
                    start_new_session=True,
                )
            except OSError as exc:
                delay = self._backoff.delay()
                log.error(
                    "to-exec: cannot run %s: %s; trying again in %.1f s",
                    shlex.join(self.argv),
                    exc.strerror or exc,
                    delay,
                )
                await self._sleep(delay)
                continue
            self.process = proc
            self.starts += 1
            log.info("to-exec: started %s (pid %d)", shlex.join(self.argv), proc.pid)
            relay = asyncio.create_task(self._relay_stderr(proc), name=f"{self.name} stderr")
            try:
                if not await self._serve(proc) and proc.returncode is None:
                    # Alive, but it closed its input: it will never take another state.
                    log.warning(
                        "to-exec: %s closed its stdin and takes no more states; stopping it",
                        self.name,
                    )
                    await self._stop(proc)
                code = await proc.wait()
                if _group_alive(proc.pid):
                    # What it started and left behind goes with it, before the next start.
                    await self._stop(proc)
            except asyncio.CancelledError:
                await self._stop(proc)
                raise
            finally:
                self.process = None
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(relay, STDERR_DRAIN_S)
            lived = loop.time() - started
            if lived >= self._stable_s:
                self._backoff.reset()
            delay = self._backoff.delay()
            log.warning(
                "to-exec: %s %s after %.1f s; restarting it in %.1f s with the whole state",
                self.name,
                _exit_reason(code),
                lived,
                delay,
            )
            await self._sleep(delay)

    async def _serve(self, proc: asyncio.subprocess.Process) -> bool:
        """Write states to ``proc`` until it exits (True) or its stdin breaks (False)."""
        stdin = proc.stdin
        assert stdin is not None
        form = self._make_format()
        fresh = True  # a new program: the whole state first
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                if self._applied and (fresh or self._written < self._applied):
                    state, count = self._take(whole=fresh), self._applied
                    fresh = False
                    data = await form.encode(state)
                    if not await self._write(stdin, data, state.revision):
                        return False
                    async with self._progress:
                        self._written = count
                        self._progress.notify_all()
                    continue
                woken = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({woken, exited}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if exited.done():
                    return True
                self._wake.clear()
        finally:
            exited.cancel()

    def _take(self, *, whole: bool) -> NodeState:
        """The state to write: everything for a new program, else what changed."""
        updated = frozenset(self._services) if whole else frozenset(self._updated)
        deleted = frozenset() if whole else frozenset(self._deleted)
        self._updated.clear()
        self._deleted.clear()
        return NodeState.of(
            node=self._node,
            revision=self._revision,
            services=self._services,
            updated=updated,
            deleted=deleted,
            facts=self._facts,
        )

    async def _write(self, stdin: asyncio.StreamWriter, data: bytes, revision: int) -> bool:
        """Put ``data`` in the pipe and wait for the program to take it; False if it is gone."""
        if stdin.is_closing():
            return False
        try:
            stdin.write(data)
            drained = asyncio.ensure_future(stdin.drain())
            done, _ = await asyncio.wait({drained}, timeout=self._slow_s)
            if not done:
                start = time.monotonic()
                log.warning(
                    "to-exec: %s is slow to read its input: revision %d (%d bytes) not taken "
                    "after %.0f s; newer states are coalesced until it has read it",
                    self.name,
                    revision,
                    len(data),
                    self._slow_s,
                )
                try:
                    await drained
                finally:
                    drained.cancel()
                log.info(
                    "to-exec: %s took revision %d after %.1f more s",
                    self.name,
                    revision,
                    time.monotonic() - start,
                )
            drained.result()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def _relay_stderr(self, proc: asyncio.subprocess.Process) -> None:
        stream = proc.stderr
        assert stream is not None
        splitter = BoundedLineSplitter()
        limiter = self._limiter()
        loop = asyncio.get_running_loop()
        try:
            while True:
                due = limiter.due(loop.time())
                try:
                    data = await asyncio.wait_for(stream.read(65536), due)
                except TimeoutError:
                    self._report_suppressed(limiter.expire(loop.time()))
                    continue
                lines = splitter.feed(data) if data else splitter.finish()
                for line in lines:
                    admitted, suppressed = limiter.admit(loop.time())
                    self._report_suppressed(suppressed)
                    if admitted:
                        log.info("%s: %s", self.name, line)
                if not data:
                    return
        finally:
            self._report_suppressed(limiter.suppressed)

    def _report_suppressed(self, count: int) -> None:
        if count:
            log.warning("%s: %d lines suppressed (stderr is rate-limited)", self.name, count)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """End ``proc`` and what it started: EOF on stdin first (a well-behaved program exits),
        then SIGTERM, then SIGKILL, each after ``STOP_S``, to its whole process group (it leads
        one, started in a session of its own), so that its children do not outlive it."""
        if proc.stdin is not None:
            proc.stdin.close()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            if proc.returncode is not None and not _group_alive(proc.pid):
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_S)
                if not _group_alive(proc.pid):
                    return


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
