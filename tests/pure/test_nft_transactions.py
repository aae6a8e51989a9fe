"""The typed transaction and the fake nft: validation, rendering, reference checks, atomicity."""

from __future__ import annotations

import asyncio

import pytest

from kpng.backends._nftables.executing import parse_error
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.nftables import (
    Chain,
    Element,
    Elements,
    InvalidNftObject,
    Map,
    NftError,
    Rule,
    Set,
    Table,
    Transaction,
    comment_name,
)

T = Table("inet", "t")


def _run(nft: FakeNft, tx: Transaction) -> None:
    asyncio.run(nft.run(tx))


def _base() -> Transaction:
    return (
        Transaction(T)
        .add(T)
        .add(Chain("pre", "nat", "prerouting", "dstnat"))
        .add(Chain("pick"))
        .add(Map("svc", "verdict", type="ipv4_addr . inet_proto . inet_service"))
        .add(Set("addrs", type="ipv4_addr"))
        .add(Rule("pre", "ip daddr . meta l4proto . th dport vmap @svc"))
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Chain("bad name"), "invalid chain name"),
        (lambda: Chain("c", "nat", "prerouting"), "needs a type"),
        (lambda: Chain("c", "nat", "sideways", "0"), "needs a type"),
        (lambda: Rule("c", "drop; accept"), "one expression"),
        (lambda: Set("s"), "exactly one of type and typeof"),
        (lambda: Map("m", "verdict", type="ipv4_addr", typeof="ip daddr"), "exactly one"),
        (lambda: Element("s", ()), "empty key"),
        (lambda: Element("s", ("1.2.3.4 . 5",)), "invalid field"),
        (lambda: Table("bridge", "t"), "invalid table family"),  # type: ignore[arg-type]
    ],
)
def test_invalid_objects_are_refused_when_made(make: object, message: str) -> None:
    with pytest.raises(InvalidNftObject, match=message):
        make()  # type: ignore[operator]


def test_rendering_batches_consecutive_elements_of_one_container() -> None:
    tx = Transaction(T)
    tx.add(Element("svc", ("10.0.0.1", "tcp", "80"), ("goto pick",)))
    tx.add(Element("svc", ("10.0.0.2", "tcp", "80"), ("drop",)))
    tx.add(Element("addrs", ("10.0.0.1",)))
    tx.delete(Element("svc", ("10.0.0.3", "tcp", "80"), ("drop",)))
    assert tx.render().splitlines() == [
        "add element inet t svc { 10.0.0.1 . tcp . 80 : goto pick, 10.0.0.2 . tcp . 80 : drop }",
        "add element inet t addrs { 10.0.0.1 }",
        "delete element inet t svc { 10.0.0.3 . tcp . 80 }",
    ]


def test_fake_applies_a_valid_transaction_and_dumps_it_sorted() -> None:
    nft = FakeNft()
    tx = _base()
    tx.add(Element("svc", ("10.0.0.2", "tcp", "80"), ("goto pick",)))
    tx.add(Element("svc", ("10.0.0.1", "udp", "53"), ("drop",)))
    _run(nft, tx)
    assert nft.dump() == (
        "table inet t\n"
        "  set addrs\n"
        "  map svc\n"
        "    10.0.0.1 . udp . 53 : drop\n"
        "    10.0.0.2 . tcp . 80 : goto pick\n"
        "  chain pick\n"
        "  chain pre (nat prerouting dstnat)\n"
        "    ip daddr . meta l4proto . th dport vmap @svc\n"
    )


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (lambda tx: tx.add(Rule("pre", "ip daddr @nosuch drop")), "set nosuch"),
        (lambda tx: tx.add(Rule("pre", "jump nowhere")), "chain nowhere"),
        (lambda tx: tx.add(Rule("nochain", "drop")), "chain nochain"),
        (
            lambda tx: tx.add(Element("svc", ("1.2.3.4", "tcp", "80"), ("goto nowhere",))),
            "chain nowhere",
        ),
        (lambda tx: tx.add(Element("svc", ("1.2.3.4", "tcp"), ("drop",))), "has 3 fields"),
        (lambda tx: tx.add(Element("addrs", ("1.2.3.4",), ("drop",))), "takes no value"),
        (lambda tx: tx.delete(Element("addrs", ("9.9.9.9",))), "element 9.9.9.9"),
        (lambda tx: tx.delete(Chain("pre", "nat", "prerouting", "dstnat")), "has rules"),
        (
            lambda tx: tx.delete(Set("addrs", type="ipv4_addr")).delete(
                Set("addrs", type="ipv4_addr")
            ),
            "set addrs",
        ),
    ],
)
def test_fake_refuses_what_the_kernel_refuses_and_keeps_its_state(op: object, message: str) -> None:
    nft = FakeNft()
    _run(nft, _base())
    before = nft.dump()
    tx = Transaction(T).add(Element("addrs", ("10.1.1.1",)))
    op(tx)  # type: ignore[operator]
    with pytest.raises(NftError, match=message) as info:
        _run(nft, tx)
    assert info.value.line_number >= 1
    assert nft.dump() == before  # all or nothing


def test_fake_refuses_deleting_a_chain_an_element_still_jumps_to() -> None:
    nft = FakeNft()
    tx = _base().add(Element("svc", ("10.0.0.1", "tcp", "80"), ("goto pick",)))
    _run(nft, tx)
    with pytest.raises(NftError, match="used by element of svc"):
        _run(nft, Transaction(T).delete(Chain("pick")))


def test_kernel_error_names_the_failing_rendered_line() -> None:
    tx = _base()
    stderr = (
        "/dev/stdin:6:23-25: Error: No such file or directory\n"
        "add rule inet t pre ip daddr . meta l4proto . th dport vmap @svc\n"
    )
    error = parse_error(tx, stderr)
    assert error.line_number == 6
    assert error.line == "add rule inet t pre ip daddr . meta l4proto . th dport vmap @svc"
    assert "No such file or directory" in str(error)


def test_an_element_names_its_service_port_in_a_comment() -> None:
    element = Element("cluster-v4", ("10.96.0.10", "tcp", "80"), ("goto x",), "shop/web:http")
    assert element.render() == '10.96.0.10 . tcp . 80 comment "shop/web:http" : goto x'
    assert element.render(with_value=False) == '10.96.0.10 . tcp . 80 comment "shop/web:http"'
    # A full sync's pre-rendered items read back as the same elements.
    assert Elements("cluster-v4", [element.render()]).expand() == [element]
    assert comment_name("shop", "web") == "shop/web"
    assert comment_name("shop", "web", "http") == "shop/web:http"
    assert len(comment_name("n" * 63, "s" * 63, "p" * 15)) == 128


@pytest.mark.parametrize("comment", ['a"b', "a b", "x;y", "c" * 129])
def test_a_comment_nft_would_misread_is_refused(comment: str) -> None:
    with pytest.raises(InvalidNftObject):
        Element("cluster-v4", ("10.96.0.10",), (), comment)
