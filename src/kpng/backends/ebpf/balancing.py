"""to-ebpf's backend: the socket balancer (programs, maps, links) beside to-nft's packets part,
their checks, flags and registration."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import shutil
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, get_args

from kpng.backends._conntrack import Conntrack
from kpng.backends._drift import Drift
from kpng.backends._healthchecks import HealthServers
from kpng.backends._nftables import NftBackend, kube_proxy_leftovers
from kpng.backends._nftables import cleanup as cleanup_nft
from kpng.backends._nftables.counting import SERIES_LIMIT
from kpng.backends._nftables.executing import LibNft, NetlinkBatches, default_nft
from kpng.backends._node import (
    FromNode,
    Options,
    add_arguments,
    add_sync_period,
    node_options,
    options_from_args,
)
from kpng.backends._samples import Sample
from kpng.backends._traffic import add_arguments as add_traffic_arguments
from kpng.backends._traffic import read_paced
from kpng.backends.ebpf import (
    auditing,
    entries,
    libbpf,
    locality,
    namespaces,
    observing,
    system,
    toolchain,
    traffic,
)
from kpng.backends.ebpf.destroying import UdpDestroyer
from kpng.backends.ebpf.entries import LAYOUT_VERSION, MAPS, Contribution, MapChanges, SocketState
from kpng.backends.ebpf.libbpf import BpfError, BpfObject
from kpng.backends.ebpf.locality import LocalNamespaces
from kpng.backends.ebpf.observing import Occupancy
from kpng.client import (
    Backend,
    BackendSpec,
    KpngError,
    NodeState,
    NoReporting,
    ServiceEndpoints,
    ServiceKey,
    SyncReporter,
    UsageError,
    object_name,
    register,
)
from kpng.gcpause import collector_paused

log = logging.getLogger(__name__)

DEFAULT_PIN_DIR = Path("/sys/fs/bpf/kpng")
PROGRAMS = (  # in the order of observing.HOOKS, kpng_counters' keys
    "kpng_connect4",
    "kpng_connect6",
    "kpng_sendmsg4",
    "kpng_sendmsg6",
    "kpng_recvmsg4",
    "kpng_recvmsg6",
    "kpng_peername4",
    "kpng_peername6",
)
_UNLIMITED = 2**62
"""The nftables part's series limit: to-ebpf applies its own to the sums (``traffic.py``)."""
SAMPLED_PER_MAP = 8
"""Entries of each map read back at every drift check (a syscall each)."""
ConnectedUdp = Literal["packets", "destroy"]
"""How a UDP socket that connects to a service is balanced (``--connected-udp``): left to the
packets part, which DNATs it and moves its conntrack entry when its endpoint goes (kube-proxy's
way), or translated at connect and destroyed once its endpoint is gone (``destroying``)."""
CONNECTED_UDP: tuple[ConnectedUdp, ...] = get_args(ConnectedUdp)


