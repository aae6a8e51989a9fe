"""``to-api``: serve the state to backends and relays over gRPC."""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kpng.errors import UsageError
from kpng.feeding import Fanout
from kpng.sinks import Runner, SinkSpec
from kpng.status import Sample, Status
from kpng.store import Store

if TYPE_CHECKING:
    from kpng.server.hub import Turns
    from kpng.server.serving import WatchStats


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        action="append",
        required=True,
        metavar="URL",
        help="tcp://HOST:PORT or unix:///PATH (repeatable)",
    )
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="server certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="server key (PEM)")
    parser.add_argument(
        "--tls-ca", type=Path, metavar="FILE", help="require client certificates signed by this CA"
    )
    parser.add_argument(
        "--token-audience",
        metavar="AUDIENCE",
        help="require a ServiceAccount token with this audience from every watcher, as gRPC "
        "metadata 'authorization: Bearer TOKEN', reviewed by the API server (TokenReview): a "
        "node agent may watch only the node its pod runs on (needs TLS on TCP)",
    )
    parser.add_argument(
        "--node-user",
        action="append",
        metavar="USER",
        help="with --token-audience: who may watch its own node's state (repeatable; default "
        f"{DEFAULT_NODE_USER})",
    )
    parser.add_argument(
        "--global-user",
        action="append",
        default=[],
        metavar="USER",
        help="with --token-audience: who may watch the global state (repeatable; default: nobody)",
    )
    parser.add_argument(
        "--review-kubeconfig",
        type=Path,
        metavar="PATH",
        help="with --token-audience: the API server that reviews tokens (default: $KUBECONFIG, "
        "then the in-cluster service account, then ~/.kube/config)",
    )
    # Defaults: kpng.server.serving's and kpng.server.auth's, not imported (grpc and protobuf
    # cost every command 0.1 s); tests/pure/test_status.py holds them equal.
    parser.add_argument(
        "--first-request-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a stream's first request must come within this long of the brain taking the "
        "call, and a resuming watcher's answer to each digest ask too, or the stream is ended "
        "(default: 60, longer than a mass connect's slowest watcher)",
    )
    parser.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=100,
        metavar="N",
        help="HTTP/2 streams a connection may hold open; a watcher needs one, two while it "
        "switches nodes (default: 100)",
    )
    parser.add_argument(
        "--token-reviews-per-second",
        type=float,
        metavar="RATE",
        help="with --token-audience: TokenReviews of tokens not yet known, at most, each second "
        "once the burst is spent (default: 100)",
    )
    parser.add_argument(
        "--token-review-burst",
        type=int,
        metavar="N",
        help="with --token-audience: TokenReviews of new tokens allowed at once (default: 1000)",
    )
    parser.add_argument(
        "--socket-mode",
        type=lambda s: int(s, 8),
        default=0o600,
        metavar="OCTAL",
        help="permissions of unix sockets (default 0600: the owner only)",
    )


