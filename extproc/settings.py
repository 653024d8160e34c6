"""Settings for ``extproc serve``: one frozen tree, validated on construction.

Flags (and nothing else, for now) map onto these dataclasses in :mod:`extproc.serve.run`; everything
below the CLI receives a validated :class:`ServeSettings` and never reads flags or the environment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from extproc.addresses import parse_host_port
from extproc.errors import ConfigError


def parse_namespaces(text: str | None) -> tuple[str, ...] | None:
    """``--namespaces a,b`` -> the names (blanks dropped); None (flag absent) -> None: all namespaces.
    :func:`check_namespaces` validates the result."""
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def check_namespaces(namespaces: tuple[str, ...] | None) -> None:
    """Refuse an empty list or a name that cannot be a namespace (ConfigError naming ``--namespaces``)."""
    if namespaces is None:
        return
    if not namespaces:
        raise ConfigError("--namespaces: give at least one namespace, or leave it out for all")
    for namespace in namespaces:
        if not _DNS_LABEL.fullmatch(namespace):
            raise ConfigError(f"--namespaces: {namespace!r} is not a namespace name (RFC 1123 label)")


@dataclass(frozen=True, slots=True)
class SourceSettings:
    """Where the catalog comes from: a YAML file (``file``) or the cluster's API server (``kube``)."""

    #: ``file`` or ``kube``.
    kind: str
    #: The YAML file for ``file``.
    path: Path | None = None
    #: Seconds between checks of the file for changes.
    poll_interval: float = 1.0
    #: ``file``: the largest catalog file read, in bytes; a larger one is refused; room
    #: for a 2,000-Service cluster's objects (3-6 MB) several times over.
    max_bytes: int = 16 * 1024 * 1024
    #: ``kube``: the namespaces to watch; None (the default) watches all namespaces.
    namespaces: tuple[str, ...] | None = None
    #: ``kube``: a kubeconfig file; None = in-cluster credentials when ``KUBERNETES_SERVICE_HOST``
    #: is set, else ``$KUBECONFIG`` or ``~/.kube/config``, as kubectl picks them.
    kubeconfig: Path | None = None
    #: ``kube``: the InferencePool this serve is the endpoint picker of (``--pool-name``), beside
    #: the worker sets; None: worker sets only.
    pool_name: str | None = None
    #: Its namespace (``--pool-namespace``).
    pool_namespace: str = "default"

    def __post_init__(self) -> None:
        if self.kind not in ("file", "kube"):
            raise ConfigError(f"--source: expected file:PATH or kube, got {self.kind!r}")
        if self.kind == "file" and self.path is None:
            raise ConfigError("--source file:PATH needs a PATH")
        if self.kind == "file" and (self.namespaces is not None or self.kubeconfig is not None):
            raise ConfigError("--namespaces and --kubeconfig apply to --source kube only")
        if self.pool_name is not None:
            if self.kind != "kube":
                raise ConfigError(
                    "--pool-name needs --source kube (an InferencePool is read from the cluster)"
                )
            if not _DNS_LABEL.fullmatch(self.pool_namespace):
                raise ConfigError(f"--pool-namespace: {self.pool_namespace!r} is not a namespace name")
            if not _DNS_SUBDOMAIN.fullmatch(self.pool_name):
                raise ConfigError(
                    f"--pool-name: {self.pool_name!r} is not an object name (RFC 1123 subdomain)"
                )
        if self.poll_interval <= 0:
            raise ConfigError(f"--source-poll-interval must be positive, got {self.poll_interval}")
        if self.max_bytes < 1:
            raise ConfigError(f"--max-catalog-bytes must be at least 1, got {self.max_bytes}")
        check_namespaces(self.namespaces)

    @classmethod
    def parse(
        cls,
        spec: str,
        *,
        poll_interval: float = 1.0,
        namespaces: str | None = None,
        kubeconfig: Path | None = None,
        max_bytes: int = 16 * 1024 * 1024,
        pool_name: str | None = None,
        pool_namespace: str = "default",
    ) -> SourceSettings:
        """``file:PATH`` or ``kube``; ``namespaces`` is the ``--namespaces a,b`` text."""
        listed = parse_namespaces(namespaces)
        if spec == "kube":
            return cls(
                kind="kube",
                namespaces=listed,
                kubeconfig=kubeconfig,
                poll_interval=poll_interval,
                pool_name=pool_name,
                pool_namespace=pool_namespace,
            )
        kind, sep, rest = spec.partition(":")
        if kind != "file" or not sep or not rest:
            raise ConfigError(f"--source: expected file:PATH or kube, got {spec!r}")
        return cls(
            kind=kind,
            path=Path(rest),
            poll_interval=poll_interval,
            namespaces=listed,
            kubeconfig=kubeconfig,
            max_bytes=max_bytes,
            pool_name=pool_name,
        )


