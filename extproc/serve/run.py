"""``extproc serve``: flags -> :class:`~extproc.settings.ServeSettings` -> the server, or
``--workers`` copies of it.

Each flag takes its default from the settings dataclass, so a default is stated once (``--help`` and
``docs/flags.md`` show it from there).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from extproc.errors import ConfigError
from extproc.scheduling.registry import DEFAULT_POLICY, POLICIES
from extproc.settings import (
    CandidateSettings,
    FlowSettings,
    PrefixSettings,
    ServeSettings,
    SourceSettings,
    TokenizerSpec,
)


def _field_defaults(settings: type[Any]) -> dict[str, Any]:
    """A settings dataclass's field defaults: flags take their defaults from the settings, so each
    default is stated once (``--help`` and ``docs/flags.md`` show it from there)."""
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


_SERVE = _field_defaults(ServeSettings)
_PREFIX = _field_defaults(PrefixSettings)
_SOURCE = _field_defaults(SourceSettings)
_CANDIDATES = _field_defaults(CandidateSettings)
_FLOW = _field_defaults(FlowSettings)


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``extproc serve`` to the CLI; :func:`run_serve` is its handler."""
    p = sub.add_parser(
        "serve",
        help="run the ext_proc gRPC server that picks an endpoint per request",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--source",
        required=True,
        help="where worker sets come from: file:PATH (multi-document YAML), or kube (the cluster's "
        "InferenceWorkerSets, Services and EndpointSlices, watched)",
    )
    p.add_argument(
        "--source-poll-interval",
        type=float,
        default=_SOURCE["poll_interval"],
        help="file: seconds between checks of the catalog file",
    )
    p.add_argument(
        "--max-catalog-bytes",
        type=int,
        default=_SOURCE["max_bytes"],
        help="file: largest catalog file read; a larger one is refused and the last good catalog kept",
    )
    p.add_argument(
        "--namespaces",
        default=None,
        metavar="NS[,NS...]",
        help="--source kube: the namespaces to watch (default: all namespaces)",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="--source kube: kubeconfig file (default: in-cluster credentials when running in a pod, "
        "else $KUBECONFIG or ~/.kube/config, as kubectl)",
    )
    p.add_argument(
        "--pool-name",
        default=None,
        help="--source kube: also be the endpoint picker of this InferencePool (its Ready pods, models "
        "discovered from them; docs/inferencepool.md)",
    )
    p.add_argument(
        "--pool-namespace",
        default=_SOURCE["pool_namespace"],
        help="the namespace of --pool-name",
    )
    p.add_argument("--listen", default=_SERVE["listen"], help="gRPC ext_proc + health address")
    p.add_argument(
        "--admin-listen",
        default=_SERVE["admin_listen"],
        help="/metrics, /healthz, /readyz; /debug/ pages answer loopback clients only",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=_SERVE["max_body_bytes"], help="larger bodies get 413"
    )
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=_SERVE["max_buffered_bytes"],
        help="request-body bytes all streams may hold at once; past it, 429",
    )
    p.add_argument(
        "--max-fallbacks",
        type=int,
        default=_SERVE["max_fallbacks"],
        help="fallback endpoints after the pick (0: works with every cluster type); 2 behind override_host "
        "makes retries follow the ranking",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=_SERVE["drain_seconds"],
        help="on SIGTERM, health turns NOT_SERVING but new streams are served this long; then open "
        "streams get as long again to finish (a second signal exits at once)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed tie-breaking randomness (for tests)")
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=DEFAULT_POLICY,
        help="how endpoints are ranked (docs/latency-profiles.md)",
    )
    p.add_argument(
        "--profiles",
        type=Path,
        default=None,
        help="latency profiles (YAML, re-read when it changes) for --policy predicted-ttft",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=_SERVE["calibrate"],
        help="fit each worker set's prefill rate and step cost to its engines' reported TTFTs "
        "(needs --scrape-interval > 0)",
    )
    p.add_argument(
        "--malloc-trim-interval",
        type=float,
        default=_SERVE["malloc_trim_interval"],
        help="seconds between malloc_trim calls giving freed heap pages back to the system; 0 = never",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=_SERVE["scrape_interval"],
        help="seconds between scrapes of each endpoint's /metrics (vLLM or SGLang names); 0 = off",
    )
    p.add_argument(
        "--decision-headers",
        action="store_true",
        help="add x-extproc-endpoint / -cached-tokens / -prefix-mode ... to responses (they name pods)",
    )
    c = p.add_argument_group(
        "candidate set",
        "a pool larger than the three counts together scores only these endpoints per request "
        "(docs/performance.md#large-pools)",
    )
    c.add_argument(
        "--candidates-prefix",
        type=int,
        default=_CANDIDATES["prefix_holders"],
        help="the endpoints holding the longest cached prefix of the prompt",
    )
    c.add_argument(
        "--candidates-least-loaded",
        type=int,
        default=_CANDIDATES["least_loaded"],
        help="the least-loaded endpoints (requests in flight, the engine's queue at its last scrape)",
    )
    c.add_argument(
        "--candidates-random",
        type=int,
        default=_CANDIDATES["random"],
        help="endpoints drawn at random, so none starves",
    )
    c.add_argument("--score-all-endpoints", action="store_true", help="score every endpoint of every pool")
    r = p.add_argument_group(
        "replicas",
        "serve replicas that share their leases, so each counts the others' requests as load "
        "(docs/operations.md#replicas)",
    )
    r.add_argument(
        "--peer-listen",
        default=None,
        metavar="HOST:PORT",
        help="where this replica publishes its leases to its peers (ZMQ); off by default",
    )
    r.add_argument(
        "--peers",
        default="",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the other replicas' --peer-listen addresses; only these are heard",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=_SERVE["workers"],
        help="processes serving the same --listen port (the kernel spreads Envoy's connections), "
        "peered with each other, so one pod uses N cores; worker i answers admin on the admin port + i "
        "and, with --peer-listen HOST:PORT, publishes on PORT + i",
    )
    r.add_argument(
        "--peer-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the replicas' shared CURVE secret key (`extproc peer-key` prints one): "
        "peer sync is then encrypted, and only holders of the key may subscribe or pass for a peer",
    )
    r.add_argument(
        "--peer-service",
        default=None,
        metavar="NAMESPACE/NAME",
        help="--source kube: the peers are the endpoints of this (headless) Service, port 'peer'",
    )
    q = p.add_argument_group(
        "flow control",
        "requests that find every endpoint of their pool saturated (the profile's queue_limit / "
        "kv_cache_limit) wait, by priority and fairly (docs/flow-control.md)",
    )
    q.add_argument(
        "--max-queue",
        type=int,
        default=_FLOW["max_queue"],
        help="requests that may wait per pool; 0: none, a saturated pool answers 429 at once",
    )
    q.add_argument(
        "--queue-timeout",
        type=float,
        default=_FLOW["queue_timeout"],
        help="seconds a request may wait for room before it gets 429 with Retry-After",
    )
    g = p.add_argument_group("prefix-cache-aware routing")
    g.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="tokenizer of an upstream model: a folder with tokenizer.json, a Hugging Face model id "
        "found in --hf-cache, or extproc:tiny (the simulator's); repeat per model",
    )
    g.add_argument(
        "--chat-template",
        action="append",
        default=[],
        metavar="MODEL=FILE",
        help="chat template of a model: a .jinja file, or chatml / llama3 (default: the tokenizer's)",
    )
    g.add_argument("--hf-cache", type=Path, default=None, help="Hugging Face hub cache for --tokenizer ids")
    g.add_argument(
        "--kv-index-memory-mib",
        type=int,
        default=_PREFIX["index_memory_mib"],
        help="memory the KV-event index may hold, MiB: its block bound at 40 bytes a block",
    )
    g.add_argument(
        "--kv-index-max-blocks",
        type=int,
        default=_PREFIX["index_max_blocks"],
        help="KV-event index size in blocks, all endpoints, least recently stored out "
        "(default: from --kv-index-memory-mib)",
    )
    g.add_argument(
        "--kv-index-max-blocks-per-endpoint",
        type=int,
        default=_PREFIX["index_max_blocks_per_endpoint"],
        help="... per endpoint",
    )
    g.add_argument(
        "--approx-prefix-max-blocks",
        type=int,
        default=_PREFIX["approx_max_blocks"],
        help="prompt chunks remembered, at most, for models routed without tokenizer or KV events; each "
        "is kept at least until half that many others are recorded after it",
    )
    g.add_argument(
        "--tokenize-threads",
        type=int,
        default=_PREFIX["tokenize_threads"],
        help="threads tokenizing prompts off the event loop (none given: one per core; 0: on the loop)",
    )
    g.add_argument(
        "--tokenize-processes",
        type=int,
        default=_PREFIX["tokenize_processes"],
        help="tokenize long prompts in this many processes of their own instead of threads: parsing "
        "and template rendering then never hold the event loop's GIL, at ~100 MB of memory each",
    )
    g.add_argument(
        "--tokenize-queue",
        type=int,
        default=_PREFIX["tokenize_queue"],
        help="prompts tokenized or waiting at once; past it a request is routed without tokens",
    )
    g.add_argument(
        "--tokenize-cache-mb",
        type=float,
        default=_PREFIX["tokenize_cache_bytes"] / (1024 * 1024),
        help="MiB of prompt pieces' token ids remembered per model, so a conversation's next turn "
        "encodes only what is new (0: off)",
    )
    g.add_argument(
        "--tokenize-budget-ms",
        type=float,
        default=_PREFIX["tokenize_budget"] * 1000,
        help="longest a request waits for its prompt's tokens before it is routed without them",
    )
    p.set_defaults(handler=run_serve)


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """Flags -> settings; ConfigError names the flag that is wrong."""
    return ServeSettings(
        source=SourceSettings.parse(
            args.source,
            poll_interval=args.source_poll_interval,
            max_bytes=args.max_catalog_bytes,
            namespaces=args.namespaces,
            kubeconfig=args.kubeconfig,
            pool_name=args.pool_name,
            pool_namespace=args.pool_namespace,
        ),
        listen=args.listen,
        admin_listen=args.admin_listen,
        max_body_bytes=args.max_body_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        max_fallbacks=args.max_fallbacks,
        candidates=CandidateSettings(
            prefix_holders=args.candidates_prefix,
            least_loaded=args.candidates_least_loaded,
            random=args.candidates_random,
            score_all=args.score_all_endpoints,
        ),
        flow=FlowSettings(max_queue=args.max_queue, queue_timeout=args.queue_timeout),
        drain_seconds=args.drain_seconds,
        seed=args.seed,
        prefix=_prefix_settings(args),
        policy=args.policy,
        profiles=args.profiles,
        calibrate=args.calibrate,
        malloc_trim_interval=args.malloc_trim_interval,
        scrape_interval=args.scrape_interval,
        decision_headers=args.decision_headers,
        peer_listen=args.peer_listen,
        peer_key_file=args.peer_key_file,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        peer_service=args.peer_service,
        workers=args.workers,
    )


