"""Named latency profiles: how fast a worker set's engines prefill and decode, from a YAML file.

A profile describes one engine (one data-parallel rank) in the simulator's terms
(:class:`extproc.sim.engine_core.EngineParams`), so predictions can be checked against it:

* one engine step lasts ``decode_base_ms + decode_per_seq_ms x decoding_seqs`` milliseconds plus
  ``prefill_tokens / prefill_tokens_per_s`` seconds of prefill work;
* a step computes at most ``max_num_batched_tokens`` tokens (chunked prefill budget; each decoding
  sequence takes one of them first);
* at most ``max_num_seqs`` requests run at once; the rest wait, first come first served.

An InferenceWorkerSet names its profile (``spec.profile``, :attr:`extproc.catalog.model.WorkerSet.profile`);
a set naming a profile the file does not define uses the built-in ``default`` (the simulator's own
defaults, estimates for Llama-3-8B bf16 on one H100) and :meth:`ProfileStore.resolve` says so, for
metrics.

File format (``--profiles PATH``)::

    profiles:
      h100-llama3-8b:
        prefill_tokens_per_s: 16000     # > 0, tokens per second of prefill compute
        decode_base_ms: 6               # >= 0, fixed cost of one engine step (ms)
        decode_per_seq_ms: 0.15         # >= 0, extra step cost per decoding sequence (ms)
        max_num_seqs: 256               # >= 1, vLLM --max-num-seqs (running batch cap)
        max_num_batched_tokens: 8192    # >= max_num_seqs, vLLM --max-num-batched-tokens
        queue_limit: 32                 # optional, >= 0: waiting requests per endpoint beyond
                                        # which it is saturated (all saturated -> queue or 429,
                                        # docs/flow-control.md); null = never
        kv_cache_limit: 0.95            # optional, 0-1: saturated too while the engine's scraped
                                        # KV-cache use is at least this; null = never
        lower_tier_hit_weight: 0.8      # 0-1: a CPU-tier cached token's worth vs a GPU one
        prefill_work_weight: 2.0        # >= 0: each second of prefill compute a pick spends
                                        # counts this much against it, besides its TTFT; 0 ranks
                                        # by predicted TTFT alone
        typical_prompt_tokens: 512      # >= 1: prompt assumed when unknown, and the prefill work
                                        # assumed for each request ahead whose prompt is unknown
        typical_output_tokens: 256      # >= 1: decode length assumed for requests ahead
      a100-small:
        prefill_tokens_per_s: 6000      # omitted keys take the built-in default's values

A profile named ``default`` in the file replaces the built-in one. Unknown keys are rejected with
their path (``profiles.a100-small.prefil_tokens_per_s: unknown key``); integers accept only whole
numbers, booleans are never numbers.

Reloading: :meth:`ProfileStore.poll` stats the file and re-reads it when its (mtime, size, inode)
stamp changed or the last read was too recent to trust the stamp (like :mod:`extproc.sources.file`);
identical bytes change nothing. A file that cannot be read or is invalid keeps the profiles in use
and sets :attr:`ProfileStore.error`; the first :meth:`ProfileStore.load` raises instead, so a bad
file fails startup.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from extproc.catalog.model import Catalog, Endpoint
from extproc.errors import ConfigError
from extproc.files import FileStamp, read_stamped

logger = logging.getLogger(__name__)

#: The name of the built-in profile, used for worker sets naming an unknown profile.
DEFAULT_PROFILE = "default"


class ProfileError(ConfigError):
    """The profiles file is unreadable or invalid; the message names the file and the key path."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One engine's (one DP rank's) speed and shape; see the module docstring for each key."""

    #: Prefill compute, tokens per second.
    prefill_tokens_per_s: float = 16_000.0
    #: Fixed cost of one engine step, milliseconds.
    decode_base_ms: float = 6.0
    #: Extra step cost per decoding sequence, milliseconds.
    decode_per_seq_ms: float = 0.15
    #: Running batch cap (vLLM ``--max-num-seqs``).
    max_num_seqs: int = 256
    #: Tokens one step computes at most (vLLM ``--max-num-batched-tokens``, chunked prefill).
    max_num_batched_tokens: int = 8192
    #: Waiting requests per endpoint beyond which it is saturated; None: never saturated.
    queue_limit: int | None = None
    #: Scraped KV-cache use (0-1, the fullest rank) at or beyond which an endpoint is saturated
    #: too; None: KV-cache use never saturates.
    kv_cache_limit: float | None = None
    #: What a lower-tier (CPU, storage) cached token is worth relative to a GPU one, 0-1.
    lower_tier_hit_weight: float = 0.8
    #: Ranking charges each pick ``prefill_work_weight x uncached prompt tokens / prefill_tokens_per_s``
    #: on top of its predicted TTFT: recomputing a prefix that another pod holds delays every later
    #: request on the pod that does it, and leaves two copies where one would do (see the predictor;
    #: 2 measured best, with 1.5-3 about as good).
    prefill_work_weight: float = 2.0
    #: Prompt tokens assumed when a request's prompt is unknown, and the prefill per request ahead.
    typical_prompt_tokens: int = 512
    #: Output tokens assumed for requests ahead (how long a seat stays taken).
    typical_output_tokens: int = 256

    def __post_init__(self) -> None:
        problem = _check(self)
        if problem is not None:
            key, message = problem
            raise ProfileError(f"{key}: {message}")

    def step_s(self, decoding: float) -> float:
        """Seconds of one step's fixed part with ``decoding`` sequences decoding (capped at max_num_seqs).

        ``step_s(n) = (decode_base_ms + decode_per_seq_ms x min(n, max_num_seqs)) / 1000``
        """
        return (self.decode_base_ms + self.decode_per_seq_ms * min(decoding, self.max_num_seqs)) / 1000.0

    def to_debug(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_FLOATS = {
    "prefill_tokens_per_s",
    "decode_base_ms",
    "decode_per_seq_ms",
    "lower_tier_hit_weight",
    "prefill_work_weight",
    "kv_cache_limit",
}
_INTS = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "queue_limit",
    "typical_prompt_tokens",
    "typical_output_tokens",
}
_KEYS = tuple(f.name for f in fields(Profile))
#: Keys whose null means "off".
_OPTIONAL = {"queue_limit", "kv_cache_limit"}


