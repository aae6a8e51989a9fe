"""What a node holds in each shape: ``kpng local ... to-nft`` behind a brain against ``kpng file
... to-local ... to-nft`` in one process, on the same synthetic cluster (10,000 services x 10
endpoints by default), each in a network namespace of its own (root).

A node agent holds no global store and resolves nothing: only its node's state, as the brain
sends it. Reported per run: the node process's peak RSS (``ru_maxrss`` of that process alone)
and the wall time to its first programmed state (``--once``), with the brain's own peak RSS
beside the split's. The in-process baseline reads the same file, so that both read the same
store; ``kpng kube`` holds the same store plus its reflector's buffers.

    python bench/bench_split.py [--services 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import synthetic

KPNG = [sys.executable, "-m", "kpng"]
NODE = synthetic.node_name(0)
BACKEND = ["to-nft", "--once", "--no-health-check", "--nodeport-addresses", "primary"]


@contextmanager
def _netns() -> Iterator[str]:
    name = f"kpng-bench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _measured(argv: list[str], timeout: float = 600) -> tuple[float, float]:
    """Run ``argv`` to its end: (wall seconds, its peak RSS in MiB)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{' '.join(argv)}: no end within {timeout:g} s")
        time.sleep(0.02)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        error = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"{' '.join(argv)} failed: {error}")
    if proc.stderr:
        proc.stderr.close()
    return wall, usage.ru_maxrss / 1024


def in_process(cluster: Path) -> tuple[float, float]:
    with _netns() as ns:
        argv = ["ip", "netns", "exec", ns, *KPNG, "file", "--input", str(cluster), "to-local",
                "--node-name", NODE, *BACKEND]  # fmt: skip
        return _measured(argv)


def split(cluster: Path, workdir: Path) -> tuple[float, float, float]:
    """(node agent's wall seconds, its peak RSS, the brain's peak RSS so far), in MiB."""
    socket = workdir / f"brain-{secrets.token_hex(3)}.sock"
    brain = subprocess.Popen(
        [*KPNG, "file", "--input", str(cluster), "to-api", "--listen", f"unix://{socket}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not socket.exists():
            if brain.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the brain did not start")
            time.sleep(0.05)
        # A first watcher waits out the brain's own start: the node is timed against a brain
        # that has its state, as a node joining a running cluster finds it.
        warm = ["--connect-timeout", "300", "to-json", "--once", "--output", os.devnull]
        _measured([*KPNG, "local", "--api", f"unix://{socket}", "--node-name", NODE, *warm])
        with _netns() as ns:
            argv = ["ip", "netns", "exec", ns, *KPNG, "local", "--api", f"unix://{socket}",
                    "--node-name", NODE, "--connect-timeout", "300", *BACKEND]  # fmt: skip
            wall, rss = _measured(argv)
        status = Path(f"/proc/{brain.pid}/status").read_text()
        brain_kib = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
        )
        return wall, rss, brain_kib / 1024
    finally:
        brain.terminate()
        brain.wait(timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kpng-bench-split-") as tmp:
        workdir = Path(tmp)
        cluster = workdir / "cluster.json"
        synthetic.write(cluster, args.services)
        rows: dict[str, list[float]] = {k: [] for k in ("in_wall", "in_rss", "node_wall",
                                                         "node_rss", "brain_rss")}  # fmt: skip
        for run in range(args.runs):  # alternated, so that drift hits both alike
            wall, rss = in_process(cluster)
            rows["in_wall"].append(wall)
            rows["in_rss"].append(rss)
            node_wall, node_rss, brain_rss = split(cluster, workdir)
            rows["node_wall"].append(node_wall)
            rows["node_rss"].append(node_rss)
            rows["brain_rss"].append(brain_rss)
            print(
                f"run {run + 1}: in process {wall:.2f} s {rss:.0f} MiB; "
                f"kpng local {node_wall:.2f} s {node_rss:.0f} MiB (brain {brain_rss:.0f} MiB)"
            )
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{args.services} services x 10 endpoints, node {NODE}, median of {args.runs}:")
    print("| | in process (kpng file ... to-local ... to-nft) | kpng local ... to-nft | ratio |")
    print("|---|---|---|---|")
    print(f"| node peak RSS | {med['in_rss']:.0f} MiB | {med['node_rss']:.0f} MiB | "
          f"{med['node_rss'] / med['in_rss']:.2f}x |")  # fmt: skip
    print(f"| start to first programmed state | {med['in_wall']:.2f} s | {med['node_wall']:.2f} s"
          f" (brain already synced) | {med['node_wall'] / med['in_wall']:.2f}x |")  # fmt: skip
    print(f"| the brain's peak RSS | | {med['brain_rss']:.0f} MiB | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
