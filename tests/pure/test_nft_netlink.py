"""netlink.py's elements, byte for byte as nft 1.0.6 sends them (``nft --debug=mnl add element
...``), and the split of a first sync into dormant text and one netlink batch. The kernel's side
is in test_nft_kernel.py."""

from __future__ import annotations

import struct

import pytest

from kpng.backends._nftables.diffing import TableState, Touched
from kpng.backends._nftables.layout import TABLE, Options, contribute
from kpng.backends._nftables.netlink import encoder, split_fresh
from kpng.backends._nftables.nftables import ElementFields, Elements, Map, Set, TableObjects
from kpng.testing.states import keyed_state
from tests.nft_services import generate

# nft's own attributes for each element, read off `nft --debug=mnl` (lengths, then payloads).
GOTO_WITH_COMMENT = bytes.fromhex(
    "48000180"  # list element (nested), 72 bytes
    "14000180"
    "10000100"
    "0a000001"
    "11000000"
    "00350000"  # key: 10.0.0.1 . udp . 53
    "1c000280"
    "18000280"
    "08000100"
    "fffffffc"
    "09000200"
    "7069636b00000000"  # goto pick
    "11000600"
    "000b"
    "6e732f7765623a646e7300"
    "000000"  # comment "ns/web:dns"
)
ENDPOINT = bytes.fromhex(
    "28000180"
    "14000180"
    "10000100"
    "0a000001"
    "06000000"
    "00500000"  # 10.0.0.1 . tcp . 80
    "10000280"
    "0c000100"
    "0a010203"
    "1f900000"  # : 10.1.2.3 . 8080
)
ADDRESS = bytes.fromhex("100001800c000180080001000a090807")  # 10.9.8.7
PORT = bytes.fromhex("14000180100001800c0001000600000075800000")  # tcp . 30080

VERDICT_MAP = Map("m", "verdict", type="ipv4_addr . inet_proto . inet_service")
ENDPOINT_MAP = Map("e", "ipv4_addr . inet_service", type="ipv4_addr . inet_proto . inet_service")


@pytest.mark.parametrize(
    ("container", "item", "expected"),
    [
        (VERDICT_MAP, '10.0.0.1 . udp . 53 comment "ns/web:dns" : goto pick', GOTO_WITH_COMMENT),
        (ENDPOINT_MAP, "10.0.0.1 . tcp . 80 : 10.1.2.3 . 8080", ENDPOINT),
        (Set("s", type="ipv4_addr"), "10.9.8.7", ADDRESS),
        (Set("p", type="inet_proto . inet_service"), "tcp . 30080", PORT),
    ],
)
def test_an_element_is_encoded_as_nft_encodes_it(
    container: Set | Map, item: str, expected: bytes
) -> None:
    encode = encoder(container)
    assert encode is not None
    assert encode(item) == expected


@pytest.mark.parametrize(
    "container",
    [
        Set("cidrs", type="ipv4_addr", flags=("interval",)),
        Set("affinity", typeof="ip saddr . numgen inc mod 1", flags=("dynamic", "timeout")),
        Map("t", "verdict", type="ipv4_addr", timeout_s=10),
        Set("macs", type="ether_addr"),
        Map("marks", "mark", type="ipv4_addr"),
    ],
)
def test_containers_whose_elements_stay_text(container: Set | Map) -> None:
    assert encoder(container) is None


@pytest.mark.parametrize(
    "item", ["10.0.0.1 . udp", "10.0.0.256 . tcp . 80 : goto pick", "10.0.0.1 . tcp . 99999"]
)
def test_an_element_that_cannot_be_encoded_is_an_error(item: str) -> None:
    encode = encoder(VERDICT_MAP)
    assert encode is not None
    with pytest.raises(ValueError, match="element"):
        encode(item)


def _state(count: int = 40) -> TableState:
    store = TableState(Options())
    for key, se in keyed_state(1, generate(count)).services.items():
        store.update(key, contribute(se, ()), Touched())
    return store


def test_a_first_sync_splits_into_dormant_text_and_one_batch_that_wakes_the_table() -> None:
    tx = _state().full(None).tx
    split = split_fresh(tx)
    assert split is not None
    text, batch = split.text, split.batch()
    rendered = text.render()
    assert rendered.startswith("add table inet kpng { comment ")
    assert "flags dormant ; }" in rendered.splitlines()[2]
    # Only what the encoder takes left the text; chains, rules and interval sets stay.
    moved = {op.obj.container for op in tx.operations if isinstance(op.obj, Elements)} - {
        op.obj.container for op in text.operations if isinstance(op.obj, Elements)
    }
    assert "cluster-v4" in moved
    assert len(text) < len(tx)
    kinds = [struct.unpack_from("=H", m, 4)[0] for m in batch]
    assert kinds[0] == 0x10  # the batch's begin
    assert kinds[-1] == 0x11  # and end
    assert kinds[-2] == 10 << 8  # NFT_MSG_NEWTABLE: the wake, last in the batch
    assert set(kinds[1:-2]) == {(10 << 8) | 12}  # NFT_MSG_NEWSETELEM
    assert all(len(m) < 65_536 for m in batch)


def test_only_a_full_sync_that_makes_the_table_anew_is_split() -> None:
    store = _state()
    assert split_fresh(store.full(TableObjects(chains=frozenset({"services"}))).tx) is None
    store.commit(store.full(None))
    touched = Touched()
    (key,) = list(store.contributions)[:1]
    store.update(key, None, touched)
    assert split_fresh(store.incremental(touched).tx) is None
    assert TABLE.dormant is False


def test_elements_encoded_from_their_fields_are_those_encoded_from_their_text() -> None:
    """A full sync's items give their fields (``ElementFields``), sent without being rendered;
    the bytes are those of the rendered text."""
    tx = _state().full(None).tx
    checked = 0
    containers = {op.obj.name: op.obj for op in tx.operations if isinstance(op.obj, Set | Map)}
    for op in tx.operations:
        if not isinstance(op.obj, Elements):
            continue
        encode = encoder(containers[op.obj.container])
        items = op.obj.items
        if encode is None:
            continue
        assert isinstance(items, ElementFields)
        by_fields = sorted(encode.element(*f) for f in items.fields())  # in the plan's order
        assert by_fields == sorted(encode(i) for i in items)  # sorted, rendered, parsed back
        assert sorted(encode.element(*f) for f in items.fields()) == by_fields  # now sorted
        checked += len(items)
    assert checked > 400
