"""A TCP port of this network namespace's loopback, reachable on the same port of another
namespace's loopback: a program started there (a real kube-proxy) reaches the test control
plane, which listens on 127.0.0.1 here, with the control plane's kubeconfig as it is.

The listening socket is made by a thread that has entered the other namespace (``setns``
moves only the calling thread); a socket stays in the namespace it was made in, so the other
threads accept on it there and connect out from here.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

_CLONE_NEWNET = 0x40000000


def _listen_in(netns: str, port: int) -> socket.socket:
    made: list[socket.socket | BaseException] = []

    def enter_and_listen() -> None:
        # This thread ends right after: it never comes back to the test's namespace.
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(fd)
            listener = socket.create_server(("127.0.0.1", port))
            made.append(listener)
        except BaseException as exc:  # handed to the caller's thread
            made.append(exc)

    thread = threading.Thread(target=enter_and_listen, name=f"enter-{netns}")
    thread.start()
    thread.join()
    result = made[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@contextmanager
def forwarded_into(netns: str, port: int) -> Iterator[None]:
    """127.0.0.1:``port`` in ``netns`` leads to 127.0.0.1:``port`` here, until the block ends."""
    listener = _listen_in(netns, port)
    stopping = threading.Event()
    connections: list[socket.socket] = []

    def serve() -> None:
        while not stopping.is_set():
            try:
                inside, _ = listener.accept()
            except OSError:
                if stopping.is_set():
                    return
                continue
            try:
                outside = socket.create_connection(("127.0.0.1", port))
            except OSError:
                inside.close()
                continue
            connections.extend((inside, outside))
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    server = threading.Thread(target=serve, name=f"forward-{netns}-{port}", daemon=True)
    server.start()
    try:
        yield
    finally:
        stopping.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for s in connections:
            with suppress(OSError):
                s.close()
        server.join(timeout=5)
