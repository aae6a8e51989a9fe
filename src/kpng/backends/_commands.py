"""Running the node's tools (nft, iptables, conntrack) as child processes, for every backend."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kpng.client import KpngError


class CommandError(KpngError):
    """A tool could not be run at all (not installed, not executable)."""


async def run_command(
    argv: Sequence[str], stdin: bytes = b"", *, output: bool = True
) -> tuple[int, str, str]:
    """Run ``argv`` with ``stdin``: its exit status, standard output (empty unless ``output``)
    and standard error."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if output else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc}") from exc
    try:
        out, err = await proc.communicate(stdin)
    except asyncio.CancelledError:
        # A caller stopped (a backend closing): the child is not left running unreaped. The
        # tools commit each table in one transaction, so a killed one changed all or nothing
        # of it, and the next start's full sync rewrites everything anyway.
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, (out or b"").decode(errors="replace"), err.decode(errors="replace")
