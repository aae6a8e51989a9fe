"""kpng's cold start on a big cluster file, against Python's own ``json.load`` of the same file.

Generates the synthetic cluster (10,000 services by default) into a temporary directory, then:

(a) ``json.load`` of the file in a fresh interpreter: the load alone, timed inside the child, and
    the child's whole wall time; and a bare ``python -c 'import json; json.load(open(F))'``;
(b) ``kpng file --input F to-local --node-name N to-json --once --output /dev/null``: its wall
    time and peak RSS (``getrusage(RUSAGE_CHILDREN)`` in a small wrapper process, so nothing else
    is counted; cross-checked with ``/usr/bin/time`` when it is there);
(c) unless ``--no-profile``, where kpng's time goes: its phases one by one, the share of Python's
    cyclic garbage collector (and kpng's time with the collector disabled), and a cProfile of the
    whole command (top functions by cumulative and by own time).

Each figure is the minimum of ``--runs`` runs. Targets: kpng's wall time at most 3x the json.load,
peak RSS at most 600 MB. A missed target is reported, not failed: the exit status is non-zero
only if something crashed.

    python bench/bench_file_to_json.py [--services N] [--runs 3] [--no-profile]
"""

from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import synthetic

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
TIMEOUT_S = 300  # per child process; a 10k run takes a few seconds
TARGET_RATIO = 3.0
TARGET_RSS_MB = 600.0

# Runs the command in argv, then reports its wall time and peak RSS as one JSON line.
_MEASURE = """\
import json, resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
tail = proc.stderr.decode(errors="replace")[-4000:]
print(json.dumps({"wall": wall, "maxrss_kb": rss, "rc": proc.returncode, "stderr": tail}))
"""

# json.load of argv[1], timing only the load.
_JSON_LOAD = """\
import json, sys, time
start = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    json.load(f)
print(time.perf_counter() - start)
"""


@dataclass
class Measured:
    wall_s: float
    maxrss_mb: float


class BenchError(Exception):
    """A child process crashed: the benchmark cannot report."""


