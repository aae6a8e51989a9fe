"""What ``test_nft_executing.py`` runs with ``LibNft`` inside a network namespace.

``ip netns exec NS python -m tests.kernel.libnft_scenarios SCENARIO`` prints the scenario's result
as JSON. A separate process because libnftables talks to the namespace the process is in, as kpng
does when it runs in a node's namespace.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import LibNft
from kpng.backends._nftables.layout import Options
from kpng.backends._nftables.nftables import (
    Chain,
    Element,
    Elements,
    NftError,
    Rule,
    Set,
    Table,
    Transaction,
)
from kpng.backends.registry import NodeState
from tests.nft_services import churn

T = Table("inet", "libnft-test")
CHANGES_OPTIONS = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))


def first() -> Transaction:
    """A table with a set of one element and a rule reading it."""
    return (
        Transaction(T)
        .add(T)
        .add(Set("s", type="ipv4_addr"))
        .add(Element("s", ("192.0.2.1",)))
        .add(Chain("c"))
        .add(Rule("c", "ip daddr @s accept"))
    )


def refused(kind: str) -> Transaction:
    """After ``first``: elements, then (line 3) one the kernel refuses, then more elements.
    ``eval``: nft refuses it before sending anything (no such set); ``kernel``: the kernel
    refuses it when committing (deleting an element that is not there)."""
    bad = (
        Element("no-such-set", ("192.0.2.9",)) if kind == "eval" else Element("s", ("192.0.2.99",))
    )
    tx = Transaction(T).add(Element("s", ("192.0.2.2",))).add(Rule("c", "ip saddr @s drop"))
    tx = tx.delete(bad) if kind == "kernel" else tx.add(bad)
    return tx.add(Element("s", ("192.0.2.3",)))


def after() -> Transaction:
    """What the same context applies after a refusal."""
    return Transaction(T).add(Element("s", ("192.0.2.5",)))


async def apply() -> object:
    await LibNft().run(first())
    return None


async def refuse(kind: str) -> object:
    nft = LibNft()
    await nft.run(first())
    error: dict[str, object] | None = None
    try:
        await nft.run(refused(kind))
    except NftError as exc:
        error = {"message": exc.message, "line_number": exc.line_number, "line": exc.line}
    await nft.run(after())
    return error


async def delete() -> object:
    nft = LibNft()
    missing = await nft.delete_table(T)
    await nft.run(first())
    return [missing, await nft.delete_table(T), await nft.delete_table(T)]


async def serve() -> object:
    """How often a task scheduled every 5 ms ran while a 100,000-element transaction did."""
    items = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(100_000)]
    tx = Transaction(T).add(T).add(Set("big", type="ipv4_addr")).add(Elements("big", items))
    nft = LibNft()
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    await nft.run(tx)
    seconds = time.perf_counter() - start
    running = False
    await task
    return {"ticks": ticks, "seconds": seconds}


def change_states() -> list[NodeState]:
    """Generated services of every shape, then 20 states of random changes to 25 of them (the
    same every time)."""
    return churn(300, seed=4, revisions=21, per_revision=25)


class RecordingLibNft(LibNft):
    """Remembers the errors of the transactions it ran (None: taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str | None] = []

    async def run(self, tx: Transaction) -> None:
        try:
            await super().run(tx)
        except NftError as exc:
            self.errors.append(str(exc))
            raise
        self.errors.append(None)


async def changes() -> object:
    """``change_states`` through one context: the error of each transaction (None: taken)."""
    nft = RecordingLibNft()
    backend = NftBackend(nft=nft, options=CHANGES_OPTIONS)
    for s in change_states():
        await backend.apply(s)
    await backend.close()
    return nft.errors


SCENARIOS: dict[str, Callable[..., Coroutine[Any, Any, object]]] = {
    "apply": apply,
    "refuse": refuse,
    "delete": delete,
    "serve": serve,
    "changes": changes,
}

if __name__ == "__main__":
    print(json.dumps(asyncio.run(SCENARIOS[sys.argv[1]](*sys.argv[2:]))))
