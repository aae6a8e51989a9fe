"""kube-proxy's leftovers on a node, of every mode: found at a backend's start (to say so), and
removed by ``kpng cleanup kube-proxy`` as ``kube-proxy --cleanup`` removes them.

What kube-proxy (1.37: pkg/proxy/nftables, iptables and ipvs, their ``CleanupLeftovers``)
leaves behind when it stops, and removes when asked to clean up:

- **nftables mode**: the tables ``ip kube-proxy`` and ``ip6 kube-proxy``;
- **iptables mode**: in both families, its fixed chains of the nat, filter and mangle tables,
  its per-service chains (nat) and the jumps to them from the built-in chains;
- **ipvs mode**: its iptables chains (some share the iptables mode's names), the IPVS virtual
  servers, the dummy interface ``kube-ipvs0`` holding the service addresses, and its ip sets.

Both iptables variants are read (iptables-nft and iptables-legacy): kube-proxy writes to the one
the node's other software uses, which may not be the one kpng uses. The chains kubelet owns
(``KUBE-FIREWALL``, ``KUBE-KUBELET-CANARY``, ``KUBE-IPTABLES-HINT``) are neither reported nor
removed, though kube-proxy also creates them: its own cleanup leaves them to kubelet.

These rules see packets beside kpng's, by kube-proxy's last state: a service kube-proxy saw
without endpoints is still rejected, one it saw with other endpoints still DNATed to them.

to-iptables uses kube-proxy's iptables names, and takes kube-proxy's chains over at its first
full sync. In a family and variant that holds its mark chain, the chains of its layout are
kpng's: they are neither reported nor removed (a kube-proxy chain outside the layout there,
such as its canary, still is).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kpng.backends._commands import CommandError, run_command
from kpng.backends._iptables_chains import OWNER_CHAIN, SERVICE_CHAIN_PREFIXES, SHARED_CHAINS
from kpng.client import KpngError

log = logging.getLogger(__name__)

Runner = Callable[[Sequence[str], bytes], Awaitable[tuple[int, str, str]]]
"""Runs a command with its standard input: its exit status, standard output and standard
error; raises ``CommandError`` when the program cannot be run at all."""

NFTABLES_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))

_IPTABLES_MODE_CHAINS: dict[str, frozenset[str]] = {
    "nat": frozenset(
        {
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY",
        }
    ),
    "filter": frozenset(
        {
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
            "KUBE-PROXY-CANARY",
        }
    ),
    "mangle": frozenset({"KUBE-PROXY-CANARY"}),
}
"""The iptables mode's fixed chains, by table."""

_IPTABLES_MODE_SERVICE_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-FW-", "KUBE-EXT-")
"""The iptables mode's per-service chains (nat): its cleanup removes every chain so named."""

_IPVS_MODE_CHAINS: dict[str, frozenset[str]] = {
    "nat": frozenset(
        {
            "KUBE-SERVICES",
            "KUBE-POSTROUTING",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            "KUBE-MARK-MASQ",
        }
    ),
    "filter": frozenset(
        {
            "KUBE-FORWARD",
            "KUBE-NODE-PORT",
            "KUBE-PROXY-FIREWALL",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        }
    ),
}
"""The ipvs mode's chains, by table."""

_IP_SETS = (
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
)
"""The ipvs mode's ip sets of IPv4; those of IPv6 are named ``KUBE-6-...``."""
IP_SETS = frozenset((*_IP_SETS, *(s.replace("KUBE-", "KUBE-6-", 1) for s in _IP_SETS)))

IPVS_INTERFACE = "kube-ipvs0"
_TABLES = ("nat", "filter", "mangle")
_BUILT_IN = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
_TARGET = re.compile(r"(?:^|\s)-[jg]\s+(\S+)")
_VARIANTS = ("nft", "legacy")
_FAMILIES = (("iptables", "IPv4"), ("ip6tables", "IPv6"))
_SERVICE_CHAINS_SHOWN = 3
"""Service chains named in a message before the rest are counted: there may be thousands."""


class NftTables(Protocol):
    """What is needed of nftables (to-nft gives its own, libnftables or the nft command)."""

    async def list_tables(self) -> list[tuple[str, str]]:
        """(family, name) of every table."""
        ...

    async def delete_table(self, family: str, name: str) -> bool:
        """Delete one table; True if it was there."""
        ...


@dataclass(frozen=True)
class Leftovers:
    """The leftovers of one kind of one mode: said and removed together."""

    mode: str
    """``nftables``, ``iptables`` or ``ipvs``: the kube-proxy mode that leaves them."""
    kind: str
    """What they are: ``tables``, ``iptables-nft IPv4 chains``, ``interface``..."""
    names: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.mode} mode's {self.kind}: {', '.join(self.names)}"