def _create(
    args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None, status: Status
) -> Runner:
    # Imported here: grpc and protobuf cost other commands 0.1 s to import.
    from kpng.server import serving

    for flag, value in (
        ("--first-request-timeout", args.first_request_timeout),
        ("--max-streams-per-connection", args.max_streams_per_connection),
        ("--token-reviews-per-second", args.token_reviews_per_second),
        ("--token-review-burst", args.token_review_burst),
    ):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise UsageError(f"{flag} must be positive, got {value}")
    reviews = {
        key: value
        for key, value in (
            ("rate", args.token_reviews_per_second),
            ("burst", args.token_review_burst),
        )
        if value is not None
    }
    limits = {
        "first_request_s": args.first_request_timeout,
        "streams_per_connection": args.max_streams_per_connection,
    }
    listen = [serving.ListenAddress.parse(url) for url in args.listen]
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = serving.TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    elif args.tls_ca:
        raise UsageError("--tls-ca needs --tls-cert and --tls-key")
    if args.token_audience is None:
        if args.node_user or args.global_user or args.review_kubeconfig:
            raise UsageError(
                "--node-user, --global-user and --review-kubeconfig need --token-audience"
            )
        if reviews:
            raise UsageError(
                "--token-reviews-per-second and --token-review-burst need --token-audience"
            )
    elif tls is None and any(address.unix_path is None for address in listen):
        raise UsageError(
            "--token-audience on TCP needs --tls-cert and --tls-key: tokens are secrets"
        )

    def started(server: serving.Serving) -> None:
        status.samplers.append(
            functools.partial(_samples, server.watch.stats, server.watch.first_states)
        )

    async def run() -> None:
        if args.token_audience is None:
            await serving.serve(
                store,
                listen=listen,
                tls=tls,
                socket_mode=args.socket_mode,
                started=started,
                **limits,
            )
            return
        from kpng.kubeclient.client import ApiClient
        from kpng.kubeclient.config import load_connection
        from kpng.server.auth import TokenReviews, WatchAuth

        connection = await load_connection(args.review_kubeconfig)
        async with ApiClient(connection) as client:
            auth = WatchAuth(
                TokenReviews(client, audience=args.token_audience, **reviews),
                node_users=frozenset(args.node_user or [DEFAULT_NODE_USER]),
                global_users=frozenset(args.global_user),
            )
            await serving.serve(
                store,
                listen=listen,
                tls=tls,
                socket_mode=args.socket_mode,
                auth=auth,
                started=started,
                **limits,
            )

    return run


DEFAULT_NODE_USER = "system:serviceaccount:kube-system:kpng-node"
"""deploy/kpng-central.yaml's node agents."""


def _samples(stats: WatchStats, turns: Turns) -> Iterator[Sample]:
    for kind in ("local", "global"):
        labels = (("state", kind),)
        yield Sample(
            "kpng_api_watches",
            "watches open now, of node-local (localv1, batchv1 Watch) or global state",
            getattr(stats, f"{kind}_watches"),
            labels=labels,
        )
        yield Sample(
            "kpng_api_change_sets",
            "change sets sent to watchers",
            getattr(stats, f"{kind}_change_sets"),
            counter=True,
            labels=labels,
        )
    for outcome, n in stats.resumes.items():
        yield Sample(
            "kpng_api_resumes",
            "node watches that resumed from what they hold (batchv1 Holds), by outcome: "
            "unchanged, changed (only what differed sent), whole, refused (a bad answer)",
            n,
            counter=True,
            labels=(("outcome", outcome),),
        )
    for code, n in stats.calls_ended.items():
        yield Sample(
            "kpng_api_calls_ended",
            "watch calls ended, by status code: OK (the watcher ended its stream), "
            "CANCELLED (it vanished), or the brain's reason to end it",
            n,
            counter=True,
            labels=(("code", code),),
        )
    yield Sample(
        "kpng_api_watches_refused",
        "watches refused: no valid token, or a token asking for another node's state",
        stats.refused,
        counter=True,
    )
    yield Sample(
        "kpng_api_first_states_waiting",
        "node-local watches waiting for their turn to receive a first state",
        turns.waiting,
    )
    yield Sample(
        "kpng_api_first_state_oldest_wait_seconds",
        "how long the watch waiting longest for its first state has waited",
        turns.oldest_wait(time.monotonic()),
    )
    yield Sample(
        "kpng_api_first_states_parked",
        "first states kept for watchers that stalled while reading them",
        turns.parked,
    )
    yield Sample(
        "kpng_api_watches_ended",
        "watches ended for not reading their first state",
        turns.ended,
        counter=True,
    )


SPEC = SinkSpec(
    name="to-api",
    help="serve the node-local and global state over gRPC (localv1, globalv1, batchv1)",
    add_arguments=_add_arguments,
    create=_create,
)
