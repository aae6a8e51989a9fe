"""Running iptables: restore, list chains, keep the jumps in the built-in chains. Failures become
``IptablesError`` here, and nowhere else.

Debian ships two iptables: ``iptables-nft`` (rules in nftables, through the iptables API) and
``iptables-legacy`` (the x_tables kernel API). The rules a node's other software writes (the CNI
plugin, kubelet) are in one of them; kpng's must be in the same one, as packets see both and in
an order no one chooses. ``auto`` takes what ``iptables`` (Debian's alternative) is.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from kpng.backends._commands import CommandError, run_command
from kpng.backends._node import Fam
from kpng.backends.iptables.rules import (
    JUMPS,
    OWNER_CHAIN,
    SERVICE_CHAIN_PREFIXES,
    SHARED_CHAINS,
    TABLES,
    Jump,
)
from kpng.client import KpngError

log = logging.getLogger(__name__)

MODES = ("auto", "nft", "legacy")
LOCK_WAIT_S = 5
"""How long a command waits for the xtables lock (``-w``) that iptables-legacy's writers share."""
ROUTE_LOCALNET = "net.ipv4.conf.all.route_localnet"
"""Off, the kernel drops as martian what is routed out from 127.0.0.0/8: a node port reached at
127.0.0.1 and DNATed to a pod."""
_FAILED_LINE = re.compile(r"line:? (\d+) failed|Error occurred at line: (\d+)")


class IptablesError(KpngError):
    """iptables refused a restore or could not be run."""


@dataclass(frozen=True)
class Tools:
    """The commands of one iptables variant, per family."""

    variant: str
    """``nft`` or ``legacy``."""

    def command(self, fam: Fam, tool: str = "") -> str:
        name = "iptables" if fam == "v4" else "ip6tables"
        return f"{name}-{self.variant}{'-' + tool if tool else ''}"


def tools(mode: str) -> Tools:
    """The variant ``mode`` names; ``auto``: the one ``iptables --version`` says it is."""
    if mode != "auto":
        return Tools(mode)
    try:
        out = subprocess.run(
            ["iptables", "--version"], capture_output=True, text=True, check=False
        ).stdout
    except OSError as exc:
        raise IptablesError(f"cannot run iptables: {exc}") from exc
    return Tools("legacy" if "legacy" in out else "nft")


@dataclass(frozen=True)
class Saved:
    """One table as ``iptables-save`` prints it: its chains, and rules as (chain, rule)."""

    table: str
    chains: set[str]
    rules: set[tuple[str, str]]
    """The rules of the built-in chains only (where kpng's jumps are)."""
    counts: dict[str, int] = field(default_factory=dict)
    """How many rules each chain holds (a chain without rules is absent)."""


_BUILT_IN_RULES = tuple(
    f"-A {chain} " for chain in ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")
)