@dataclass
class _Saved:
    """One table of one family and variant as iptables-save prints it."""

    chains: set[str] = field(default_factory=set)
    built_in_rules: list[tuple[str, str]] = field(default_factory=list)
    """(built-in chain, rule): where jumps to kube-proxy's chains are."""


@dataclass
class _IptablesLeftovers:
    """kube-proxy's chains in one family of one variant, by table, and the jumps to them."""

    variant: str
    tool: str
    label: str
    chains: dict[str, set[str]]
    jumps: dict[str, list[tuple[str, str]]]

    def reports(self) -> list[Leftovers]:
        """One or two lines (a node switched from ipvs to iptables mode has both's chains): a
        chain both modes use goes with the mode whose own chains are there."""
        kind = f"iptables-{self.variant} {self.label} chains"
        by_mode: dict[str, dict[str, list[str]]] = {"iptables": {}, "ipvs": {}}
        shared: dict[str, list[str]] = {}
        for table in _TABLES:
            for chain in sorted(self.chains.get(table, ())):
                iptables = chain in _IPTABLES_MODE_CHAINS.get(table, ()) or (
                    table == "nat" and chain.startswith(_IPTABLES_MODE_SERVICE_PREFIXES)
                )
                ipvs = chain in _IPVS_MODE_CHAINS.get(table, ())
                if iptables and ipvs:
                    shared.setdefault(table, []).append(chain)
                else:
                    by_mode["iptables" if iptables else "ipvs"].setdefault(table, []).append(chain)
        owner = "ipvs" if by_mode["ipvs"] and not by_mode["iptables"] else "iptables"
        for table, chains in shared.items():
            by_mode[owner][table] = sorted([*by_mode[owner].get(table, []), *chains])
        return [
            Leftovers(mode, kind, tuple(_describe_chains(tables)))
            for mode, tables in by_mode.items()
            if tables
        ]

    def restore_input(self, table: str) -> str:
        """Flush the chains, delete the jumps to them, delete them: one iptables-restore
        transaction per table, so a refusal leaves the table as it was."""
        chains = sorted(self.chains.get(table, ()))
        lines = [f"*{table}", *(f":{c} - [0:0]" for c in chains)]
        lines += [f"-D {chain} {rule}" for chain, rule in self.jumps.get(table, ())]
        lines += [f"-X {c}" for c in chains]
        return "\n".join([*lines, "COMMIT"]) + "\n"


def _describe_chains(tables: dict[str, list[str]]) -> list[str]:
    """``nat KUBE-SERVICES``, ..., with the per-service chains beyond a few counted."""
    described: list[str] = []
    for table in _TABLES:
        chains = tables.get(table, [])
        fixed = [c for c in chains if not c.startswith(_IPTABLES_MODE_SERVICE_PREFIXES)]
        services = [c for c in chains if c.startswith(_IPTABLES_MODE_SERVICE_PREFIXES)]
        described += [f"{table} {c}" for c in fixed]
        described += [f"{table} {c}" for c in services[:_SERVICE_CHAINS_SHOWN]]
        if len(services) > _SERVICE_CHAINS_SHOWN:
            described.append(f"{len(services) - _SERVICE_CHAINS_SHOWN} more {table} service chains")
    return described


@dataclass
class _Found:
    nft_tables: list[tuple[str, str]] = field(default_factory=list)
    iptables: list[_IptablesLeftovers] = field(default_factory=list)
    virtual_servers: list[str] = field(default_factory=list)
    interface: bool = False
    ip_sets: list[str] = field(default_factory=list)

    def reports(self) -> list[Leftovers]:
        found: list[Leftovers] = []
        if self.nft_tables:
            names = tuple(f"{family} {name}" for family, name in self.nft_tables)
            found.append(Leftovers("nftables", "tables", names))
        for part in self.iptables:
            found += part.reports()
        if self.virtual_servers:
            found.append(Leftovers("ipvs", "virtual servers", tuple(self.virtual_servers)))
        if self.interface:
            found.append(Leftovers("ipvs", "interface", (IPVS_INTERFACE,)))
        if self.ip_sets:
            found.append(Leftovers("ipvs", "ip sets", tuple(self.ip_sets)))
        return found


async def _run(argv: Sequence[str], stdin: bytes) -> tuple[int, str, str]:
    return await run_command(argv, stdin)


