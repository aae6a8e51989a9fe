"""``LibNft`` (libnftables in process) against the kernel, in network namespaces of its own (root
and nft needed), held to what ``KernelNft`` (the ``nft`` command) does.

LibNft runs in ``ip netns exec NS python -m tests.kernel.libnft_scenarios`` (a library talks to the
namespace of its process), and the test reads the namespace with ``nft``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kpng
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft, LibNft, default_nft
from kpng.backends._nftables.nftables import NftError
from kpng.testing.netns import available
from kpng.testing.states import keyed_state
from tests.kernel import libnft_scenarios as scenarios
from tests.kernel.test_nft_kernel import _table

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(kpng.__file__).resolve().parent.parent

root_and_nft = pytest.mark.skipif(available() is not None, reason=str(available()))


def _libnft_loads() -> bool:
    try:
        LibNft().close()
    except (OSError, AttributeError):
        return False
    return True


needs_libnft = pytest.mark.skipif(not _libnft_loads(), reason="libnftables.so.1 cannot be loaded")


def _scenario(netns: str, *args: str) -> object:
    """Run a scenario of ``tests.kernel.libnft_scenarios`` in ``netns``; its result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(ROOT)])}
    argv = [sys.executable, "-m", "tests.kernel.libnft_scenarios", *args]
    out = subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _nft(netns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nft", *args], capture_output=True, text=True, check=False
    )


def _elements(netns: str) -> list[str]:
    out = _nft(netns, "-j", "list", "set", "inet", scenarios.T.name, "s")
    assert out.returncode == 0, out.stderr
    (elements,) = [item["set"].get("elem", []) for item in json.loads(out.stdout)["nftables"][1:]]
    return sorted(elements)


def _rules(netns: str) -> str:
    return _nft(netns, "list", "chain", "inet", scenarios.T.name, "c").stdout


@root_and_nft
@needs_libnft
def test_applies_in_the_namespace_of_its_process(netns: str) -> None:
    assert _scenario(netns, "apply") is None
    assert _elements(netns) == ["192.0.2.1"]
    assert "ip daddr @s accept" in _rules(netns)
    # Not in the namespace pytest runs in.
    assert (
        subprocess.run(
            ["nft", "list", "table", "inet", scenarios.T.name], capture_output=True, check=False
        ).returncode
        != 0
    )


@root_and_nft
@needs_libnft
@pytest.mark.parametrize("kind", ["eval", "kernel"])
def test_refuses_a_bad_transaction_whole_naming_its_line_as_the_nft_command_does(
    namespaces: Callable[[], str], kind: str
) -> None:
    lib_ns, command_ns = namespaces(), namespaces()
    error = _scenario(lib_ns, "refuse", kind)
    # Nothing of the refused transaction (its first line was fine); the context took the next.
    assert _elements(lib_ns) == ["192.0.2.1", "192.0.2.5"]
    assert "drop" not in _rules(lib_ns)

    async def with_the_command() -> NftError:
        nft = KernelNft(("ip", "netns", "exec", command_ns, "nft"))
        await nft.run(scenarios.first())
        with pytest.raises(NftError) as caught:
            await nft.run(scenarios.refused(kind))
        return caught.value

    expected = asyncio.run(with_the_command())
    assert expected.line_number == 3
    # "Could not process rule": the kernel's refusal, when nft had sent the transaction.
    assert expected.message.startswith("Could not process rule") == (kind == "kernel")
    assert error == {
        "message": expected.message,
        "line_number": expected.line_number,
        "line": expected.line,
    }


@root_and_nft
@needs_libnft
def test_delete_table_says_whether_there_was_one(netns: str) -> None:
    assert _scenario(netns, "delete") == [False, True, False]
    assert _nft(netns, "list", "table", "inet", scenarios.T.name).returncode != 0


@root_and_nft
@needs_libnft
def test_event_loop_keeps_serving_while_a_long_transaction_runs(netns: str) -> None:
    result = _scenario(netns, "serve")
    assert isinstance(result, dict)
    assert result["seconds"] > 0.1, "too short a transaction to show anything"
    # Blocked, the ticker would not have run at all until the transaction was over.
    assert result["ticks"] >= 5
    out = _nft(netns, "list", "set", "inet", scenarios.T.name, "big")
    assert "10.1.134.159" in out.stdout  # element 99,999


@root_and_nft
@needs_libnft
def test_one_context_takes_every_incremental_transaction_as_the_nft_command_would(
    namespaces: Callable[[], str],
) -> None:
    """The context caches what it read of the table between transactions: random changes
    through it end with the table one full sync of the last state writes with the command."""
    changed, fresh = namespaces(), namespaces()
    errors = _scenario(changed, "changes")
    assert errors == [None] * 21
    last = keyed_state(1, scenarios.change_states()[-1].services)
    nft = KernelNft(("ip", "netns", "exec", fresh, "nft"))
    asyncio.run(NftBackend(nft=nft, options=scenarios.CHANGES_OPTIONS).apply(last))
    assert _table(changed) == _table(fresh)


def test_without_libnftables_the_nft_command_runs_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kpng.backends._nftables.executing")
    assert isinstance(default_nft("libnftables-that-is-not-there.so.1"), KernelNft)
    assert len(caplog.records) == 1
    assert "libnftables-that-is-not-there.so.1" in caplog.text


LISTED = """\
add table inet kpng
add chain inet kpng services
add chain inet kpng nat-output { type nat hook output priority -100 ; }
add rule inet kpng services ip daddr 10.0.0.1 accept
add set inet kpng memory { type ipv4_addr ; flags dynamic,timeout ; }
add element inet kpng memory { 10.0.0.9 timeout 60s }
add map inet kpng dispatch { type ipv4_addr : verdict ; }
add element inet kpng dispatch { 10.0.0.1 : goto services }
add table inet other
add chain inet other elsewhere
add table ip kpng
add chain ip kpng other-family
"""


@pytest.mark.parametrize("executor", ["lib", "command"])
def test_both_executors_list_the_objects_of_one_table(netns: str, executor: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=LISTED.encode(), check=True
    )
    script = (
        "import asyncio\n"
        "from kpng.backends._nftables.executing import KernelNft, LibNft\n"
        "from kpng.backends._nftables.nftables import Table\n"
        f"nft = {'LibNft()' if executor == 'lib' else 'KernelNft()'}\n"
        "for name in ('kpng', 'none'):\n"
        "    o = asyncio.run(nft.list_objects(Table('inet', name)))\n"
        "    print(o and [sorted(o.chains), sorted(o.sets), sorted(o.maps)])\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found, missing = done.stdout.splitlines()
    # Neither another table's objects nor those of a table of that name in another family.
    assert found == "[['nat-output', 'services'], ['memory'], ['dispatch']]"
    assert missing == "None"
