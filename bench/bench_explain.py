"""``kpng explain`` on 10,000 services of 10 endpoints, against the time to a full node state.

The synthetic cluster of ``synthetic.py`` (10,000 Services, one 10-endpoint EndpointSlice each,
100 Nodes) and one of its Services (a LoadBalancer with externalTrafficPolicy Local and topology
hints, past the middle of the list: the richest answer). Then:

1. **from a file**: ``kpng file --input F explain --node-name N --service NS/NAME``, from process
   start to its answer (the first byte on its stdout) and to its exit, with its peak RSS; against
   the **baseline** of the same run: ``kpng file --input F to-local --node-name N to-json --once
   --output /dev/null``, the time to a full node-local state. Also ``explain`` of every Service
   (no ``--service``), the whole table to a pipe.
2. **from the API**: the same two commands with ``kpng kube --kubeconfig K`` against a real
   kube-apiserver (``rig.cluster``) filled with the same cluster (as ``bench_kube.py``
   fills it: the fields the API server assigns are left to it).
3. **``/debug/explain?service=NS/NAME``** on a running ``kpng --metrics-bind-address A file
   --input F to-local --node-name N to-json --output /dev/null``: the latency of one answer over
   one kept-alive HTTP connection, against ``/livez`` on the same connection (the HTTP floor).

Wall times are medians of ``--runs`` processes, timed from their spawn by a small wrapper
process, whose ``getrusage(RUSAGE_CHILDREN)`` gives the peak RSS of kpng alone. ``--no-api``
skips part 2 (filling the API server takes a few minutes on two cores).

    python bench/bench_explain.py [--services 10000] [--runs 5] [--requests 50] [--no-api]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import synthetic
from stats import nearest_rank

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
NODE = synthetic.node_name(0)
TIMEOUT_S = 300  # per child process; a 10k run takes a second or two
READY_TIMEOUT_S = 120.0

# Runs argv; reports as one JSON line the seconds from spawn to the first byte on its stdout
# and to its exit, its peak RSS (this wrapper's only child), its exit status and its output.
_MEASURE = """\
import json, resource, subprocess, sys, tempfile, time
with tempfile.TemporaryFile() as err:
    start = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=err)
    first = proc.stdout.read(1)
    answered = time.perf_counter() - start
    rest = proc.stdout.read()
    rc = proc.wait()
    exited = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    err.seek(0)
    tail = err.read().decode(errors="replace")[-4000:]
out = first + rest
print(json.dumps({"answered": answered if first else exited, "exited": exited,
                  "maxrss_kb": rss, "rc": rc, "bytes": len(out),
                  "head": out[:200].decode(errors="replace"), "stderr": tail}))
