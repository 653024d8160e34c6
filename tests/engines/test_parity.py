"""Tokenizer parity: the router asks engines to tokenize a probe and compares with its own ids."""

from __future__ import annotations

import aiohttp
import pytest
from simulated import StartSim

from extproc.catalog.build import build_catalog
from extproc.catalog.model import Catalog
from extproc.catalog.resources import EndpointSlice, InferenceWorkerSet, Service, parse_object
from extproc.catalog.store import CatalogStore
from extproc.demo.backends import Backend
from extproc.demo.catalog import LocalWorkerSet, catalog_documents
from extproc.engines.parity import ParityChecker, compare, probe_targets
from extproc.settings import TokenizerSpec
from extproc.sim.server import SimServer
from extproc.tokenize.registry import SHIPPED_TOKENIZER, TokenizerRegistry

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def catalog_of(sets: list[LocalWorkerSet]) -> Catalog:
    objects = [parse_object(doc) for doc in catalog_documents(sets)]
    return build_catalog(
        [o for o in objects if isinstance(o, InferenceWorkerSet)],
        [o for o in objects if isinstance(o, Service)],
        [o for o in objects if isinstance(o, EndpointSlice)],
        (),
    )


@pytest.mark.parametrize(
    ("ours", "theirs", "verdict", "fragment"),
    [
        ([1, 2, 3], [1, 2, 3], "match", "3 tokens agree"),
        ([1, 2, 3], [1, 9, 3], "mismatch", "from position 1"),
        ([1, 2], [1, 2, 3], "mismatch", "from position 2 (router 2 tokens, engine 3)"),
    ],
    ids=["equal", "differ", "prefix"],
)
def test_compare_names_the_first_difference(
    ours: list[int], theirs: list[int], verdict: str, fragment: str
) -> None:
    """The verdict says whether ids agree and, if not, where they first differ."""
    got, detail = compare(ours, theirs)
    assert got == verdict and fragment in detail


@pytest.fixture
async def engine(sim: StartSim) -> SimServer:
    return await sim(served_model_names=(MODEL,), chat_template="llama3")


def store_for(address: str) -> CatalogStore:
    store = CatalogStore()
    store.publish(catalog_of([LocalWorkerSet("llama", MODEL, [address])]))
    return store


@pytest.mark.parametrize(
    ("template", "verdict"),
    [("llama3", "match"), ("chatml", "mismatch")],
    ids=["same-template", "other-template"],
)
async def test_probe_catches_a_template_mismatch(engine: SimServer, template: str, verdict: str) -> None:
    """Configured with another template than the engine, the model is reported and routed approximately."""
    tokenizers = TokenizerRegistry.load([TokenizerSpec(MODEL, SHIPPED_TOKENIZER, template)])
    store = store_for(engine.address)
    checker = ParityChecker(store, tokenizers)
    async with aiohttp.ClientSession() as session:
        await checker.check(session, store.current)
    result = checker.results[(MODEL, "default/llama")]
    assert result.verdict == verdict and result.endpoint == engine.address
    assert (MODEL in checker.blocked_models()) is (verdict == "mismatch")
    if verdict == "mismatch":
        assert "--chat-template" in result.detail


async def test_engine_without_tokenize_is_unknown_and_keeps_precise_routing() -> None:
    """An engine with no /tokenize cannot be checked: reported unknown, the model stays precise."""
    async with Backend("fake", models=(MODEL,)) as backend:
        tokenizers = TokenizerRegistry.load([TokenizerSpec(MODEL, SHIPPED_TOKENIZER, "llama3")])
        store = store_for(backend.address)
        checker = ParityChecker(store, tokenizers)
        async with aiohttp.ClientSession() as session:
            await checker.check(session, store.current)
    result = checker.results[(MODEL, "default/llama")]
    assert result.verdict == "unknown" and "HTTP 404" in result.detail
    assert checker.blocked_models() == frozenset()


def test_probe_targets_only_models_with_a_tokenizer() -> None:
    """Only (model, set) pairs we hold a tokenizer for, and only sets with a ready endpoint, are probed."""
    catalog = catalog_of(
        [
            LocalWorkerSet("llama", MODEL, ["127.0.0.1:8000", "127.0.0.1:8001"]),
            LocalWorkerSet("qwen", "qwen", ["127.0.0.1:8002"]),
            LocalWorkerSet("cold", MODEL, [], not_ready=["127.0.0.1:9"]),
        ]
    )
    assert probe_targets(catalog, [MODEL]) == {(MODEL, "default/llama"): "127.0.0.1:8000"}