def _run(argv: Sequence[str], *, what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{what} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def _measure(argv: Sequence[str], *, what: str) -> Measured:
    """Wall time and peak RSS of one run of argv (its output discarded)."""
    proc = _run([PYTHON, "-c", _MEASURE, *argv], what=f"the wrapper of {what}")
    report = json.loads(proc.stdout)
    if report["rc"] != 0:
        raise BenchError(f"{what} exited {report['rc']}:\n{report['stderr']}")
    return Measured(wall_s=report["wall"], maxrss_mb=report["maxrss_kb"] / 1024)


def _wall(argv: Sequence[str], *, what: str) -> float:
    start = time.perf_counter()
    _run(argv, what=what)
    return time.perf_counter() - start


def _gnu_time(argv: Sequence[str]) -> tuple[float, float] | None:
    """(wall s, peak RSS MB) of one run through GNU time, or None if that is not GNU time."""
    proc = _run(["/usr/bin/time", "-f", "%e %M", *argv], what="kpng under /usr/bin/time")
    try:
        wall, rss_kb = proc.stderr.strip().splitlines()[-1].split()
        return float(wall), float(rss_kb) / 1024
    except (ValueError, IndexError):
        return None


def _inprocess(*args: str) -> dict[str, Any]:
    proc = _run([PYTHON, str(BENCH_DIR / "inprocess.py"), *args], what=f"inprocess.py {args[0]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def kpng_args(path: Path, node: str, output: str = "/dev/null") -> list[str]:
    """The arguments of the measured kpng command."""
    return [
        *("file", "--input", str(path)),
        *("to-local", "--node-name", node),
        *("to-json", "--once", "--output", output),
    ]


def kpng_argv(path: Path, node: str, output: str = "/dev/null") -> list[str]:
    """The measured command: the installed ``kpng`` script next to this interpreter."""
    script = Path(PYTHON).parent / "kpng"
    command = [str(script)] if script.exists() else [PYTHON, "-m", "kpng"]
    return [*command, *kpng_args(path, node, output)]


def _check_output(path: Path, node: str, services: int, workdir: Path) -> tuple[int, int]:
    """One kpng run into a real file (it also warms the page cache): (services, local endpoints)."""
    out = workdir / "state.json"
    _run(kpng_argv(path, node, str(out)), what="kpng")
    state = json.loads(out.read_bytes())
    out.unlink()
    served = state["services"]
    local = sum(1 for s in served for ep in s.get("endpoints", ()) if ep.get("Local"))
    if len(served) != services:
        print(f"  WARNING: kpng served {len(served)} services, expected {services}")
    return len(served), local


def _where(file: str, line: int, function: str) -> str:
    if file == "~":
        return function  # a built-in, e.g. <method 'decode' of 'msgspec.json.Decoder' objects>
    short = "kpng/" + file.rsplit("/kpng/", 1)[1] if "/kpng/" in file else Path(file).name
    return f"{short}:{line}({function})"


def _print_profile(prof: Path, top: int) -> None:
    stats = pstats.Stats(str(prof))
    # {(file, line, function): (primitive calls, calls, own time, cumulative time, callers)}
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = vars(stats)["stats"]
    total: float = vars(stats)["total_tt"]
    rows = [(key, calls, own, cum) for key, (_, calls, own, cum, _) in table.items()]
    print(f"\ncProfile of the whole kpng command: {total:.3f} s under the profiler")
    print("(the collector's time is charged to whichever function allocates when it fires)")
    for title, order, only_kpng in (
        ("cumulative time, kpng's functions (asyncio's and runpy's frames left out)", 3, True),
        ("own time, all functions", 2, False),
    ):
        chosen = [r for r in rows if not only_kpng or "/kpng/" in r[0][0]]
        chosen.sort(key=lambda r: r[order], reverse=True)
        print(f"--- top {top} by {title}")
        print(f"  {'calls':>9} {'own s':>7} {'cum s':>7}  function")
        for key, calls, own, cum in chosen[:top]:
            print(f"  {calls:9d} {own:7.3f} {cum:7.3f}  {_where(*key)}")


def _profile(path: Path, node: str, workdir: Path, runs: int) -> dict[str, float]:
    """Where kpng's time goes: phases, garbage collection, cProfile. Returns the GC figures."""
    phases = _inprocess("phases", str(path), node)
    no_gc = _inprocess("phases", str(path), node, "--no-gc")
    print(f"\nkpng's phases, one by one in a fresh interpreter ({phases['services']} services):")
    print(f"  {'phase':26} {'wall s':>7} {'of it GC':>9} {'GC off':>8}")
    total = total_gc = total_off = 0.0
    for name, figures in phases["phases"].items():
        off = no_gc["phases"][name]["s"]
        print(f"  {name:26} {figures['s']:7.3f} {figures['gc_s']:9.3f} {off:8.3f}")
        total, total_gc, total_off = (
            total + figures["s"],
            total_gc + figures["gc_s"],
            total_off + off,
        )
    print(f"  {'sum':26} {total:7.3f} {total_gc:9.3f} {total_off:8.3f}")
    gen0, gen1, gen2 = phases["gc_collections"]
    print(f"  collections: {gen0} young, {gen1} middle, {gen2} full")

    args = ["--", *kpng_args(path, node)]
    with_gc = [_inprocess("run", *args) for _ in range(runs)]
    without = [_inprocess("run", "--no-gc", *args) for _ in range(runs)]
    best = min(with_gc, key=lambda r: float(r["s"]))
    best_off = min(float(r["s"]) for r in without)
    share = best["gc_s"] / best["s"]
    print("\nthe whole command in-process (kpng.cli.main, from its imports on), min of runs:")
    print(
        f"  as is        {best['s']:6.3f} s, of which cyclic GC {best['gc_s']:.3f} s ({share:.0%})"
    )
    print(f"  GC disabled  {best_off:6.3f} s")

    prof = workdir / "kpng.prof"
    _run(
        [PYTHON, "-m", "cProfile", "-o", str(prof), "-m", "kpng", *kpng_args(path, node)],
        what="kpng under cProfile",
    )
    _print_profile(prof, top=15)
    return {"inprocess_s": best["s"], "inprocess_gc_s": best["gc_s"], "gc_disabled_s": best_off}


def run(services: int, *, runs: int, profile: bool, seed: int = 1) -> dict[str, float]:
    """Runs the benchmark and prints it; returns the headline figures."""
    figures: dict[str, float] = {}
    node = synthetic.node_name(0)
    with tempfile.TemporaryDirectory(prefix="kpng-bench-") as tmp:
        workdir = Path(tmp)
        path = workdir / f"cluster-{services}.json"
        generator = [PYTHON, str(BENCH_DIR / "synthetic.py"), "--services", str(services)]
        generated_s = _wall(
            [*generator, "--seed", str(seed), "--output", str(path)], what="the generator"
        )
        size_mb = path.stat().st_size / 1e6
        figures["file_mb"] = size_mb
        print(
            f"cluster: {services} services x {synthetic.ENDPOINTS_PER_SERVICE} endpoints on "
            f"{synthetic.NODES} nodes: {size_mb:.1f} MB of JSON (generated in {generated_s:.1f} s)"
        )
        served, local = _check_output(path, node, services, workdir)
        print(f"  kpng serves {served} services to {node}, {local} endpoints local to it")

        loads, load_walls, bare_walls = [], [], []
        bare = f"import json; json.load(open({str(path)!r}))"
        for _ in range(runs):
            start = time.perf_counter()
            proc = _run([PYTHON, "-c", _JSON_LOAD, str(path)], what="json.load")
            load_walls.append(time.perf_counter() - start)
            loads.append(float(proc.stdout))
            bare_walls.append(_wall([PYTHON, "-c", bare], what="bare json.load"))
        kpng_runs = [_measure(kpng_argv(path, node), what="kpng") for _ in range(runs)]

        json_load = min(loads)
        kpng_wall = min(m.wall_s for m in kpng_runs)
        kpng_rss = max(m.maxrss_mb for m in kpng_runs)
        ratio = kpng_wall / json_load
        bare_ratio = kpng_wall / min(bare_walls)
        figures |= {
            "json_load_s": json_load,
            "json_load_process_wall_s": min(load_walls),
            "bare_json_wall_s": min(bare_walls),
            "kpng_wall_s": kpng_wall,
            "kpng_peak_rss_mb": kpng_rss,
            "ratio_vs_json_load": ratio,
            "ratio_vs_bare_json_wall": bare_ratio,
        }

        print(f"\nminimum of {runs} runs each:")
        print(f"  json.load alone, timed in a fresh interpreter  {json_load:7.3f} s")
        print(f"  that interpreter's wall time                   {min(load_walls):7.3f} s")
        print(f"  bare python -c 'import json; json.load(...)'   {min(bare_walls):7.3f} s")
        print(f"  kpng ... to-json --once --output /dev/null     {kpng_wall:7.3f} s")
        walls = ", ".join(f"{m.wall_s:.3f}" for m in kpng_runs)
        rsses = ", ".join(f"{m.maxrss_mb:.1f}" for m in kpng_runs)
        print(f"    (each kpng run: {walls} s; peak RSS {rsses} MB)")
        print(f"  kpng peak RSS (max of runs)                    {kpng_rss:7.1f} MB")
        if Path("/usr/bin/time").exists():
            checked = _gnu_time(kpng_argv(path, node))
            if checked is not None:
                print(f"    (/usr/bin/time, one more run: {checked[0]:.2f} s, {checked[1]:.1f} MB)")
        print(
            f"\n  kpng wall / json.load            {ratio:5.2f}x  "
            f"(target ≤ {TARGET_RATIO:g}x: {_verdict(ratio <= TARGET_RATIO)})"
        )
        print(f"  kpng wall / bare json.load wall  {bare_ratio:5.2f}x")
        print(
            f"  kpng peak RSS                    {kpng_rss:5.0f} MB "
            f"(target ≤ {TARGET_RSS_MB:g} MB: {_verdict(kpng_rss <= TARGET_RSS_MB)})"
        )
        if profile:
            figures |= _profile(path, node, workdir, runs)
    return figures


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (default: 3)")
    parser.add_argument("--seed", type=int, default=1, help="the generator's seed (default: 1)")
    parser.add_argument(
        "--no-profile", dest="profile", action="store_false", help="skip the phases and profile"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 20:
        parser.error("--runs: 1 to 20")
    if not 1 <= args.services <= 100_000:
        parser.error("--services: 1 to 100000")
    print(f"== file → to-local → to-json, cold start ({args.services} services)")
    start = time.perf_counter()
    try:
        run(args.services, runs=args.runs, profile=args.profile, seed=args.seed)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        print(f"bench_file_to_json: {exc}", file=sys.stderr)
        return 1
    print(f"\n(bench_file_to_json took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
