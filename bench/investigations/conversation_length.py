"""What a conversation's next turn costs serve's event loop as the conversation grows.

In this process, no gRPC: a ``RequestStream`` handles the messages Envoy sends for one request, as
in ``decision_scaling.py``, with the real Llama 3 tokenizer, its segment tree and the tokenizing
threads (started, as in serve), against 8 endpoints that declare KV events. One conversation (an
~8k-token system prompt, then turns of a ~30-word question and a ~20-word answer, as in
``long_prompts.py``) is walked through serve turn by turn; at each checkpoint, 40 next turns of the
same history (each with a new last question, none joining it) are timed, after 10 untimed:

- **loop CPU**: the event loop thread's CPU time for the whole stream (``time.thread_time``): what
  every other decision waits behind. Work handed to the tokenizing threads is not in it;
- **wall**: the stream from its first message to its close, the threads' work included.

p50 of each, per checkpoint. Writes ``bench/results/conversation_length.{json,md}``.

    python bench/investigations/conversation_length.py      # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from decision_scaling import catalog, handle_stream
from grpc_load import request_messages, response_headers_message
from long_prompts import MODEL, Conversation, Texts
from machine import machine, provenance, record

from extproc.serve.app import Server
from extproc.settings import PrefixSettings, ServeSettings, SourceSettings, TokenizerSpec
from extproc.sources.file import FileSource

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
sys.path.insert(0, str(HERE.parent / "scripts"))
from fetch_tokenizers import ensure  # noqa: E402

#: Turns walked before each measure: the history then holds 1 + 2 x turns messages.
CHECKPOINTS = (0, 50, 150, 300)
SAMPLES = 40
WARM = 10


async def run() -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "checkpoints": []}
    tokenizer = ensure("llama3")
    with tempfile.TemporaryDirectory(prefix="extproc-conversation-") as tmp:
        prefix = PrefixSettings(tokenizers=(TokenizerSpec(MODEL, str(tokenizer)),))
        path = catalog(Path(tmp), 8, precise=True)
        server = Server(ServeSettings(source=SourceSettings.parse(f"file:{path}"), seed=1, prefix=prefix))
        source = server.source
        assert isinstance(source, FileSource)
        server.store.publish(source.load())
        pool = server.prefix.tokenize_pool
        assert pool is not None
        pool.workers.start()
        try:
            texts = Texts(tokenizers.Tokenizer.from_file(str(tokenizer / "tokenizer.json")), seed=7)
            conversation = Conversation(texts, 8_000)

            async def one(body: bytes) -> tuple[float, float]:
                """Loop-thread CPU seconds and wall seconds of one request's stream."""
                messages = [*request_messages(body), response_headers_message()]
                started, started_cpu = time.perf_counter(), time.thread_time()
                await handle_stream(server, messages)
                return time.thread_time() - started_cpu, time.perf_counter() - started

            walked = 0
            for turns in CHECKPOINTS:
                for _ in range(turns - walked):
                    await one(conversation.body())
                    conversation.advance()
                walked = turns
                for _ in range(WARM):  # the history's last turn learned, the code paths warm
                    await one(conversation.body())
                samples = [await one(conversation.body()) for _ in range(SAMPLES)]
                results["checkpoints"].append(
                    {
                        "messages": len(conversation.messages) + 1,
                        "body_bytes": len(conversation.body()),
                        "loop_cpu_us": statistics.median(s[0] for s in samples) * 1e6,
                        "wall_us": statistics.median(s[1] for s in samples) * 1e6,
                    }
                )
        finally:
            pool.close()
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        "# A conversation's next turn by its length: serve's event loop",
        "",
        f"{provenance(results['machine'])}. In-process `RequestStream`, real Llama 3 tokenizer, tokenizing "
        f"threads, 8 endpoints with KV events; p50 of {SAMPLES} next turns per length.",
        "",
        "| messages | body kB | loop CPU µs | wall µs |",
        "|--:|--:|--:|--:|",
    ]
    for c in results["checkpoints"]:
        kb = c["body_bytes"] / 1024
        lines.append(f"| {c['messages']} | {kb:.0f} | {c['loop_cpu_us']:.0f} | {c['wall_us']:.0f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "conversation_length.json")
    args = parser.parse_args()
    record(args.out, asyncio.run(run()), report)


if __name__ == "__main__":
    main()
