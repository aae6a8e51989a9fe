"""netfilter's extended accounting (nfnetlink_acct): named packet counters that iptables rules
count into with ``-m nfacct --nfacct-name NAME``, made and read over netlink.

kube-proxy's iptables mode (1.37, pkg/proxy/util/nfacct) counts two things so:
``ct_state_invalid_dropped_pkts``, the forwarded packets its INVALID rule drops, and
``localhost_nps_accepted_pkts``, the packets to node ports on 127.0.0.0/8 it accepts; its
``/metrics`` reads them at each scrape as
``kubeproxy_iptables_ct_state_invalid_dropped_packets_total`` and
``kubeproxy_iptables_localhost_nodeports_accepted_packets_total``. A kernel without
nfnetlink_acct answers neither a read nor a creation; kube-proxy then writes its rules without the
match and exports neither series, and to-iptables does the same.

The encoders and the parser are pure over bytes; ``Nfacct`` does the I/O, blocking and brief (one
request and its answer on a fresh socket), in the thread that calls it.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

from kpng.backends._netlink import (
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    attr,
    messages,
    nested_attributes,
    netfilter_socket,
)

INVALID_DROPPED = "ct_state_invalid_dropped_pkts"
LOCALHOST_ACCEPTED = "localhost_nps_accepted_pkts"
COUNTERS = (INVALID_DROPPED, LOCALHOST_ACCEPTED)
"""kube-proxy's object names: a node moving between kube-proxy and kpng keeps its counts."""
MAX_NAME = 31
"""The kernel's NFACCT_NAME_MAX less its terminating NUL."""

NFNL_SUBSYS_ACCT = 7
NFNL_MSG_ACCT_NEW, NFNL_MSG_ACCT_GET = 0, 1
NFACCT_NAME, NFACCT_PKTS = 1, 2
_NLM_F_CREATE = 0x400
_HEADER = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("=BBH")
_ERRNO = struct.Struct("=i")


def request(command: int, name: str, *, create: bool = False) -> bytes:
    """An ``NFNL_MSG_ACCT_NEW`` or ``_GET`` of object ``name``, asking for an acknowledgement."""
    encoded = name.encode()
    if not encoded or len(encoded) > MAX_NAME:
        raise ValueError(f"nfacct object name {name!r}: 1 to {MAX_NAME} bytes")
    flags = NLM_F_REQUEST | NLM_F_ACK | (_NLM_F_CREATE if create else 0)
    payload = _NFGENMSG.pack(0, 0, 0) + attr(NFACCT_NAME, encoded + b"\0")
    kind = NFNL_SUBSYS_ACCT << 8 | command
    return _HEADER.pack(_HEADER.size + len(payload), kind, flags, 1, 0) + payload


@dataclass(frozen=True)
class Answer:
    """What the kernel answered a request: an errno (0: done), and an object's packets if it
    sent one."""

    error: int = 0
    packets: int | None = None


def parse(reply: bytes) -> Answer:
    """The kernel's answer to one request, from the datagrams it sent (concatenated)."""
    error, packets = 0, None
    for kind, message in messages(reply):
        if kind == NLMSG_ERROR and len(message) >= _HEADER.size + _ERRNO.size:
            (code,) = _ERRNO.unpack_from(message, _HEADER.size)
            error = error or -code
        elif kind >> 8 == NFNL_SUBSYS_ACCT:
            body = message[_HEADER.size + _NFGENMSG.size :]
            for attribute, value in nested_attributes(body):
                if attribute == NFACCT_PKTS and len(value) == 8:
                    (packets,) = struct.unpack(">Q", value)
    return Answer(error, packets)


class Nfacct:
    """nfacct objects of this process's network namespace, or of the one at path ``netns``."""

    def __init__(self, netns: str | None = None) -> None:
        self._netns = netns

    def _ask(self, message: bytes) -> Answer:
        with netfilter_socket(self._netns) as sock:
            sock.bind((0, 0))
            sock.settimeout(1.0)
            sock.send(message)
            reply = b""
            # The object (if any) comes first, then the acknowledgement: read up to that.
            while not any(kind == NLMSG_ERROR for kind, _ in messages(reply)):
                part = sock.recv(1 << 16)
                if not part:
                    break
                reply += part
        return parse(reply)

    def packets(self, name: str) -> int | None:
        """The packets object ``name`` counted; None if there is no such object. Raises
        ``OSError`` if the kernel refuses the read (no nfnetlink_acct)."""
        answer = self._ask(request(NFNL_MSG_ACCT_GET, name))
        if answer.error == errno.ENOENT:
            return None
        if answer.error:
            raise OSError(answer.error, f"nfacct {name}: {os.strerror(answer.error)}")
        if answer.packets is None:
            raise OSError(errno.EPROTO, f"nfacct {name}: the kernel sent no count")
        return answer.packets

    def ensure(self, name: str) -> None:
        """Make object ``name`` unless it exists. Raises ``OSError`` if the kernel refuses."""
        if self.packets(name) is not None:
            return
        answer = self._ask(request(NFNL_MSG_ACCT_NEW, name, create=True))
        # EBUSY: made meanwhile by another (kube-proxy's handling too).
        if answer.error and answer.error != errno.EBUSY:
            raise OSError(answer.error, f"nfacct {name}: {os.strerror(answer.error)}")
