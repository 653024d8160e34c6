"""Every HTTP header the router reads from a request or sets on it, and what it means.

Read: the InferenceObjective and fairness ID a request names (flow control), and, on the
accounting stream, the lease and predicted prefill the routing answer set. Set on the routed
request: the destination (:data:`~extproc.protocol.messages.DESTINATION_HEADER`), the upstream model
name, the engine's data-parallel rank, the lease and its predicted prefill; with
``--decision-headers``, the pick and its reasons on the client's response. Pure functions: no
stream state.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.control.flow import DEFAULT_FAIRNESS_ID, MAX_FAIRNESS_ID, RequestClass
from extproc.scheduling.scheduler import Decision

#: Headers we add for the upstream's and operators' benefit (never read back from clients).
MODEL_HEADER = "x-gateway-model-name"
#: vLLM routes a request carrying this header to that data-parallel rank (0.10+).
DP_RANK_HEADER = "x-data-parallel-rank"
#: The InferenceObjective a request names (its priority when the pool is saturated), as the llm-d
#: router reads it, then the Gateway API Inference Extension's older name.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
#: Who the request is fair to (a tenant), likewise; absent: one shared default.
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
#: The pick's predicted prefill ("tokens,seconds"), set by the routing answer, so the accounting
#: stream can charge the endpoint for it whichever replica it reaches.
PREFILL_HEADER = "x-extproc-prefill"
#: The token under which the routing stream offered its lease (see ``LeaseHandover``).
LEASE_HEADER = "x-extproc-lease"
#: The longest predicted prefill believed from a header, in seconds.
_MAX_PREFILL_SECONDS = 3600.0


def request_class(headers: Mapping[str, str]) -> RequestClass | None:
    """The objective and fairness ID the request's headers name (None: neither)."""
    objective = next((v for h in OBJECTIVE_HEADERS if (v := headers.get(h))), None)
    fairness = next((v for h in FAIRNESS_HEADERS if (v := headers.get(h))), None)
    if objective is None and fairness is None:
        return None
    return RequestClass(
        objective=objective, fairness_id=fairness[:MAX_FAIRNESS_ID] if fairness else DEFAULT_FAIRNESS_ID
    )


def routing_headers(decision: Decision, lease_token: str) -> dict[str, str]:
    """The headers the routed request carries upstream, besides the destination."""
    tokens, seconds = decision.prefill
    headers: dict[str, str] = {}
    if decision.route is not None:
        headers[MODEL_HEADER] = decision.route.upstream_model
    rank = decision.prefix.ranks.get(decision.endpoints[0].address)
    if rank is not None:
        # vLLM's API server sends a request to this DP rank (the one holding the prefix).
        headers[DP_RANK_HEADER] = str(rank)
    # Always set (overwriting anything a client sent): the accounting stream
    # (:mod:`extproc.protocol.accounting`) reads them back.
    headers[LEASE_HEADER] = lease_token
    headers[PREFILL_HEADER] = f"{tokens},{seconds:.4f}"
    return headers


def prefill_hint(value: str) -> tuple[int, float]:
    """``tokens,seconds`` from :data:`PREFILL_HEADER`; (0, 0) when absent or not ours."""
    tokens, _, seconds = value.partition(",")
    try:
        return max(0, int(tokens)), max(0.0, min(float(seconds), _MAX_PREFILL_SECONDS))
    except ValueError:
        return 0, 0.0


def explain(decision: Decision) -> dict[str, str]:
    """``--decision-headers``: what was picked and why, for the client's response (opt-in: it names pods)."""
    pick = decision.endpoints[0].address
    prefix = decision.prefix
    headers = {
        "x-extproc-endpoint": pick,
        "x-extproc-prefix-mode": prefix.mode,
        "x-extproc-cached-tokens": str(prefix.cached_tokens.get(pick, 0)),
    }
    if prefix.prompt_tokens is not None:
        headers["x-extproc-prompt-tokens"] = str(prefix.prompt_tokens)
    if decision.prediction is not None:
        headers["x-extproc-predicted-ttft-ms"] = f"{decision.prediction.ttft_s * 1000:.1f}"
    return headers
