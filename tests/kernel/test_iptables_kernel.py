"""to-iptables against the kernel, in fresh network namespaces, with both iptables variants:
partial syncs touch only what changed, a restart's full sync removes what went meanwhile, other
software's rules stay, and cleanup removes kpng's chains and nothing else. (Packets: the
conformance suite, tests/kernel/test_conformance_iptables_*.py.)"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from typing import Any

import pytest

from kpng.backends._node import Options
from kpng.backends.iptables import IptablesBackend, cleanup
from kpng.backends.iptables.executing import Iptables, Tools
from kpng.backends.iptables.rules import chain_name
from kpng.feeding import SyncStats
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states

pytestmark = pytest.mark.skipif(
    shutil.which("iptables-nft-restore") is None, reason="needs iptables"
)

VARIANTS = ["nft", "legacy"]


def _save(netns: str, variant: str, *table: str) -> str:
    argv = [
        "ip",
        "netns",
        "exec",
        netns,
        f"iptables-{variant}-save",
        *(("-t", *table) if table else ()),
    ]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def _nat(netns: str, variant: str, *args: str) -> None:
    """Another program's edit of the nat table."""
    argv = ["ip", "netns", "exec", netns, f"iptables-{variant}", "-w", "5", "-t", "nat", *args]
    subprocess.run(argv, check=True)


def _chains(netns: str, variant: str) -> set[str]:
    return set(re.findall(r"^:(\S+)", _save(netns, variant), re.MULTILINE))


def _backend(netns: str, variant: str, **kwargs: Any) -> IptablesBackend:
    """to-iptables in ``netns``, with ``kwargs`` for its constructor (the families, periods...)."""
    iptables = Iptables(Tools(variant), prefix=("ip", "netns", "exec", netns))
    options = Options(cluster_cidrs=("10.244.0.0/16",))
    return IptablesBackend(iptables=iptables, options=options, **kwargs)


def _web(*addresses: str) -> ServiceEndpoints:
    return ServiceEndpoints(states.service("web"), tuple(states.endpoint(a) for a in addresses))


def _sep(address: str) -> str:
    return chain_name("KUBE-SEP-", "ns/web:http", "tcp", f"{address}:8080")


@pytest.mark.parametrize("variant", VARIANTS)
def test_syncs_restart_and_cleanup_keep_to_kpngs_own_chains(netns: str, variant: str) -> None:
    foreign = ["ip", "netns", "exec", netns, f"iptables-{variant}", "-t", "nat"]
    subprocess.run([*foreign, "-N", "CNI-TEST"], check=True)
    subprocess.run([*foreign, "-A", "PREROUTING", "-j", "CNI-TEST"], check=True)
    db = states.entry("db", ["10.244.3.3"])

    async def scenario() -> None:
        backend = _backend(netns, variant)
        services = {"web": _web("10.244.1.2", "10.244.2.2"), "db": db}
        await backend.apply(states.state(1, services))
        chains = _chains(netns, variant)
        assert {_sep("10.244.1.2"), _sep("10.244.2.2"), "KPNG-IPTABLES"} <= chains
        assert "-A PREROUTING -m comment --comment" in _save(netns, variant)

        services["web"] = _web("10.244.1.2")
        await backend.apply(states.state(2, services, updated=["web"]))
        chains = _chains(netns, variant)
        assert _sep("10.244.2.2") not in chains
        assert _sep("10.244.1.2") in chains

        # Gone while kpng was down: the next kpng's full sync removes its chains.
        await backend.close()
        restarted = _backend(netns, variant)
        await restarted.apply(states.state(3, {"db": db}))
        # The jumps it found in place are not inserted twice.
        portal = '-A PREROUTING -m comment --comment "kubernetes service portals"'
        assert _save(netns, variant).count(portal) == 1
        assert not any(c.startswith("KUBE-SEP-") and c != db_sep for c in _chains(netns, variant))
        assert await cleanup(prefix=("ip", "netns", "exec", netns))

    db_sep = chain_name("KUBE-SEP-", "ns/db:http", "tcp", "10.244.3.3:8080")
    asyncio.run(scenario())
    left = _chains(netns, variant)
    assert not [c for c in left if c.startswith(("KUBE-", "KPNG-"))]
    assert "CNI-TEST" in left
    assert "-A PREROUTING -j CNI-TEST" in _save(netns, variant)


