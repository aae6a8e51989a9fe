"""An incremental Sink that records every call, for the tests of watches over real gRPC
(tests/pure/test_server.py, tests/pure/test_resume.py, tests/pure/test_fuzz_client.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from kpng.model.messages import Service

WAIT_S = 20.0


class RecordingSink:
    """Each call as a tuple (``sync`` included); ``next_sync`` hands over those up to a sync."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.synced = asyncio.Event()

    def reset(self) -> None:
        self.calls.append(("reset",))

    def set_service(self, service: Service) -> None:
        self.calls.append(("set_service", service.Namespace, service.Name))

    def delete_service(self, namespace: str, name: str) -> None:
        self.calls.append(("delete_service", namespace, name))

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Any) -> None:
        self.calls.append(("set_endpoint", namespace, service, key))

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self.calls.append(("delete_endpoint", namespace, service, key))

    def sync(self) -> None:
        self.calls.append(("sync",))
        self.synced.set()

    async def next_sync(self) -> list[tuple[Any, ...]]:
        await asyncio.wait_for(self.synced.wait(), WAIT_S)
        self.synced.clear()
        calls, self.calls = self.calls, []
        return calls
