"""``kpng.errors.field_problem``: msgspec's ValidationError read into its parts, which the
KubeProxyConfiguration and kubeconfig readers word for their users (pure, a table)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kpng.errors import FieldProblem, field_problem


class _Inner(msgspec.Struct, forbid_unknown_fields=True):
    port: int | None = None


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    inner: _Inner | None = None


class _Document(msgspec.Struct, forbid_unknown_fields=True):
    entries: list[_Entry] | None = None
    inner: _Inner | None = None


@pytest.mark.parametrize(
    ("document", "problem", "dotted", "value"),
    [
        ({"bogus": 1}, FieldProblem(path=(), unknown="bogus"), "", None),
        ({"inner": {"prot": 1}}, FieldProblem(path=("inner",), unknown="prot"), "inner", None),
        ({"entries": [{}, {"inner": {"port": "80"}}]},
         FieldProblem(path=("entries", 1, "inner", "port"), expected="int"),
         "entries[1].inner.port", "80"),
        ({"inner": 5}, FieldProblem(path=("inner",), expected="object"), "inner", 5),
        ({"entries": [{1: 2}]}, FieldProblem(path=("entries", 0), key=True), "entries[0]", None),
        ({2: 1}, FieldProblem(path=(), key=True), "", None),
    ],
)  # fmt: skip
def test_a_validation_error_is_read_into_its_path_and_what_is_wrong(
    document: dict[Any, Any], problem: FieldProblem, dotted: str, value: object
) -> None:
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.convert(document, _Document)
    got = field_problem(raised.value)
    assert got == problem
    assert got.dotted == dotted
    if value is not None:
        assert got.value(document) == value
    if got.key:
        assert got.bad_key(document) in (1, 2)