class KubeProxyLeftovers:
    """Finds and removes kube-proxy's leftovers in one network namespace.

    ``nft`` lists and deletes nftables tables (to-nft's ``Nft``); without it the ``nft``
    command does, if installed (kube-proxy's nftables mode runs it, so a node without it has
    no such tables unless kube-proxy ran in a container). ``prefix`` goes before every command
    (``ip netns exec NS`` in tests); ``run`` runs them.
    """

    def __init__(
        self,
        *,
        nft: NftTables | None = None,
        prefix: Sequence[str] = (),
        run: Runner = _run,
    ) -> None:
        self._prefix = tuple(prefix)
        self._nft = nft or _NftCommand(self._try)
        self._run = run

    async def find(self) -> list[Leftovers]:
        """What is there, one entry per mode and kind; raises ``KpngError`` when a tool that
        is installed fails."""
        return (await self._find()).reports()

    async def remove(self) -> list[Leftovers]:
        """Remove what is there, as ``kube-proxy --cleanup``; what was removed."""
        found = await self._find()
        for family, name in found.nft_tables:
            await self._nft.delete_table(family, name)
        for part in found.iptables:
            for table in _TABLES:
                if part.chains.get(table):
                    await self._restore(part, table)
        if found.virtual_servers:
            # kube-proxy's cleanup flushes every virtual server (IPVS has no owner field); kpng
            # only finds them where kube-proxy's other ipvs leftovers say whose they are.
            await self._command("ipvsadm", "--clear")
        if found.interface:
            await self._command("ip", "link", "del", IPVS_INTERFACE)
        # After the iptables chains: a set that a rule still references cannot be destroyed.
        for name in found.ip_sets:
            await self._command("ipset", "destroy", name)
        return found.reports()

    async def warn(self) -> None:
        """Log one warning naming what is there; never fails (a backend calls it at start)."""
        try:
            found = await self.find()
        except KpngError as exc:
            log.warning("cannot look for kube-proxy's leftovers: %s", exc)
            return
        if not found:
            return
        log.warning(
            "kube-proxy's leftovers are here (%s): their rules act beside kpng's and follow "
            "kube-proxy's last state. Once kube-proxy is stopped on this node, remove them "
            "with `kpng cleanup kube-proxy`",
            "; ".join(str(f) for f in found),
        )

    async def _find(self) -> _Found:
        found = _Found()
        found.nft_tables = await self._nft_tables()
        for variant in _VARIANTS:
            for tool, label in _FAMILIES:
                part = await self._iptables(variant, tool, label)
                if part is not None:
                    found.iptables.append(part)
        found.ip_sets = await self._ip_sets()
        found.interface = await self._has_ipvs_interface()
        ipvs_chains = any(r.mode == "ipvs" for p in found.iptables for r in p.reports())
        if found.ip_sets or found.interface or ipvs_chains:
            # IPVS virtual servers carry no owner; others' (keepalived's) may be there too.
            found.virtual_servers = await self._virtual_servers()
        return found

    async def _nft_tables(self) -> list[tuple[str, str]]:
        listed = set(await self._nft.list_tables())
        return [table for table in NFTABLES_TABLES if table in listed]

    async def _iptables(self, variant: str, tool: str, label: str) -> _IptablesLeftovers | None:
        saved = await self._save(f"{tool}-{variant}-save")
        if not saved:
            return None
        nat = saved.get("nat", _Saved())
        kpngs = OWNER_CHAIN in nat.chains
        chains: dict[str, set[str]] = {}
        jumps: dict[str, list[tuple[str, str]]] = {}
        for table in _TABLES:
            present = saved.get(table, _Saved())
            theirs = {c for c in present.chains if _is_kube_proxys(table, c)}
            if kpngs:
                theirs = {c for c in theirs if not _is_kpngs(table, c)}
            if not theirs:
                continue
            chains[table] = theirs
            jumps[table] = [
                (chain, rule)
                for chain, rule in present.built_in_rules
                if (target := _TARGET.search(rule)) is not None and target.group(1) in theirs
            ]
        if not chains:
            return None
        return _IptablesLeftovers(variant, tool, label, chains, jumps)

    async def _save(self, command: str) -> dict[str, _Saved]:
        """Every table iptables-save prints (those that exist: it creates none)."""
        rc, out, err = await self._try(command)
        if rc is None:
            return {}
        if rc != 0:
            # A variant the kernel lacks (iptables-legacy without x_tables): nothing of it.
            log.debug("%s: %s", command, err.strip())
            return {}
        tables: dict[str, _Saved] = {}
        current = _Saved()
        for line in out.splitlines():
            if line.startswith("*"):
                current = tables.setdefault(line[1:].strip(), _Saved())
            elif line.startswith(":"):
                current.chains.add(line[1:].split()[0])
            elif line.startswith("-A "):
                chain, _, rule = line[3:].partition(" ")
                if chain in _BUILT_IN:
                    current.built_in_rules.append((chain, rule))
        return tables

    async def _ip_sets(self) -> list[str]:
        rc, out, err = await self._try("ipset", "list", "-n")
        if rc is None:
            # kube-proxy's cleanup skips ip sets without the ipset command, as kpng does.
            return []
        if rc != 0:
            log.debug("ipset list -n: %s", err.strip())
            return []
        return sorted(name for name in out.split() if name in IP_SETS)

    async def _has_ipvs_interface(self) -> bool:
        rc, out, _ = await self._try("ip", "-d", "-o", "link", "show", "dev", IPVS_INTERFACE)
        # Only a dummy interface is kube-proxy's (its cleanup deletes no other of that name).
        return rc == 0 and re.search(r"\sdummy\s", out) is not None

    async def _virtual_servers(self) -> list[str]:
        rc, out, _ = await self._try("cat", "/proc/net/ip_vs")
        if rc != 0:
            return []  # No IPVS in this kernel: no virtual server.
        return parse_virtual_servers(out)

    async def _restore(self, part: _IptablesLeftovers, table: str) -> None:
        text = part.restore_input(table)
        command = f"{part.tool}-{part.variant}-restore"
        rc, _, err = await self._checked(command, "--noflush", "-w", "5", stdin=text.encode())
        if rc != 0:
            raise KpngError(f"{command} refused to remove kube-proxy's {table} chains: {err}")

    async def _command(self, *argv: str) -> None:
        rc, _, err = await self._checked(*argv)
        if rc != 0:
            raise KpngError(f"{' '.join(argv)} failed: {err.strip()}")

    async def _checked(self, *argv: str, stdin: bytes = b"") -> tuple[int, str, str]:
        try:
            return await self._run([*self._prefix, *argv], stdin)
        except CommandError as exc:
            raise KpngError(f"cannot remove kube-proxy's leftovers: {exc}") from exc

    async def _try(self, *argv: str) -> tuple[int | None, str, str]:
        """Run a looking command: None for a tool not installed (nothing of it can be there)."""
        try:
            return await self._run([*self._prefix, *argv], b"")
        except CommandError as exc:
            log.debug("%s", exc)
            return None, "", ""


