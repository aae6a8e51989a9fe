"""IP address and CIDR parsing, strict and fast: the file source checks every endpoint address."""

from __future__ import annotations

import ipaddress
import re
import socket


class BadAddress(ValueError):
    pass


def parse_ip(text: str) -> tuple[bool, str]:
    """(is_v6, canonical text) of an IP address; raises BadAddress for anything else.

    IPv4 must be dotted quads without leading zeros (what Kubernetes validation accepts); IPv6 is
    returned in its canonical compressed form so that equal addresses compare equal.
    """
    if ":" in text:
        try:
            return True, socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, text))
        except (OSError, ValueError):
            raise BadAddress(f"invalid IP address {text!r}") from None
    try:
        socket.inet_pton(socket.AF_INET, text)
    except (OSError, ValueError):
        raise BadAddress(f"invalid IP address {text!r}") from None
    return False, text


def parse_cidr(text: str) -> tuple[bool, str]:
    """(is_v6, canonical network) of a CIDR; host bits are cleared as the kernel would."""
    try:
        net = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise BadAddress(f"invalid CIDR {text!r}") from None
    return net.version == 6, str(net)


# Kubernetes before 1.20 stored IPv4 addresses with leading zeros ("010.000.001.002"), and still
# keeps them: kube-proxy reads such stored values with netutils.ParseIPSloppy, each part in
# decimal (not octal, as inet_aton would). kpng reads Services the same way, or an old Service
# would be dropped by kpng where kube-proxy serves it.
_DOTTED = re.compile(r"([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)")
_PREFIX = re.compile(r"[0-9]+")


def _decimal_quad(text: str) -> str | None:
    """A dotted quad whose parts may have leading zeros, as canonical text; None otherwise."""
    match = _DOTTED.fullmatch(text)
    if match is None:
        return None
    # Stripped before int(): a run of zeros as long as Python's int limit is still one octet.
    parts = [part.lstrip("0") or "0" for part in match.groups()]
    if any(len(part) > 3 or int(part) > 255 for part in parts):
        return None
    return ".".join(parts)


def parse_ip_sloppy(text: str) -> tuple[bool, str]:
    """parse_ip, but IPv4 parts (alone or ending an IPv6 address) may have leading zeros, read
    as decimal: kube-proxy's reading of the IPs stored in a Service."""
    head, colon, tail = text.rpartition(":")
    quad = _decimal_quad(tail)
    if quad is not None:
        return parse_ip(f"{head}{colon}{quad}")
    return parse_ip(text)


def parse_cidr_sloppy(text: str) -> tuple[bool, str]:
    """parse_cidr as kube-proxy reads a Service's loadBalancerSourceRanges: ADDRESS/BITS only
    (no bare address, no netmask), the address read as parse_ip_sloppy reads it."""
    address, slash, bits = text.strip().partition("/")
    if not slash or _PREFIX.fullmatch(bits) is None:
        raise BadAddress(f"invalid CIDR {text!r}")
    try:
        is_v6, ip = parse_ip_sloppy(address)
    except BadAddress:
        raise BadAddress(f"invalid CIDR {text!r}") from None
    length = bits.lstrip("0") or "0"
    if len(length) > 3 or int(length) > (128 if is_v6 else 32):
        raise BadAddress(f"invalid CIDR {text!r}")
    return parse_cidr(f"{ip}/{length}")