class Iptables:
    """iptables commands for kpng's chains, in both families."""

    def __init__(self, tools: Tools, *, prefix: Sequence[str] = ()) -> None:
        self.tools = tools
        self._prefix = list(prefix)
        """Put before every command (``ip netns exec NS`` in tests)."""

    def _command(self, fam: Fam, tool: str = "") -> list[str]:
        return [*self._prefix, self.tools.command(fam, tool)]

    async def restore(self, fam: Fam, text: str) -> None:
        """``iptables-restore --noflush`` of ``text``; the line it refused, in the error."""
        argv = [*self._command(fam, "restore"), "--noflush", "-w", str(LOCK_WAIT_S)]
        rc, _, err = await _run(argv, text.encode())
        if rc != 0:
            raise IptablesError(_explain(err, text, self.tools.command(fam, "restore")))

    async def save(self, fam: Fam, table: str) -> Saved:
        """The chains of ``table`` and its rules (``iptables-save``, as kube-proxy reads them).
        With iptables-legacy every command reads the whole table, some 0.8 s for a nat table of
        10k services: one save serves every question about a table."""
        out = await self.save_text(fam, table)
        chains: set[str] = set()
        rules: set[tuple[str, str]] = set()
        counts: dict[str, int] = {}
        for line in out.splitlines():
            if line.startswith(":"):
                chains.add(line[1:].split()[0])
            elif line.startswith("-A "):
                chain, _, rule = line[3:].partition(" ")
                counts[chain] = counts.get(chain, 0) + 1
                if line.startswith(_BUILT_IN_RULES):
                    rules.add((chain, rule))
        return Saved(table, chains, rules, counts)

    async def save_text(self, fam: Fam, table: str, *, counters: bool = False) -> str:
        """``iptables-save -t TABLE`` as it prints it; with ``counters``, each rule's packet
        and byte counters first (``-c``)."""
        argv = [*self._command(fam, "save"), *(["-c"] if counters else []), "-t", table]
        rc, out, err = await _run(argv)
        if rc != 0:
            command = self.tools.command(fam, "save")
            raise IptablesError(f"{command} -t {table} failed: {err.strip()}")
        return out

    async def list_counted(self, fam: Fam, table: str, chain: str) -> str:
        """The rules of one chain with their counters (``iptables -S CHAIN -v``): iptables-nft
        reads that chain alone, where ``iptables-save`` reads every rule of the family (1.4 s
        for a filter table of 1,000 lines beside a nat table of 40,000, 0.09 s so)."""
        argv = [*self._command(fam), "-w", str(LOCK_WAIT_S), "-t", table, "-S", chain, "-v"]
        rc, out, err = await _run(argv)
        if rc != 0:
            command = self.tools.command(fam)
            raise IptablesError(f"{command} -t {table} -S {chain} -v failed: {err.strip()}")
        return out

    async def ensure_route_localnet(self) -> bool:
        """Set ``ROUTE_LOCALNET`` (in the namespace the commands run in); True if it was off."""
        rc, out, err = await _run([*self._prefix, "sysctl", "-n", ROUTE_LOCALNET])
        if rc != 0:
            raise IptablesError(f"cannot read {ROUTE_LOCALNET}: {err.strip()}")
        if out.strip() == "1":
            return False
        rc, _, err = await _run([*self._prefix, "sysctl", "-qw", f"{ROUTE_LOCALNET}=1"])
        if rc != 0:
            raise IptablesError(f"cannot set {ROUTE_LOCALNET} to 1: {err.strip()}")
        return True

    async def chains(self, fam: Fam, table: str) -> set[str]:
        return (await self.save(fam, table)).chains

    async def missing_jumps(
        self, fam: Fam, nat: Saved | None = None, wanted: Sequence[Jump] = JUMPS
    ) -> set[Jump]:
        """Which of ``wanted`` are not in the built-in chains (from one save per table; ``nat``:
        a save of the nat table already made). A missing jump is kube-proxy's canary: another
        program flushed the built-in chains or deleted the KUBE- ones (a firewall reload,
        ``iptables -F -X``)."""
        missing = set()
        for table in sorted({t for t, _, _ in wanted}):
            saved = nat if nat is not None and table == nat.table else await self.save(fam, table)
            missing |= {(t, c, r) for t, c, r in wanted if t == table and (c, r) not in saved.rules}
        return missing

    async def remove(self, fam: Fam) -> bool:
        """Remove the jumps and every chain of kpng's layout; True if there were any. Chains
        of the same names without kpng's mark are kube-proxy's, and stay."""
        if OWNER_CHAIN not in await self.chains(fam, "nat"):
            return False
        base = [*self._command(fam), "-w", str(LOCK_WAIT_S)]
        for table, chain, rule in JUMPS:
            spec = shlex.split(rule)
            while (await _run([*base, "-t", table, "-D", chain, *spec]))[0] == 0:
                pass
        lines: list[str] = []
        for table in TABLES:
            present = await self.chains(fam, table)
            ours = sorted(
                c
                for c in present
                if c in SHARED_CHAINS[table] or c.startswith(SERVICE_CHAIN_PREFIXES)
            )
            lines += [f"*{table}", *(f":{c} - [0:0]" for c in ours), *(f"-X {c}" for c in ours)]
            lines.append("COMMIT")
        await self.restore(fam, "\n".join(lines) + "\n")
        return True


def _explain(stderr: str, text: str, command: str) -> str:
    message = stderr.strip() or f"{command} failed without a message"
    match = _FAILED_LINE.search(stderr)
    if match is not None:
        number = int(match.group(1) or match.group(2))
        lines = text.splitlines()
        if 0 < number <= len(lines):
            message += f" (line {number}: {lines[number - 1]})"
    return message


async def _run(argv: Sequence[str], stdin: bytes = b"") -> tuple[int, str, str]:
    try:
        return await run_command(argv, stdin)
    except CommandError as exc:
        raise IptablesError(str(exc)) from exc
