"""Who may watch what: nodes authenticated the Kubernetes way, by a projected ServiceAccount token
with kpng's audience, checked with a TokenReview.

A node agent (``kpng local``) sends its pod's token as ``authorization: Bearer TOKEN`` metadata.
The API server says whose it is, and on which node its pod runs (the token's
``authentication.kubernetes.io/node-name``, set for tokens bound to a pod). A node agent may watch
its own node's state only; the global state is for the users named for it (relays). ``decide``
is the rule, pure; ``TokenReviews`` asks the API server, with a short cache, so that a thousand
nodes reconnecting cost one review each, not one per stream.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from kpng.errors import KpngError
from kpng.kubeclient.client import ApiClient, ApiStatusError, TransportError

log = logging.getLogger(__name__)

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""The TokenReview's ``user.extra`` key naming the node of the pod a token is bound to."""
DEFAULT_AUDIENCE = "kpng"
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
REVIEWS_PER_S = 100.0
"""TokenReviews of new tokens a brain asks for, at most, each second once ``REVIEW_BURST`` is
spent: random tokens cost the API server nothing past it, and 5,000 node agents reconnecting at
once (their tokens new to this replica) are all reviewed within 40 s, the refused ones
retrying."""
REVIEW_BURST = 1000


@dataclass(frozen=True)
class Identity:
    """Whom a token belongs to, as the API server says: a user, and the node of its pod."""

    user: str
    node: str = ""


class Refused(KpngError):
    """A watch that is not allowed: ``unauthenticated`` (no valid token) or not (a valid token
    asking for what is not its own)."""

    def __init__(self, message: str, *, unauthenticated: bool) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated


def decide(
    identity: Identity | None,
    *,
    node: str | None,
    node_users: frozenset[str],
    global_users: frozenset[str],
) -> None:
    """Raise Refused unless ``identity`` may watch ``node``'s state (or, ``node`` None, the
    global state). Pure."""
    if identity is None:
        raise Refused("no valid token with kpng's audience", unauthenticated=True)
    if node is None:
        if identity.user not in global_users:
            raise Refused(f"{identity.user} may not watch the global state", unauthenticated=False)
        return
    if identity.user not in node_users:
        raise Refused(f"{identity.user} is not a kpng node agent", unauthenticated=False)
    if identity.node != node:
        bound = f"node {identity.node}" if identity.node else "no node"
        raise Refused(
            f"{identity.user} runs on {bound} and may not watch node {node}",
            unauthenticated=False,
        )


class Reviewer(Protocol):
    async def review(self, token: str) -> Identity | None:
        """Whose ``token`` is, or None if it is not valid (for kpng's audience)."""
        ...


class _UserInfo(msgspec.Struct):
    username: str = ""
    extra: dict[str, list[str]] = {}


class _ReviewStatus(msgspec.Struct):
    authenticated: bool = False
    user: _UserInfo | None = None
    error: str = ""


class _Review(msgspec.Struct):
    status: _ReviewStatus | None = None


_decode_review = msgspec.json.Decoder(_Review).decode


class TokenReviews:
    """A Reviewer asking the API server (``create tokenreviews``), caching each answer for
    ``ttl`` seconds (tokens are kept as hashes only)."""

    def __init__(
        self,
        client: ApiClient,
        *,
        audience: str = DEFAULT_AUDIENCE,
        ttl: float = 60.0,
        size: int = 16_384,
        rate: float = REVIEWS_PER_S,
        burst: int = REVIEW_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._audience = audience
        self._ttl = ttl
        self._size = size
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, Identity | None]] = OrderedDict()
        self._rate, self._burst = rate, burst
        self._allowance, self._filled = float(burst), clock()

    async def review(self, token: str) -> Identity | None:
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        # Tokens not seen for a while are reviewed at a bounded rate: random tokens cost the
        # API server nothing past it (kpng's agents' tokens are cached once reviewed).
        self._allowance = min(self._burst, self._allowance + (now - self._filled) * self._rate)
        self._filled = now
        if self._allowance < 1:
            raise Refused(
                "too many new tokens to review at once; try again shortly", unauthenticated=True
            )
        self._allowance -= 1
        body = msgspec.json.encode(
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self._audience]},
            }
        )
        try:
            answer = _decode_review(await self._client.post(TOKEN_REVIEWS, body))
        except (ApiStatusError, TransportError) as exc:
            # Not cached: the next stream asks again.
            reason = f"the API server could not review the token: {exc}"
            raise Refused(reason, unauthenticated=True) from exc
        identity = _identity(answer)
        self._cache[key] = (now + self._ttl, identity)
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return identity


def _identity(review: _Review) -> Identity | None:
    status = review.status
    if status is None or not status.authenticated or status.user is None:
        return None
    nodes = status.user.extra.get(NODE_NAME_EXTRA, [])
    return Identity(user=status.user.username, node=nodes[0] if nodes else "")


@dataclass(frozen=True)
class WatchAuth:
    """The to-api server's rule: who may watch, checked once per stream (and again when a
    stream asks for another node)."""

    reviewer: Reviewer
    node_users: frozenset[str]
    global_users: frozenset[str] = frozenset()

    async def check(self, metadata: Sequence[tuple[str, str | bytes]], *, node: str | None) -> None:
        """Raise Refused unless the stream whose ``metadata`` this is may watch ``node``'s state
        (None: the global state)."""
        identity = await self.identify(metadata)
        decide(identity, node=node, node_users=self.node_users, global_users=self.global_users)

    async def identify(self, metadata: Sequence[tuple[str, str | bytes]]) -> Identity:
        """Whose the stream's token is; Refused (unauthenticated) if it has no valid one."""
        token = bearer_token(metadata)
        identity = None if token is None else await self.reviewer.review(token)
        if identity is None:
            raise Refused("no valid token with kpng's audience", unauthenticated=True)
        return identity


def bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip() or None
    return None
