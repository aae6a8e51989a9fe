"""``backends._commands.run_command``: how the node's tools are run."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from kpng.backends._commands import run_command


def test_output_and_status_come_back() -> None:
    rc, out, err = asyncio.run(run_command(["sh", "-c", "cat; echo oops >&2; exit 3"], b"in"))
    assert (rc, out, err) == (3, "in", "oops\n")


def test_a_cancelled_caller_leaves_no_child_running(tmp_path: Path) -> None:
    """A backend closing while a tool runs (to-iptables' sync-period check) must not leave the
    process behind, running or unreaped."""
    pidfile = tmp_path / "pid"

    async def scenario() -> int:
        task = asyncio.create_task(run_command(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"]))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if pidfile.exists() and pidfile.read_text().strip():
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return int(pidfile.read_text())

    pid = asyncio.run(scenario())
    assert not Path(f"/proc/{pid}").exists()
