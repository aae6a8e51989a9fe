"""The head of an HTTP/1.1 message (start line and header fields), both directions."""

from __future__ import annotations

import asyncio


class HttpError(Exception):
    """A peer broke the protocol: a malformed head, a body cut short, a refused tunnel."""


async def read_head(reader: asyncio.StreamReader) -> bytes:
    """The next head, up to and including its blank line; b"" at a clean end of stream (no
    byte of a new head came)."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return b""
        raise HttpError("the connection closed inside a message head") from None
    except asyncio.LimitOverrunError:
        # The limit is the stream's own (``limit=`` where it was made): the client's and the
        # server's differ.
        raise HttpError("a message head longer than the connection takes") from None


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The start line and the header fields, by lower-case name; a field given more than once
    is one value, joined by ", " as RFC 9110 allows."""
    start, *lines = head.rstrip(b"\r\n").split(b"\r\n")
    fields: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise HttpError(f"a malformed header field: {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        fields[key] = f"{fields[key]}, {text}" if key in fields else text
    return start.decode("latin-1"), fields


def encode_fields(fields: dict[str, str]) -> bytes:
    """Header fields as sent, each ending in CRLF. A value with a line break would start a header
    of its own (request smuggling), so it is refused."""
    out = []
    for name, value in fields.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a line break in the header field {name!r}")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


def keeps_alive(version: str, fields: dict[str, str]) -> bool:
    """Whether the connection stays open after this message (HTTP/1.1 unless told to close,
    HTTP/1.0 only when told to keep it)."""
    tokens = {t.strip().lower() for t in fields.get("connection", "").split(",")}
    if version == "HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens
