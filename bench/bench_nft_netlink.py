"""The floor's elements through nft's text parser against the same elements as netlink messages
built in Python (root; each run in a fresh network namespace, made here and removed at the end).

Issue 24 asks, before choosing how to get to-nft's first sync within 2x the floor, for both
ways to be measured: a far smaller text for ``nft -f``, or speaking netlink to nf_tables
directly for the bulk of the elements. ``bench_node_scale.py`` measures the text side (the
floor, and ``nft -f`` of kpng's own transaction). This measures the other side on the floor's
own work, S x 11 elements ``ipv4_addr . inet_proto . inet_service : goto pick`` in one verdict
map of a new table:

- **text**: ``nft -f`` of ``bench_node_scale.floor_text`` (what bench_node_scale calls the
  floor);
- **netlink**: ``python bench_nft_netlink.py load --elements N``, a process that builds one
  nfnetlink batch (the table, the chain, the map and every element, as nft itself sends it,
  in messages of at most 64 KiB of elements) and sends it on a netlink socket; the kernel
  commits it as one transaction. Each element is encoded from the strings a backend holds
  (address, protocol, port, chain), made before the clock starts as kpng's records are. It
  prints the seconds its Python spent encoding and the kernel's part (send to last
  acknowledgement) apart.

Both are whole processes timed from start to exit, with their peak RSS; each run ends by
checking, with ``nft list``, that the map holds every element (not timed).

This measured the approach before kpng had it; kpng's own encoder and sender are
``kpng.backends._nftables.netlink`` and ``executing.NetlinkBatches``. The loader here keeps a
small encoder of its own for this one map shape, so that its process imports nothing of kpng's
and its figures stay those of the approach alone.

    flock /tmp/kpng-bench.lock python bench/bench_nft_netlink.py [--sizes 10000,100000] [--runs 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NFT_MSG_NEWTABLE = 0
NFT_MSG_NEWCHAIN = 3
NFT_MSG_NEWSET = 9
NFT_MSG_NEWSETELEM = 12
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_CREATE = 0x400
NLMSG_ERROR = 0x2
NLA_F_NESTED = 0x8000
NFPROTO_IPV4 = 2
NFT_SET_MAP = 0x8
NFT_DATA_VERDICT = 0xFFFFFF00
NFT_GOTO = -4
# nft's datatype numbers, concatenated as nft does (6 bits a field): only `nft list` reads them.
TYPE_IPADDR, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE = 7, 12, 13
KEY_TYPE = (((TYPE_IPADDR << 6) | TYPE_INET_PROTOCOL) << 6) | TYPE_INET_SERVICE
MESSAGE_ELEMENTS_BYTES = 60_000
"""An element list is one attribute, whose length is 16 bits."""

TABLE, CHAIN, MAP = b"floor", b"pick", b"services"


def _attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nested(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(attrs))


def _string(kind: int, value: bytes) -> bytes:
    return _attr(kind, value + b"\0")


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value & 0xFFFFFFFF))


def _message(kind: int, flags: int, seq: int, family: int, body: bytes, res_id: int = 0) -> bytes:
    header = struct.pack("=IHHII", 16 + 4 + len(body), kind, flags, seq, 0)
    return header + struct.pack("=BBH", family, 0, socket.htons(res_id)) + body


def _nft(kind: int) -> int:
    return (NFNL_SUBSYS_NFTABLES << 8) | kind


def batch(elements: list[tuple[str, str, int, str]]) -> tuple[list[bytes], int]:
    """The whole transaction's messages (the table, the chain, the map and its ``elements``:
    address, protocol, port, goto chain), and how many of them the kernel acknowledges."""
    create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK
    seq = 0
    messages = [
        _message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0, b"", NFNL_SUBSYS_NFTABLES),
        _message(_nft(NFT_MSG_NEWTABLE), create, 1, NFPROTO_IPV4, _string(1, TABLE)),
        _message(
            _nft(NFT_MSG_NEWCHAIN),
            create,
            2,
            NFPROTO_IPV4,
            _string(1, TABLE) + _string(3, CHAIN),
        ),
        _message(
            _nft(NFT_MSG_NEWSET),
            create,
            3,
            NFPROTO_IPV4,
            _string(1, TABLE)
            + _string(2, MAP)
            + _u32(3, NFT_SET_MAP)
            + _u32(4, KEY_TYPE)
            + _u32(5, 12)
            + _u32(6, NFT_DATA_VERDICT)
            + _u32(10, 1),
        ),
    ]
    seq = 4
    key_head = struct.pack("=HH", 4 + 4 + 12, 1 | NLA_F_NESTED) + struct.pack("=HH", 4 + 12, 1)
    # Each element is encoded from the strings a backend holds (address, protocol, port, the
    # chain of its goto), as kpng's records hold them; only a goto's bytes are kept per chain.
    pack_key = struct.Struct(">4sB3xH2x").pack
    protocols = {"tcp": 6, "udp": 17, "sctp": 132}
    gotos: dict[str, bytes] = {}
    encoded: list[bytes] = []
    for address, protocol, port, chain in elements:
        data = gotos.get(chain)
        if data is None:
            data = gotos[chain] = _nested(
                2, _nested(2, _u32(1, NFT_GOTO), _string(2, chain.encode()))
            )
        key = pack_key(socket.inet_aton(address), protocols[protocol], port)
        encoded.append(
            struct.pack("=HH", 4 + 20 + len(data), 1 | NLA_F_NESTED) + key_head + key + data
        )
    list_head = _string(1, TABLE) + _string(2, MAP)
    start = 0
    while start < len(encoded):
        size, end = 0, start
        while end < len(encoded) and size + len(encoded[end]) <= MESSAGE_ELEMENTS_BYTES:
            size += len(encoded[end])
            end += 1
        body = list_head + struct.pack("=HH", 4 + size, 3 | NLA_F_NESTED)
        body += b"".join(encoded[start:end])
        messages.append(_message(_nft(NFT_MSG_NEWSETELEM), create, seq, NFPROTO_IPV4, body))
        seq += 1
        start = end
    messages.append(_message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq, 0, b"", NFNL_SUBSYS_NFTABLES))
    return messages, len(messages) - 2


def send(messages: list[bytes], acks: int) -> None:
    """One sendmsg of the batch (the kernel commits it before returning), then its answers."""
    size = sum(len(m) for m in messages)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        # The batch travels as one message: the send buffer must hold it (root may force it).
        sock.setsockopt(socket.SOL_SOCKET, 32, size + 65536)  # SO_SNDBUFFORCE
        sock.setsockopt(socket.SOL_SOCKET, 33, 4 << 20)  # SO_RCVBUFFORCE, for the acks
        sock.bind((0, 0))
        sent = sock.sendmsg(messages)
        if sent != size:
            raise SystemExit(f"netlink took {sent} of {size} bytes")
        seen = 0
        while seen < acks:
            reply = sock.recv(1 << 20)
            offset = 0
            while offset < len(reply):
                length, kind = struct.unpack_from("=IH", reply, offset)
                if kind == NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", reply, offset + 16)
                    if error != 0:
                        (seq,) = struct.unpack_from("=I", reply, offset + 20 + 8)
                        raise SystemExit(
                            f"nf_tables refused the batch's message {seq}: errno {-error}"
                        )
                    seen += 1
                offset += (length + 3) & ~3


def floor_elements(count: int) -> list[tuple[str, str, int, str]]:
    """``bench_node_scale.floor_text``'s elements, as a backend's records would hold them."""
    return [
        (f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}", "tcp", 80, CHAIN.decode())
        for i in range(count)
    ]


def load(count: int) -> None:
    elements = floor_elements(count)
    started = time.perf_counter()
    messages, acks = batch(elements)
    built = time.perf_counter()
    send(messages, acks)
    done = time.perf_counter()
    size = sum(len(m) for m in messages)
    print(
        f"built {len(messages)} messages, {size / 1e6:.1f} MB, in {built - started:.3f} s; "
        f"the kernel's part {done - built:.3f} s",
        file=sys.stderr,
    )


def _run_checked(ns: str, argv: list[str], count: int) -> tuple[float, float]:
    """``argv``'s wall seconds and peak RSS (MiB); then the map must hold ``count`` elements."""
    from bench_split import measured_usage

    wall, peak, _ = measured_usage(["ip", "netns", "exec", ns, *argv], timeout=1800)
    listed = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "list", "map", "ip", "floor", "services"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = listed.count("goto pick")
    if found != count:
        raise SystemExit(f"{argv[0]}: the map holds {found} elements, not {count}")
    return wall, peak