#: A namespace name: an RFC 1123 label.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """One model's tokenizer source: a folder, a Hugging Face model id, or ``extproc:tiny``."""

    model: str
    tokenizer: str
    #: A template file or a shipped name (``chatml``, ``llama3``); None = the tokenizer's own.
    chat_template: str | None = None

    @staticmethod
    def parse_pairs(flag: str, values: Iterable[str]) -> dict[str, str]:
        """``MODEL=VALUE`` flags -> {model: value}; model names may contain ``=``-free slashes."""
        pairs: dict[str, str] = {}
        for value in values:
            model, sep, rest = value.rpartition("=")
            if not sep or not model or not rest:
                raise ConfigError(f"{flag}: expected MODEL=VALUE, got {value!r}")
            if model in pairs:
                raise ConfigError(f"{flag}: model {model!r} is given twice")
            pairs[model] = rest
        return pairs


@dataclass(frozen=True, slots=True)
class CandidateSettings:
    """How many endpoints of a large pool one decision scores (:mod:`extproc.scheduling.candidates`).

    A pool no larger than the three counts together is scored whole."""

    #: The endpoints holding the longest cached prefix of the prompt.
    prefix_holders: int = 8
    #: The least-loaded endpoints (our requests in flight, the engine's queue at its last scrape).
    least_loaded: int = 8
    #: Endpoints drawn at random, so none starves and new ones get tried.
    random: int = 4
    #: Score every endpoint whatever the pool's size.
    score_all: bool = False

    def __post_init__(self) -> None:
        counts = {
            "--candidates-prefix": self.prefix_holders,
            "--candidates-least-loaded": self.least_loaded,
            "--candidates-random": self.random,
        }
        for flag, value in counts.items():
            if value < 0:
                raise ConfigError(f"{flag} must be 0 or more, got {value}")
        if not self.score_all and self.least_loaded + self.random < 1:
            raise ConfigError(
                "--candidates-least-loaded + --candidates-random must be 1 or more: prefix holders "
                "alone leave a request nothing to score when no endpoint holds its prompt"
            )

    @property
    def total(self) -> int:
        return self.prefix_holders + self.least_loaded + self.random

    def scores_all(self, pool_size: int) -> bool:
        """Whether a pool of ``pool_size`` endpoints is scored whole."""
        return self.score_all or pool_size <= self.total


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """Prefix-cache-aware routing: tokenizers per model and the bounds of the indexes."""

    #: Tokenizer (+ chat template) per upstream model; models without one route approximately.
    tokenizers: tuple[TokenizerSpec, ...] = ()
    #: A Hugging Face hub cache to resolve ``--tokenizer MODEL=org/name`` in (never downloaded).
    hf_cache: Path | None = None
    #: Memory the KV-event index may hold, MiB: its block bound is this at 40 bytes a block (the
    #: measured worst case, bench/results/kvindex.md), ~27M blocks by default: 1,000 pods' whole GPU
    #: caches (a Llama-3-8B H100 pod holds ~24k blocks of 16 tokens).
    index_memory_mib: int = 1024
    #: Blocks the KV-event index holds in total (None: from ``index_memory_mib``), and per endpoint
    #: (LRU beyond).
    index_max_blocks: int | None = None
    index_max_blocks_per_endpoint: int = 262_144
    #: Prompt chunks remembered for approximate affinity (models without tokenizer or KV events).
    approx_max_blocks: int = 200_000
    #: Threads tokenizing prompts off the event loop (None: one per core; 0: inline, on the loop).
    tokenize_threads: int | None = None
    #: Processes tokenizing long prompts instead of threads (0: threads; see tokenize/workers.py).
    tokenize_processes: int = 0
    #: Prompts being tokenized or waiting at once; one more is routed without its tokens.
    tokenize_queue: int = 256
    #: Seconds a request waits for its prompt's tokens before it is routed without them.
    tokenize_budget: float = 0.25
    #: Bytes of prompt pieces' ids remembered per model, so a conversation's next turn encodes only
    #: what is new (0: off).
    tokenize_cache_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for flag, value in (
            ("--kv-index-memory-mib", self.index_memory_mib),
            ("--kv-index-max-blocks", 1 if self.index_max_blocks is None else self.index_max_blocks),
            ("--kv-index-max-blocks-per-endpoint", self.index_max_blocks_per_endpoint),
            ("--approx-prefix-max-blocks", self.approx_max_blocks),
            ("--tokenize-queue", self.tokenize_queue),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if self.tokenize_threads is not None and self.tokenize_threads < 0:
            raise ConfigError(f"--tokenize-threads must be 0 (inline) or more, got {self.tokenize_threads}")
        if self.tokenize_processes < 0:
            raise ConfigError(
                f"--tokenize-processes must be 0 (threads) or more, got {self.tokenize_processes}"
            )
        if self.tokenize_processes and self.tokenize_threads == 0:
            raise ConfigError(
                "--tokenize-processes N and --tokenize-threads 0 (tokenize on the loop) contradict each other"
            )
        if self.tokenize_cache_bytes < 0:
            raise ConfigError(f"--tokenize-cache-mb must be 0 (off) or more, got {self.tokenize_cache_bytes}")
        if not self.tokenize_budget > 0:
            raise ConfigError(f"--tokenize-budget-ms must be positive, got {self.tokenize_budget * 1000:g}")
        models = [spec.model for spec in self.tokenizers]
        if len(set(models)) != len(models):
            raise ConfigError(f"--tokenizer: a model is given twice in {models}")


#: serve's admin address when --admin-listen is not given.
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9090"


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """Flow control: requests that find their pool saturated wait (``extproc.control.flow``)."""

    #: Requests that may wait per pool (``--max-queue``); 0 turns queueing off: a saturated pool
    #: answers 429 at once.
    max_queue: int = 128
    #: Seconds a request may wait for room before it gets 429 (``--queue-timeout``).
    queue_timeout: float = 2.0

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue must be 0 (no queueing) or more, got {self.max_queue}")
        if not (self.queue_timeout > 0 and math.isfinite(self.queue_timeout)):
            raise ConfigError(
                f"--queue-timeout must be a positive number of seconds, got {self.queue_timeout}"
            )

    @property
    def retry_after(self) -> int:
        """``Retry-After`` seconds of a shed request: about one queue wait."""
        return max(1, math.ceil(self.queue_timeout))


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything ``extproc serve`` needs."""

    source: SourceSettings
    #: gRPC ext_proc (+ grpc.health.v1) listen address. Loopback by default.
    listen: str = "127.0.0.1:9002"
    #: Admin HTTP (``/metrics``, ``/debug/state``) listen address. Loopback by default.
    admin_listen: str = DEFAULT_ADMIN_LISTEN
    #: Largest request body accepted, in bytes; larger ones get 413.
    max_body_bytes: int = 16 * 1024 * 1024
    #: Request-body bytes all streams may hold at once; past it, requests get 429.
    max_buffered_bytes: int = 256 * 1024 * 1024
    #: How many fallback endpoints follow the pick in ``x-gateway-destination-endpoint``.
    #: Envoy's override_host policy walks the list on retry; ORIGINAL_DST clusters accept a
    #: single address only (a list gets 503), and the endpoint-picker protocol requires the header
    #: and the ``envoy.lb`` metadata to hold the same value. 0 works behind either.
    max_fallbacks: int = 0
    #: How many endpoints of a large pool one decision scores.
    candidates: CandidateSettings = field(default_factory=CandidateSettings)
    #: How requests wait when their pool is saturated.
    flow: FlowSettings = field(default_factory=FlowSettings)
    #: Seed for tie-breaking randomness; None for a random seed. Tests and benchmarks set it.
    seed: int | None = None
    #: Seconds to let in-flight streams finish on shutdown.
    drain_seconds: float = 5.0
    prefix: PrefixSettings = field(default_factory=PrefixSettings)
    #: How endpoints are ranked: a name in :mod:`extproc.scheduling.registry` (which validates it
    #: when serve starts, and holds the default); None: the registry's default.
    policy: str | None = None
    #: The latency profiles file (YAML, hot-reloaded); None = the built-in ``default`` profile only.
    profiles: Path | None = None
    #: Fit each worker set's prefill rate and step cost to the TTFTs its engines report (needs
    #: scraping); False: the profiles are used as written.
    calibrate: bool = True
    #: Seconds between calls to glibc's malloc_trim (freed heap pages back to the system); 0 = never.
    malloc_trim_interval: float = 60.0
    #: Seconds between scrapes of every endpoint's Prometheus metrics; 0 turns scraping off.
    scrape_interval: float = 1.0
    #: Add ``x-extproc-*`` headers describing the decision to client responses. Off by default:
    #: they name pod addresses.
    decision_headers: bool = False
    #: Peer sync (``--peer-listen``): where this replica publishes its leases; None: no peer sync.
    peer_listen: str | None = None
    #: The other replicas' ``--peer-listen`` addresses (``--peers``).
    peers: tuple[str, ...] = ()
    #: Processes serving the same ``--listen`` port, peered over loopback (``--workers``).
    workers: int = 1
    #: This process is one of several workers on one port (set by ``--workers``, not a flag).
    reuse_port: bool = False
    #: With ``--workers N`` and ``--peer-listen HOST:PORT``, this worker publishes on PORT + this
    #: index (set by ``--workers``, not a flag).
    peer_worker: int = 0
    #: Ports every replica (this one too) publishes on, from its ``--peer-listen`` port up: one per
    #: worker, so every replica runs the same ``--workers`` (set by ``--workers``, not a flag).
    peer_fanout: int = 1
    #: ``NAMESPACE/NAME`` of a Service whose EndpointSlices list the replicas (``--peer-service``,
    #: with ``--source kube``): its port named ``peer``; the addresses found join ``peers``.
    peer_service: str | None = None
    #: A file holding the replicas' shared CURVE secret key (``--peer-key-file``): peer sync is then
    #: encrypted, and only holders of the key may subscribe or pass for a peer. None: plain ZMQ.
    peer_key_file: Path | None = None

    def __post_init__(self) -> None:
        parse_host_port(self.listen, what="--listen")
        parse_host_port(self.admin_listen, what="--admin-listen")
        if self.peer_listen is not None:
            parse_host_port(self.peer_listen, what="--peer-listen")
        for peer in self.peers:
            parse_host_port(peer, what="--peers")
        if not 1 <= self.workers <= 64:
            raise ConfigError(f"--workers must be 1 to 64, got {self.workers}")
        if self.workers > 1 and self.peer_listen is not None:
            port = parse_host_port(self.peer_listen, what="--peer-listen")[1]
            if port == 0 or port + self.workers - 1 > 65535:
                raise ConfigError(
                    f"--workers {self.workers} with --peer-listen: the workers publish on {self.workers} "
                    f"ports from the one given, which must be fixed (not 0) and leave room, got {port}"
                )
        if self.workers > 1 and parse_host_port(self.listen, what="--listen")[1] == 0:
            raise ConfigError("--workers N needs a --listen port of its own (not 0): the workers share it")
        if self.peer_key_file is not None and self.peer_listen is None:
            raise ConfigError("--peer-key-file needs --peer-listen (it secures peer sync)")
        if (self.peers or self.peer_service) and self.peer_listen is None:
            raise ConfigError("--peers and --peer-service need --peer-listen (peers hear this replica there)")
        if self.peer_service is not None:
            namespace, _, name = self.peer_service.partition("/")
            if not (_DNS_LABEL.fullmatch(namespace) and _DNS_LABEL.fullmatch(name)):
                raise ConfigError(f"--peer-service must be NAMESPACE/NAME, got {self.peer_service!r}")
            if self.source.kind != "kube":
                raise ConfigError(
                    "--peer-service needs --source kube (it reads the Service's EndpointSlices)"
                )
        if self.max_body_bytes < 1:
            raise ConfigError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ConfigError(
                f"--max-buffered-bytes ({self.max_buffered_bytes}) must be at least --max-body-bytes "
                f"({self.max_body_bytes}), or no large request could ever pass"
            )
        if self.max_fallbacks < 0:
            raise ConfigError(f"--max-fallbacks must be 0 or more, got {self.max_fallbacks}")
        if self.drain_seconds < 0:
            raise ConfigError(f"--drain-seconds must be 0 or more, got {self.drain_seconds}")
        if self.malloc_trim_interval < 0:
            raise ConfigError(
                f"--malloc-trim-interval must be 0 (off) or more seconds, got {self.malloc_trim_interval}"
            )
        if self.scrape_interval < 0:
            raise ConfigError(
                f"--scrape-interval must be 0 (off) or more seconds, got {self.scrape_interval}"
            )


@dataclass(frozen=True, slots=True)
class ReconcileSettings:
    """Everything ``extproc reconcile`` (the status sidecar) needs."""

    #: Who we are in the Lease (``--identity``; the CLI defaults it to $POD_NAME, else the host name).
    identity: str
    #: A kubeconfig file; None: in-cluster credentials, else $KUBECONFIG, else ~/.kube/config.
    kubeconfig: Path | None = None
    #: Namespaces to reconcile; None: all of them.
    namespaces: tuple[str, ...] | None = None
    #: Base URL of the ``serve`` admin port beside us (its ``/debug/state``). Loopback by default.
    serve_admin: str = "http://127.0.0.1:9090"
    #: Seconds between reads of ``serve``'s state, and the longest wait for one.
    serve_poll_interval: float = 2.0
    serve_timeout: float = 1.5
    #: The ``coordination.k8s.io`` Lease that elects the one replica writing status.
    lease_name: str = "extproc-reconciler"
    lease_namespace: str = "default"
    #: Seconds: how long a leader's lease lasts unrenewed, how often it renews, and how often a
    #: follower retries. A leader stops writing 2/3 of a lease duration after its last
    #: renewal, before anyone may take over.
    lease_duration: float = 15.0
    renew_interval: float = 5.0
    retry_interval: float = 2.0
    #: Admin HTTP (``/healthz``, ``/metrics``, ``/debug/state``) listen address. Loopback by default.
    admin_listen: str = "127.0.0.1:9091"
    #: Seconds between full recomputations when nothing reported a change.
    resync_interval: float = 30.0

    def __post_init__(self) -> None:
        parse_host_port(self.admin_listen, what="--admin-listen")
        if not self.identity:
            raise ConfigError("--identity must not be empty")
        if not self.serve_admin.startswith(("http://", "https://")):
            raise ConfigError(f"--serve-admin: expected an http:// URL, got {self.serve_admin!r}")
        check_namespaces(self.namespaces)
        for flag, value in (
            ("--serve-poll-interval", self.serve_poll_interval),
            ("--serve-timeout", self.serve_timeout),
            ("--lease-duration", self.lease_duration),
            ("--lease-renew-interval", self.renew_interval),
            ("--lease-retry-interval", self.retry_interval),
            ("--resync-interval", self.resync_interval),
        ):
            if not value > 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        if self.renew_interval >= self.lease_duration * 2 / 3:
            raise ConfigError(
                f"--lease-renew-interval ({self.renew_interval}) must be under 2/3 of --lease-duration "
                f"({self.lease_duration}), or a leader would step down between renewals"
            )
