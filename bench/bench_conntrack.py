"""One UDP conntrack clean-up on a busy node: over ctnetlink (kpng now) against the conntrack
tool (kpng before, if ``conntrack`` is installed). Root; a network namespace of its own,
removed at the end.

The node's table holds ``--unrelated`` UDP flows that go to no service (100,000 by default)
and ``--stale`` flows (1,000) to a UDP service whose endpoint left: DNATed to 10.244.1.2,
while only 10.244.1.3 serves now. ``--services`` UDP services are frontends (the one of the
stale flows among them). The flows are made over ctnetlink (IPCTNL_MSG_CT_NEW, thousands a
second), not by packets; the stale ones again before each run.

Each run times one whole clean-up, wall and CPU (this process's, its threads' and its
children's, user and system: the kernel's work for a dump is system time of the process that
reads it), and checks that exactly the stale flows went:

- **netlink, full**: ``Conntrack.clean_stale`` of every frontend, as after a full sync: one dump
  per family restricted to UDP in the kernel, and a delete per stale flow;
- **netlink, one service**: ``clean_stale`` of the changed service's frontend only, as after an
  incremental sync: a dump filtered to that frontend in the kernel;
- **tool** (before): ``conntrack -L -p udp -f FAMILY`` for each family, its text parsed, and a
  ``conntrack -D`` with kube-proxy's filters per distinct (frontend, endpoint) of the stale
  flows; what ``_conntrack.py`` did until it spoke ctnetlink.

    flock /tmp/kpng-bench.lock python bench/bench_conntrack.py [--unrelated 100000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence

from kpng.backends._conntrack import Conntrack, Frontends, Reconciled
from kpng.backends._ctnetlink import CtSocket, new

SERVICE, PORT = "10.96.0.10", 53
GONE, STAYS = "10.244.1.2", "10.244.1.3"
CLIENT = "10.0.0.1"


def _cpu() -> float:
    """CPU seconds, user and system, of this process (all threads) and its waited children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _frontends(services: int) -> Frontends:
    frontends: dict[tuple[str, str], frozenset[tuple[str, str]]] = {
        (SERVICE, str(PORT)): frozenset({(STAYS, "5353")})
    }
    for i in range(1, services):
        frontends[(f"10.96.{1 + i // 250}.{i % 250 + 1}", "53")] = frozenset(
            {(f"10.244.2.{i % 250 + 1}", "5353")}
        )
    return frontends


def _make(sock: CtSocket, requests: Sequence[bytes]) -> None:
    refused = sock.send(requests)
    if refused:
        raise SystemExit(f"{len(refused)} flows not made: {os.strerror(refused[0])}")


def _unrelated(count: int) -> list[bytes]:
    """Flows between pods and to the outside, none to a service address."""
    return [
        new(socket.AF_INET, f"10.1.{i >> 8 & 255}.{i & 255}", "10.2.0.1", 1024 + (i >> 16), 9999)
        for i in range(count)
    ]


def _stale(count: int) -> list[bytes]:
    return [new(socket.AF_INET, CLIENT, SERVICE, 10000 + i, PORT, GONE, 5353) for i in range(count)]


def _count(sock: CtSocket) -> tuple[int, int]:
    """(flows to the gone endpoint, every other UDP flow) of the namespace."""
    flows = sock.flows(socket.AF_INET)
    stale = sum(1 for f in flows if f.reply_src == GONE)
    return stale, len(flows) - stale


def _netlink(netns: str, frontends: Frontends, only: Iterable[tuple[str, str]] | None) -> int:
    reconciled: dict[str, Reconciled] = {}
    asyncio.run(Conntrack(netns, reconciled).clean_stale(frontends, only))
    return sum(r.deleted for r in reconciled.values())


def _enter(netns: str) -> Callable[[], None]:
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(netns) as there:
            if libc.setns(there.fileno(), 0x40000000) != 0:
                raise OSError(ctypes.get_errno(), "setns")

    return enter


def _tool(netns: str, frontends: Frontends, only: Iterable[tuple[str, str]] | None) -> int:
    """The clean-up as kpng ran it with the conntrack tool: list each family, parse the text,
    one ``-D`` per distinct (frontend, endpoint), its count read from what it says."""
    del only  # it listed every flow whatever the sync touched
    deleted = 0
    for family in ("ipv4", "ipv6"):
        listing = subprocess.run(
            ["conntrack", "-L", "-p", "udp", "-f", family],
            capture_output=True,
            text=True,
            preexec_fn=_enter(netns),
            check=False,
        ).stdout
        filters: set[tuple[str, ...]] = set()
        for line in listing.splitlines():
            values: dict[str, list[str]] = {}
            for item in line.split():
                name, eq, value = item.partition("=")
                if eq:
                    values.setdefault(name, []).append(value)
            try:
                dst, dport = values["dst"][0], values["dport"][0]
                reply, reply_port = values["src"][1], values["sport"][1]
            except (KeyError, IndexError):
                continue
            serving = frontends.get((dst, dport))
            if serving is not None and (reply, reply_port) not in serving:
                orig = ("--orig-dst", dst, "--orig-port-dst", dport)
                filters.add((*orig, "--reply-src", reply, "--reply-port-src", reply_port))
        for f in sorted(filters):
            said = subprocess.run(
                ["conntrack", "-D", "-f", family, "-p", "udp", *f],
                capture_output=True,
                text=True,
                preexec_fn=_enter(netns),
                check=False,
            ).stderr
            words = said.split()
            if "flow" in words:
                deleted += int(words[words.index("flow") - 1])
    return deleted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unrelated", type=int, default=100_000)
    parser.add_argument("--stale", type=int, default=1_000)
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root: a network namespace and its conntrack table")
    name = f"kpng-bench-ct-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    netns = f"/run/netns/{name}"
    try:
        frontends = _frontends(args.services)
        ways: dict[str, Callable[[], int]] = {
            "netlink, full": lambda: _netlink(netns, frontends, None),
            "netlink, one service": lambda: _netlink(netns, frontends, [(SERVICE, str(PORT))]),
        }
        if shutil.which("conntrack"):
            ways["tool (before)"] = lambda: _tool(netns, frontends, None)
        else:
            print("conntrack is not installed: the tool's figures are left out")
        with CtSocket(netns) as sock:
            start = time.perf_counter()
            _make(sock, _unrelated(args.unrelated))
            print(f"{args.unrelated} unrelated flows made in {time.perf_counter() - start:.2f} s")
            stale = _stale(args.stale)
            print(f"{'clean-up':<22} {'wall s':>8} {'CPU s':>8} {'deleted':>8}")
            for way, run in ways.items():
                walls, cpus = [], []
                for _ in range(args.runs):
                    _make(sock, stale)
                    assert _count(sock) == (args.stale, args.unrelated)
                    wall, cpu = time.perf_counter(), _cpu()
                    deleted = run()
                    walls.append(time.perf_counter() - wall)
                    cpus.append(_cpu() - cpu)
                    left = _count(sock)
                    if left != (0, args.unrelated) or deleted != args.stale:
                        raise SystemExit(f"{way}: deleted {deleted}, left {left}")
                wall_s, cpu_s = statistics.median(walls), statistics.median(cpus)
                print(f"{way:<22} {wall_s:>8.3f} {cpu_s:>8.3f} {args.stale:>8}")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
