"""Tokenizer parity: does our tokenizer + chat template produce the engine's prompt tokens?

Precise prefix routing only works if the router's token ids equal the engine's: a different chat
template (the commonest mistake in every peer) silently turns every lookup into a miss. So for
each model we hold a tokenizer for, we ask one ready endpoint of every worker set serving it to
tokenize a fixed probe (vLLM's ``POST /tokenize``, chat and completion forms) and compare.

- match: precise routing stays on;
- mismatch: the model is routed approximately until a later probe matches, and
  ``/debug/state`` + ``extproc_tokenizer_parity`` say where the token ids first differ;
- unknown: the engine has no ``/tokenize`` or did not answer; precise routing stays on (we
  cannot tell) and the state says why.

Probes run when the catalog changes (new endpoints, new sets) and every ``interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore
from extproc.engines.poller import EndpointPoller
from extproc.errors import BadRequest
from extproc.openai import ChatPrompt, CompletionPrompt
from extproc.tokenize.registry import TokenizerRegistry

log = logging.getLogger(__name__)

Verdict = Literal["match", "mismatch", "unknown"]

#: A conversation exercising what templates differ on: system prompt, turns, a generation prompt.
PROBE_CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a routing probe. Answer briefly."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Saved attention keys and values."},
        {"role": "user", "content": "And prefix caching?"},
    ],
    # No add_generation_prompt: vLLM's /tokenize defaults it to true, and SGLang (0.5) renders
    # messages as for a chat completion without it, but refuses it when the server runs a named,
    # non-Jinja template (the verdict then read "unknown").
}
PROBE_COMPLETION: dict[str, Any] = {"prompt": "Routing probe: the quick brown fox jumps over the lazy dog."}


@dataclass(frozen=True, slots=True)
class ParityResult:
    """One probe's outcome for a (model, worker set)."""

    verdict: Verdict
    endpoint: str
    #: Human-readable: where the ids first differ, or why the probe could not tell.
    detail: str
    checked_at: float


def compare(ours: Sequence[int], theirs: Sequence[int]) -> tuple[Verdict, str]:
    """Pure comparison of two token-id lists, naming the first difference."""
    if list(ours) == list(theirs):
        return "match", f"{len(ours)} tokens agree"
    first = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )
    return "mismatch", (
        f"token ids differ from position {first} (router {len(ours)} tokens, engine {len(theirs)}); "
        "check --tokenizer / --chat-template for this model"
    )


class ParityChecker(EndpointPoller):
    """Probes every (model with a tokenizer, worker set serving it) and keeps the verdicts."""

    def __init__(
        self,
        store: CatalogStore,
        tokenizers: TokenizerRegistry,
        *,
        interval: float = 300.0,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(what="tokenizer parity check", timeout=timeout, clock=clock)
        self._store = store
        self._tokenizers = tokenizers
        self._interval = interval
        self._unsubscribe = store.subscribe(lambda _catalog: self.wake())
        #: (model, worker set) -> latest result.
        self.results: dict[tuple[str, str], ParityResult] = {}

    def blocked_models(self) -> frozenset[str]:
        """Models whose tokens differ from an engine's: route them approximately."""
        return frozenset(model for (model, _), r in self.results.items() if r.verdict == "mismatch")

    def start(self) -> None:
        if self._tokenizers.models():
            super().start()

    async def close(self) -> None:
        self._unsubscribe()
        await super().close()

    async def round(self) -> None:
        assert self.session is not None
        await self.check(self.session, self._store.current)

    def delay(self, elapsed: float) -> float:
        return self._interval

    async def check(self, session: aiohttp.ClientSession, catalog: Catalog) -> None:
        """Probe one ready endpoint per (model, worker set); forget pairs that left the catalog."""
        pairs = probe_targets(catalog, self._tokenizers.models())
        results = await asyncio.gather(
            *(self._probe(session, model, ws, address) for (model, ws), address in pairs.items())
        )
        self.results = dict(zip(pairs, results, strict=True))

    async def _probe(self, session: aiohttp.ClientSession, model: str, ws: str, address: str) -> ParityResult:
        tokenizer = self._tokenizers.get(model)
        assert tokenizer is not None
        details: list[str] = []
        verdict: Verdict = "match"
        for kind, probe in (("chat", PROBE_CHAT), ("completion", PROBE_COMPLETION)):
            prompt = ChatPrompt.from_body(probe) if kind == "chat" else CompletionPrompt.from_body(probe)
            try:
                ours = tokenizer.prompt_ids(prompt)
            except BadRequest as exc:
                return self._result(
                    "mismatch", address, f"our template cannot render the probe: {exc.message}"
                )
            if ours is None:
                continue
            try:
                async with asyncio.timeout(self.timeout):
                    theirs = await _engine_tokens(session, address, model, probe)
            except TimeoutError:
                theirs = f"POST /tokenize: no answer within {self.timeout:g}s"
            if isinstance(theirs, str):
                return self._result("unknown", address, theirs)
            kind, detail = compare(ours, theirs)
            details.append(f"{kind}: {detail}")
            if kind == "mismatch":
                verdict = "mismatch"
        result = self._result(verdict, address, "; ".join(details))
        if verdict == "mismatch":
            log.warning(
                "tokenizer mismatch model=%s worker_set=%s endpoint=%s %s", model, ws, address, result.detail
            )
        return result

    def _result(self, verdict: Verdict, address: str, detail: str) -> ParityResult:
        return ParityResult(verdict, address, detail, self._clock())

    def debug_state(self) -> dict[str, Any]:
        return {
            f"{model} @ {ws}": {
                "verdict": r.verdict,
                "endpoint": r.endpoint,
                "detail": r.detail,
                "checkedAt": r.checked_at,
            }
            for (model, ws), r in sorted(self.results.items())
        }


def probe_targets(catalog: Catalog, models: Sequence[str]) -> dict[tuple[str, str], str]:
    """(model, worker set) -> the first ready endpoint to ask, for models we hold a tokenizer for."""
    wanted = set(models)
    targets: dict[tuple[str, str], str] = {}
    for key, ws in sorted(catalog.worker_sets.items()):
        if not ws.endpoints:
            continue
        for served in ws.models:
            if served.name in wanted:
                targets[(served.name, key)] = ws.endpoints[0].address
    return targets


async def _engine_tokens(
    session: aiohttp.ClientSession, address: str, model: str, probe: Mapping[str, Any]
) -> list[int] | str:
    """The engine's token ids for ``probe``, or why we could not get them."""
    try:
        async with session.post(f"http://{address}/tokenize", json={"model": model, **probe}) as resp:
            if resp.status != 200:
                return f"POST /tokenize answered HTTP {resp.status}"
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"POST /tokenize failed: {type(exc).__name__}: {exc}"
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return "POST /tokenize answered without a token list"
    return tokens
