"""Fuzzing the converters from Kubernetes objects to kpng's model (kpng.model.k8s and
kpng.model.converting) as the kube source runs them: each object decoded on its own by its
kind's typed decoder, then converted. A conversion gives the model, or None (not kpng's), or
raises ``InvalidObject`` naming the object's kind, namespace and name; what it gives can be
served (resolved for a node, encoded for the wire).

Bounded: see tests/pure/fuzzing.py (``KPNG_FUZZ_EXAMPLES`` runs a longer campaign).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import event, given

from kpng.api import codec
from kpng.errors import InvalidObject
from kpng.model import converting, dumping, k8s
from kpng.model.cluster import Slice
from kpng.model.messages import Service
from kpng.resolver.resolving import ClusterResolver
from tests.pure.fuzzing import fuzz_settings, k8s_objects

_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(cls)
    for kind, cls in (
        ("Service", k8s.Service),
        ("EndpointSlice", k8s.EndpointSlice),
        ("Node", k8s.Node),
        ("ServiceCIDR", k8s.ServiceCIDR),
    )
}


def _convert(obj: Any) -> Any:
    if isinstance(obj, k8s.Service):
        return converting.service_from_k8s(obj, proxy_name=None)
    if isinstance(obj, k8s.EndpointSlice):
        return converting.slice_from_k8s(obj, proxy_name=None)
    if isinstance(obj, k8s.Node):
        return converting.node_from_k8s(obj)
    return converting.service_cidr_from_k8s(obj)


@fuzz_settings(400)
@given(k8s_objects(odds=60))
def test_an_object_converts_is_ignored_or_is_refused_by_name(raw: Any) -> None:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in _DECODERS:
        return
    try:
        data = json.dumps(raw, allow_nan=False).encode()
    except ValueError:
        return  # NaN and infinities are no JSON: the API server never sends them
    try:
        obj = _DECODERS[kind].decode(data)
    except msgspec.ValidationError:
        event("does not decode")  # the reflector reports it by its metadata, and skips it
        return
    refusal: InvalidObject | None = None
    try:
        model = _convert(obj)
    except InvalidObject as exc:
        refusal = exc
    if refusal is not None:
        event("refused")
        assert refusal.kind == kind
        assert refusal.name == obj.metadata.name
        assert str(refusal).startswith(f"{refusal.kind} ")
        return
    event("ignored" if model is None else "converted")
    resolver = ClusterResolver()
    if isinstance(model, Service):
        key = (model.Namespace, model.Name)
        resolver.set_service(key, model)
        resolved = resolver.resolve(key, "node-1")
        assert resolved is not None
        codec.SERVICE.encode(resolved.service)
    elif isinstance(model, Slice):
        for info in dumping.endpoint_infos(model):
            codec.ENDPOINT_INFO.encode(info)