def _prefix_settings(args: argparse.Namespace) -> PrefixSettings:
    tokenizers = TokenizerSpec.parse_pairs("--tokenizer", args.tokenizer)
    templates = TokenizerSpec.parse_pairs("--chat-template", args.chat_template)
    orphans = sorted(set(templates) - set(tokenizers))
    if orphans:
        raise ConfigError(f"--chat-template for {orphans} needs a --tokenizer for the same model")
    return PrefixSettings(
        tokenizers=tuple(TokenizerSpec(m, path, templates.get(m)) for m, path in sorted(tokenizers.items())),
        hf_cache=args.hf_cache,
        index_memory_mib=args.kv_index_memory_mib,
        index_max_blocks=args.kv_index_max_blocks,
        index_max_blocks_per_endpoint=args.kv_index_max_blocks_per_endpoint,
        approx_max_blocks=args.approx_prefix_max_blocks,
        tokenize_threads=args.tokenize_threads,
        tokenize_processes=args.tokenize_processes,
        tokenize_queue=args.tokenize_queue,
        tokenize_budget=args.tokenize_budget_ms / 1000,
        tokenize_cache_bytes=int(args.tokenize_cache_mb * 1024 * 1024),
    )


async def run_serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from extproc.serve.app import serve
    from extproc.serve.workers import as_worker, run_workers

    settings = as_worker(serve_settings(args))
    if settings.workers > 1:
        await run_workers(settings, args.argv, stop)
    else:
        await serve(settings, stop=stop)
