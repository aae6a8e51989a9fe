"""What a node holds in each shape: ``kpng local ... to-nft`` behind a brain against ``kpng file
... to-local ... to-nft`` in one process, on the same synthetic cluster (10,000 services x 10
endpoints by default), each in a network namespace of its own (root).

A node agent holds no global store and resolves nothing: only its node's state, as the brain
sends it. Reported per run: the node process's peak RSS (``ru_maxrss`` of that process alone)
and the wall time to its first programmed state (``--once``); then, run again without
``--once``, the RSS it holds once its rules are programmed (``/healthz`` 200, then 3 s); and
the brain's own peak RSS beside the split's. The in-process baseline reads the same file, so
that both hold the same store; ``kpng kube`` holds that store plus its reflector's buffers.

    python bench/bench_split.py [--services 10000] [--runs 3]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import secrets
import signal
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


def compiled_as_installed() -> None:
    """kpng's bytecode, as an installed kpng has it (pip and the image compile it at install).
    An editable install has none, and under PYTHONDONTWRITEBYTECODE (set on this machine) every
    start compiled each of kpng's modules again: 0.2 s of ``kpng --version``'s 0.45 s."""
    import kpng

    compileall.compile_dir(Path(kpng.__file__).parent, quiet=1)


NODE = synthetic.node_name(0)
BACKEND = ["to-nft", "--no-health-check", "--nodeport-addresses", "primary"]
HEALTHZ = "127.0.0.1:10299"
"""In each namespace of its own: what tells that the first state is programmed."""


@contextmanager
def _netns() -> Iterator[str]:
    name = f"kpng-bench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _measured(argv: list[str], timeout: float = 600) -> tuple[float, float]:
    """Run ``argv`` to its end: (wall seconds, its peak RSS in MiB)."""
    wall, peak, _ = measured_usage(argv, timeout)
    return wall, peak


_LAUNCHER = """
import json, os, sys, time
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.close(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
report = [time.perf_counter() - started, os.waitstatus_to_exitcode(status), *usage[:16]]
os.write(int(sys.argv[1]), json.dumps(report).encode())
"""
"""Forks the measured command from a fresh, small interpreter. A child's ``ru_maxrss`` is at
least the resident size of the process it was forked from (the kernel folds the parent's
high-water mark in at ``exec``): forked from this benchmark, which holds the synthetic cluster
(2.3 GB at 100,000 services), every command measured as large as the benchmark itself."""


def measured_usage(
    argv: list[str], timeout: float = 600
) -> tuple[float, float, resource.struct_rusage]:
    """Run ``argv`` to its end: (wall seconds, its peak RSS in MiB, its resource usage)."""
    read, write = os.pipe()
    launcher = [sys.executable, "-S", "-c", _LAUNCHER, str(write), *argv]
    proc = subprocess.Popen(
        launcher,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(write,),
        start_new_session=True,
    )
    os.close(write)
    try:
        _, error = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"{' '.join(argv)}: no end within {timeout:g} s") from None
    finally:
        with os.fdopen(read, "rb") as pipe:
            report = pipe.read()
    if proc.returncode != 0 or not report:
        raise SystemExit(f"{' '.join(argv)}: its launcher failed: {error.decode()}")
    wall, code, *fields = json.loads(report)
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {error.decode()}")
    usage = resource.struct_rusage(fields)
    return wall, usage.ru_maxrss / 1024, usage


def _held(ns: str, argv: list[str], timeout: float = 600) -> float:
    """Start ``argv`` (a kpng command, in ``ns``) serving /healthz: the RSS in MiB it holds 3 s
    after its first state is programmed."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, *KPNG, f"--healthz-bind-address={HEALTHZ}", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = f"import urllib.request; urllib.request.urlopen('http://{HEALTHZ}/healthz', timeout=2)"
    in_ns = ["ip", "netns", "exec", ns, sys.executable, "-c", probe]
    try:
        deadline = time.monotonic() + timeout
        while subprocess.run(in_ns, capture_output=True, check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(argv)}: never healthy")
            time.sleep(0.5)
        time.sleep(3)
        return _kib(proc.pid, "VmRSS") / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith(field))


def in_process(cluster: Path) -> tuple[float, float, float]:
    """(wall seconds to the first programmed state, peak RSS, RSS held after it), in MiB."""
    argv = ["file", "--input", str(cluster), "to-local", "--node-name", NODE, *BACKEND]
    with _netns() as ns:
        wall, peak = _measured(["ip", "netns", "exec", ns, *KPNG, *argv, "--once"])
    with _netns() as ns:
        return wall, peak, _held(ns, argv)


def split(cluster: Path, workdir: Path) -> tuple[float, float, float, float]:
    """The node agent's (wall seconds, peak RSS, RSS held) and the brain's peak RSS, in MiB."""
    socket = workdir / f"brain-{secrets.token_hex(3)}.sock"
    brain = subprocess.Popen(
        [*KPNG, "file", "--input", str(cluster), "to-api", "--listen", f"unix://{socket}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not socket.exists():
            if brain.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the brain did not start")
            time.sleep(0.05)
        argv = ["local", "--api", f"unix://{socket}", "--node-name", NODE]
        argv += ["--connect-timeout", "300"]
        # A first watcher waits out the brain's own start: the node is timed against a brain
        # that has its state, as a node joining a running cluster finds it.
        _measured([*KPNG, *argv, "to-json", "--once", "--output", os.devnull])
        with _netns() as ns:
            wall, peak = _measured(["ip", "netns", "exec", ns, *KPNG, *argv, *BACKEND, "--once"])
        with _netns() as ns:
            held = _held(ns, [*argv, *BACKEND])
        return wall, peak, held, _kib(brain.pid, "VmHWM") / 1024
    finally:
        brain.terminate()
        brain.wait(timeout=30)


ROWS = ("in_wall", "in_peak", "in_held", "node_wall", "node_peak", "node_held", "brain_peak")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    compiled_as_installed()
    if os.geteuid() != 0:
        print("needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    rows: dict[str, list[float]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory(prefix="kpng-bench-split-") as tmp:
        workdir = Path(tmp)
        cluster = workdir / "cluster.json"
        synthetic.write(cluster, args.services)
        for run in range(args.runs):  # alternated, so that drift hits both alike
            figures = (*in_process(cluster), *split(cluster, workdir))
            for name, value in zip(ROWS, figures, strict=True):
                rows[name].append(value)
            line = ", ".join(f"{n} {v:.2f}" for n, v in zip(ROWS, figures, strict=True))
            print(f"run {run + 1}: {line}")
    m = {name: statistics.median(values) for name, values in rows.items()}
    print(f"\n{args.services} services x 10 endpoints, node {NODE}, median of {args.runs}:")
    print("| | in process (kpng file ... to-local ... to-nft) | kpng local ... to-nft | ratio |")
    print("|---|---|---|---|")
    for label, key, unit in (
        ("node RSS held once programmed", "held", "MiB"),
        ("node peak RSS (the first sync)", "peak", "MiB"),
        ("start to first programmed state", "wall", "s"),
    ):
        here, there = m[f"in_{key}"], m[f"node_{key}"]
        print(f"| {label} | {here:.2f} {unit} | {there:.2f} {unit} | {there / here:.2f}x |")
    print(f"| the brain's peak RSS | | {m['brain_peak']:.0f} MiB | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