class SocketBalancer:
    """The sockets part: loads and attaches the programs at the first state, then keeps the
    maps in step with each state. A failed write leaves what the maps held, and the next state
    (or the feeder's retry) rewrites everything."""

    def __init__(
        self,
        *,
        options: Options,
        from_node: FromNode,
        cgroup: Path | None,
        pin_dir: Path,
        bpf_object: Path | None,
        connected_udp: ConnectedUdp = "packets",
        traffic_counters: bool = False,
        endpoint_counters: bool = False,
    ) -> None:
        self._options, self._from_node = options, from_node
        self._cgroup, self._pin_dir, self._bpf_object = cgroup, pin_dir, bpf_object
        self._connected_udp = connected_udp
        self._traffic = traffic.FrontendTraffic() if traffic_counters else None
        self._traffic_fd: int | None = None
        self._counted: set[bytes] = set()
        """The frontends ``kpng_traffic`` holds an entry for, as written (``traffic.py``)."""
        self._zero_counts = b""
        self._endpoint_traffic = (
            traffic.FrontendTraffic() if traffic_counters and endpoint_counters else None
        )
        self._endpoint_fd: int | None = None
        self._endpoint_entries = traffic.EndpointEntries()
        """The (set, endpoint) pairs ``kpng_endpoint_traffic`` holds an entry for, as written."""
        self._endpoint_names: dict[bytes, str] = {}
        """Packed endpoints as their ``endpoint`` label, those of the last read."""
        self._reading: asyncio.Task[None] | None = None
        self._object: BpfObject | None = None
        self._destroyer: UdpDestroyer | None = None
        self._locality: LocalNamespaces | None = None
        self._looking: asyncio.Task[None] | None = None
        self._resolved = options
        self._destroyed = 0
        self._fds: dict[entries.MapName, int] = {}
        self._counters_fd: int | None = None
        self.state = SocketState()
        self.occupancy = Occupancy()
        self._recorded: dict[ServiceKey, ServiceEndpoints] = {}
        self._cache: dict[tuple[str, str], bytes] = {}
        self._node: tuple[Options, tuple[str, ...]] | None = None
        self._needs_full = True
        self._attached = False
        self._attached_to: Path | None = None
        self._lock = asyncio.Lock()
        """Held by an apply and by a drift check or repair: each sees the other's whole."""
        self._map_ids: dict[str, int] = {}
        """Each pinned map's id, as loaded: what its pin is to hold."""
        self._program_ids: dict[str, int] = {}
        self._rng = random.Random()

    @property
    def maps_dir(self) -> Path:
        return self._pin_dir / f"maps-v{LAYOUT_VERSION}"

    async def apply(self, state: NodeState) -> MapChanges:
        """Program ``state``; the changes made."""
        async with self._lock:
            return await self._apply(state)

    async def _apply(self, state: NodeState) -> MapChanges:
        options = node_options(self._options, self._from_node, state)
        self._resolved = options
        node = (options, state.node_ips)
        if node != self._node:
            # Node ports follow the node's primary IPs: every service is contributed anew.
            self._node = node
            self._recorded.clear()
            self._needs_full = True
        full = self._needs_full or not self._attached
        try:
            present: asyncio.Future[dict[entries.MapName, list[bytes]]] | None = None
            if full:
                cgroup = await asyncio.to_thread(self._load)
                # What the maps hold is read while the services are contributed: the kernel's
                # part of that read runs without the GIL.
                present = asyncio.get_running_loop().run_in_executor(None, self._present)
            updated = self._contribute(state, options)
            if present is not None:
                changes = await asyncio.to_thread(
                    self._full, updated, await present, cgroup, options
                )
            else:
                changes = self.state.changes(updated)
                await asyncio.to_thread(self._write, changes)
            if self._looking is None and self._locality is not None and self._attached:
                self._looking = asyncio.create_task(self._look_periodically(self._locality))
            if self._reading is None and self._traffic is not None and self._attached:
                self._reading = asyncio.create_task(self._read_periodically())
            if self._destroyer is not None and _may_take_endpoints(changes):
                await asyncio.to_thread(self._sweep, self._destroyer)
        except BpfError:
            self._needs_full = True
            raise
        finally:
            # What was to be written, refused or not: a refusal for want of room is what the
            # warning is about.
            self.occupancy.update(self.state.entries())
        for key, owners in changes.conflicts:
            log.warning(
                "to-ebpf: frontend %s wanted differently by %s; %s wins",
                entries.describe_frontend(key),
                ", ".join(object_name(*o) for o in owners),
                object_name(*owners[0]),
            )
        return changes

    def _contribute(
        self, state: NodeState, options: Options
    ) -> dict[ServiceKey, Contribution | None]:
        """The entries of the services that changed since the last state (None: deleted)."""
        updated: dict[ServiceKey, Contribution | None] = dict.fromkeys(state.deleted)
        with collector_paused():
            for key in state.services.keys() if not self._recorded else state.updated:
                se = state.services[key]
                if self._recorded.get(key) != se:
                    self._recorded[key] = se
                    updated[key] = entries.contribute(se, options, state.node_ips, self._cache)
        for key in state.deleted:
            self._recorded.pop(key, None)
        return updated

    def _load(self) -> Path:
        """Load the programs (once), bound to the pinned maps; the cgroup they are for."""
        cgroup = self._cgroup or system.cgroup2_root()
        if not cgroup.is_dir():
            raise BpfError(f"no cgroup directory {cgroup}")
        system.ensure_bpffs(self._pin_dir)
        self.maps_dir.mkdir(parents=True, exist_ok=True)
        if self._object is not None:
            # A full sync after a failure or a drift: pins removed since are made again, so
            # that the next start finds these maps (affinity memory and counters included).
            self._pin_maps(self._object)
        else:
            # Both the destroy and local traffic detection enter the pods' namespaces.
            entering = namespaces.unavailable(cgroup)
            if self._connected_udp == "destroy":
                self._destroyer = self._load_destroyer(cgroup, entering)
            else:
                log.info(
                    "to-ebpf: connected UDP sockets are left to the nftables part and conntrack "
                    "(--connected-udp packets): a send after their endpoint is gone reaches "
                    "another endpoint"
                )
            # Connected UDP translated at connect only where its sockets are destroyed later.
            rodata = struct.pack("=I", self._destroyer is not None)
            try:
                self._object = BpfObject(
                    toolchain.ensure_object(self._bpf_object), self.maps_dir, rodata=rodata
                )
            except BpfError:
                if self._destroyer is not None:
                    self._destroyer.close()
                    self._destroyer = None
                raise
            self._fds = {name: self._object.map_fd(name) for name in MAPS}
            self._locality = LocalNamespaces(
                self._object.map_fd("kpng_locality"),
                self._object.map_fd("kpng_local_netns"),
                cgroup,
                why_not=entering or locality.unavailable(),
            )
            self.occupancy.capacity = {name: self._object.map_capacity(name) for name in MAPS}
            self._counters_fd = self._object.map_fd("kpng_counters")
            try:
                self._traffic_fd = self._object.map_fd("kpng_traffic")
            except BpfError:
                # A --bpf-object compiled from an older source: fine unless it is to count.
                if self._traffic is not None:
                    raise
            try:
                self._endpoint_fd = self._object.map_fd("kpng_endpoint_traffic")
            except BpfError:
                if self._endpoint_traffic is not None:
                    raise
            self._zero_counts = bytes(
                libbpf.per_cpu_stride(traffic.VALUE_SIZE) * libbpf.possible_cpus()
            )
            self._map_ids = {
                name: libbpf.object_id(fd) for name, (fd, _) in self._object.pinned_maps().items()
            }
            self._program_ids = {name: self._object.program_id(name) for name in PROGRAMS}
        return cgroup

    def _pin_maps(self, loaded: BpfObject) -> None:
        pinned = []
        for name, (fd, path) in loaded.pinned_maps().items():
            if libbpf.pinned_id(path) != self._map_ids[name]:
                path.unlink(missing_ok=True)
                libbpf.pin(fd, path)
                pinned.append(name)
        if pinned:
            log.info("to-ebpf: maps %s pinned again in %s", ", ".join(pinned), self.maps_dir)

    async def drift(self) -> Drift | None:
        """What another program changed of the pins, links and entries since the last sync
        (``auditing.py``), or None; nothing is checked before the programs are attached, nor
        while a full sync is due (the Feeder's retry, or a repair's)."""
        async with self._lock:
            if not self._attached or self._needs_full:
                return None
            return await asyncio.to_thread(self._drift)

    def _drift(self) -> Drift | None:
        assert self._object is not None
        pins = self._object.pinned_maps()
        found_pins = {name: libbpf.pinned_id(path) for name, (_, path) in pins.items()}
        drift = auditing.compare_pins(self._map_ids, found_pins, self.maps_dir)
        if drift is None:
            cgroup = self._attached_to
            assert cgroup is not None
            links = self._links(cgroup)
            found_links = {}
            for name in PROGRAMS:
                link = libbpf.pinned_link(links / name)
                found_links[name] = None if link is None else auditing.Link(*link)
            drift = auditing.compare_links(
                self._program_ids, found_links, cgroup.stat().st_ino, links
            )
        if drift is None:
            counts: dict[str, int] = {
                name: libbpf.count(fd, entries.KEY_SIZES[name], entries.VALUE_SIZES[name])
                for name, fd in self._fds.items()
            }
            with collector_paused():
                drift = auditing.compare_counts(self.state.entries(), counts)
        if drift is None:
            with collector_paused():
                sampled = self.state.sample(SAMPLED_PER_MAP, self._rng)
            found = [
                libbpf.lookup(self._fds[name], key, entries.VALUE_SIZES[name])
                for name, key, _ in sampled
            ]
            drift = auditing.compare_entries(sampled, found)
        return drift

    async def repair(self) -> None:
        """What a start does, over the maps kpng holds: the maps pinned again, the programs
        attached again (the links switched, or made anew), every entry rewritten. A failure
        leaves a full sync due, for the next repair or the next state."""
        async with self._lock:
            self._needs_full, self._attached = True, False
            await asyncio.to_thread(self._reload)

    def _reload(self) -> None:
        cgroup = self._load()
        self._full({}, self._present(), cgroup, self._resolved)

    def _load_destroyer(self, cgroup: Path, entering: str | None) -> UdpDestroyer | None:
        """The iterator that destroys connected UDP sockets (``--connected-udp destroy``), if
        this kernel and kpng's privileges allow it (``entering``: why kpng cannot enter the
        pods' namespaces, or None); which way connected UDP sockets go is logged once, as a
        warning where the destroy was asked for and cannot be had."""
        why_not = entering
        destroyer = None
        if why_not is None:
            try:
                path = toolchain.ensure_object(unit=toolchain.UDP_DESTROY)
                destroyer = UdpDestroyer(path, self.maps_dir, cgroup)
            except BpfError as exc:
                why_not = f"the socket destroy program did not load (Linux 6.5+, kernel BTF): {exc}"
        if destroyer is None:
            log.warning(
                "to-ebpf: --connected-udp destroy cannot be had; connected UDP sockets are left "
                "to the nftables part and conntrack: %s",
                why_not,
            )
        else:
            log.info(
                "to-ebpf: connected UDP sockets are translated at connect, and destroyed in "
                "every network namespace of cgroup %s once their endpoint is gone",
                cgroup,
            )
        return destroyer

    def _sweep(self, destroyer: UdpDestroyer) -> None:
        done = destroyer.sweep()
        self._destroyed += done.destroyed
        if done.failures:
            log.warning(
                "to-ebpf: connected UDP sockets not checked in %d network namespaces: %s",
                len(done.failures),
                "; ".join(done.failures[:5]),
            )
        log.log(
            logging.INFO if done.destroyed else logging.DEBUG,
            "to-ebpf: %d connected UDP sockets of gone endpoints destroyed (%d network namespaces)",
            done.destroyed,
            done.namespaces,
        )

    def metric_samples(self) -> list[Sample]:
        """The programs' counters, summed over the CPUs (once loaded), the maps' occupancy, the
        sockets destroyed and the namespaces looked at: read at each scrape."""
        samples = self.occupancy.samples()
        if self._destroyer is not None:
            samples.append(observing.destroyed_sample(self._destroyed))
        counts = self._locality.counts if self._locality is not None else None
        if counts is not None:
            samples += observing.namespace_samples(*counts)
        fd = self._counters_fd
        if fd is None:
            return samples
        try:
            per_hook = {
                hook: libbpf.per_cpu(fd, struct.pack("=I", i), observing.COUNTERS.size)
                for i, hook in enumerate(observing.HOOKS)
            }
        except BpfError as exc:
            log.debug("to-ebpf: counters not read: %s", exc)
            return samples
        return observing.counter_samples(observing.counter_sums(per_hook)) + samples

    def _present(self) -> dict[entries.MapName, list[bytes]]:
        return {
            name: list(
                libbpf.keys(self._fds[name], entries.KEY_SIZES[name], entries.VALUE_SIZES[name])
            )
            for name in MAPS
        }

    def _full(
        self,
        updated: dict[ServiceKey, Contribution | None],
        present: dict[entries.MapName, list[bytes]],
        cgroup: Path,
        options: Options,
    ) -> MapChanges:
        """Every entry written over what the maps hold, and which namespaces are local; at the
        first state, the programs are attached only then, so that they see only whole states."""
        with collector_paused():
            changes = self.state.full(updated, present)
        fd = self._traffic_fd
        if fd is not None:
            found = [
                (key, traffic.sum_counts(values))
                for key, values in libbpf.per_cpu_entries(fd, traffic.KEY_SIZE, traffic.VALUE_SIZE)
            ]
            self._counted = {key for key, _ in found}
            if self._traffic is not None and not self._traffic.begun:
                self._traffic.begin(found)
        efd = self._endpoint_fd
        if efd is not None:
            # What the map holds is what _write keeps or adds to: no live count is zeroed.
            found = [
                (key, traffic.sum_counts(values))
                for key, values in libbpf.per_cpu_entries(
                    efd, traffic.ENDPOINT_KEY_SIZE, traffic.VALUE_SIZE
                )
            ]
            self._endpoint_entries.found(entries.split_endpoint_key(key) for key, _ in found)
            if self._endpoint_traffic is not None and not self._endpoint_traffic.begun:
                self._endpoint_traffic.begin(found)
        self._write(changes)
        if efd is not None and self._endpoint_traffic is None:
            # Without the endpoint level, the programs stop counting per endpoint.
            _, stale_pairs = self._endpoint_entries.changes({})
            keys = [entries.endpoint_key(s, ep) for s, ep in stale_pairs]
            libbpf.delete_batch(efd, "kpng_endpoint_traffic", keys)
        if fd is not None:
            # Entries of frontends no service wants, or every entry without the flag: the
            # programs stop counting.
            wanted = self.state.frontends if self._traffic is not None else {}
            stale = [k for k in self._counted if k not in wanted]
            libbpf.delete_batch(fd, "kpng_traffic", stale)
            self._counted.difference_update(stale)
        assert self._locality is not None
        self._locality.refresh(options)
        self._needs_full = False
        if not self._attached:
            self._attach(cgroup)
        return changes

    async def _look_periodically(self, locals: LocalNamespaces) -> None:
        """New pods' namespaces found, gone ones forgotten, every ``LOOK_EVERY_S``; a failure
        is logged when it first happens, not every second while it lasts."""
        failed = ""
        while True:
            await asyncio.sleep(locality.LOOK_EVERY_S)
            try:
                await asyncio.to_thread(locals.refresh, self._resolved)
                failed = ""
            except (BpfError, OSError) as exc:
                if str(exc) != failed:
                    log.warning("to-ebpf: the pods' network namespaces not looked at: %s", exc)
                failed = str(exc)

    def _attach(self, cgroup: Path) -> None:
        assert self._object is not None
        links = self._links(cgroup)
        for name in PROGRAMS:
            libbpf.attach(self._object.program(name), name, cgroup, links / name)
        for other in links.parent.iterdir():
            if other != links:
                log.info("to-ebpf: detaching the programs of an earlier cgroup (%s)", other.name)
                shutil.rmtree(other, ignore_errors=True)
        self._attached, self._attached_to = True, cgroup
        for old in self._pin_dir.glob("maps-v*"):
            if old != self.maps_dir:
                # Another layout's maps: no program uses them since the switch above.
                shutil.rmtree(old, ignore_errors=True)
        log.info(
            "to-ebpf: programs attached to cgroup %s, maps pinned in %s", cgroup, self.maps_dir
        )

    def _links(self, cgroup: Path) -> Path:
        # Links are pinned by cgroup (a cgroup2 directory's inode number is its id): those of
        # another cgroup, from an earlier --cgroup, are detached once these are attached.
        return self._pin_dir / "links" / str(cgroup.stat().st_ino)

    def _write(self, changes: MapChanges) -> None:
        efd = self._endpoint_fd if self._endpoint_traffic is not None else None
        left_keys: list[bytes] = []
        if efd is not None:
            # Before the slots that expose them: no connection to a new endpoint goes
            # uncounted. Those of endpoints that left go after the slots.
            counted, sets = self.state.counted, self.state.sets
            touched = None if changes.full else _sets_touched(changes)
            ids = counted.keys() if touched is None else touched
            wanted = {s: sets.get(s, ()) for s in ids if s in counted}
            made, left = self._endpoint_entries.changes(wanted, touched)
            libbpf.update_batch(
                efd,
                "kpng_endpoint_traffic",
                [(entries.endpoint_key(s, ep), self._zero_counts) for s, ep in made],
            )
            left_keys = [entries.endpoint_key(s, ep) for s, ep in left]
        fd = self._traffic_fd if self._traffic is not None else None
        if fd is not None:
            # Before the frontends: no connection to a new one goes uncounted.
            new = [
                k
                for name, pairs in changes.updates
                if name == "kpng_frontends"
                for k, _ in pairs
                if k not in self._counted
            ]
            libbpf.update_batch(fd, "kpng_traffic", [(k, self._zero_counts) for k in new])
            self._counted.update(new)
        for name, pairs in changes.updates:
            libbpf.update_batch(self._fds[name], name, pairs)
        for name, keys in changes.deletes:
            libbpf.delete_batch(self._fds[name], name, keys)
        if fd is not None:
            gone = [
                k
                for name, keys in changes.deletes
                if name == "kpng_frontends"
                for k in keys
                if k in self._counted
            ]
            libbpf.delete_batch(fd, "kpng_traffic", gone)
            self._counted.difference_update(gone)
        if efd is not None:
            libbpf.delete_batch(efd, "kpng_endpoint_traffic", left_keys)

    async def _read_periodically(self) -> None:
        # Paced as to-nft's reads: a read of every endpoint's per-CPU entry takes seconds at
        # 100,000 of them (bench_ebpf.py), under the lock that syncs take.
        await read_paced(self.read_traffic, sleep=asyncio.sleep, failure=BpfError, log=log)

    async def read_traffic(self) -> None:
        """Read ``kpng_traffic`` (and ``kpng_endpoint_traffic``) and fold it into the service
        ports' (and endpoints') totals (``traffic.py``), under the lock, so that the owners are
        those of the frontends and sets the read saw."""
        if self._traffic is None or self._traffic_fd is None:
            return
        async with self._lock:
            await asyncio.to_thread(self._read_traffic, self._traffic, self._traffic_fd)
            if self._endpoint_traffic is not None and self._endpoint_fd is not None:
                await asyncio.to_thread(
                    self._read_endpoint_traffic, self._endpoint_traffic, self._endpoint_fd
                )

    def _read_traffic(self, totals: traffic.FrontendTraffic, fd: int) -> None:
        with collector_paused():
            owners = {
                key: traffic.labels(service[0], service[1], port)
                for key, (service, port) in self.state.owners().items()
            }
        counts = [
            (key, traffic.sum_counts(values))
            for key, values in libbpf.per_cpu_entries(fd, traffic.KEY_SIZE, traffic.VALUE_SIZE)
        ]
        totals.fold(counts, owners)

    def _read_endpoint_traffic(self, totals: traffic.FrontendTraffic, fd: int) -> None:
        names, known = {}, self._endpoint_names
        owners = {}
        with collector_paused():
            counted = self.state.counted
            for set_id, endpoints in self._endpoint_entries.held.items():
                owner = counted.get(set_id)
                if owner is None:
                    continue
                (namespace, service), port = owner
                port_labels = traffic.labels(namespace, service, port)
                for ep in endpoints:
                    name = names[ep] = known.get(ep) or entries.describe_endpoint(ep)
                    owners[entries.endpoint_key(set_id, ep)] = traffic.endpoint_labels(
                        port_labels, name
                    )
        self._endpoint_names = names
        counts = [
            (key, traffic.sum_counts(values))
            for key, values in libbpf.per_cpu_entries(
                fd, traffic.ENDPOINT_KEY_SIZE, traffic.VALUE_SIZE
            )
        ]
        totals.fold(counts, owners)

    def endpoint_totals(self) -> Mapping[traffic.Labels, int] | None:
        """Per endpoint of a service port (``traffic.endpoint_labels``), the connections the
        programs gave it, as of the last read (None: not counted)."""
        return self._endpoint_traffic.totals if self._endpoint_traffic is not None else None

    def traffic_totals(self) -> Mapping[traffic.Labels, int] | None:
        """Per service port, the connections the programs translated, as of the last read
        (None: not counted)."""
        return self._traffic.totals if self._traffic is not None else None

    def close(self) -> None:
        # The pins keep programs and maps: closing only lets go of this process's handles (and
        # detaches the iterator, which runs only when kpng runs it).
        if self._looking is not None:
            self._looking.cancel()
            self._looking = None
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._destroyer is not None:
            self._destroyer.close()
            self._destroyer = None
        if self._object is not None:
            self._counters_fd = self._traffic_fd = self._endpoint_fd = None
            self._object.close()
            self._object = None
            self._locality = None