"""


class BenchError(Exception):
    """A child process crashed or answered wrongly: the benchmark cannot report."""


@dataclass
class Run:
    answered_s: float
    exited_s: float
    maxrss_mb: float
    out_bytes: int
    head: str


@dataclass
class Figures:
    answered_s: float
    exited_s: float
    maxrss_mb: float
    out_bytes: int


def _measure(argv: Sequence[str], *, what: str) -> Run:
    proc = subprocess.run(
        [PYTHON, "-c", _MEASURE, *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"the wrapper of {what} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout)
    if report["rc"] != 0:
        raise BenchError(f"{what} exited {report['rc']}:\n{report['stderr']}")
    return Run(
        report["answered"],
        report["exited"],
        report["maxrss_kb"] / 1024,
        report["bytes"],
        report["head"],
    )


def _median_of(argv: Sequence[str], runs: int, *, what: str, expect: str = "") -> Figures:
    results = [_measure(argv, what=what) for _ in range(runs)]
    for r in results:
        if not r.head.startswith(expect):
            raise BenchError(f"{what} answered {r.head[:120]!r}, expected {expect!r}...")
    return Figures(
        statistics.median(r.answered_s for r in results),
        statistics.median(r.exited_s for r in results),
        statistics.median(r.maxrss_mb for r in results),
        results[0].out_bytes,
    )


def pick_service(document: dict[str, Any]) -> tuple[str, str]:
    """A LoadBalancer with externalTrafficPolicy Local and PreferClose past the middle of the
    list (else the middle Service): both traffic policies, topology, a health check."""
    services = [i for i in document["items"] if i["kind"] == "Service"]
    middle = len(services) // 2
    for s in services[middle:]:
        spec = s["spec"]
        if (
            spec.get("type") == "LoadBalancer"
            and spec.get("externalTrafficPolicy") == "Local"
            and spec.get("trafficDistribution") == "PreferClose"
        ):
            return s["metadata"]["namespace"], s["metadata"]["name"]
    meta = services[middle]["metadata"]
    return meta["namespace"], meta["name"]


def _kpng(source: Sequence[str], *sink: str) -> list[str]:
    return [PYTHON, "-m", "kpng", *source, *sink]


def _explain(source: Sequence[str], service: str | None) -> list[str]:
    sink = ["explain", "--node-name", NODE]
    return _kpng(source, *sink, *(["--service", service] if service else []))


def _to_json(source: Sequence[str]) -> list[str]:
    return _kpng(
        source, "to-local", "--node-name", NODE, "to-json", "--once", "--output", "/dev/null"
    )


def compare(source: Sequence[str], service: str, runs: int, *, title: str) -> dict[str, float]:
    """Part 1 or 2: explain of one Service, of every Service, and to-json, from ``source``."""
    print(f"\n{title} (median of {runs} runs each)")
    print(f"   {'':42} {'answer':>8} {'exit':>8} {'peak RSS':>10}")
    rows = [
        ("explain --service NS/NAME", _explain(source, service), f"{service} on node {NODE}"),
        ("baseline: to-local ... to-json --once", _to_json(source), ""),
        ("explain, every Service (table to a pipe)", _explain(source, None), ""),
    ]
    got: dict[str, Figures] = {}
    for name, argv, expect in rows:
        got[name] = f = _median_of(argv, runs, what=name, expect=expect)
        answered = f"{f.answered_s:6.2f} s" if f.out_bytes else f"{'-':>8}"
        extra = f"   ({f.out_bytes / 1e6:.1f} MB)" if f.out_bytes > 100_000 else ""
        print(
            f"   {name:42} {answered} {f.exited_s:6.2f} s {f.maxrss_mb:6.0f} MiB{extra}", flush=True
        )
    one, base, every = (got[name] for name, _, _ in rows)
    print(
        f"   explain one / to-json: {one.exited_s / base.exited_s:.2f}x time to exit "
        f"({one.answered_s / base.exited_s:.2f}x to the answer), "
        f"{one.maxrss_mb / base.maxrss_mb:.2f}x peak RSS; "
        f"every Service: {every.exited_s / base.exited_s:.2f}x"
    )
    return {
        "explain_answer_s": one.answered_s,
        "explain_exit_s": one.exited_s,
        "explain_rss_mb": one.maxrss_mb,
        "to_json_exit_s": base.exited_s,
        "to_json_rss_mb": base.maxrss_mb,
        "explain_all_exit_s": every.exited_s,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes, float]:
    start = time.perf_counter()
    conn.request("GET", path)
    response = conn.getresponse()
    body = response.read()
    return response.status, body, time.perf_counter() - start


def debug_explain(path: Path, service: str, requests: int) -> dict[str, float]:
    """Part 3: /debug/explain on a running kpng, against /livez on the same connection."""
    port = _free_port()
    argv = [
        *(PYTHON, "-m", "kpng", "--metrics-bind-address", f"127.0.0.1:{port}"),
        *("file", "--input", str(path)),
        *("to-local", "--node-name", NODE, "to-json", "--output", "/dev/null"),
    ]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        try:
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while True:  # until the first node-local state is served
                if proc.poll() is not None or time.perf_counter() - started > READY_TIMEOUT_S:
                    err.seek(0)
                    tail = err.read().decode(errors="replace")[-4000:]
                    raise BenchError(f"kpng with --metrics-bind-address never served:\n{tail}")
                try:
                    status, _, _ = _get(conn, "/debug/state")
                    if status == 200:
                        break
                except OSError:
                    conn.close()
                time.sleep(0.1)
            status, body, _ = _get(conn, f"/debug/explain?service={service}")
            answer = json.loads(body)
            if status != 200 or len(answer) != 1 or not answer[0]["served"]:
                raise BenchError(f"/debug/explain answered {status}: {body[:300]!r}")
            endpoints = sum(len(p["endpoints"]) for p in answer[0]["ports"])
            floor, took = [], []
            for _ in range(requests):
                status, _, seconds = _get(conn, "/livez")
                floor.append(seconds * 1000)
                status, _, seconds = _get(conn, f"/debug/explain?service={service}")
                took.append(seconds * 1000)
                if status != 200:
                    raise BenchError(f"/debug/explain answered {status}")
            conn.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    median, p99, livez = statistics.median(took), nearest_rank(took, 0.99), statistics.median(floor)
    print(
        f"\n3. /debug/explain?service={service} on a running kpng file ... to-json "
        f"({requests} requests, one kept-alive connection; {len(body)} bytes, "
        f"{endpoints} endpoint rows)"
    )
    print(
        f"   /debug/explain   median {median:6.2f} ms   p99 {p99:6.2f} ms   max {max(took):6.2f} ms"
    )
    print(f"   /livez (floor)   median {livez:6.2f} ms")
    return {"debug_explain_ms": median, "debug_explain_p99_ms": p99, "livez_ms": livez}


def from_api(document: dict[str, Any], service: str, runs: int, fill_timeout: float) -> None:
    """Part 2: a control plane of its own, filled as bench_kube.py fills it."""
    from bench_kube import APISERVER_ARGS, THREADS, fill

    from rig.cluster import ControlPlane, ensure_binaries

    t = time.perf_counter()
    binaries = ensure_binaries()
    print(
        f"\ncontrol plane: kube-apiserver {binaries.kubernetes_version}, etcd "
        f"{binaries.etcd_version} (ready in {time.perf_counter() - t:.1f} s)"
    )
    items = document["items"]
    with ControlPlane(binaries, apiserver_args=APISERVER_ARGS) as plane:
        print(f"filling: {len(items)} objects from {THREADS} threads ...", flush=True)
        seconds = fill(plane, items, time.monotonic() + fill_timeout)
        print(f"filled in {seconds:.1f} s ({len(items) / seconds:.0f} objects/s)", flush=True)
        source = ["kube", "--kubeconfig", str(plane.kubeconfig)]
        compare(source, service, runs, title="2. from the API: kpng kube --kubeconfig K ...")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--runs", type=int, default=5, help="processes per figure (default: 5)")
    parser.add_argument("--requests", type=int, default=50, help="/debug/explain requests")
    parser.add_argument("--no-api", dest="api", action="store_false", help="skip part 2")
    parser.add_argument("--fill-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 20:
        parser.error("--runs: 1 to 20")
    if not 1 <= args.services <= 100_000:
        parser.error("--services: 1 to 100000")

    start = time.perf_counter()
    document = synthetic.generate(args.services)
    namespace, name = pick_service(document)
    service = f"{namespace}/{name}"
    try:
        with tempfile.TemporaryDirectory(prefix="kpng-bench-explain-") as tmp:
            path = Path(tmp) / f"cluster-{args.services}.json"
            path.write_bytes(synthetic.dumps(document))
            print(
                f"== kpng explain: {args.services} services x {synthetic.ENDPOINTS_PER_SERVICE} "
                f"endpoints on {synthetic.NODES} nodes ({path.stat().st_size / 1e6:.1f} MB of "
                f"JSON), node {NODE}, Service {service}"
            )
            compare(
                ["file", "--input", str(path)],
                service,
                args.runs,
                title="1. from a file: kpng file --input F ...",
            )
            if args.api:
                from_api(document, service, args.runs, args.fill_timeout)
            else:
                print("\n2. from the API: skipped (--no-api)")
            debug_explain(path, service, args.requests)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        print(f"bench_explain: {exc}", file=sys.stderr)
        return 1
    print(f"\n(bench_explain took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