def _check(p: Profile) -> tuple[str, str] | None:
    """The first invalid field as (key, message), or None."""
    for name in _KEYS:
        value = getattr(p, name)
        if name in _OPTIONAL and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return name, f"must be a number, got {value!r}"
        if name in _INTS and not (isinstance(value, int) or float(value).is_integer()):
            return name, f"must be a whole number, got {value!r}"
        if not math.isfinite(value):
            return name, f"must be finite, got {value!r}"
    if not p.prefill_tokens_per_s > 0:
        return "prefill_tokens_per_s", f"must be > 0, got {p.prefill_tokens_per_s!r}"
    for name in ("decode_base_ms", "decode_per_seq_ms", "prefill_work_weight"):
        if getattr(p, name) < 0:
            return name, f"must be >= 0, got {getattr(p, name)!r}"
    for name in ("max_num_seqs", "max_num_batched_tokens", "typical_prompt_tokens", "typical_output_tokens"):
        if getattr(p, name) < 1:
            return name, f"must be >= 1, got {getattr(p, name)!r}"
    if p.max_num_batched_tokens < p.max_num_seqs:
        # vLLM refuses this too: a full decode batch must fit one step's budget.
        return (
            "max_num_batched_tokens",
            f"must be >= max_num_seqs {p.max_num_seqs}, got {p.max_num_batched_tokens!r}",
        )
    if p.queue_limit is not None and p.queue_limit < 0:
        return "queue_limit", f"must be >= 0 or null, got {p.queue_limit!r}"
    if p.kv_cache_limit is not None and not 0 < p.kv_cache_limit <= 1:
        return "kv_cache_limit", f"must be above 0 and at most 1, or null, got {p.kv_cache_limit!r}"
    if not 0 <= p.lower_tier_hit_weight <= 1:
        return "lower_tier_hit_weight", f"must be between 0 and 1, got {p.lower_tier_hit_weight!r}"
    return None


#: The built-in profile: :class:`extproc.sim.engine_core.EngineParams` defaults.
DEFAULT = Profile()


def parse_profile(data: Any, *, path: str = "profile", base: Profile = DEFAULT) -> Profile:
    """One profile from its YAML mapping; omitted keys keep ``base``'s values.

    Raises :class:`ProfileError` naming ``path.key`` for an unknown key or an invalid value.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ProfileError(f"{path}: must be a mapping of profile keys, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _KEYS:
            raise ProfileError(f"{path}.{key}: unknown key (known: {', '.join(_KEYS)})")
        if key in _INTS and isinstance(value, float) and value.is_integer():
            value = int(value)
        if key in _FLOATS and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        values[key] = value
    try:
        return replace(base, **values)
    except ProfileError as exc:
        raise ProfileError(f"{path}.{exc}") from None


def parse_profiles(data: Any, *, source: str = "profiles file") -> dict[str, Profile]:
    """Every profile of a parsed YAML document, ``default`` included (built-in unless overridden)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: must be a mapping with a 'profiles' key, got {type(data).__name__}")
    for key in data:
        if key != "profiles":
            raise ProfileError(f"{source}: {key}: unknown key (known: profiles)")
    entries = data.get("profiles") or {}
    if not isinstance(entries, Mapping):
        raise ProfileError(f"{source}: profiles: must be a mapping of name -> profile")
    result = {DEFAULT_PROFILE: DEFAULT}
    for name, body in entries.items():
        if not isinstance(name, str) or not name:
            raise ProfileError(f"{source}: profiles: profile names must be non-empty strings, got {name!r}")
        try:
            result[name] = parse_profile(body, path=f"profiles.{name}")
        except ProfileError as exc:
            raise ProfileError(f"{source}: {exc}") from None
    return result


