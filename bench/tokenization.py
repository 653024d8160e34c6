"""Router-side tokenization cost per request: chat template render + encode, and completions encode.

    python bench/tokenization.py [--quick] [--out bench/results/tokenize.json]

(Not ``bench/tokenize.py``: a file of that name next to the bench scripts would shadow the
standard library's ``tokenize`` module, which ``inspect`` and ``linecache`` import, for every
script run from this folder.)

What ``serve`` pays per request before it can look a prompt up in the KV-event index, measured on
the code the router runs (``TokenizerRegistry.get(model).prompt_ids(path, body)``, loaded as
``--tokenizer MODEL=extproc:tiny --chat-template MODEL=llama3|chatml``), at ~1k, 8k and 32k
prompt tokens: completions (encode with BOS) and chats (system prompt + a few turns: render the
template, then encode). Also reported: render and encode alone, and ``block_keys`` over the ids
(the step after tokenizing). Everything runs in this process, on one thread, after a warm-up (the
BPE word cache is warm, as in a router serving similar prompts). About 40 s (``--quick``: ~10 s).

The shipped tokenizer's vocabulary is 5000 ids, ~2.7 characters per token on this text; a real
128k-vocabulary tokenizer (Llama 3) makes ~4-4.5 characters per token on English, so the same
token count is longer text there, and its per-token cost differs. See the markdown output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from machine import machine

from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.openai import CHAT_PATH, COMPLETIONS_PATH, ChatPrompt, read_request
from extproc.settings import TokenizerSpec
from extproc.tokenize.pipeline import render_chat
from extproc.tokenize.prompts import chat_prompt_ids
from extproc.tokenize.registry import SHIPPED_TOKENIZER, ModelTokenizer, TokenizerRegistry

HERE = Path(__file__).resolve().parent
MODEL = "bench-model"
BLOCK = 16
SIZES = (1024, 8192, 32768)
#: Seconds of measurement per (case, size): more runs where a run is cheap.
BUDGET = {1024: 1.5, 8192: 3.0, 32768: 5.0}
MIN_RUNS, MAX_RUNS = 20, 2000

_SENTENCES = (
    "The gateway reads the model name from the request body and picks an endpoint for it.",
    "Each engine keeps the attention keys and values of recent prompts in blocks of sixteen tokens.",
    "When two prompts share a long beginning, the second one is cheaper on the engine that saw the first.",
    "Operators watch the queue depth, the cache usage and the time to first token of every replica.",
    "A catalog file lists the worker sets, their services and the slices of endpoints behind them.",
    "Requests that stream their answers keep a connection open until the last chunk has been sent.",
    "If a replica restarts, its event stream begins again at sequence zero and the index forgets it.",
    "Budgets protect the router: bodies over the limit get a clear error instead of a slow failure.",
    "Version {n} of the release notes lists {m} fixes, among them a race in the reload of the catalog.",
    'The function returns {{"status": "ok", "count": {n}, "items": ["alpha", "beta", "gamma"]}} on success.',
    "for (int i = 0; i < {n}; i++) {{ total += weights[i] * inputs[i]; }} // dot product",
    "Average latency was {n}.{m} ms at the 50th percentile and {m}.{n} ms at the 99th, over one hour.",
    "Please summarize the following report in three sentences, keeping every number exactly as written.",
    "Café, naïve and Zürich are spelled with accents; the tokenizer falls back to bytes when needed.",
)


def text_of(tokens: int, tokenizer: ModelTokenizer, rng: random.Random) -> str:
    """Prose-like text of about ``tokens`` tokens (encoded alone, without special tokens)."""
    encode = tokenizer.tokenizer.encode
    sentences: list[str] = []
    length = 0
    while length < tokens:
        # Add roughly what is missing (at ~2.7 chars/token), then measure again.
        missing_chars = int((tokens - length) * 2.7) + 1
        chunk: list[str] = []
        while sum(len(s) + 1 for s in chunk) < missing_chars:
            template = rng.choice(_SENTENCES)
            chunk.append(template.format(n=rng.randrange(10_000), m=rng.randrange(100)))
        sentences += chunk
        length = len(encode(" ".join(sentences), add_special_tokens=False))
    # Trim sentence by sentence to the closest length at or just above the target.
    while len(sentences) > 1:
        shorter = len(encode(" ".join(sentences[:-1]), add_special_tokens=False))
        if shorter < tokens:
            break
        sentences.pop()
    return " ".join(sentences)


def completion_body(tokens: int, tokenizer: ModelTokenizer, rng: random.Random) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text_of(tokens, tokenizer, rng), "max_tokens": 16}


def chat_body(tokens: int, tokenizer: ModelTokenizer, rng: random.Random) -> dict[str, Any]:
    """Half the tokens in the system prompt, the rest over three exchanges and a last question."""
    messages = [{"role": "system", "content": text_of(tokens // 2, tokenizer, rng)}]
    turn = max(tokens // 2 // 7, 8)
    for _ in range(3):
        messages.append({"role": "user", "content": text_of(turn, tokenizer, rng)})
        messages.append({"role": "assistant", "content": text_of(turn, tokenizer, rng)})
    messages.append({"role": "user", "content": text_of(turn, tokenizer, rng)})
    return {"model": MODEL, "messages": messages, "max_tokens": 16}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - started) / 1e3  # µs


def measure(tokenizer: ModelTokenizer, path: str, body: dict[str, Any], budget: float) -> dict[str, Any]:
    """p50 / p99 of ``prompt_ids`` (the router's call), and of its parts, over a time budget."""
    prompt = read_request(path, body).read_prompt()
    assert prompt is not None
    ids = tokenizer.prompt_ids(prompt)
    assert ids is not None
    seed = namespace_seed(MODEL)
    token_tuple = tuple(ids)
    if path == CHAT_PATH:
        assert tokenizer.template is not None
        template = tokenizer.template
        text = render_chat(tokenizer.tokenizer, template, body["messages"])
        assert isinstance(prompt, ChatPrompt)
        assert ids == chat_prompt_ids(prompt, tokenizer.tokenizer, template)

        def render() -> object:
            return render_chat(tokenizer.tokenizer, template, body["messages"])

        def encode() -> object:
            return tokenizer.tokenizer.encode(text, add_special_tokens=False)
    else:
        text = body["prompt"]

        def render() -> object:
            return None

        def encode() -> object:
            return tokenizer.tokenizer.encode(text, add_special_tokens=True)

    def total() -> object:
        return tokenizer.prompt_ids(prompt)

    def keys() -> object:
        return block_keys(token_tuple, BLOCK, seed)

    for _ in range(3):  # warm-up: BPE word cache, template, allocator
        total()
    samples: dict[str, list[float]] = {"total": [], "render": [], "encode": [], "keys": []}
    gc.collect()
    deadline = time.perf_counter() + budget
    while len(samples["total"]) < MIN_RUNS or (
        time.perf_counter() < deadline and len(samples["total"]) < MAX_RUNS
    ):
        samples["total"].append(timed(total))
        if path == CHAT_PATH:
            samples["render"].append(timed(render))
        samples["encode"].append(timed(encode))
        samples["keys"].append(timed(keys))
    out: dict[str, Any] = {"tokens": len(ids), "chars": len(text), "runs": len(samples["total"])}
    for name, values in samples.items():
        if not values:
            continue
        values.sort()
        out[f"{name}_us"] = {
            "p50": round(percentile(values, 50), 1),
            "p99": round(percentile(values, 99), 1),
            "mean": round(statistics.fmean(values), 1),
        }
    return out


def run_all(quick: bool) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": machine(tokenizers=tokenizers.__version__),
        "quick": quick,
        "cases": [],
    }
    scale = 0.2 if quick else 1.0
    loaded = {
        template: TokenizerRegistry.load([TokenizerSpec(MODEL, SHIPPED_TOKENIZER, template)]).get(MODEL)
        for template in ("llama3", "chatml")
    }
    started = time.monotonic()
    for size in SIZES:
        rng = random.Random(size)
        llama = loaded["llama3"]
        assert llama is not None
        bodies = {"completion": completion_body(size, llama, rng), "chat": chat_body(size, llama, rng)}
        for kind, template in (("completion", "-"), ("chat", "llama3"), ("chat", "chatml")):
            tokenizer = loaded["llama3" if template == "-" else template]
            assert tokenizer is not None
            path = COMPLETIONS_PATH if kind == "completion" else CHAT_PATH
            row = measure(tokenizer, path, bodies[kind], BUDGET[size] * scale)
            row |= {"kind": kind, "template": template, "target_tokens": size}
            results["cases"].append(row)
            p50, p99 = row["total_us"]["p50"] / 1000, row["total_us"]["p99"] / 1000
            print(
                f"{kind:10} {template:6} {row['tokens']:>6} tokens: p50 {p50:.2f} ms p99 {p99:.2f} ms "
                f"({row['runs']} runs)",
                file=sys.stderr,
            )
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.monotonic() - started, 1)
    return results


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    dirty = " + uncommitted changes" if m["git_dirty"] else ""
    lines = [
        "# Tokenization benchmark (router side)",
        "",
        f"{m['date']}, commit {m['git_commit'][:12]}{dirty}; {m['cpu_model']}, nproc {m['nproc']}, "
        f"Python {m['python']}, tokenizers {m['tokenizers']}; load average {m['loadavg_at_start'][0]} at "
        f"start, {m['loadavg_at_end'][0]} at end; {results['seconds']} s"
        f"{' (--quick)' if results['quick'] else ''}.",
        "",
    ]
    if max(m["loadavg_at_start"][0], m["loadavg_at_end"][0]) > 0.5:
        lines += [
            "Other processes were running (see the load averages): on a shared machine, read the "
            "numbers as upper bounds, and the differences between rows of similar size as noise.",
            "",
        ]
    lines += [
        "What `serve` computes per request before its KV-index lookup: "
        "`TokenizerRegistry.get(model).prompt_ids(path, body)` with the shipped tokenizer "
        "(`--tokenizer MODEL=extproc:tiny`), one thread, warm caches. Times in milliseconds.",
        "",
        "| request | template | tokens | chars/token | runs | total p50 | total p99 | render p50 "
        "| encode p50 | µs per 1k tokens | block_keys p50 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["cases"]:
        render = _ms(row["render_us"]["p50"]) if "render_us" in row else "-"
        per_k = row["total_us"]["p50"] / row["tokens"] * 1000
        lines.append(
            f"| {row['kind']} | {row['template']} | {row['tokens']:,} | {row['chars'] / row['tokens']:.2f} "
            f"| {row['runs']} | **{_ms(row['total_us']['p50'])}** | {_ms(row['total_us']['p99'])} | {render} "
            f"| {_ms(row['encode_us']['p50'])} | {per_k:.0f} | {_ms(row['keys_us']['p50'])} |"
        )
    lines += [
        "",
        "- *total* is the router's call: for chats, message shaping + template render + encode (no "
        "special tokens); for completions, encode with BOS. *render* and *encode* are the two steps "
        "alone (their sum is about the total). *block_keys* is the next step (our chained keys over "
        "16-token blocks) and is not in *total*.",
        "- Chats: half the tokens in the system prompt, the rest in three user/assistant exchanges and "
        "a last question. Text: English sentences with numbers, JSON, code and a few accented words.",
        "- p99 over few runs (32k tokens) is close to the maximum of the runs.",
        "- Tokenizing runs synchronously on `serve`'s event loop: while a 32k-token prompt is "
        "tokenized, no other request on that process is decided.",
        "",
        "**The shipped tokenizer is not a real one.** Its vocabulary is 5000 ids (Llama 3 has 128k), "
        "so it cuts text into more, shorter tokens: ~2.7 characters per token here against ~4-4.5 for "
        "Llama 3 on English. A 32k-token prompt is ~90 kB of text here, ~140 kB with Llama 3; BPE cost "
        "grows with text length (and with vocabulary merges), so expect different, probably higher, "
        "times per token with a real tokenizer. Rerun with a real one before drawing capacity "
        "conclusions.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the time budget (~10 s)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tokenize.json")
    args = parser.parse_args()
    results = run_all(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
