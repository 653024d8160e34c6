"""Poll ``GET /v1/models`` of every endpoint of every ``modelDiscovery.mode: Endpoint`` worker set.

vLLM lists the names it serves there: each ``--served-model-name`` as a base model (``parent``
null, ``max_model_len`` its context window) and each LoRA adapter (``parent`` the base name,
``max_model_len`` null). One task asks each endpoint at its set's ``interval`` (right away when the
endpoint appears), keeps per endpoint the last good answer, the last error and when, and calls
``on_change()`` only when what was learned changed, so whoever rebuilds the catalog
(:func:`~extproc.catalog.discovered.apply_discovery`) does so only then. A failing endpoint keeps
its last answer: an engine that is busy or restarting still serves what it served, and its health
is the scheduler's business, not discovery's. Endpoints that leave the declared catalog are
forgotten at the next look at it (:meth:`ModelDiscovery.refresh` makes that immediate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

import aiohttp

from extproc.addresses import join_host_port
from extproc.catalog.discovered import DiscoveredModel, EndpointModels
from extproc.catalog.model import Catalog
from extproc.engines.poller import EndpointPoller, LastAnswer
from extproc.types import EndpointAddress, ModelName

__all__ = [
    "DiscoveredModel",
    "DiscoveryError",
    "EndpointModels",
    "ModelDiscovery",
    "discovery_targets",
    "parse_interval",
    "parse_models",
]

log = logging.getLogger(__name__)

#: A /v1/models answer larger than this (bytes) is refused: a card is ~300 bytes, so this allows
#: thousands of adapters while a misbehaving server cannot make us buffer without end.
MAX_RESPONSE_BYTES = 1024 * 1024
#: Cards kept per endpoint; the rest are counted as skipped.
MAX_MODELS = 1024
#: Longest model name kept (the CRD's limit for spec.models names).
MAX_NAME = 512
#: Polls of one endpoint are at least this far apart (seconds), whatever the interval says ("0s").
MIN_INTERVAL = 0.1
#: A failed poll is retried after min(interval, this) seconds, so a pod that was not yet listening
#: when it turned ready is learned soon rather than one long interval later.
FAILURE_RETRY = 5.0
#: How often (seconds) the declared catalog is looked at for new or departed endpoints without a
#: :meth:`ModelDiscovery.refresh`.
FOLLOW_INTERVAL = 1.0
#: The CRD's default ``modelDiscovery.interval``, used if a set's interval cannot be read.
DEFAULT_INTERVAL = 30.0

_INTERVAL = re.compile(r"^(?:[0-9]{1,5}(?:h|ms|m|s)){1,4}$")
_INTERVAL_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


class DiscoveryError(Exception):
    """An answer that is not a usable model list (HTTP status, size, shape)."""


def parse_interval(text: str) -> float:
    """Seconds in a CRD duration (``30s``, ``1m30s``, ``500ms``, ``1h``; up to four parts).

    Raises ValueError for anything the CRD pattern ``^([0-9]{1,5}(h|m|s|ms)){1,4}$`` rejects.
    """
    if not _INTERVAL.fullmatch(text):
        raise ValueError(f"not a duration like 30s, 1m30s or 500ms: {text!r}")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _INTERVAL_PART.findall(text))


def parse_models(
    body: bytes | str, *, max_bytes: int = MAX_RESPONSE_BYTES, max_models: int = MAX_MODELS
) -> EndpointModels:
    """Read an OpenAI/vLLM ``/v1/models`` answer (pure).

    Tolerant of single cards: one without a usable ``id``, with a ``parent`` or ``max_model_len`` of
    the wrong type, or a repeated ``id`` is skipped and counted, since the others still say what the
    engine serves. Raises :class:`DiscoveryError` when the whole body is not a model list.
    """
    if len(body) > max_bytes:
        raise DiscoveryError(f"model list of {len(body)} bytes exceeds {max_bytes}")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DiscoveryError(f"model list is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise DiscoveryError(f'expected a JSON object with a "data" list, got {type(document).__name__}')
    kind = document.get("object", "list")
    if kind != "list":
        raise DiscoveryError(f'expected "object": "list", got {kind!r}')
    cards = document.get("data")
    if not isinstance(cards, list):
        raise DiscoveryError(f'expected a "data" list of models, got {type(cards).__name__}')
    models: list[DiscoveredModel] = []
    seen: set[str] = set()
    skipped = 0
    for card in cards:
        model = _card(card)
        if model is None or model.name in seen or len(models) >= max_models:
            skipped += 1
            continue
        seen.add(model.name)
        models.append(model)
    return EndpointModels(tuple(models), skipped)


def _card(card: Any) -> DiscoveredModel | None:
    """One card, or None if it cannot be used."""
    if not isinstance(card, dict):
        return None
    name, parent, window, root = (
        card.get("id"),
        card.get("parent"),
        card.get("max_model_len"),
        card.get("root"),
    )
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        return None
    if parent is not None and (not isinstance(parent, str) or not 0 < len(parent) <= MAX_NAME):
        return None
    # bool is an int in Python; "max_model_len": true is not a window.
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        return None
    return DiscoveredModel(
        name=ModelName(name),
        parent=None if parent is None else ModelName(parent),
        max_model_len=window,
        root=root if isinstance(root, str) else None,
    )


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how often to ask one endpoint."""

    url: str
    interval: float


