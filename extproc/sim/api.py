"""The simulator's HTTP surface: vLLM's OpenAI-compatible routes plus a few of its dev routes.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /version``, ``GET /metrics``,
``POST /reset_prefix_cache``; and the simulator's own ``GET /sim/state`` (ports, ranks, cache) and
``POST /sim/kv_events`` (inject faults into the KV-event stream, restart a publisher).

With ``--engine sglang`` the generation routes and ``/metrics`` stay, and the rest is SGLang's
(:mod:`extproc.sim.sglang`): its model cards, tokenize bodies, error JSON, ``/server_info``,
``/model_info``, ``/health_generate`` and ``/flush_cache``.

A request goes to the data-parallel rank named by the ``X-data-parallel-rank`` header (as vLLM
allows, and SGLang), else to the rank with the fewest running + waiting requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc import __version__
from extproc.openai import ChatPrompt, CompletionPrompt, flag
from extproc.sim import responses, sglang
from extproc.sim.engine import Engine
from extproc.sim.requests import (
    Generation,
    Limits,
    SimRequestError,
    parse_chat,
    parse_completion,
    refusals,
    sglang_cache_salt,
    sglang_resolve_model,
)
from extproc.sim.responses import ResponseHead, Usage
from extproc.tokenize.prompts import chat_prompt_ids, completion_prompt_ids

DP_RANK_HEADER = "X-data-parallel-rank"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(server: Engine, *, max_body_bytes: int = 64 * 1024 * 1024) -> web.Application:
    api = _Api(server)
    is_sglang = server.settings.engine_kind == "sglang"
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[_sglang_errors if is_sglang else _errors]
    )
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/metrics", api.metrics)
    if is_sglang:
        sglang.add_routes(app, server, api.token_ids)
    else:
        app.router.add_get("/v1/models", api.models)
        app.router.add_post("/tokenize", api.tokenize)
        app.router.add_post("/detokenize", api.detokenize)
        app.router.add_get("/health", api.health)
        app.router.add_get("/version", api.version)
        app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)
    app.router.add_get("/sim/state", api.state)
    app.router.add_post("/sim/kv_events", api.kv_events)
    return app


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refusals become vLLM's error JSON, whatever route raised them."""
    try:
        return await handler(request)
    except SimRequestError as exc:
        return _json(exc.as_json(), status=exc.status)


@web.middleware
async def _sglang_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refusals become SGLang's ``ErrorResponse``."""
    try:
        return await handler(request)
    except SimRequestError as exc:
        return _json(sglang.error_json(exc), status=exc.status)


async def _body(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SimRequestError(400, f"the request body is not valid JSON: {exc}") from None


class _Api:
    def __init__(self, server: Engine) -> None:
        self.server = server
        self.limits = Limits(
            max_model_len=server.settings.engine.max_model_len,
            default_output_tokens=server.settings.default_output_tokens,
        )
        if server.settings.engine_kind == "sglang":
            self.limits = dataclasses.replace(
                self.limits, cache_salt=sglang_cache_salt, resolve_model=sglang_resolve_model
            )

    # -- generation -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        gen = parse_completion(
            body, models=self.server.models, tokenizer=self.server.tokenizer, limits=self.limits
        )
        return await self._generate(request, gen, "completion", "cmpl")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        gen = parse_chat(
            body,
            models=self.server.models,
            tokenizer=self.server.tokenizer,
            template=self.server.chat_template,
            limits=self.limits,
        )
        return await self._generate(request, gen, "chat", "chatcmpl")

    async def _generate(
        self, request: web.Request, gen: Generation, kind: responses.Kind, prefix: str
    ) -> web.StreamResponse:
        rank = self.server.pick_rank(request.headers.get(DP_RANK_HEADER))
        run = self.server.submit(rank, gen, request_id=f"{prefix}-{self.server.next_request_id()}")
        head = ResponseHead(kind, run.request_id, gen.model.name, int(time.time()))
        if not gen.stream:
            try:
                async for _ in run.tokens():
                    pass
            finally:
                run.close()
            usage = self._usage(gen, run.generated, run.num_cached_tokens)
            return _json(responses.full_response(head, run.text, gen.finish_reason, usage))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            opening = responses.role_chunk(head)
            if opening is not None:
                await resp.write(opening)
            async for text, finished in run.tokens():
                reason = gen.finish_reason if finished else None
                await resp.write(responses.text_chunk(head, text, reason))
            if gen.include_usage:
                usage = self._usage(gen, run.generated, run.num_cached_tokens)
                await resp.write(responses.usage_chunk(head, usage))
            await resp.write(responses.SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            # The client went away: the request is aborted below, nothing to answer.
            pass
        finally:
            run.close()
        return resp

    def _usage(self, gen: Generation, generated: int, cached: int) -> Usage:
        details = cached if self.server.settings.enable_prompt_tokens_details else None
        return Usage(len(gen.prompt_token_ids), generated, details)

    # -- models and tokens ------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        created = int(self.server.started_at)
        max_len = self.server.settings.engine.max_model_len
        cards = []
        for served in self.server.models.values():
            lora_path = self.server.lora_paths.get(served.name)
            cards.append(
                {
                    "id": served.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": lora_path if lora_path is not None else served.root,
                    "parent": self.server.base_name if lora_path is not None else None,
                    "max_model_len": None if lora_path is not None else max_len,
                    "permission": [_permission(created)],
                }
            )
        return _json({"object": "list", "data": cards})

    async def token_ids(self, request: web.Request) -> tuple[list[int], dict[str, Any]]:
        """A tokenize request's ids, as the engine renders and encodes them, and its body."""
        body = await _body(request)
        if not isinstance(body, dict):
            raise SimRequestError(400, "the request body must be a JSON object")
        if body.get("model") is not None:
            self.limits.resolve_model(self.server.models, body)
        tokenizer = self.server.tokenizer
        ids: Sequence[int]
        with refusals():
            if "messages" in body:
                ids = chat_prompt_ids(ChatPrompt.from_body(body), tokenizer, self.server.chat_template)
            elif "prompt" in body:
                add_special = flag(body, "add_special_tokens", True)
                ids = completion_prompt_ids(
                    CompletionPrompt.from_body(body), tokenizer, add_special_tokens=add_special
                )
            else:
                raise SimRequestError(400, "give either 'prompt' or 'messages'")
        return list(ids), body

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        ids, body = await self.token_ids(request)
        strs = self.server.tokenizer.token_strs(ids) if body.get("return_token_strs") else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.server.settings.engine.max_model_len,
                "tokens": list(ids),
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise SimRequestError(400, "'tokens' must be a list of token ids", param="tokens")
        return _json({"prompt": self.server.tokenizer.decode(tokens)})

    # -- operations -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.StreamResponse:
        return _json({"version": f"extproc-sim {__version__}"})

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.server.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """Like vLLM, the reset only happens when no block is in use; we say which ranks refused."""
        refused = self.server.reset_prefix_cache()
        if refused:
            raise SimRequestError(
                400, f"prefix cache not reset: blocks are in use on data-parallel rank(s) {refused}"
            )
        return web.Response(status=200)

    async def state(self, request: web.Request) -> web.StreamResponse:
        return _json(self.server.state())

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        if not isinstance(body, dict):
            raise SimRequestError(400, "the request body must be a JSON object")
        self.server.control_kv_events(body)
        return _json(self.server.state()["ranks"])


def _permission(created: int) -> dict[str, Any]:
    return {
        "id": "modelperm-sim",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
