"""``/debug/rules`` on the metrics address is what the kernel holds: kpng's to-nft in a network
namespace of the test's (the rest of the state view: tests/pure/test_debug_view.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kpng.testing.waiting import until
from tests.pure.test_debug_view import EXAMPLE, WAIT_S, _get, _kpng


def test_rules_are_what_the_kernel_holds(
    tmp_path: Path, subprocess_env: dict[str, str], netns: str
) -> None:
    argv = [
        "--metrics-bind-address", "127.0.0.1:10249",
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2", "to-nft",
    ]  # fmt: skip
    url = "http://127.0.0.1:10249/debug/rules"
    with _kpng(argv, subprocess_env, tmp_path / "kpng.log", netns=netns):
        # Until the first sync is in: its elements (before it, the answer says there is no table).
        until(lambda: 'comment "shop/web:http"' in _get(url, netns=netns)[1], within=WAIT_S)
        code, rules = _get(url, netns=netns)
        listed = subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "list", "table", "inet", "kpng"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert code == 200
        assert rules == f"# to-nft\n{listed}"
