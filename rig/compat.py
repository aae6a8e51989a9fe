"""``make compat``: the API-server tests (``pytest -m apiserver``) against every supported
Kubernetes release, or the ones named, each with its own control plane (built on first use, a
few minutes each, then cached); a table of the results at the end.

    python -m rig.compat [VERSION...] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rig.cluster import SUPPORTED_VERSIONS, ControlPlaneError, ensure_binaries


@dataclass(frozen=True)
class Run:
    version: str
    status: int
    seconds: float
    summary: str


def run(version: str, pytest_args: Sequence[str]) -> Run:
    started = time.monotonic()
    env = {**os.environ, "KPNG_KUBERNETES_VERSION": version}
    # The variable wins over an explicit version (kubernetes_release): set it for the build too.
    previous, os.environ["KPNG_KUBERNETES_VERSION"] = (
        os.environ.get("KPNG_KUBERNETES_VERSION"),
        version,
    )
    try:
        ensure_binaries()
    except ControlPlaneError as exc:
        return Run(version, 1, time.monotonic() - started, f"no control plane: {exc}")
    finally:
        if previous is None:
            del os.environ["KPNG_KUBERNETES_VERSION"]
        else:
            os.environ["KPNG_KUBERNETES_VERSION"] = previous
    argv = [sys.executable, "-m", "pytest", "-m", "apiserver", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*argv, *pytest_args], env=env, capture_output=True, text=True, check=False
    )
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "(no output)"
    return Run(version, done.returncode, time.monotonic() - started, summary)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args = args[args.index("--") + 1 :] if "--" in args else []
    versions = (args[: args.index("--")] if "--" in args else args) or list(SUPPORTED_VERSIONS)
    unknown = [v for v in versions if v not in SUPPORTED_VERSIONS]
    if unknown:
        print(f"not a supported release: {', '.join(unknown)} "
              f"(supported: {', '.join(SUPPORTED_VERSIONS)})", file=sys.stderr)  # fmt: skip
        return 2
    runs = []
    for version in versions:
        print(f"=== kube-apiserver {version}", flush=True)
        runs.append(run(version, pytest_args))
    print("\nrelease   result  time    pytest")
    for r in runs:
        print(
            f"{r.version:9} {'pass' if r.status == 0 else 'FAIL':7} {r.seconds:5.0f} s  {r.summary}"
        )
    return 0 if all(r.status == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
