"""docs/design/versioning.md's wire rules, checked against the protos: no released field or enum
value changes its number or type or disappears without being reserved; nothing new goes unrecorded;
Go KPNG's localv1 and globalv1 fields stay as Go KPNG has them, and kpng's additions to Go KPNG's
messages are numbered from 100 up."""

from __future__ import annotations

import json

from tests.pure import wire_lock


def _locked() -> dict[str, dict[str, int | str]]:
    locked: dict[str, dict[str, int | str]] = json.loads(wire_lock.LOCK.read_text())
    return locked


def test_released_numbers_keep_their_meaning_or_are_reserved() -> None:
    now = wire_lock.entries()
    reserved = wire_lock.reserved()
    broken = []
    for name, was in _locked().items():
        if name in now:
            if now[name] != was:
                broken.append(f"{name}: was {was}, is {now[name]}")
            continue
        message = name.rsplit(".", 1)[0]
        if was["type"] != "enum" and was["number"] not in reserved.get(message, set()):
            broken.append(f"{name} (#{was['number']}) is gone but its number is not reserved")
    assert not broken, "\n".join(broken)


def test_no_number_is_used_twice_in_a_message() -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, entry in {**_locked(), **wire_lock.entries()}.items():
        key = (name.rsplit(".", 1)[0], int(entry["number"]))
        assert seen.setdefault(key, name) == name, f"#{key[1]} of {key[0]}: {seen[key]}, {name}"


def test_every_field_is_recorded_in_the_lock() -> None:
    new = sorted(set(wire_lock.entries()) - set(_locked()))
    assert not new, f"not in {wire_lock.LOCK.name} (python -m tests.pure.wire_lock --update): {new}"


def test_go_kpng_fields_are_kept_and_kpng_extends_its_messages_from_100() -> None:
    go_kpng: dict[str, dict[str, int | str]] = json.loads(wire_lock.GO_KPNG.read_text())
    now = wire_lock.entries()
    assert {k: now.get(k) for k in go_kpng} == go_kpng
    go_messages = {name.rsplit(".", 1)[0] for name in go_kpng}
    low = [
        name
        for name, entry in now.items()
        if name.rsplit(".", 1)[0] in go_messages
        and name not in go_kpng
        and entry["type"] != "enum"
        and int(entry["number"]) < 100
    ]
    assert not low, f"kpng fields below 100 in Go KPNG's messages: {low}"