class _NftCommand:
    """nftables through the ``nft`` command (to-iptables and to-ebpf have no ``Nft`` of
    to-nft's): kube-proxy's nftables mode runs it, so a node without it has none of its tables
    (unless kube-proxy ran in a container, whose nft kpng cannot borrow)."""

    def __init__(self, run: Callable[..., Awaitable[tuple[int | None, str, str]]]) -> None:
        self._run = run

    async def list_tables(self) -> list[tuple[str, str]]:
        rc, out, err = await self._run("nft", "list", "tables")
        if rc is None:
            return []
        if rc != 0:
            raise KpngError(f"nft list tables failed: {err.strip()}")
        return [
            (words[1], words[2])
            for words in (line.split() for line in out.splitlines())
            if len(words) == 3 and words[0] == "table"
        ]

    async def delete_table(self, family: str, name: str) -> bool:
        rc, _, err = await self._run("nft", "delete", "table", family, name)
        if rc is None:
            return False
        if rc != 0:
            raise KpngError(f"nft delete table {family} {name} failed: {err.strip()}")
        return True


def _is_kube_proxys(table: str, chain: str) -> bool:
    return (
        chain in _IPTABLES_MODE_CHAINS.get(table, ())
        or chain in _IPVS_MODE_CHAINS.get(table, ())
        or (table == "nat" and chain.startswith(_IPTABLES_MODE_SERVICE_PREFIXES))
    )


def _is_kpngs(table: str, chain: str) -> bool:
    """Whether to-iptables' layout has ``chain`` (in a family where its mark is)."""
    return chain in SHARED_CHAINS.get(table, ()) or (
        table == "nat" and chain.startswith(SERVICE_CHAIN_PREFIXES)
    )


def parse_virtual_servers(listing: str) -> list[str]:
    """The virtual servers of ``/proc/net/ip_vs``, as ``TCP 10.96.0.1:443`` (IPv4 addresses and
    ports are in hexadecimal there; IPv6 ones are shown as the kernel writes them)."""
    servers = []
    for line in listing.splitlines():
        match line.split():
            case [("TCP" | "UDP" | "SCTP") as protocol, address, *_]:
                servers.append(f"{protocol} {_decode_endpoint(address)}")
            case ["FWM", mark, *_]:
                servers.append(f"FWM {int(mark, 16)}")
    return servers


def _decode_endpoint(address: str) -> str:
    host, _, port = address.rpartition(":")
    try:
        number = int(port, 16)
        if len(host) == 8 and not host.startswith("["):
            value = int(host, 16)
            host = ".".join(str((value >> shift) & 0xFF) for shift in (24, 16, 8, 0))
    except ValueError:
        return address
    return f"{host}:{number}"
