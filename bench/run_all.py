"""Every kpng benchmark, one after the other (``make bench``).

1. the synthetic cluster: what the 10k-service file holds, its size, how long it takes to make;
2. ``bench_file_to_json.py``: kpng's cold start on that file against ``json.load``, with the
   phases, garbage collection and cProfile of where the time goes;
3. ``bench_incremental.py``: the cost of one EndpointSlice change at 1k, 10k and 30k services;
4. ``bench_api.py``: the watch API (``to-api``): a 10k-service initial state over the compatible
   and the batched RPC, one change to a remote client at 1k, 10k and 30k services (through the
   file, and in process), and the fan-out of one change to 1,000 node watchers;
5. ``bench_plugins.py``: to-exec and to-plugin from a change to the backend's acknowledgement at
   10k services, and three to-json backends against one;
6. ``bench_kube.py``: ``kpng kube`` against a real kube-apiserver holding 10,000 services.

Each runs in its own interpreter, so one's memory and garbage does not weigh on the next. The exit
status is non-zero only if a benchmark crashed; missed targets are reported, not failed.

    python bench/run_all.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
TIMEOUT_S = 900  # per benchmark; the longest, bench_api.py, takes about 4 minutes on two cores


def _step(title: str, argv: Sequence[str]) -> tuple[int, float]:
    print(f"\n{'=' * 100}\n{title}\n$ {' '.join(argv)}\n", flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.run(argv, timeout=TIMEOUT_S, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {TIMEOUT_S} s", flush=True)
        rc = -1
    return rc, time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="one run per figure, no profile, sizes up to 10k"
    )
    args = parser.parse_args(argv)
    file_args = ["--runs", "1", "--no-profile"] if args.quick else []
    incremental_args = ["--sizes", "1000,10000"] if args.quick else []
    api_args = (
        ["--runs", "1", "--sizes", "1000,10000", "--changes", "30", "--file-budget", "20"]
        if args.quick
        else []
    )
    plugins_args = ["--changes", "10"] if args.quick else []
    kube_args = ["--runs", "1", "--changes", "50", "--churn", "100"] if args.quick else []

    with tempfile.TemporaryDirectory(prefix="kpng-bench-") as tmp:
        cluster = Path(tmp) / "cluster-10k.json"
        steps = [
            (
                "1. the synthetic cluster (10,000 services)",
                [PYTHON, str(BENCH_DIR / "synthetic.py"), "--describe", "--output", str(cluster)],
            ),
            (
                "2. file → to-local → to-json, against json.load",
                [PYTHON, str(BENCH_DIR / "bench_file_to_json.py"), *file_args],
            ),
            (
                "3. one EndpointSlice change, by cluster size",
                [PYTHON, str(BENCH_DIR / "bench_incremental.py"), *incremental_args],
            ),
            (
                "4. the watch API: initial state, one change, fan-out",
                [PYTHON, str(BENCH_DIR / "bench_api.py"), *api_args],
            ),
            (
                "5. backends out of process, and three backends against one",
                [PYTHON, str(BENCH_DIR / "bench_plugins.py"), *plugins_args],
            ),
            (
                "6. kpng kube against a real kube-apiserver",
                [PYTHON, str(BENCH_DIR / "bench_kube.py"), *kube_args],
            ),
        ]
        results = [(title, *_step(title, command)) for title, command in steps]

    print(f"\n{'=' * 100}")
    failed = 0
    for title, rc, elapsed in results:
        status = "ok" if rc == 0 else f"CRASHED (exit {rc})"
        failed += rc != 0
        print(f"  {title:55} {elapsed:6.1f} s  {status}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
