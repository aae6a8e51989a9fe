"""Every plugin of one ``to-plugin``: each fed through its own Feeder, watched between changes,
and, for a plugin directory, found and forgotten as its sockets come and go.

Why a Feeder per plugin inside the backend, rather than the CLI expanding ``to-plugin`` into one
backend per plugin: the set of plugins is not known when the command line is read — a plugin
directory gains and loses plugins while kpng runs, as a CSI driver's socket appears beside the
kubelet's — and a plugin that comes back after a crash must be sent the whole state at once,
without waiting for the next change. Both need the latest state and each plugin's Feeder in one
place, which is here. Each plugin keeps what the Feeder gives any backend: its own pace,
coalesced states, retries with backoff and a full resync after a failure, isolation from the
others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kpng.backends.plugin.config import SOCKET_SUFFIX, PluginSpec, plugins_in_directory
from kpng.backends.plugin.connection import PluginBackend
from kpng.client import Backoff, NodeState
from kpng.feeding import Feeder

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0
"""How often each plugin is checked (connection, configuration, Health) between changes, and
plugin directories are read again."""


@dataclass
class _Member:
    spec: PluginSpec
    backend: PluginBackend
    feeder: Feeder
    tasks: list[asyncio.Task[None]]
    from_directory: bool


class PluginsBackend:
    """The ``to-plugin`` backend: the named plugins and those of a directory."""

    def __init__(
        self,
        plugins: Sequence[PluginSpec],
        *,
        directory: Path | None = None,
        timeout: float,
        interval: float = WATCH_INTERVAL_S,
        backoff: Backoff | None = None,
    ) -> None:
        self._named = list(plugins)
        self._directory = directory
        self._timeout = timeout
        self._interval = interval
        self._backoff = backoff
        self.members: dict[str, _Member] = {}
        self._latest: NodeState | None = None
        self._scanner: asyncio.Task[None] | None = None
        self._directory_missing = False
        self._not_sockets: set[str] = set()
        """``NAME.sock`` entries found that are no socket, warned about once each."""
        self._stopping: set[asyncio.Task[None]] = set()

    @property
    def feeders(self) -> list[Feeder]:
        """One per plugin: kpng's health and metrics report each plugin on its own."""
        return [member.feeder for member in self.members.values()]

    async def apply(self, state: NodeState) -> bool:
        # The caller's mapping changes with its next state; the plugins are fed later, at their
        # own pace, and a plugin found later needs this one whole.
        self._latest = msgspec.structs.replace(state, services=dict(state.services))
        if self._scanner is None:
            for spec in self._named:
                self._add(spec)
            if self._directory is not None:
                self._scan(self._directory)
            self._scanner = asyncio.create_task(self._rescan(), name="to-plugin directory")
            return False
        for member in self.members.values():
            member.feeder.offer(self._latest)
        return False

    def _add(self, spec: PluginSpec, *, from_directory: bool = False) -> None:
        backend = PluginBackend(spec, timeout=self._timeout)
        backoff = self._backoff or Backoff.for_backends()
        feeder = Feeder(f"to-plugin {spec.name}", backend, backoff=backoff)
        member = _Member(spec, backend, feeder, [], from_directory)
        member.tasks = [
            asyncio.create_task(feeder.run(), name=f"to-plugin {spec.name}"),
            asyncio.create_task(self._watch(member), name=f"to-plugin {spec.name} watch"),
        ]
        self.members[spec.name] = member
        if self._latest is not None:
            self._resync(member)

    def _resync(self, member: _Member) -> None:
        """Offer the whole latest state: what a new or restarted plugin needs."""
        latest = self._latest
        if latest is not None:
            member.feeder.offer(
                msgspec.structs.replace(
                    latest, updated=frozenset(latest.services), deleted=frozenset()
                )
            )

    async def _watch(self, member: _Member) -> None:
        while True:
            await asyncio.sleep(self._interval)
            why = await member.backend.check()
            if why is not None:
                log.warning(
                    "plugin %s: %s; starting a new session with the whole state",
                    member.spec.name,
                    why,
                )
                self._resync(member)

    async def _rescan(self) -> None:
        directory = self._directory
        if directory is None:
            return
        while True:
            await asyncio.sleep(self._interval)
            self._scan(directory)

    def _scan(self, directory: Path) -> None:
        try:
            entries = os.listdir(directory)
        except OSError as exc:
            if not self._directory_missing:
                log.warning("to-plugin: cannot read the plugin directory %s: %s", directory, exc)
            self._directory_missing = True
            entries = []
        else:
            if self._directory_missing:
                log.info("to-plugin: the plugin directory %s is readable again", directory)
            self._directory_missing = False
        named = {spec.name for spec in self._named}
        found = plugins_in_directory(directory, [e for e in entries if self._usable(directory, e)])
        for name, spec in sorted(found.items()):
            if name in named:
                continue  # --plugin names it: that one is fed
            if name not in self.members:
                log.info("to-plugin: found plugin %s at %s", name, spec.url)
                self._add(spec, from_directory=True)
        for name in [n for n, m in self.members.items() if m.from_directory]:
            if name not in found:
                log.info("to-plugin: plugin %s left %s", name, directory)
                member = self.members.pop(name)
                task = asyncio.create_task(self._stop(member), name=f"to-plugin {name} stop")
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    def _usable(self, directory: Path, entry: str) -> bool:
        """Whether ``entry`` may name a plugin: a ``NAME.sock`` must be a socket (a plain file
        or a directory of that name is nobody's plugin, and kpng would connect to it for
        ever)."""
        if not entry.endswith(SOCKET_SUFFIX):
            return True
        try:
            is_socket = stat.S_ISSOCK(os.stat(directory / entry).st_mode)
        except OSError:
            return False  # gone since it was listed
        if not is_socket and entry not in self._not_sockets:
            log.warning("to-plugin: %s is not a socket: not a plugin", directory / entry)
        (self._not_sockets.discard if is_socket else self._not_sockets.add)(entry)
        return is_socket

    async def _stop(self, member: _Member) -> None:
        for task in member.tasks:
            task.cancel()
        await asyncio.gather(*member.tasks, return_exceptions=True)
        await member.backend.close()

    async def close(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scanner
        members, self.members = list(self.members.values()), {}
        await asyncio.gather(
            *(self._stop(m) for m in members), *self._stopping, return_exceptions=True
        )
