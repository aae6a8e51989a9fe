"""The whole kpng process on one node against the nftables floor, at 10,000 and 100,000 services
(root; each kernel figure in a network namespace of its own, made here and removed at the end).

For each size S (services x 10 endpoints, ``synthetic.py``'s cluster):

- **the floor**: ``nft -f`` loading S x 11 elements into one named verdict map keyed
  ``ipv4_addr . inet_proto . inet_service`` (batched as to-nft batches them), in a fresh
  namespace: what any program feeding nftables through its text parser pays at least;
- **kpng**: ``kpng file --input F to-local --node-name node-000 to-nft --once`` from process
  start to exit, wall time and peak RSS (``ru_maxrss``, forked from a small launcher: see
  ``bench_split.measured_usage``), the median of ``--runs``
  (``--large-runs`` above 10,000 services); and, to split that, the same with ``--dry-run``
  (everything but nftables: parse, resolve, contribute, render, write the text) and ``nft -f`` of
  the transaction that dry run printed (nft's text parser and the kernel's commit);
- **to-ebpf** at the largest size (``--ebpf-sizes``): the same command with ``to-ebpf`` on a
  cgroup2 directory and a bpffs made here (the BPF object compiled beforehand, as an image ships
  it), so the programs see only this benchmark's sockets.

Then the ratios to the floor and the issue's targets (met or MISSED, never an error): the whole
process within 2x the floor at each size, and at most 2 GiB peak RSS at 100,000.

Last, Python's start-up: ``kpng --version`` (the interpreter, kpng's CLI, its argument parsing),
and ``python -X importtime`` of building the node agent's pipelines (``kpng local ... to-nft``,
``kpng file ... to-local ... to-nft``), with the modules that cost the most.

    flock /tmp/kpng-bench.lock python bench/bench_node_scale.py [--sizes 10000,100000]
        [--runs 3] [--large-runs 1] [--ebpf-sizes 100000] [--clusters DIR]
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import synthetic
from bench_nft import _ip
from bench_split import KPNG, NODE, _netns, compiled_as_installed, measured_usage

from kpng.backends._nftables.nftables import ELEMENTS_PER_LINE

ENDPOINTS = 10
GIB = 1024.0  # MiB
TIMEOUT_S = 1800.0
"""Per process: 100k services took 65 s before this benchmark existed."""


def floor_text(services: int) -> str:
    """S x (endpoints + 1) elements into one verdict map, in to-nft's batches."""
    count = services * (ENDPOINTS + 1)
    out = [
        "add table ip floor",
        "add chain ip floor pick",
        "add map ip floor services { type ipv4_addr . inet_proto . inet_service : verdict ; }",
    ]
    for start in range(0, count, ELEMENTS_PER_LINE):
        items = ", ".join(
            f"{_ip(10, i)} . tcp . 80 : goto pick"
            for i in range(start, min(count, start + ELEMENTS_PER_LINE))
        )
        out.append(f"add element ip floor services {{ {items} }}")
    return "\n".join(out) + "\n"


@dataclass
class Figures:
    """Seconds and peak MiB of the runs of one command, and the CPU seconds of its median run
    in user space and in the kernel."""

    walls: list[float]
    peaks: list[float]
    cpu: dict[float, tuple[float, float]]

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def peak(self) -> float:
        return max(self.peaks)

    @property
    def user_sys(self) -> tuple[float, float]:
        return self.cpu[min(self.cpu, key=lambda wall: abs(wall - self.wall))]

    def line(self) -> str:
        each = ", ".join(f"{w:.2f}" for w in self.walls)
        user, kernel = self.user_sys
        return (
            f"median {self.wall:.2f} s (runs: {each}; CPU user {user:.2f} s, kernel "
            f"{kernel:.2f} s), peak RSS {self.peak:.0f} MiB ({self.peak / GIB:.2f} GiB)"
        )


def _in_netns(argv: Sequence[str], runs: int) -> Figures:
    """``argv`` run ``runs`` times, each in a fresh namespace."""
    figures = Figures([], [], {})
    for _ in range(runs):
        with _netns() as ns:
            wall, peak, usage = measured_usage(
                ["ip", "netns", "exec", ns, *argv], timeout=TIMEOUT_S
            )
        figures.walls.append(wall)
        figures.peaks.append(peak)
        figures.cpu[wall] = (usage.ru_utime, usage.ru_stime)
    return figures


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@contextmanager
def _sockets_sandbox() -> Iterator[tuple[Path, Path]]:
    """A cgroup2 directory and a bpffs of this benchmark's own: (cgroup, pin dir). Unmounting
    the bpffs drops the pins, and with them the programs' links."""
    root = Path("/run") / f"kpng-bench-{secrets.token_hex(3)}"
    mounts: list[Path] = []
    cgroup: Path | None = None
    try:
        for fstype in ("cgroup2", "bpf"):
            target = root / fstype
            target.mkdir(parents=True)
            subprocess.run(["mount", "-t", fstype, fstype, str(target)], check=True)
            mounts.append(target)
        cgroup = root / "cgroup2" / root.name
        cgroup.mkdir()
        yield cgroup, root / "bpf" / "pins"
    finally:
        if cgroup is not None:
            cgroup.rmdir()
        for target in reversed(mounts):
            subprocess.run(["umount", str(target)], check=False)
            target.rmdir()
        if root.exists():
            root.rmdir()


def _bpf_object(workdir: Path) -> Path:
    from kpng.backends.ebpf.toolchain import compile_object

    obj = workdir / "sockets.bpf.o"
    if not obj.exists():
        compile_object(obj)
    return obj


