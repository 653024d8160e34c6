"""The demo's sample traffic (``--traffic``): a few clients sending chats and completions through Envoy."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import aiohttp

from extproc.demo.options import DemoSet
from extproc.demo.view import TrafficStats

#: Concurrent sample clients, and how long one request may take before it counts as failed.
_TRAFFIC_WORKERS = 3
_TRAFFIC_TIMEOUT = 10.0


class Traffic:
    """Counts of the demo's own sample requests (mutable; the view gets frozen copies)."""

    def __init__(self) -> None:
        self.sent = self.ok = self.failed = 0

    def stats(self) -> TrafficStats:
        return TrafficStats(self.sent, self.ok, self.failed)


#: Every sample chat starts with a long system prompt, as a deployed assistant's requests do: the
#: router sends them where that prompt is cached, and the live view's "prefix hits" climbs.
SYSTEM_PROMPT = (
    "You are the assistant of the extproc demo, a gateway that routes OpenAI-style requests through "
    "Envoy to a pool of model servers. Answer in a friendly, concise way, in plain text without "
    "markdown. When a question is about the gateway, explain which part does the work: Envoy accepts "
    "the HTTP request and streams its body to the external processor over gRPC; the processor reads "
    "the model name, maps an alias such as chat to the model the servers really load, picks one "
    "endpoint of the worker set that serves it, rewrites the body when the name changed, and tells "
    "Envoy where to send the request. The model servers run vLLM, which keeps the attention keys and "
    "values of every prompt in fixed-size blocks of sixteen tokens; blocks whose tokens match an "
    "earlier prompt are reused instead of being computed again, which is why requests that share a "
    "long beginning are cheaper on the server that has already seen it. If you do not know an "
    "answer, say so rather than guessing, and never invent numbers, names or quotations."
)
#: Three assistants, each with its own system prompt (they differ from the first sentence, so they
#: share no cached block): the router keeps each one on the engine holding its prompt.
SYSTEM_PROMPTS = (
    SYSTEM_PROMPT,
    "You talk to operators who are on call tonight and want short, exact answers. " + SYSTEM_PROMPT,
    "You talk to students who are new to model serving and like examples. " + SYSTEM_PROMPT,
)
#: The qwen set gets completions that continue one shared document, for the same reason.
DOCUMENT = (
    "Release notes, version 2.4 of the inference gateway. Requests are now routed by the load of "
    "each endpoint, counted by the router itself from the moment it picks an endpoint until the "
    "response ends. Aliases are rewritten before the body reaches the model server, so clients can "
    "keep using short names when the deployed model changes. Catalog files are reloaded on change, "
    "and an invalid edit keeps the last valid version. Question: "
)
_QUESTIONS = (
    "Hello!",
    "Summarize the plot of Hamlet.",
    "Write a haiku about routers.",
    "What is a KV cache?",
    "Why do shared prefixes make requests cheaper?",
    "What does the external processor change in a request?",
)


def sample_request(rng: random.Random, sets: Sequence[DemoSet]) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body): mostly chats through the first alias, some streams, some others.

    ``max_tokens`` stays small (8-96 tokens, 0.05-0.6 s of simulated decoding): three clients keep
    a request or two running on the engines, never a queue of long answers.
    """
    first, last = sets[0].alias, sets[-1].alias
    question = rng.choice(_QUESTIONS)
    system = rng.choice(SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    roll = rng.random()
    if roll < 0.45:
        body = {"model": first, "messages": messages, "max_tokens": rng.randint(8, 32)}
        return "POST", "/v1/chat/completions", body
    if roll < 0.75:
        body = {"model": first, "messages": messages, "max_tokens": rng.randint(32, 96), "stream": True}
        return "POST", "/v1/chat/completions", body
    if roll < 0.95:
        body = {"model": last, "prompt": DOCUMENT + question, "max_tokens": 16}
        return "POST", "/v1/completions", body
    return "GET", "/v1/models", None


async def send_sample_traffic(url: str, sets: Sequence[DemoSet], traffic: Traffic) -> None:
    """A few concurrent clients sending sample requests with short random pauses, until cancelled."""
    timeout = aiohttp.ClientTimeout(total=_TRAFFIC_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_client(session, url, sets, traffic, i) for i in range(_TRAFFIC_WORKERS)))


async def _client(
    session: aiohttp.ClientSession, url: str, sets: Sequence[DemoSet], traffic: Traffic, seed: int
) -> None:
    rng = random.Random(seed)
    while True:
        method, path, body = sample_request(rng, sets)
        traffic.sent += 1
        try:
            async with session.request(method, url + path, json=body) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            traffic.ok += 1
        else:
            traffic.failed += 1
        await asyncio.sleep(rng.uniform(0.05, 0.5))
