"""The one place policies are named: ``--policy`` choices, the default, and how each is built.

Adding a policy is its own module plus one line here. A factory receives what policies may need
from ``serve`` (today: each endpoint's latency profile) and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from extproc.catalog.model import Endpoint
from extproc.errors import ConfigError
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.policy import Policy
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.profiles import Profile

#: Endpoint -> the latency profile of its worker set.
ProfileOf = Callable[[Endpoint], Profile]
PolicyFactory = Callable[[ProfileOf], Policy]

POLICIES: Mapping[str, PolicyFactory] = {
    PredictedTTFT.name: PredictedTTFT,
    CacheThenLoad.name: lambda _profile_of: CacheThenLoad(),
    LeastInFlight.name: lambda _profile_of: LeastInFlight(),
}
#: Best of the policies in ``bench/results/replay.md``.
DEFAULT_POLICY = PredictedTTFT.name


def build_policy(name: str, *, profile_of: ProfileOf) -> Policy:
    """The named policy; :class:`ConfigError` lists the names when ``name`` is not one of them."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return factory(profile_of)
