"""IP address and CIDR parsing, strict and fast: the file source checks every endpoint address."""

from __future__ import annotations

import ipaddress
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
