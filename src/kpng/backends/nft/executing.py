"""The one module of the nft backend that runs programs: ``nft`` and ``conntrack``.

Subprocess failures become ``NftError`` here, and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

from kpng.backends.nft.nftables import NftError, Table, Transaction, error_for_line

log = logging.getLogger(__name__)

# nft names the failing line of `-f -` as "/dev/stdin:LINE:COLS: Error: TEXT".
_ERROR_LINE = re.compile(r"^(?:/dev/stdin|-|<cmdline>):(\d+):[\d-]+: Error: (.*)$", re.M)


async def _run(argv: Sequence[str], stdin: bytes = b"") -> tuple[int, str]:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise NftError(f"cannot run {argv[0]}: {exc}") from exc
    _, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


def parse_error(tx: Transaction, stderr: str) -> NftError:
    """The first error nft reported for ``tx``, with the rendered line it names."""
    match = _ERROR_LINE.search(stderr)
    if match is None:
        return NftError(stderr.strip() or "nft failed without a message")
    return error_for_line(tx, line_number=int(match.group(1)), message=match.group(2).strip())


class KernelNft:
    """Runs transactions with ``nft -f -`` in the current network namespace.

    ``command`` is how to run nft, e.g. ``("ip", "netns", "exec", NS, "nft")`` for another
    network namespace.
    """

    def __init__(self, command: Sequence[str] = ("nft",)) -> None:
        self._command = tuple(command)

    async def run(self, tx: Transaction) -> None:
        if not tx.operations:
            return
        rc, err = await _run([*self._command, "-f", "-"], tx.render().encode())
        if rc != 0:
            raise parse_error(tx, err)

    async def delete_table(self, table: Table) -> bool:
        rc, err = await _run([*self._command, "delete", "table", table.family, table.name])
        if rc == 0:
            return True
        if "No such file or directory" in err:
            return False
        raise NftError(err.strip())


class Conntrack:
    """Deletes conntrack entries with the ``conntrack`` tool (conntrack-tools)."""

    def __init__(self, conntrack: str = "conntrack") -> None:
        self._conntrack = conntrack

    async def delete(self, filters: Sequence[str]) -> None:
        """``conntrack -D FILTERS``; finding nothing to delete is not an error."""
        rc, err = await _run([self._conntrack, "-D", *filters])
        # conntrack exits 1 with "0 flow entries have been deleted" when nothing matched.
        if rc != 0 and "0 flow entries" not in err:
            log.warning("conntrack -D %s failed: %s", " ".join(filters), err.strip())
