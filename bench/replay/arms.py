"""The replay's arms and run configuration, shared by the online runner (:mod:`.run`) and the
offline one (:mod:`.offline`): an arm is one policy with the prefix producer it runs on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.replay.policies import ActiveBlocks, DynamoCost, GieLike, RoundRobin
from extproc.catalog.build import build_catalog
from extproc.catalog.model import Catalog
from extproc.catalog.resources import EndpointSlice, InferenceWorkerSet, Service, parse_object
from extproc.demo.catalog import LocalWorkerSet, catalog_documents
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.policy import Policy
from extproc.scheduling.profiles import Profile
from extproc.settings import CandidateSettings
from extproc.sim.engine_core import EngineParams

log = logging.getLogger("bench.replay")

REPO = Path(__file__).resolve().parents[2]
#: The shared traces live beside the repository (``../shared/traces``), as the project lays them out.
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL = "mooncake-replay"
PATH = "/v1/completions"


@dataclass(slots=True)
class Arm:
    """One policy with the prefix producer it runs on and the hooks its state needs."""

    name: str
    policy: Policy
    #: True: the catalog declares no KV events, so the matcher uses our routing history (approximate).
    approximate: bool = False
    active: ActiveBlocks | None = None
    #: The scheduler's candidate set (None: serve's default, which scores a pool of 20 or fewer whole).
    candidates: CandidateSettings | None = None


def true_profile(engine: EngineParams) -> Profile:
    """The latency profile the simulated engines actually run: their speed and batch limits."""
    return Profile(
        prefill_tokens_per_s=engine.prefill_tokens_per_s,
        decode_base_ms=engine.decode_base_s * 1000,
        decode_per_seq_ms=engine.decode_per_seq_s * 1000,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
    )


def ours(engine: EngineParams) -> tuple[str, Policy]:
    """The router's own policy: the latency-profile predictor (with :func:`true_profile`) when it
    exists, else cache-then-load."""
    try:
        from extproc.scheduling.predictor import PredictedTTFT

        profile = true_profile(engine)
        policy: Policy = PredictedTTFT(lambda _endpoint: profile)
        return f"ours ({policy.name})", policy
    except Exception as exc:  # not landed, or its interface changed: still compare something
        log.warning("predictor unavailable (%r): ours = cache-then-load", exc)
        return "ours (cache-then-load)", CacheThenLoad()


def default_arms(
    engine: EngineParams, candidates: CandidateSettings | None = None
) -> list[Callable[[], Arm]]:
    """Factories (fresh policy state per arm) in report order; edit here to add or swap a policy.

    With ``candidates``, ours runs twice: scoring every endpoint, then scoring that bounded set.
    """

    def dynamo() -> Arm:
        active = ActiveBlocks(engine.block_size)
        return Arm(DynamoCost.name, DynamoCost(active), active=active)

    def our_arm() -> Arm:
        name, policy = ours(engine)
        if candidates is None:
            return Arm(name, policy)
        return Arm(f"{name}, all scored", policy, candidates=CandidateSettings(score_all=True))

    def our_bounded_arm() -> Arm:
        assert candidates is not None
        name, policy = ours(engine)
        c = candidates
        return Arm(f"{name}, {c.prefix_holders}+{c.least_loaded}+{c.random} scored", policy, candidates=c)

    arms: list[Callable[[], Arm]] = [
        lambda: Arm(RoundRobin.name, RoundRobin()),
        lambda: Arm(LeastInFlight.name, LeastInFlight()),
        lambda: Arm(GieLike.name, GieLike(), approximate=True),
        dynamo,
        our_arm,
    ]
    return arms if candidates is None else [*arms, our_bounded_arm]


@dataclass(slots=True)
class Sent:
    """What the client saw of one request (wall seconds, relative to the arm's start)."""

    index: int
    endpoint: str
    ok: bool = False
    router_cached: int = 0
    engine_cached: int | None = None
    decide_s: float = 0.0
    ttft_wall_s: float | None = None
    e2e_wall_s: float | None = None
    lag_s: float = 0.0
    error: str | None = None
    #: The policy's predicted TTFT for the pick (predicted-ttft only), seconds.
    predicted_ttft_s: float | None = None


@dataclass(slots=True)
class Config:
    engines: int
    time_scale: float
    output_cap: int
    engine: dict[str, Any] = field(default_factory=dict)
    seed: int = 1
    #: Scrape each engine's /metrics every this many simulated seconds; 0 = no engine signals.
    scrape_interval: float = 0.0
    #: Router replicas, requests spread round robin.
    routers: int = 1
    #: None: the routers do not share. Otherwise they do: offline, a lease change reaches the others
    #: this many model seconds later; online, through the real peer sync (whatever it takes).
    sync_delay_s: float | None = None
    #: Whose surface the simulated engines show (metric names, KV-event encoding): vllm or sglang.
    engine_kind: str = "vllm"
    #: Offline only (online events always cross ZMQ): encode each step's KV events as vLLM does and
    #: decode them with the router's ingest, instead of handing them over as domain events.
    wire_events: bool = False


def replay_catalog(worker_set: LocalWorkerSet) -> Catalog:
    """A catalog built in memory from the same objects a cluster would hold (as the parity tests do)."""
    objects = [parse_object(doc) for doc in catalog_documents([worker_set])]
    return build_catalog(
        [o for o in objects if isinstance(o, InferenceWorkerSet)],
        [o for o in objects if isinstance(o, Service)],
        [o for o in objects if isinstance(o, EndpointSlice)],
        (),
    )
