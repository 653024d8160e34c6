"""Gauges of serve's state, computed at scrape time from the live objects (never stale, no bookkeeping)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.catalog.model import Catalog
from extproc.scheduling.calibration import Calibration
from extproc.types import EndpointAddress


class UnknownProfileCollector(Collector):
    """Worker sets naming a latency profile the profiles file does not define (routed with the default)."""

    def __init__(self, catalog: Callable[[], Catalog], is_known: Callable[[str], bool]) -> None:
        self._catalog = catalog
        self._is_known = is_known

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "extproc_worker_set_unknown_profile",
            "1 for each worker set whose spec.profile is not in the profiles file (the default is used).",
            labels=["worker_set", "profile"],
        )
        for key, ws in sorted(self._catalog().worker_sets.items()):
            if not self._is_known(ws.profile):
                family.add_metric([key, ws.profile], 1)
        yield family


class CatalogCollector(Collector):
    """In-flight counts per endpoint and the catalog's size, read at scrape time."""

    def __init__(
        self, catalog: Callable[[], Catalog], inflight: Callable[[], Mapping[EndpointAddress, int]]
    ) -> None:
        self._catalog = catalog
        self._inflight = inflight

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily(
            "extproc_inflight_requests",
            "Requests routed to an endpoint and not finished.",
            labels=["endpoint"],
        )
        for address, count in sorted(self._inflight().items()):
            inflight.add_metric([address], count)
        yield inflight
        catalog = self._catalog()
        ready = GaugeMetricFamily(
            "extproc_worker_set_ready_endpoints", "Ready endpoints per worker set.", labels=["worker_set"]
        )
        terminating = GaugeMetricFamily(
            "extproc_worker_set_terminating_endpoints",
            "Terminating endpoints per worker set.",
            labels=["worker_set"],
        )
        for key, worker_set in sorted(catalog.worker_sets.items()):
            ready.add_metric([key], len(worker_set.endpoints))
            terminating.add_metric([key], worker_set.terminating)
        yield ready
        yield terminating
        yield GaugeMetricFamily(
            "extproc_catalog_models",
            "Client-facing model names (upstream names and aliases).",
            value=len(catalog.routes),
        )
        yield GaugeMetricFamily(
            "extproc_catalog_name_conflicts",
            "Model names claimed by worker sets for different models.",
            value=len(catalog.conflicts),
        )
        yield GaugeMetricFamily(
            "extproc_catalog_rejected_objects",
            "Source objects rejected or held at a previous version.",
            value=len(catalog.problems),
        )


class CalibrationCollector(Collector):
    """Each worker set's fitted profile speeds and how far its TTFT predictions miss."""

    def __init__(self, calibration: Calibration) -> None:
        self._calibration = calibration

    def collect(self) -> Iterable[Metric]:
        speeds = GaugeMetricFamily(
            "extproc_profile_calibrated",
            "A worker set's profile speed in use after calibration (prefill_tokens_per_s, "
            "decode_base_ms, decode_per_seq_ms).",
            labels=["worker_set", "parameter"],
        )
        error = GaugeMetricFamily(
            "extproc_ttft_prediction_error_ratio",
            "Median absolute error of recent TTFT predictions against the engines' reported TTFTs, "
            "relative to the reported (0.2 = 20%).",
            labels=["worker_set"],
        )
        matched = CounterMetricFamily(
            "extproc_ttft_predictions_matched",
            "Requests whose predicted TTFT was compared with the engine's reported one.",
            labels=["worker_set"],
        )
        for key, fit in sorted(self._calibration.fits.items()):
            profile = fit.profile
            speeds.add_metric([key, "prefill_tokens_per_s"], profile.prefill_tokens_per_s)
            speeds.add_metric([key, "decode_base_ms"], profile.decode_base_ms)
            speeds.add_metric([key, "decode_per_seq_ms"], profile.decode_per_seq_ms)
            median = fit.median_error
            if median is not None:
                error.add_metric([key], median)
            matched.add_metric([key], fit.requests)
        yield speeds
        yield error
        yield matched
