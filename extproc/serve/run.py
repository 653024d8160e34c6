"""``extproc serve``: flags -> :class:`~extproc.settings.ServeSettings` -> the server, or
``--workers`` copies of it.

A flag that sets a settings field is declared with :func:`~extproc.flags.setting_flag`, so its
default and type are the field's (``--help`` and ``docs/flags.md`` show them from there).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from extproc.errors import ConfigError
from extproc.flags import flag_values, setting_flag
from extproc.scheduling.registry import DEFAULT_POLICY, POLICIES
from extproc.settings import (
    CandidateSettings,
    FlowSettings,
    PrefixSettings,
    ServeSettings,
    SourceSettings,
    TokenizerSpec,
)


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
    setting_flag(
        p,
        "--source-poll-interval",
        SourceSettings,
        "poll_interval",
        "file: seconds between checks of the catalog file",
    )
    setting_flag(
        p,
        "--max-catalog-bytes",
        SourceSettings,
        "max_bytes",
        "file: largest catalog file read; a larger one is refused and the last good catalog kept",
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
    setting_flag(p, "--pool-namespace", SourceSettings, "pool_namespace", "the namespace of --pool-name")
    setting_flag(p, "--listen", ServeSettings, "listen", "gRPC ext_proc + health address")
    setting_flag(
        p,
        "--admin-listen",
        ServeSettings,
        "admin_listen",
        "/metrics, /healthz, /readyz; /debug/ pages answer loopback clients only",
    )
    setting_flag(p, "--max-body-bytes", ServeSettings, "max_body_bytes", "larger bodies get 413")
    setting_flag(
        p,
        "--max-buffered-bytes",
        ServeSettings,
        "max_buffered_bytes",
        "request-body bytes all streams may hold at once; past it, 429",
    )
    setting_flag(
        p,
        "--max-fallbacks",
        ServeSettings,
        "max_fallbacks",
        "fallback endpoints after the pick (0: works with every cluster type); 2 behind override_host "
        "makes retries follow the ranking",
    )
    setting_flag(
        p,
        "--drain-seconds",
        ServeSettings,
        "drain_seconds",
        "on SIGTERM, health turns NOT_SERVING but new streams are served this long; then open "
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
    setting_flag(
        p,
        "--calibrate",
        ServeSettings,
        "calibrate",
        "fit each worker set's prefill rate and step cost to its engines' reported TTFTs "
        "(needs --scrape-interval > 0)",
        action=argparse.BooleanOptionalAction,
    )
    setting_flag(
        p,
        "--malloc-trim-interval",
        ServeSettings,
        "malloc_trim_interval",
        "seconds between malloc_trim calls giving freed heap pages back to the system; 0 = never",
    )
    setting_flag(
        p,
        "--scrape-interval",
        ServeSettings,
        "scrape_interval",
        "seconds between scrapes of each endpoint's /metrics (vLLM or SGLang names); 0 = off",
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
    setting_flag(
        c,
        "--candidates-prefix",
        CandidateSettings,
        "prefix_holders",
        "the endpoints holding the longest cached prefix of the prompt",
    )
    setting_flag(
        c,
        "--candidates-least-loaded",
        CandidateSettings,
        "least_loaded",
        "the least-loaded endpoints (requests in flight, the engine's queue at its last scrape)",
    )
    setting_flag(
        c, "--candidates-random", CandidateSettings, "random", "endpoints drawn at random, so none starves"
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
    setting_flag(
        r,
        "--workers",
        ServeSettings,
        "workers",
        "processes serving the same --listen port (the kernel spreads Envoy's connections), "
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
    setting_flag(
        q,
        "--max-queue",
        FlowSettings,
        "max_queue",
        "requests that may wait per pool; 0: none, a saturated pool answers 429 at once",
    )
    setting_flag(
        q,
        "--queue-timeout",
        FlowSettings,
        "queue_timeout",
        "seconds a request may wait for room before it gets 429 with Retry-After",
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
    setting_flag(
        g,
        "--kv-index-memory-mib",
        PrefixSettings,
        "index_memory_mib",
        "memory the KV-event index may hold, MiB: its block bound at 40 bytes a block",
    )
    setting_flag(
        g,
        "--kv-index-max-blocks",
        PrefixSettings,
        "index_max_blocks",
        "KV-event index size in blocks, all endpoints, least recently stored out "
        "(default: from --kv-index-memory-mib)",
        type=int,
    )
    setting_flag(
        g,
        "--kv-index-max-blocks-per-endpoint",
        PrefixSettings,
        "index_max_blocks_per_endpoint",
        "... per endpoint",
    )
    setting_flag(
        g,
        "--approx-prefix-max-blocks",
        PrefixSettings,
        "approx_max_blocks",
        "prompt chunks remembered, at most, for models routed without tokenizer or KV events; each "
        "is kept at least until half that many others are recorded after it",
    )
    setting_flag(
        g,
        "--tokenize-threads",
        PrefixSettings,
        "tokenize_threads",
        "threads tokenizing prompts off the event loop (none given: one per core; 0: on the loop)",
        type=int,
    )
    setting_flag(
        g,
        "--tokenize-processes",
        PrefixSettings,
        "tokenize_processes",
        "tokenize long prompts in this many processes of their own instead of threads: parsing "
        "and template rendering then never hold the event loop's GIL, at ~100 MB of memory each",
    )
    setting_flag(
        g,
        "--tokenize-queue",
        PrefixSettings,
        "tokenize_queue",
        "prompts tokenized or waiting at once; past it a request is routed without tokens",
    )
    setting_flag(
        g,
        "--tokenize-cache-mb",
        PrefixSettings,
        "tokenize_cache_bytes",
        "MiB of prompt pieces' token ids remembered per model, so a conversation's next turn "
        "encodes only what is new (0: off)",
        scale=1 / (1024 * 1024),
    )
    setting_flag(
        g,
        "--tokenize-budget-ms",
        PrefixSettings,
        "tokenize_budget",
        "longest a request waits for its prompt's tokens before it is routed without them",
        scale=1000,
    )
    p.set_defaults(handler=run_serve)


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """Flags -> settings; ConfigError names the flag that is wrong."""
    return ServeSettings(
        **flag_values(args, ServeSettings),
        source=SourceSettings.parse(
            args.source,
            **flag_values(args, SourceSettings),
            namespaces=args.namespaces,
            kubeconfig=args.kubeconfig,
            pool_name=args.pool_name,
        ),
        candidates=CandidateSettings(
            **flag_values(args, CandidateSettings), score_all=args.score_all_endpoints
        ),
        flow=FlowSettings(**flag_values(args, FlowSettings)),
        seed=args.seed,
        prefix=_prefix_settings(args),
        policy=args.policy,
        profiles=args.profiles,
        decision_headers=args.decision_headers,
        peer_listen=args.peer_listen,
        peer_key_file=args.peer_key_file,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        peer_service=args.peer_service,
    )


def _prefix_settings(args: argparse.Namespace) -> PrefixSettings:
    tokenizers = TokenizerSpec.parse_pairs("--tokenizer", args.tokenizer)
    templates = TokenizerSpec.parse_pairs("--chat-template", args.chat_template)
    orphans = sorted(set(templates) - set(tokenizers))
    if orphans:
        raise ConfigError(f"--chat-template for {orphans} needs a --tokenizer for the same model")
    return PrefixSettings(
        **flag_values(args, PrefixSettings),
        tokenizers=tuple(TokenizerSpec(m, path, templates.get(m)) for m, path in sorted(tokenizers.items())),
        hf_cache=args.hf_cache,
    )


async def run_serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from extproc.serve.app import serve
    from extproc.serve.workers import as_worker, run_workers

    settings = as_worker(serve_settings(args))
    if settings.workers > 1:
        await run_workers(settings, args.argv, stop)
    else:
        await serve(settings, stop=stop)
