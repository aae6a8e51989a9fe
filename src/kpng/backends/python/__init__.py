"""``to-python --module FILE[:NAME]``: a backend in a Python file, loaded in process, for quick
experiments without packaging an entry point.

NAME (default ``backend``) is, in the file:
- a Backend (``async apply(state) -> done``, ``async close()``);
- a Sink (``reset``, ``set_service``... ``sync``), fed the watch API's calls (SinkBackend);
- a handler function, plain or async, called with each NodeState (returning True ends kpng);
- or a class of one of these, made with no arguments.

``--once`` ends kpng (exit 0) after the first complete state has been applied, as ``to-json
--once`` does, whatever the backend returns: a backend written to follow changes can be tried
on one state without editing it.

The file is run as a module named after it; it imports kpng.client as any backend does.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from kpng.client import (
    Backend,
    BackendSpec,
    Handler,
    NodeState,
    Sink,
    SinkBackend,
    UsageError,
    register,
)

DEFAULT_NAME = "backend"


class HandlerBackend:
    """A Backend calling a full-state handler."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    async def apply(self, state: NodeState) -> bool:
        result = self._handler(state)
        if inspect.isawaitable(result):
            result = await result
        return bool(result)

    async def close(self) -> None:
        return None


class OnceBackend:
    """A Backend that is done after its first state (``--once``)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def apply(self, state: NodeState) -> bool:
        await self._backend.apply(state)
        return True

    async def close(self) -> None:
        await self._backend.close()


def load(spec: str) -> Backend:
    """The backend that ``FILE[:NAME]`` names; UsageError saying what is wrong if none."""
    file, _, name = spec.partition(":")
    name = name or DEFAULT_NAME
    path = Path(file)
    if not path.is_file():
        raise UsageError(f"--module {spec}: {file}: no such file")
    module_name = f"kpng_module_{path.stem.replace('-', '_')}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"--module {spec}: {file} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except (SyntaxError, ImportError) as exc:
        # the user's code: one line, not kpng's traceback (other errors keep theirs)
        raise UsageError(f"--module {spec}: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if _usable(v) and not k.startswith("_"))
        hint = f"; it defines {', '.join(defined)} (use {file}:NAME)" if defined else ""
        raise UsageError(f"--module {spec}: {file} has no {name!r}{hint}")
    return _as_backend(getattr(module, name), f"--module {spec}")


def _usable(value: Any) -> bool:
    return (inspect.isclass(value) or callable(value) or hasattr(value, "apply")) and getattr(
        value, "__module__", ""
    ).startswith("kpng_module_")


def _as_backend(value: Any, what: str) -> Backend:
    if inspect.isclass(value):
        value = value()
    if callable(getattr(value, "apply", None)) and callable(getattr(value, "close", None)):
        return value  # type: ignore[no-any-return]
    if isinstance(value, Sink):
        return SinkBackend(value)
    if callable(value):
        return HandlerBackend(value)
    raise UsageError(
        f"{what}: {type(value).__name__} is neither a Backend (apply, close), a Sink "
        "(reset, set_service, delete_service, set_endpoint, delete_endpoint, sync) nor a function"
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--module",
        required=True,
        metavar="FILE[:NAME]",
        help=f"the Python file and the name in it (default {DEFAULT_NAME}) of a Backend, a Sink, "
        "a handler function, or a class of one of them",
    )
    parser.add_argument("--once", action="store_true", help="exit 0 after the first complete state")


def _create(args: argparse.Namespace) -> Backend:
    backend = load(args.module)
    return OnceBackend(backend) if args.once else backend


SPEC = register(
    BackendSpec(
        name="python",
        help="a backend in a Python file (a Backend, a Sink or a handler), loaded in process",
        add_arguments=_add_arguments,
        create=lambda args, _syncs: _create(args),
        once=lambda args: bool(args.once),
    )
)