def _sets_touched(changes: MapChanges) -> set[int]:
    """The sets whose slots or count these changes write or delete."""
    return {
        entries.set_of_slot(key)
        for name, pairs in changes.updates
        if name in ("kpng_slots", "kpng_sets")
        for key, _ in pairs
    } | {
        entries.set_of_slot(key)
        for name, keys in changes.deletes
        if name in ("kpng_slots", "kpng_sets")
        for key in keys
    }


def _may_take_endpoints(changes: MapChanges) -> bool:
    """Whether an endpoint may have stopped serving a frontend: a member left a set, or a
    frontend went (a full sync, also after a restart, may follow removals kpng did not see)."""
    return changes.full or any(
        name in ("kpng_members", "kpng_frontends") for name, _ in changes.deletes
    )


class EbpfBackend:
    """The sockets part and the packets part, applied in that order for each state.

    Every ``sync_period`` (0: never) the sockets part is checked for drift (``auditing.py``)
    and repaired, the divergence reported until then; the packets part checks its own table
    (``NftBackend``)."""

    def __init__(
        self,
        *,
        sockets: SocketBalancer,
        packets: NftBackend,
        syncs: SyncReporter | None = None,
        sync_period: float = 0.0,
        traffic_series_limit: int = SERIES_LIMIT,
    ) -> None:
        self.sockets, self.packets = sockets, packets
        self._series_limit = traffic_series_limit
        self._syncs = syncs or NoReporting()
        self._sync_period = sync_period
        self._revision: int | None = None
        """The revision last applied whole (None: none yet)."""
        self._unrepaired = False
        """A divergence is reported that no sync has repaired yet."""
        self._watching: asyncio.Task[None] | None = None

    async def apply(self, state: NodeState) -> bool:
        started = time.monotonic()
        try:
            changes = await self.sockets.apply(state)
            once = await self.packets.apply(state)
        except Exception:
            self._syncs.failed()
            # Which kind the failed attempt was is not known here; the next one is full.
            self._syncs.attempted(seconds=time.monotonic() - started, full=True)
            raise
        elapsed = time.monotonic() - started
        self._syncs.attempted(seconds=elapsed, full=changes.full)
        self._syncs.synced(revision=state.revision)
        self._revision = state.revision
        if changes.full:
            # What a repair would have done: the divergence ends with this sync.
            self._unrepaired = False
        if self._sync_period > 0 and self._watching is None:
            self._watching = asyncio.create_task(self._watch(), name="ebpf-drift-check")
        log.debug("to-ebpf: %d map operations; state applied in %.3f s", len(changes), elapsed)
        return once

    async def _watch(self) -> None:
        """kube-proxy's sync period: a drift check of the sockets part, and its repair. A state
        that fails to apply is not this loop's to retry: the Feeder does, with the state."""
        while True:
            await asyncio.sleep(self._sync_period)
            try:
                await self.check_sockets()
            except (BpfError, OSError) as exc:
                log.error(
                    "to-ebpf: the drift check or repair of the maps and programs failed: %s; "
                    "again in %gs",
                    exc,
                    self._sync_period,
                )

    async def check_sockets(self) -> Drift | None:
        """One drift check of the sockets part: what another program changed, repaired as a
        start would, or None. A repair that failed is tried again, found anew or not."""
        if self._revision is None:
            return None
        drift = await self.sockets.drift()
        if drift is not None:
            log.warning(
                "to-ebpf: kpng's BPF %s were changed by another program: %s; reloading them",
                drift.kind,
                drift.detail,
            )
            self._syncs.diverged(kind=drift.kind, detail=drift.detail)
            self._unrepaired = True
        if self._unrepaired:
            await self.sockets.repair()
            self._unrepaired = False
            self._syncs.synced(revision=self._revision)
            log.info("to-ebpf: the maps and programs hold revision %d again", self._revision)
        return drift

    def sockets_diverged(self) -> bool:
        """Whether a divergence of the sockets part is reported and not repaired yet."""
        return self._unrepaired

    def metric_samples(self) -> list[Sample]:
        """What kpng's ``/metrics`` adds for to-ebpf (``kpng.status.ReportsSamples``): with
        ``--traffic-counters service``, each service port's connections, those the programs
        translated and those the nftables part counted, summed (``traffic.py``); with
        ``endpoint``, each endpoint's likewise."""
        samples = self.sockets.metric_samples()
        translated = self.sockets.traffic_totals()
        if translated is not None:
            packets = self.packets.metric_samples()
            samples += traffic.merged_samples(
                translated, packets, self._series_limit, self.sockets.endpoint_totals()
            )
        return samples

    async def close(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        self.sockets.close()
        await self.packets.close()


class PacketsReporter:
    """What the packets part (an ``NftBackend``) reports, as to-ebpf's: the services it
    refused and the drift it found in its table go through; its syncs are to-ebpf's to time
    (``EbpfBackend.apply``), but a repair of its table ends the divergence it reported, unless
    the sockets part still has one of its own (its own repair ends both)."""

    def __init__(self, syncs: SyncReporter) -> None:
        self._syncs = syncs
        self._diverged = False
        self.sockets_diverged: Callable[[], bool] = lambda: False

    def attempted(self, *, seconds: float, full: bool) -> None:
        pass

    def failed(self) -> None:
        pass

    def synced(self, *, revision: int) -> None:
        if self._diverged and not self.sockets_diverged():
            self._syncs.synced(revision=revision)
        self._diverged = False

    def refused(self, services: Mapping[ServiceKey, str]) -> None:
        self._syncs.refused(services)

    def diverged(self, *, kind: str, detail: str) -> None:
        self._diverged = True
        self._syncs.diverged(kind=kind, detail=detail)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    add_sync_period(
        parser,
        checks="that kpng's pinned maps and links, the maps' entries and kpng's nftables table "
        "(for traffic from outside) hold what it applied",
    )
    parser.add_argument(
        "--cgroup",
        type=Path,
        metavar="DIR",
        help="the cgroup2 directory whose sockets are balanced, descendants included (default: "
        "the root of the cgroup2 hierarchy, mounted at /run/kpng/cgroup2 if nothing mounts it)",
    )
    parser.add_argument(
        "--pin-dir",
        type=Path,
        default=DEFAULT_PIN_DIR,
        metavar="DIR",
        help=f"where the maps and links are pinned, on bpffs (default: {DEFAULT_PIN_DIR})",
    )
    parser.add_argument(
        "--bpf-object",
        type=Path,
        metavar="FILE",
        help="the compiled programs (python -m kpng.backends.ebpf.toolchain FILE makes one); "
        "default: the sockets.bpf.o shipped with kpng",
    )
    parser.add_argument(
        "--connected-udp",
        choices=CONNECTED_UDP,
        default="packets",
        help="how a UDP socket that connects to a service is balanced. packets (default): left "
        "untranslated, DNATed by the nftables part, its conntrack entry deleted when its "
        "endpoint goes, so that its next datagram reaches another endpoint, as with "
        "kube-proxy. destroy (Linux 6.5+ with the kernel's BTF, CAP_SYS_ADMIN and "
        "CAP_SYS_PTRACE; else packets, with a warning): translated at connect, leaving no "
        "conntrack entry, and destroyed once its endpoint is gone; this breaks applications "
        "that keep one connected socket and do not connect again when a send fails "
        "(EDESTADDRREQ), such as metrics clients that ignore send errors: they never deliver "
        "again",
    )
    add_traffic_arguments(
        parser,
        where="those the programs translate, counted in per-CPU BPF maps, and those the "
        "nftables part serves or refuses, counted as to-nft counts them (its endpoints: not "
        "those of ClientIP-affinity Service ports), summed",
    )


def _create(args: argparse.Namespace, syncs: SyncReporter) -> Backend:
    if args.dry_run:
        raise UsageError(
            "to-ebpf has no --dry-run: its maps are binary (to-nft --dry-run shows the rules)"
        )
    # Before anything touches the node: an older kernel would refuse the programs one by one,
    # with errors that do not say why.
    too_old = system.kernel_too_old()
    if too_old is not None:
        raise KpngError(too_old)
    options, from_node = options_from_args(args)
    counting = args.traffic_counters != "off"
    per_endpoint = args.traffic_counters == "endpoint"
    options = dataclasses.replace(
        options, traffic_counters=counting, endpoint_counters=per_endpoint
    )
    nft = default_nft()
    if not isinstance(nft, LibNft) and shutil.which("nft") is None:
        raise UsageError("to-ebpf needs libnftables or the nft command for traffic from outside")
    reporter = PacketsReporter(syncs)
    packets = NftBackend(
        nft=nft,
        syncs=reporter,
        options=options,
        from_node=from_node,
        min_sync_period=args.min_sync_period,
        conntrack=None if args.no_conntrack else Conntrack(),
        health=None if args.no_health_check else HealthServers(),
        once=args.once,
        kube_proxy=kube_proxy_leftovers(nft),
        netlink=NetlinkBatches(),
        sync_period=0.0 if args.once else args.sync_period,
        # Every service port's counts: the limit applies to their sums with the programs'.
        traffic_series_limit=_UNLIMITED,
    )
    sockets = SocketBalancer(
        options=options,
        from_node=from_node,
        cgroup=args.cgroup,
        pin_dir=args.pin_dir,
        bpf_object=args.bpf_object,
        connected_udp=args.connected_udp,
        traffic_counters=counting,
        endpoint_counters=per_endpoint,
    )
    backend = EbpfBackend(
        sockets=sockets,
        packets=packets,
        syncs=syncs,
        sync_period=0.0 if args.once else args.sync_period,
        traffic_series_limit=args.traffic_series_limit,
    )
    reporter.sockets_diverged = backend.sockets_diverged
    return backend


def remove_pins(pin_dir: Path = DEFAULT_PIN_DIR) -> bool:
    """Detach the programs (their links' pins are their last references) and drop the maps."""
    if not pin_dir.is_dir():
        return False
    shutil.rmtree(pin_dir)
    return True


async def cleanup() -> bool:
    """Remove the programs, links and maps at the default pin dir, and with them the nftables
    part; True if the pins were there.

    The nftables part is to-nft's table: without to-ebpf's pins it is to-nft's to remove and
    report (``kpng cleanup`` runs both; in a network namespace, where ``ip netns exec`` hides
    the host's bpffs, to-ebpf would otherwise claim to-nft's table as its own)."""
    if not remove_pins():
        return False
    await cleanup_nft()
    return True


SPEC = register(
    BackendSpec(
        name="ebpf",
        help="balance services when sockets connect (cgroup BPF), nftables for traffic from "
        "outside",
        add_arguments=_add_arguments,
        create=_create,
        reports_syncs=True,
        cleanup=cleanup,
        once=lambda args: bool(args.once),
    )
)
