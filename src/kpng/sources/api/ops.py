"""Another kpng's global watch, applied to the store (``kpng api``): a change set is one store
revision."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from kpng.api import codec
from kpng.api.localv1_pb2 import (
    GlobalEndpointInfos,
    GlobalNodeInfos,
    GlobalServiceCIDRInfos,
    GlobalServiceInfos,
)
from kpng.errors import WireError
from kpng.model.cluster import ServiceCIDR, ServiceKey, SliceKey
from kpng.model.dumping import slice_from_infos
from kpng.model.messages import EndpointInfo, NodeInfo, ServiceCIDRInfo, ServiceInfo
from kpng.model.paths import split_service_path
from kpng.remote.watching import OpHandler, json_decoding, report_skipped
from kpng.store import SourceHandle

log = logging.getLogger(__name__)

_json: dict[int, Callable[[bytes], Any]] = {
    GlobalServiceInfos: json_decoding(msgspec.json.Decoder(ServiceInfo)),
    GlobalEndpointInfos: json_decoding(msgspec.json.Decoder(EndpointInfo)),
    GlobalNodeInfos: json_decoding(msgspec.json.Decoder(NodeInfo)),
    GlobalServiceCIDRInfos: json_decoding(msgspec.json.Decoder(ServiceCIDRInfo)),
}
_protobuf: dict[int, Callable[[bytes], Any]] = {
    GlobalServiceInfos: codec.SERVICE_INFO.decode,
    GlobalEndpointInfos: codec.ENDPOINT_INFO.decode,
    GlobalNodeInfos: codec.NODE_INFO.decode,
    GlobalServiceCIDRInfos: codec.SERVICE_CIDR_INFO.decode,
}


class GlobalOps:
    """Applies global watch ops to a store source; a change set is one store revision."""

    def __init__(self, out: SourceHandle) -> None:
        self._out = out
        self._services: set[ServiceKey] = set()
        self._nodes: set[str] = set()
        self._service_cidrs: set[str] = set()
        self._endpoints: dict[SliceKey, dict[str, EndpointInfo]] = {}
        self._dirty_slices: set[SliceKey] = set()
        self._resetting = False
        self._seen: set[tuple[int, str]] = set()
        self._decoders = _json

    def handler(self, json: bool) -> OpHandler:
        self._decoders = _json if json else _protobuf
        return self

    def op(self, kind: str, set_: int, path: str, payload: bytes) -> None:
        """One op to the store; one kpng cannot read (a hostile or broken upstream's) is
        reported and skipped, so that it changes nothing the store holds."""
        try:
            self._op(kind, set_, path, payload)
        except WireError as exc:
            report_skipped("the upstream", kind, set_, path, exc)

    def _op(self, kind: str, set_: int, path: str, payload: bytes) -> None:
        if kind == "Set" and set_ in self._decoders:
            self._set(set_, path, self._decoders[set_](payload))
        elif kind == "Delete":
            self._delete(set_, path)
        elif kind == "Reset":
            self._resetting = True
            self._seen.clear()

    async def sync(self) -> bool:
        self._sync()
        return False

    def _set(self, set_: int, path: str, info: Any) -> None:
        self._seen.add((set_, path))
        if set_ == GlobalServiceInfos and info.Service is not None:
            key = split_service_path(path)
            self._services.add(key)
            self._out.set_service(key, info.Service)
        elif set_ == GlobalNodeInfos and info.Node is not None:
            self._nodes.add(path)
            self._out.set_node(path, info.Node)
        elif set_ == GlobalServiceCIDRInfos:
            self._service_cidrs.add(path)
            self._out.set_service_cidr(path, ServiceCIDR(name=path, cidrs=info.CIDRs))
        elif set_ == GlobalEndpointInfos:
            key = (info.Namespace, info.SourceName)
            self._endpoints.setdefault(key, {})[path] = info
            self._dirty_slices.add(key)

    def _delete(self, set_: int, path: str) -> None:
        if set_ == GlobalServiceInfos:
            key = split_service_path(path)
            self._services.discard(key)
            self._out.set_service(key, None)
        elif set_ == GlobalNodeInfos:
            self._nodes.discard(path)
            self._out.set_node(path, None)
        elif set_ == GlobalServiceCIDRInfos:
            self._service_cidrs.discard(path)
            self._out.set_service_cidr(path, None)
        elif set_ == GlobalEndpointInfos:
            parts = path.split("/", 3)  # namespace/service/slice/address
            if len(parts) != 4:
                raise WireError(f"endpoint path {path!r} is not namespace/service/slice/address")
            namespace, _, slice_name, _ = parts
            key = (namespace, slice_name)
            infos = self._endpoints.get(key)
            if infos is not None and infos.pop(path, None) is not None:
                self._dirty_slices.add(key)

    def _sync(self) -> None:
        if self._resetting:
            # Whatever the new stream did not send again is gone upstream.
            self._resetting = False
            for key in list(self._services):
                if (GlobalServiceInfos, f"{key[0]}/{key[1]}") not in self._seen:
                    self._delete(GlobalServiceInfos, f"{key[0]}/{key[1]}")
            for name in list(self._nodes):
                if (GlobalNodeInfos, name) not in self._seen:
                    self._delete(GlobalNodeInfos, name)
            for name in list(self._service_cidrs):
                if (GlobalServiceCIDRInfos, name) not in self._seen:
                    self._delete(GlobalServiceCIDRInfos, name)
            for sent in list(self._endpoints.values()):
                for path in list(sent):
                    if (GlobalEndpointInfos, path) not in self._seen:
                        self._delete(GlobalEndpointInfos, path)
        for key in self._dirty_slices:
            current = self._endpoints.get(key)
            if current:
                self._out.set_slice(key, slice_from_infos(key[0], key[1], list(current.values())))
            else:
                self._endpoints.pop(key, None)
                self._out.set_slice(key, None)
        self._dirty_slices.clear()
        if self._out.synced:
            self._out.commit()
        else:
            self._out.mark_synced()