def size_report(args: argparse.Namespace, size: int, cluster: Path, workdir: Path) -> bool:
    """Every figure of one size; True if its targets are met."""
    runs = args.runs if size <= 10_000 else args.large_runs
    floor_file = workdir / f"floor-{size}.nft"
    floor_file.write_text(floor_text(size))
    floor = _in_netns(["nft", "-f", str(floor_file)], runs)
    print(f"\n{size} services x {ENDPOINTS} endpoints ({cluster.stat().st_size / 1e6:.0f} MB)")
    print(f"  floor, nft -f of {size * (ENDPOINTS + 1)} elements in one vmap: {floor.line()}")

    argv = [*KPNG, "file", "--input", str(cluster), "to-local", "--node-name", NODE]
    whole = _in_netns([*argv, "to-nft", "--once"], runs)
    print(f"  kpng ... to-nft --once, whole process: {whole.line()}")

    tx = workdir / f"tx-{size}.nft"
    started = time.perf_counter()
    with tx.open("wb") as out:
        done = subprocess.run(
            [*argv, "to-nft", "--once", "--dry-run"],
            stdout=out,
            stderr=subprocess.PIPE,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"kpng --dry-run failed: {done.stderr.decode()[-2000:]}")
    dry = time.perf_counter() - started
    nft_part = _in_netns(["nft", "-f", str(tx)], 1)
    print(f"  split: --dry-run (all but nftables): {dry:.2f} s")
    print(
        f"         nft -f of its transaction ({tx.stat().st_size / 1e6:.0f} MB of text): "
        f"{nft_part.line()}; {nft_part.wall / floor.wall:.2f}x the floor"
    )
    ratio = whole.wall / floor.wall
    ok = ratio <= 2.0
    print(f"  target: to-nft whole process within 2x the floor: {ratio:.2f}x, {_verdict(ok)}")
    if size >= 100_000:
        fits = whole.peak <= 2 * GIB
        print(f"  target: peak RSS <= 2 GiB: {whole.peak / GIB:.2f} GiB, {_verdict(fits)}")
        ok = ok and fits
    if size in args.ebpf_sizes:
        obj = _bpf_object(workdir)
        with _sockets_sandbox() as (cgroup, pins):
            ebpf = [*argv, "to-ebpf", "--cgroup", str(cgroup), "--pin-dir", str(pins)]
            figures = _in_netns([*ebpf, "--bpf-object", str(obj), "--once"], 1)
        print(f"  kpng ... to-ebpf --once, whole process: {figures.line()}")
        print(
            f"  to-ebpf: {figures.wall / floor.wall:.2f}x the floor, "
            f"{figures.wall / whole.wall:.2f}x to-nft"
        )
    return ok


def startup(cluster: Path) -> None:
    """Python's start-up: a no-op start, and what the node agent's pipelines import (``cluster``:
    a small one, so that the run is mostly imports)."""
    version = []
    for _ in range(5):
        started = time.perf_counter()
        subprocess.run([*KPNG, "--version"], capture_output=True, check=True)
        version.append(time.perf_counter() - started)
    print(
        f"\nstart-up: kpng --version median {statistics.median(version):.3f} s "
        f"(best {min(version):.3f} s) of 5"
    )
    # kpng local's pipeline is only built (there is no brain to watch); kpng file's runs to its
    # end as a dry run, so that what it imports once running counts too.
    local = ["local", "--api", "unix:///nonexistent", "--node-name", NODE, "to-nft", "--once"]
    build = f"import kpng.cli; kpng.cli.build({local!r})"
    file = ["file", "--input", str(cluster), "to-local", "--node-name", NODE]
    for label, argv in (
        ("kpng local ... to-nft (built)", ["-c", build]),
        (
            "kpng file ... to-local ... to-nft (run)",
            [*KPNG[1:], *file, "to-nft", "--dry-run", "--once"],
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"{label}: {done.stderr[-2000:]}")
        rows: list[tuple[int, int, str]] = []
        for line in done.stderr.splitlines():
            if line.startswith("import time:") and "|" in line and "self [us]" not in line:
                self_us, cumulative_us, module = line[len("import time:") :].split("|")
                rows.append((int(cumulative_us), int(self_us), module.rstrip()))
        top_level = sum(total for total, _, name in rows if not name.startswith("  "))
        print(f"  importtime, {label}: {top_level / 1e6:.3f} s, {len(rows)} modules")
        print("    most, cumulative (self) ms:")
        for total, own, name in sorted(rows, reverse=True)[:12]:
            print(f"      {total / 1e3:7.1f} ({own / 1e3:5.1f}) {name}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=_sizes, default=[10_000, 100_000])
    parser.add_argument("--runs", type=int, default=3, help="per figure up to 10,000 services")
    parser.add_argument("--large-runs", type=int, default=1, help="per figure above 10,000")
    parser.add_argument("--ebpf-sizes", type=_sizes, default=[100_000], help="'' for none")
    parser.add_argument(
        "--clusters",
        type=Path,
        help="where the synthetic clusters are kept between runs (default: made afresh)",
    )
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up figures")
    args = parser.parse_args(argv)
    compiled_as_installed()
    if os.geteuid() != 0:
        print("needs root (network namespaces, nftables, BPF)", file=sys.stderr)
        return 2
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    met = True
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kpng-node-")))
        clusters = args.clusters or workdir
        for size in args.sizes:
            cluster = clusters / f"cluster-{size}.json"
            if not cluster.exists():
                synthetic.write(cluster, size)
            met = size_report(args, size, cluster, workdir) and met
        if not args.no_startup:
            small = workdir / "cluster-100.json"
            synthetic.write(small, 100)
            startup(small)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; targets {_verdict(met)}")
    return 0


def _sizes(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v]


if __name__ == "__main__":
    sys.exit(main())
