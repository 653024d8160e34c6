"""``extproc sim``: flags -> :class:`SimSettings` -> one engine, or a fleet of ``--replicas``.

Flag names follow ``vllm serve`` where vLLM has the same knob (``--served-model-name``,
``--lora-modules``, ``--block-size``, ``--num-gpu-blocks-override``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--data-parallel-size``,
``--enable-prompt-tokens-details``), so a command line reads like the real one.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from extproc.errors import ConfigError
from extproc.flags import field_default, flag_values, setting_flag
from extproc.sim.block_hash import HASH_ALGOS
from extproc.sim.engine_core import EngineParams
from extproc.sim.fleet import SimFleet
from extproc.sim.kv_wire import EventEncoding, HashFormat
from extproc.sim.settings import KVEventSettings, LoraModule, PublisherFaults, SimSettings
from extproc.types import ENGINE_KINDS

_CPU_LOAD_DEFAULT = field_default(EngineParams, "cpu_load_tokens_per_s")


def add_sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``extproc sim`` to the CLI; :func:`run_sim` is its handler."""
    p = sub.add_parser(
        "sim",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run a simulated vLLM or SGLang model server (OpenAI API, /metrics, KV events over ZMQ)",
        description="A simulated vLLM (or SGLang) engine on loopback: OpenAI-compatible HTTP, a real "
        "tokenizer and chat template, a prefix cache publishing the engine's KV events over ZMQ, and a "
        "latency model. Defaults resemble an 8B model on one H100 (see extproc/sim/README.md).",
    )
    g = p.add_argument_group("serving")
    setting_flag(
        g,
        "--engine",
        SimSettings,
        "engine_kind",
        "whose surface to show: routes, metric names, KV-event encoding",
        choices=list(ENGINE_KINDS),
    )
    setting_flag(g, "--listen", SimSettings, "listen", "HTTP address; port 0 = any")
    g.add_argument("--replicas", type=int, default=1, help="engines to start, on consecutive ports")
    setting_flag(g, "--model", SimSettings, "model", "model path or id, /v1/models root")
    g.add_argument("--served-model-name", nargs="+", default=[], help="names clients use (default: --model)")
    g.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="LoRA adapters to serve"
    )
    g.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer dir (default: the shipped tiny one)"
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="template file, or a shipped one: chatml, llama3 (default: the tokenizer's, else llama3)",
    )
    setting_flag(
        g,
        "--tokenize-cache-mb",
        SimSettings,
        "tokenize_cache_bytes",
        "remember this many MiB of prompt pieces, so a repeated prefix is encoded once (same ids; "
        "saves a load harness's CPU); 0 encodes every prompt whole, as vLLM does",
        scale=1 / (1024 * 1024),
    )
    setting_flag(
        g,
        "--default-output-tokens",
        SimSettings,
        "default_output_tokens",
        "tokens generated for a chat request without max_tokens",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    g = p.add_argument_group("engine model")
    e = EngineParams
    setting_flag(g, "--block-size", e, "block_size", "tokens per KV block")
    setting_flag(g, "--num-gpu-blocks-override", e, "num_gpu_blocks", "KV blocks per rank")
    setting_flag(g, "--max-num-seqs", e, "max_num_seqs", "running batch cap")
    setting_flag(g, "--max-num-batched-tokens", e, "max_num_batched_tokens", "token budget per step")
    setting_flag(g, "--max-model-len", e, "max_model_len", "context window")
    setting_flag(g, "--prefill-tokens-per-s", e, "prefill_tokens_per_s", "prefill throughput")
    setting_flag(g, "--decode-base-ms", e, "decode_base_s", "fixed cost of one engine step", scale=1000)
    setting_flag(
        g, "--decode-per-seq-ms", e, "decode_per_seq_s", "extra step time per running sequence", scale=1000
    )
    setting_flag(
        g,
        "--cpu-offload-blocks",
        e,
        "cpu_offload_blocks",
        "CPU offload tier per rank, in published blocks, as vLLM's native CPU offloading (0 = none)",
    )
    setting_flag(
        g,
        "--cpu-load-tokens-per-s",
        e,
        "cpu_load_tokens_per_s",
        f"CPU->GPU KV load speed ({_CPU_LOAD_DEFAULT:g}; ~50 GB/s PCIe Gen5, 128 KiB/token)",
    )
    setting_flag(
        g,
        "--prefix-caching-hash-algo",
        e,
        "prefix_caching_hash_algo",
        "what hashes the blocks, as vLLM's flag (sha256; xxhash needs the xxhash package)",
        choices=HASH_ALGOS,
    )
    setting_flag(g, "--data-parallel-size", SimSettings, "data_parallel_size", "DP ranks, each its own cache")
    setting_flag(g, "--time-scale", SimSettings, "time_scale", "wall seconds per simulated second")
    g = p.add_argument_group("KV events (the engine's ZMQ publisher)")
    g.add_argument(
        "--kv-events-port", type=int, default=None, help="PUB port of rank 0; 0 = any; off if unset"
    )
    g.add_argument(
        "--kv-replay-port", type=int, default=None, help="ROUTER replay port of rank 0; off if unset"
    )
    setting_flag(g, "--kv-topic", KVEventSettings, "topic", "topic frame of every message")
    g.add_argument(
        "--kv-encoding",
        choices=[e.value for e in EventEncoding],
        default=None,
        help="arrays = vLLM <= 0.23, maps = vLLM >= 0.24, sglang = SGLang 0.5 (default: the engine's own)",
    )
    g.add_argument(
        "--kv-hash-format",
        choices=[h.value for h in HashFormat],
        default=None,
        help="vLLM only: int = uint64 (vLLM default), bytes = the digest",
    )
    g.add_argument(
        "--kv-replay-frames",
        type=int,
        choices=[3, 4],
        default=4,
        help="replay replies without (vLLM <= 0.25) or with (>= 0.26) the topic frame",
    )
    setting_flag(g, "--kv-buffer-steps", KVEventSettings, "buffer_steps", "batches kept for replay")
    g.add_argument(
        "--published-block-size",
        type=int,
        default=None,
        help="publish coarser blocks than --block-size (a multiple of it), as hybrid models do",
    )
    setting_flag(
        g, "--kv-drop-probability", PublisherFaults, "drop_probability", "lose this share of batches"
    )
    setting_flag(
        g, "--kv-delay-ms", PublisherFaults, "delay_seconds", "publish every batch this late", scale=1000
    )
    setting_flag(g, "--seed", SimSettings, "seed", "seed of the fault injection")
    p.set_defaults(handler=run_sim)


def sim_settings(args: argparse.Namespace) -> SimSettings:
    """Flags -> settings; ConfigError names the flag that is wrong."""
    if not args.cpu_offload_blocks and args.cpu_load_tokens_per_s != _CPU_LOAD_DEFAULT:
        raise ConfigError("--cpu-load-tokens-per-s needs --cpu-offload-blocks (no CPU tier to load from)")
    engine = EngineParams(
        **flag_values(args, EngineParams), published_block_size=args.published_block_size or args.block_size
    )
    faults = PublisherFaults(**flag_values(args, PublisherFaults))
    kv: KVEventSettings | None = None
    if args.engine == "sglang" and args.kv_hash_format is not None:
        raise ConfigError("--kv-hash-format is vLLM's: SGLang publishes signed int64 hashes only")
    if args.kv_events_port is not None:
        default_encoding = EventEncoding.SGLANG if args.engine == "sglang" else EventEncoding.MAPS
        kv = KVEventSettings(
            **flag_values(args, KVEventSettings),
            port=args.kv_events_port,
            replay_port=args.kv_replay_port,
            encoding=EventEncoding(args.kv_encoding or default_encoding),
            hash_format=HashFormat(args.kv_hash_format or HashFormat.INT),
            replay_topic_frame=args.kv_replay_frames == 4,
            faults=faults,
        )
    else:
        # KV-event flags without a publisher would be silently ignored: say so instead.
        for flag, value, default in (
            ("--kv-replay-port", args.kv_replay_port, None),
            ("--kv-topic", args.kv_topic, field_default(KVEventSettings, "topic")),
            # Compared in the fields' units, so the flags' scale is not stated again here.
            (
                "--kv-drop-probability",
                faults.drop_probability,
                field_default(PublisherFaults, "drop_probability"),
            ),
            ("--kv-delay-ms", faults.delay_seconds, field_default(PublisherFaults, "delay_seconds")),
        ):
            if value != default:
                raise ConfigError(f"{flag} needs --kv-events-port (the publisher it configures is off)")
    return SimSettings(
        **flag_values(args, SimSettings),
        served_model_names=tuple(args.served_model_name),
        lora_modules=tuple(LoraModule.parse(spec) for spec in args.lora_modules),
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        engine=engine,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        kv_events=kv,
    )


async def run_sim(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The ``sim`` command: start the engine(s), print where they listen, serve until stopped."""
    settings = sim_settings(args)
    async with SimFleet(settings, replicas=args.replicas) as fleet:
        for server in fleet.servers:
            print(_describe(server.state()), flush=True)
        await stop.wait()


def _describe(state: dict[str, Any]) -> str:
    parts = [f"sim http://{state['address']} model={state['served_model_names'][0]}"]
    for rank in state["ranks"]:
        kv = rank.get("kv_events")
        if kv is not None:
            replay = f" replay={kv['replay_endpoint']}" if kv["replay_endpoint"] else ""
            parts.append(f"rank {rank['dp_rank']}: kv={kv['endpoint']}{replay}")
    return "  ".join(parts)