def test_cleanup_leaves_kube_proxys_chains_of_the_same_names(netns: str) -> None:
    cmd = ["ip", "netns", "exec", netns, "iptables-nft", "-t", "nat"]
    subprocess.run([*cmd, "-N", "KUBE-SERVICES"], check=True)
    subprocess.run([*cmd, "-A", "PREROUTING", "-j", "KUBE-SERVICES"], check=True)
    assert not asyncio.run(cleanup(prefix=("ip", "netns", "exec", netns)))
    assert "KUBE-SERVICES" in _chains(netns, "nft")


def test_a_refused_restore_changes_nothing_and_fails_apply(netns: str) -> None:
    async def scenario() -> None:
        backend = _backend(netns, "nft")
        await backend.apply(states.state(1, {"web": _web("10.244.1.2")}))
        before = _save(netns, "nft")
        # A port iptables cannot express: the restore is refused as a whole.
        bad = states.service("bad", index=7, protocol="TCP", port=80)
        bad_se = ServiceEndpoints(bad, (states.endpoint("10.244.9.9", port=99999),))
        with pytest.raises(Exception, match="refused"):
            await backend.apply(
                states.state(2, {"web": _web("10.244.1.2"), "bad": bad_se}, updated=["bad"])
            )
        assert _strip_counters(_save(netns, "nft")) == _strip_counters(before)

    asyncio.run(scenario())


def _strip_counters(saved: str) -> str:
    return "\n".join(line for line in saved.splitlines() if not line.startswith("#"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_rules_another_program_flushes_are_rewritten_within_a_sync_period(
    netns: str, variant: str
) -> None:
    """kube-proxy's canary: `iptables -t nat -F; -X` (a firewall reload) takes kpng's jumps and
    chains; the next check finds a jump gone and rewrites every rule from the last state."""

    async def scenario() -> None:
        backend = _backend(netns, variant, families=("v4",), sync_period=0.2)
        try:
            await backend.apply(states.state(1, {"web": _web("10.244.1.2")}))
            written = _strip_counters(_save(netns, variant))
            _nat(netns, variant, "-F")
            _nat(netns, variant, "-X")
            assert _sep("10.244.1.2") not in _chains(netns, variant)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if _strip_counters(_save(netns, variant)) == written:
                    break
            assert _strip_counters(_save(netns, variant)) == written
        finally:
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("edit", "kind"),
    [(("-F", "KUBE-SERVICES"), "rules"), (("-I", "KUBE-SERVICES", "1", "-j", "RETURN"), "rules")],
    ids=["chain-flushed", "foreign-rule"],
)
def test_a_chain_of_kpngs_flushed_or_given_a_foreign_rule_is_rewritten_within_a_sync_period(
    netns: str, edit: tuple[str, ...], kind: str
) -> None:
    """The jumps stay, so kube-proxy's canary sees nothing: the rules each of kpng's chains
    holds, counted from the same iptables-save, do."""

    async def scenario() -> None:
        syncs = SyncStats()
        backend = _backend(netns, "nft", families=("v4",), sync_period=0.1, syncs=syncs)
        try:
            await backend.apply(states.state(1, {"web": _web("10.244.1.2")}))
            written = _strip_counters(_save(netns, "nft"))
            _nat(netns, "nft", *edit)
            assert _strip_counters(_save(netns, "nft")) != written
            for _ in range(50):
                await asyncio.sleep(0.1)
                if syncs.repairs:
                    break
            assert syncs.repairs == {kind: 1}
            assert _strip_counters(_save(netns, "nft")) == written
        finally:
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("full_sync_period", [0.5, 3600.0], ids=["periodic-full", "none-due"])
def test_an_edit_no_check_sees_lasts_until_the_periodic_full_sync(
    netns: str, full_sync_period: float
) -> None:
    """A rule replaced in place leaves the jumps and every chain's count: only kube-proxy's
    hourly full resync (here made short) repairs it."""

    async def scenario() -> bool:
        backend = _backend(
            netns, "nft", families=("v4",), sync_period=0.1, full_sync_period=full_sync_period
        )
        try:
            await backend.apply(states.state(1, {"web": _web("10.244.1.2")}))
            _nat(netns, "nft", "-R", "KUBE-SERVICES", "1", "-j", "RETURN")
            assert "-A KUBE-SERVICES -j RETURN" in _save(netns, "nft", "nat")
            for _ in range(30):
                await asyncio.sleep(0.1)
                if "-A KUBE-SERVICES -j RETURN" not in _save(netns, "nft", "nat"):
                    return True
            return False
        finally:
            await backend.close()

    assert asyncio.run(scenario()) is (full_sync_period < 1)