class ProfileStore:
    """The profiles in use: the built-in default, plus a file's when ``path`` is given.

    Not thread-safe; call :meth:`poll` from the event loop (e.g. every few seconds).
    """

    def __init__(self, path: Path | str | None = None, *, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.path = None if path is None else Path(path)
        self._clock_ns = clock_ns
        self._profiles: dict[str, Profile] = {DEFAULT_PROFILE: DEFAULT}
        self._stamp: FileStamp | None = None
        self._digest: bytes | None = None
        self._racy = False
        #: Why the last read failed (the previous profiles stay in use); None after a good read.
        self.error: str | None = None
        #: Successful loads that changed the profiles (the first load counts).
        self.generation = 0

    @property
    def profiles(self) -> Mapping[str, Profile]:
        """Name -> profile, ``default`` always present."""
        return self._profiles

    def load(self) -> None:
        """Read the file now; raises :class:`ProfileError` if it is unreadable or invalid."""
        if self.path is None:
            return
        self._read(force=True)
        if self.error is not None:
            raise ProfileError(self.error)

    def poll(self) -> bool:
        """Re-read the file if it may have changed; True when the profiles in use changed.

        A missing, unreadable or invalid file keeps the previous profiles and sets :attr:`error`.
        """
        if self.path is None:
            return False
        return self._read(force=False)

    def resolve(self, name: str | None) -> tuple[Profile, bool]:
        """The profile called ``name``, and whether it is defined (else the default, ``False``)."""
        if name is not None:
            profile = self._profiles.get(name)
            if profile is not None:
                return profile, True
        return self._profiles[DEFAULT_PROFILE], False

    def _read(self, *, force: bool) -> bool:
        assert self.path is not None
        try:
            if not force and FileStamp.at(self.path) == self._stamp and not self._racy:
                return False
            read = read_stamped(self.path, clock_ns=self._clock_ns)
        except OSError as exc:
            return self._fail(f"profiles file {self.path}: cannot read: {exc.strerror or exc}")
        self._stamp, self._racy, digest, data = read.stamp, read.racy, read.digest, read.data
        if digest == self._digest:
            return False  # same bytes: same profiles, or the same error as last time
        try:
            document = yaml.safe_load(data)
            profiles = parse_profiles(document, source=f"profiles file {self.path}")
        except yaml.YAMLError as exc:
            self._digest = digest
            return self._fail(f"profiles file {self.path}: invalid YAML: {exc}")
        except ProfileError as exc:
            self._digest = digest
            return self._fail(str(exc))
        self._digest = digest
        self.error = None
        if profiles == self._profiles and self.generation:
            return False
        self._profiles = profiles
        self.generation += 1
        logger.info("profiles loaded from %s: %s", self.path, ", ".join(sorted(profiles)))
        return True

    def _fail(self, message: str) -> bool:
        if message != self.error:
            kept = "; the previous profiles stay in use" if self.generation else ""
            logger.warning("%s%s", message, kept)
        self.error = message
        return False


def profile_lookup(
    store: ProfileStore,
    catalog: Callable[[], Catalog],
    *,
    on_unknown: Callable[[str], None] | None = None,
) -> Callable[[Endpoint], Profile]:
    """``profile_of`` for :class:`~extproc.scheduling.predictor.PredictedTTFT`: endpoint -> its set's profile.

    Endpoints of a set the catalog no longer holds, and sets naming an undefined profile, get the
    default; ``on_unknown(profile name)`` is called for the latter (e.g. to count it).
    """

    def profile_of(endpoint: Endpoint) -> Profile:
        worker_set = catalog().worker_sets.get(endpoint.worker_set)
        name = None if worker_set is None else worker_set.profile
        profile, known = store.resolve(name)
        if not known and name is not None and on_unknown is not None:
            on_unknown(name)
        return profile

    return profile_of


def render_profiles(profiles: Mapping[str, Profile], comments: Mapping[str, str] | None = None) -> str:
    """A ``--profiles`` file holding ``profiles`` (every key written), ``comments[name]`` above each.

    The inverse of :func:`parse_profiles`: what it writes reads back to the same profiles.
    """
    lines = ["profiles:"]
    for name, profile in profiles.items():
        for comment in (comments or {}).get(name, "").splitlines():
            lines.append(f"  # {comment}")
        lines.append(f"  {yaml.safe_dump(name).splitlines()[0]}:")
        for key in _KEYS:
            value = getattr(profile, key)
            text = "null" if value is None else repr(round(value, 6) if isinstance(value, float) else value)
            lines.append(f"    {key}: {text}")
    return "\n".join(lines) + "\n"