def _loader_figures(argv: list[str], runs: int, count: int) -> tuple[list[float], float, str]:
    from bench_split import _netns

    walls, peaks = [], []
    for _ in range(runs):
        with _netns() as ns:
            wall, peak = _run_checked(ns, argv, count)
        walls.append(wall)
        peaks.append(peak)
    line = (
        f"median {statistics.median(walls):.2f} s (runs: "
        f"{', '.join(f'{w:.2f}' for w in walls)}), peak RSS {max(peaks):.0f} MiB"
    )
    return walls, max(peaks), line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    loader = sub.add_parser("load", help="(in a namespace) send the batch of N elements")
    loader.add_argument("--elements", type=int, required=True)
    parser.add_argument("--sizes", default="10000,100000", help="services; 11 elements each")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "load":
        load(args.elements)
        return 0
    # Here, not at the top: the loader's own process imports nothing of kpng's.
    from bench_node_scale import ENDPOINTS, floor_text
    from bench_split import _netns

    print(f"nft: {subprocess.run(['nft', '--version'], capture_output=True, text=True).stdout}")
    with tempfile.TemporaryDirectory(prefix="kpng-netlink-") as workdir:
        for services in (int(s) for s in args.sizes.split(",")):
            count = services * (ENDPOINTS + 1)
            text = Path(workdir) / f"floor-{services}.nft"
            text.write_text(floor_text(services))
            nft_walls, _, nft_line = _loader_figures(["nft", "-f", str(text)], args.runs, count)
            ours = [sys.executable, __file__, "load", "--elements", str(count)]
            with _netns() as ns:
                detail = subprocess.run(
                    ["ip", "netns", "exec", ns, *ours], capture_output=True, text=True, check=True
                ).stderr.strip()
            nl_walls, _, nl_line = _loader_figures(ours, args.runs, count)
            ratio = statistics.median(nl_walls) / statistics.median(nft_walls)
            print(f"{services} services, {count} elements")
            print(f"  text, nft -f:            {nft_line}")
            print(f"  netlink, from Python:    {nl_line}; {ratio:.2f}x the text")
            print(f"    one run's split: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
