"""The UDP conntrack clean-up against a kernel: real flows, made by packets through a DNAT in a
network namespace of the test's own, and read back over ctnetlink after the clean-up."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest

from kpng.backends import _conntrack, _ctnetlink
from kpng.backends._conntrack import Conntrack, Frontends, Reconciled
from kpng.backends._netlink import NLM_F_DUMP, messages, nested_attributes

GONE, STAYS = "10.244.1.2", "10.244.1.3"
GONE6, STAYS6 = "fd00:244::2", "fd00:244::3"
SETUP = [
    "link add d0 type veth peer name d1",
    "link set d0 up",
    "link set d1 up",
    f"addr add {GONE}/32 dev d0",
    f"addr add {STAYS}/32 dev d0",
    f"addr add {GONE6}/128 dev d0 nodad",
    f"addr add {STAYS6}/128 dev d0 nodad",
    # A route to the service addresses: a local packet is routed before its DNAT.
    "route add 10.96.0.0/16 dev d0",
    "route add fd00:96::/64 dev d0",
]


def _dnat(to4: str, to6: str) -> str:
    return f"""
        flush ruleset
        table inet t {{
            chain out {{
                type nat hook output priority -100;
                ip daddr 10.96.0.10 meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {to4}:5353
                ip6 daddr fd00:96::10 udp dport 53 dnat ip6 to [{to6}]:5353
                udp dport 30053 dnat ip to {to4}:5353
            }}
        }}
    """


SEND = """
import socket, sys
for family, tcp, address, port, source in eval(sys.argv[1]):
    any_address = "::" if family == socket.AF_INET6 else "0.0.0.0"
    s = socket.socket(family, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
    s.bind((any_address, source))
    if tcp:
        # Answered and closed in order, the flow stays listed (TIME_WAIT) for minutes: an
        # unanswered one is reset, and gone, at once.
        listener = socket.create_server((any_address, 5353), family=family)
        s.connect((address, port))
        accepted, _ = listener.accept()
        s.close()
        accepted.close()
        listener.close()
    else:
        s.sendto(b"x", (address, port))
        s.close()
"""


def _in(netns: str, *argv: str, stdin: str | None = None) -> None:
    subprocess.run(["ip", "netns", "exec", netns, *argv], input=stdin, text=True, check=True)


def _send(netns: str, *packets: tuple[int, bool, str, int, int]) -> None:
    _in(netns, sys.executable, "-c", SEND, repr(list(packets)))


V4, V6 = int(socket.AF_INET), int(socket.AF_INET6)
FRONTENDS: Frontends = {
    ("10.96.0.10", "53"): frozenset({(STAYS, "5353")}),
    ("fd00:96::10", "53"): frozenset({(STAYS6, "5353")}),
    ("", "30053"): frozenset({(STAYS, "5353")}),
}
# (original destination, port, reply source, port, client's source port) of each UDP flow.
STALE = {
    ("10.96.0.10", "53", GONE, "5353", "40001"),
    (STAYS, "30053", GONE, "5353", "40006"),  # through the node port, on any local address
}
STALE6 = {("fd00:96::10", "53", GONE6, "5353", "40005")}
KEPT = {
    ("10.96.0.10", "53", STAYS, "5353", "40002"),  # DNATed after the endpoint moved
    (STAYS, "5353", STAYS, "5353", "40003"),  # to the endpoint itself, not through the service
    ("10.96.0.10", "54", "10.96.0.10", "54", "40004"),  # another port of the service address
}


def _flows(netns: str, family: int) -> set[tuple[str, ...]]:
    with _ctnetlink.CtSocket(f"/run/netns/{netns}") as sock:
        return {(*flow[:4], flow.orig_sport) for flow in sock.flows(family)}


def _tcp_flows(netns: str) -> int:
    """Every flow of the namespace, any protocol: counted with a dump that filters nothing."""
    request = _ctnetlink._message(_ctnetlink.IPCTNL_MSG_CT_GET, 0, b"", NLM_F_DUMP)
    with _ctnetlink.CtSocket(f"/run/netns/{netns}") as sock:
        answer = b"".join(sock.dump(request))
    tcp = [m for m in _messages(answer) if _protocol(m) == socket.IPPROTO_TCP]
    return len(tcp)


def _messages(data: bytes) -> list[bytes]:
    return [message for _, message in messages(data)]


def _protocol(message: bytes) -> int:
    orig = dict(nested_attributes(message[20:]))[_ctnetlink.CTA_TUPLE_ORIG]
    return _ctnetlink._tuple_of(orig, 0, len(orig))[2]


@pytest.mark.parametrize("few", [0, 8], ids=["one-dump-per-family", "a-dump-per-frontend"])
def test_exactly_the_udp_flows_to_an_endpoint_gone_are_deleted(
    netns: str, few: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_conntrack, "FEW_FRONTENDS", few)
    _in(netns, "ip", "-batch", "-", stdin="\n".join(SETUP) + "\n")
    _in(netns, "nft", "-f", "-", stdin=_dnat(GONE, GONE6))
    _send(
        netns,
        (V4, False, "10.96.0.10", 53, 40001),
        (V4, True, "10.96.0.10", 53, 40010),
        (V6, False, "fd00:96::10", 53, 40005),
        (V4, False, STAYS, 30053, 40006),
    )
    _in(netns, "nft", "-f", "-", stdin=_dnat(STAYS, STAYS6))  # the endpoint leaves
    _send(
        netns,
        (V4, False, "10.96.0.10", 53, 40002),
        (V4, False, STAYS, 5353, 40003),
        (V4, False, "10.96.0.10", 54, 40004),
    )
    assert _flows(netns, V4) == STALE | KEPT
    assert _flows(netns, V6) == STALE6
    assert _tcp_flows(netns) == 1

    reconciled: dict[str, Reconciled] = {}
    conntrack = Conntrack(f"/run/netns/{netns}", reconciled)
    asyncio.run(conntrack.clean_stale(FRONTENDS))

    assert _flows(netns, V4) == KEPT
    assert _flows(netns, V6) == set()
    assert _tcp_flows(netns) == 1  # DNATed to the endpoint gone too, but TCP
    assert {family: r.deleted for family, r in reconciled.items()} == {"IPv4": 2, "IPv6": 1}
    # Again: nothing left to delete, and each family is timed once more.
    asyncio.run(conntrack.clean_stale(FRONTENDS))
    assert {family: (r.count, r.deleted) for family, r in reconciled.items()} == {
        "IPv4": (2, 2),
        "IPv6": (2, 1),
    }


def test_the_kernel_lists_only_udp_of_the_family_asked_for(netns: str) -> None:
    """CTA_FILTER and the family are applied in the kernel: a TCP flow and another family's
    never reach kpng (``parse`` would drop them, so the answer's messages are counted)."""
    _in(netns, "ip", "-batch", "-", stdin="\n".join(SETUP) + "\n")
    _in(netns, "nft", "-f", "-", stdin=_dnat(GONE, GONE6))  # conntrack starts with a user
    _send(
        netns,
        (V4, False, STAYS, 5353, 40001),
        (V4, True, STAYS, 5353, 40002),
        (V6, False, STAYS6, 5353, 40003),
    )
    with _ctnetlink.CtSocket(f"/run/netns/{netns}") as sock:
        for family in (V4, V6):
            answer = b"".join(sock.dump(_ctnetlink.dump_udp(family)))
            found = _messages(answer)
            assert [_protocol(m) for m in found] == [socket.IPPROTO_UDP]
            assert [m[16] for m in found] == [family]


def test_without_a_kernel_that_lists_flows_nothing_is_reconciled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A namespace path that is not one: the clean-up logs and skips, as with a refusal."""
    reconciled: dict[str, Reconciled] = {}
    run: Callable[[], None] = lambda: asyncio.run(  # noqa: E731
        Conntrack("/nonexistent/netns", reconciled).clean_stale(FRONTENDS)
    )
    run()
    assert reconciled == {}
    assert "cannot list the IPv4 UDP flows" in caplog.text
