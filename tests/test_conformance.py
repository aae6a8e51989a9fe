"""The backend conformance suite (``kpng.testing.conformance``), run against to-nft.

Needs root, nft and iproute2 (skipped otherwise); ``KPNG_CONFORMANCE_BACKEND`` picks another
backend command.
"""

from kpng.testing.conformance import *  # noqa: F403
