"""The backend conformance suite (``kpng.testing.conformance``), run against to-nft.

Needs root, nft and iproute2 (skipped otherwise); ``KPNG_CONFORMANCE_BACKEND`` picks another
backend command.
"""

from kpng.testing.conformance import *  # noqa: F403
from kpng.testing.conformance import Cluster


def test_to_nft_had_no_transaction_refused(cluster: Cluster) -> None:
    """Last (tests run in the order they are defined): the kernel took every transaction of
    every node. A refused one is followed by a full resync, which hides it from the cases."""
    refused = [
        line
        for log in sorted(cluster.logs.glob("*.log"))
        for line in log.read_text().splitlines()
        if "nft refused" in line
    ]
    assert refused == []
