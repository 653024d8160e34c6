"""Identifiers of the domain that must not be mixed up with one another."""

from typing import Literal, NewType

#: ``ip:port`` of one model-server endpoint (``[v6]:port`` for IPv6), as Envoy receives it.
EndpointAddress = NewType("EndpointAddress", str)
#: A model name: a client-facing name (upstream name or alias), or the name the engine serves.
ModelName = NewType("ModelName", str)
#: ``namespace/name`` of an InferenceWorkerSet.
WorkerSetKey = NewType("WorkerSetKey", str)
#: The model server software behind an endpoint: what its metrics, routes and KV events look like.
EngineKind = Literal["vllm", "sglang"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "sglang")