def discovery_targets(catalog: Catalog) -> dict[EndpointAddress, Target]:
    """Every ready endpoint of every Endpoint-mode set (pure). An endpoint in several sets is asked
    at the shortest of their intervals."""
    targets: dict[EndpointAddress, Target] = {}
    for key in sorted(catalog.worker_sets):
        ws = catalog.worker_sets[key]
        if ws.discovery_mode != "Endpoint":
            continue
        try:
            interval = max(MIN_INTERVAL, parse_interval(ws.discovery_interval))
        except ValueError:
            interval = DEFAULT_INTERVAL  # validated by the source; never leave a set unpolled
        for endpoint in ws.endpoints:
            url = f"http://{join_host_port(endpoint.ip, endpoint.port)}/v1/models"
            known = targets.get(endpoint.address)
            if known is None or interval < known.interval:
                targets[endpoint.address] = Target(url, interval)
    return targets


@dataclass(slots=True)
class _State(LastAnswer[EndpointModels]):
    """An endpoint's latest ``/v1/models`` answer, and when to ask again."""

    _: KW_ONLY
    interval: float
    #: ``clock()`` at which the next poll is due.
    due: float


class ModelDiscovery(EndpointPoller):
    """Learns what the endpoints of Endpoint-mode sets serve; see the module docstring.

    ``declared()`` gives the catalog to follow (the source's, or the store's: only sets, modes,
    intervals and endpoints are read). ``on_change()`` is called from the polling task after a
    round in which some endpoint's models changed, appeared or were forgotten; it should rebuild
    the catalog from :meth:`results`. ``session`` is borrowed if given (not closed), else one is
    made in :meth:`start` and closed in :meth:`close`. ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        *,
        declared: Callable[[], Catalog],
        on_change: Callable[[], None],
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout: float = 2.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        follow_interval: float = FOLLOW_INTERVAL,
    ) -> None:
        if not follow_interval > 0:
            raise ValueError(f"follow_interval must be positive, got {follow_interval}")
        super().__init__(what="model discovery", timeout=timeout, clock=clock, session=session)
        self._declared = declared
        self._on_change = on_change
        self._max_bytes = max_response_bytes
        self._follow_interval = follow_interval
        self._states: dict[EndpointAddress, _State] = {}
        self.rounds = 0
        #: Times ``on_change`` was called.
        self.changes = 0

    def refresh(self) -> None:
        """Look at ``declared()`` now (e.g. after a source published): new endpoints are asked at once."""
        self.wake()

    def results(self) -> Mapping[EndpointAddress, EndpointModels]:
        """The last good answer of every followed endpoint that has answered (a fresh dict)."""
        return {a: s.value for a, s in self._states.items() if s.value is not None}

    def debug_state(self) -> dict[str, Any]:
        now = self._clock()
        endpoints: dict[str, Any] = {}
        for address, state in sorted(self._states.items()):
            result = state.value
            endpoints[address] = {
                "url": state.url,
                "intervalSeconds": state.interval,
                "models": None
                if result is None
                else [
                    {"name": m.name, "parent": m.parent, "maxModelLen": m.max_model_len, "root": m.root}
                    for m in result.models
                ],
                "skippedCards": None if result is None else result.skipped,
                "ageSeconds": None if state.answered_at is None else round(now - state.answered_at, 3),
                "error": state.error,
                "polls": state.asks,
                "failures": state.failures,
            }
        return {
            "timeoutSeconds": self.timeout,
            "rounds": self.rounds,
            "changes": self.changes,
            "endpoints": endpoints,
        }

    async def poll(self, *, everyone: bool = False) -> bool:
        """One round: follow ``declared()``, ask every due endpoint (every one if ``everyone``)
        concurrently, then call ``on_change`` if something learned changed. Returns whether it did."""
        changed = self._follow(self._declared())
        now = self._clock()
        due = [(a, s.url) for a, s in self._states.items() if everyone or s.due <= now]
        outcomes = await asyncio.gather(*(self._poll_one(address, url) for address, url in due))
        self.rounds += 1
        if changed or any(outcomes):
            self._notify()
            return True
        return False

    def _follow(self, catalog: Catalog) -> bool:
        """Add new endpoints (due now), drop departed ones; True if a dropped one had taught us something."""
        targets = discovery_targets(catalog)
        now = self._clock()
        changed = False
        for address in set(self._states) - set(targets):
            changed |= self._states.pop(address).value is not None
            self.forget(address)
        for address, target in targets.items():
            state = self._states.get(address)
            if state is None or state.url != target.url:
                changed |= state is not None and state.value is not None
                self._states[address] = _State(target.url, interval=target.interval, due=now)
            elif state.interval != target.interval:
                state.interval = target.interval
                state.due = min(state.due, now + target.interval)
        return changed

    async def round(self) -> None:
        await self.poll()

    def delay(self, elapsed: float) -> float:
        delay = self._follow_interval
        if self._states:
            delay = min(delay, min(s.due for s in self._states.values()) - self._clock())
        return max(delay, 0.01)

    async def _poll_one(self, address: EndpointAddress, url: str) -> bool:
        """Ask one endpoint; True if what it serves changed. Never raises."""
        result, error = await self.get(
            address,
            url,
            accept="application/json",
            max_bytes=self._max_bytes,
            parse=lambda body: parse_models(body, max_bytes=self._max_bytes),
            error=DiscoveryError,
        )
        now = self._clock()
        state = self._states.get(address)
        if state is None or state.url != url:
            return False  # the endpoint left (or moved) while we were asking it
        if result is None:
            assert error is not None
            state.failed(error, now)
            state.due = now + min(state.interval, FAILURE_RETRY)
            self.warn_sometimes(address, error)
            return False
        changed = state.value is None or state.value.models != result.models
        if state.answered(result, now):
            log.info("model discovery recovered endpoint=%s", address)
        if changed:
            log.info("models discovered endpoint=%s models=%s", address, ",".join(result.names()) or "-")
        state.due = now + state.interval
        return changed

    def _notify(self) -> None:
        self.changes += 1
        try:
            self._on_change()
        except Exception:
            # The catalog owner's bug must not stop discovery; the next change calls it again.
            log.exception("model discovery on_change failed")
