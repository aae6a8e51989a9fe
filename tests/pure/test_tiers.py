"""The test tiers (tests/tiers.py): which tier a test is in, what a pure test may not use, and
the end-of-run summary, which names a tier none of whose tests ran rather than its reason."""

from __future__ import annotations

import pytest

from tests.tiers import NEEDS, Summary, misplaced, tier_of, tier_skip_reason


@pytest.mark.parametrize(
    ("nodeid", "tier"),
    [
        ("tests/pure/test_cli.py::test_output_is_deterministic", "pure"),
        ("tests/kernel/test_nft_kernel.py::test_x[a/b]", "kernel"),
        ("tests/nodes/test_real_cluster.py::test_x", "nodes"),
        ("tests/test_new.py::test_x", None),  # not placed in a tier yet
        ("tests/other/test_x.py::test_x", None),
        ("bench/test_x.py::test_x", None),
    ],
)
def test_a_tests_tier_is_its_folder(nodeid: str, tier: str | None) -> None:
    assert tier_of(nodeid) == tier


def test_a_pure_test_may_not_ask_for_root_or_a_control_plane() -> None:
    assert misplaced(["tmp_path", "kpng_command", "parametrize", "timeout"]) == {}
    assert misplaced(["tmp_path", "netns", "kube_api", "realcluster"]) == {
        "netns": "kernel",
        "kube_api": "apiserver",
        "realcluster": "nodes",
    }


def test_a_tier_that_did_not_run_is_one_line_naming_it() -> None:
    whole = tier_skip_reason("kernel", "network namespaces need root")
    summary = Summary(
        {
            "tests/kernel/test_a.py::test_1": whole,
            "tests/kernel/test_a.py::test_2": whole,
            "tests/kernel/test_b.py::test_3": "needs ipset",  # its own reason, still the tier
            "tests/pure/test_c.py::test_4": None,
            "tests/pure/test_c.py::test_5": "set KPNG_X to run it",
            "tests/packaging/test_d.py::test_6": "needs make",
            "tests/packaging/test_d.py::test_7": None,
        }
    )
    assert summary.tiers == {"kernel": (3, whole)}
    assert whole.startswith(f"the kernel tier needs {NEEDS['kernel']}: ")
    assert summary.reasons == {"set KPNG_X to run it": 1, "needs make": 1}


def test_tests_outside_the_tiers_are_counted_by_reason() -> None:
    summary = Summary({"tests/test_new.py::test_1": "needs nft", "tests/test_new.py::test_2": None})
    assert summary.tiers == {}
    summary = Summary({"tests/test_new.py::test_1": "needs nft"})
    assert summary.tiers == {}
    assert summary.reasons == {"needs nft": 1}
