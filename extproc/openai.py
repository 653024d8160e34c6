"""OpenAI-style request bodies: what routing needs to know, and the model rewrite.

Parsing is pure and strict about the one field routing depends on (``model``) and tolerant of
everything else, which is passed through untouched: engines validate their own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from extproc.errors import BadRequest

#: Paths whose bodies carry ``model``; anything else with a body is routed the same way when it
#: does, and gets 400 when it does not (we never guess the model).
INFERENCE_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
    }
)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """The parsed body of one request, as far as routing is concerned."""

    model: str
    stream: bool
    #: ``max_completion_tokens`` or ``max_tokens`` when given (a positive int), else None.
    max_tokens: int | None
    #: The whole decoded JSON object; kept so the body can be rewritten without parsing twice.
    payload: dict[str, Any]


def parse_request(body: bytes) -> InferenceRequest:
    """Decode a JSON request body; raise :class:`BadRequest` naming what is wrong."""
    if not body:
        raise BadRequest("request body is empty; expected a JSON object with a 'model' field")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(payload).__name__}")
    model = payload.get("model")
    if model is None:
        raise BadRequest("request body has no 'model' field", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    stream = payload.get("stream") is True
    return InferenceRequest(model=model, stream=stream, max_tokens=_max_tokens(payload), payload=payload)


def _max_tokens(payload: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def rewrite_model(request: InferenceRequest, upstream_model: str) -> bytes:
    """The body with ``model`` replaced, every other field kept as the client sent it."""
    payload = dict(request.payload)
    payload["model"] = upstream_model
    return orjson.dumps(payload)


def models_list(entries: list[tuple[str, str]]) -> bytes:
    """``GET /v1/models`` in OpenAI's list format from (client name, upstream name) pairs."""
    return orjson.dumps({"object": "list", "data": [model_object(n, u) for n, u in entries]})


def model_response(name: str, upstream: str) -> bytes:
    """``GET /v1/models/{name}``: one model object."""
    return orjson.dumps(model_object(name, upstream))


def model_object(name: str, upstream: str) -> dict[str, Any]:
    # ``root`` follows vLLM: the upstream model an alias stands for.
    return {"id": name, "object": "model", "created": 0, "owned_by": "extproc", "root": upstream}


def error_body(message: str, *, error_type: str, code: str, param: str | None = None) -> bytes:
    """An error in OpenAI's shape, so SDKs surface the message instead of a parse failure."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})
