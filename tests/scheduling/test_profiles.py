"""Latency profiles: validation with key paths, the built-in default, resolution and hot reload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from extproc.catalog.model import Catalog, Endpoint, WorkerSet
from extproc.errors import ConfigError
from extproc.scheduling.profiles import (
    DEFAULT,
    DEFAULT_PROFILE,
    Profile,
    ProfileError,
    ProfileStore,
    parse_profile,
    parse_profiles,
    profile_lookup,
    render_profiles,
)
from extproc.sim.engine_core import EngineParams
from extproc.types import EndpointAddress, WorkerSetKey

GOOD = """
profiles:
  h100:
    prefill_tokens_per_s: 20000
    decode_base_ms: 5
    decode_per_seq_ms: 0.1
    max_num_seqs: 128
    max_num_batched_tokens: 4096
    queue_limit: 16
    lower_tier_hit_weight: 0.5
  small:
    prefill_tokens_per_s: 6000
"""


def test_default_profile_is_the_simulators_defaults() -> None:
    sim = EngineParams()
    assert DEFAULT.prefill_tokens_per_s == sim.prefill_tokens_per_s == 16_000
    assert DEFAULT.decode_base_ms == pytest.approx(sim.decode_base_s * 1000)
    assert DEFAULT.decode_per_seq_ms == pytest.approx(sim.decode_per_seq_s * 1000)
    assert (DEFAULT.max_num_seqs, DEFAULT.max_num_batched_tokens) == (
        sim.max_num_seqs,
        sim.max_num_batched_tokens,
    )
    assert DEFAULT.queue_limit is None
    assert DEFAULT.lower_tier_hit_weight == 0.8
    assert DEFAULT.typical_prompt_tokens == 512


def test_step_cost_caps_the_batch_at_max_num_seqs() -> None:
    assert DEFAULT.step_s(0) == pytest.approx(0.006)
    assert DEFAULT.step_s(100) == pytest.approx(0.021)
    assert DEFAULT.step_s(10_000) == DEFAULT.step_s(256)


def test_parse_profiles_with_defaults_for_omitted_keys() -> None:
    profiles = parse_profiles(yaml.safe_load(GOOD))
    assert set(profiles) == {DEFAULT_PROFILE, "h100", "small"}
    h100 = profiles["h100"]
    assert (h100.prefill_tokens_per_s, h100.max_num_seqs, h100.queue_limit) == (20_000.0, 128, 16)
    assert isinstance(h100.prefill_tokens_per_s, float)
    assert profiles["small"] == Profile(prefill_tokens_per_s=6000.0)
    assert profiles[DEFAULT_PROFILE] is DEFAULT
    assert parse_profiles(None) == {DEFAULT_PROFILE: DEFAULT}
    override = parse_profiles({"profiles": {"default": {"queue_limit": 8}}})
    assert override[DEFAULT_PROFILE].queue_limit == 8
    assert parse_profile({"max_num_seqs": 64.0}).max_num_seqs == 64  # YAML 64.0 is a whole number


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"profiles": {"h100": {"prefil_tokens_per_s": 1}}},
            "profiles.h100.prefil_tokens_per_s: unknown key",
        ),
        (
            {"profiles": {"h100": {"prefill_tokens_per_s": 0}}},
            "profiles.h100.prefill_tokens_per_s: must be > 0",
        ),
        ({"profiles": {"h100": {"decode_base_ms": "6ms"}}}, "profiles.h100.decode_base_ms: must be a number"),
        ({"profiles": {"h100": {"decode_per_seq_ms": -1}}}, "profiles.h100.decode_per_seq_ms: must be >= 0"),
        ({"profiles": {"h100": {"max_num_seqs": 2.5}}}, "profiles.h100.max_num_seqs: must be a whole number"),
        ({"profiles": {"h100": {"max_num_seqs": True}}}, "profiles.h100.max_num_seqs: must be a number"),
        ({"profiles": {"h100": {"max_num_seqs": 0}}}, "profiles.h100.max_num_seqs: must be >= 1"),
        (
            {"profiles": {"h100": {"max_num_seqs": 512, "max_num_batched_tokens": 256}}},
            "profiles.h100.max_num_batched_tokens: must be >= max_num_seqs 512",
        ),
        ({"profiles": {"h100": {"queue_limit": -1}}}, "profiles.h100.queue_limit: must be >= 0 or null"),
        (
            {"profiles": {"h100": {"lower_tier_hit_weight": 1.5}}},
            "profiles.h100.lower_tier_hit_weight: must be",
        ),
        (
            {"profiles": {"h100": {"prefill_work_weight": -0.5}}},
            "profiles.h100.prefill_work_weight: must be >= 0",
        ),
        (
            {"profiles": {"h100": {"decode_base_ms": float("inf")}}},
            "profiles.h100.decode_base_ms: must be finite",
        ),
        ({"profiles": {"h100": [1, 2]}}, "profiles.h100: must be a mapping"),
        ({"profiles": [1]}, "profiles: must be a mapping"),
        ({"profile": {}}, "profile: unknown key"),
        ("text", "must be a mapping with a 'profiles' key"),
    ],
)
def test_invalid_profiles_name_the_key(document: object, message: str) -> None:
    with pytest.raises(ProfileError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        parse_profiles(document, source="f.yaml")
    assert str(info.value).startswith("f.yaml: ")
    assert isinstance(info.value, ConfigError)


def test_null_queue_limit_and_null_profile_body() -> None:
    profiles = parse_profiles({"profiles": {"a": {"queue_limit": None}, "b": None}})
    assert profiles["a"].queue_limit is None
    assert profiles["b"] == DEFAULT


def test_store_without_a_file_has_only_the_default() -> None:
    store = ProfileStore()
    store.load()
    assert not store.poll()
    assert store.resolve("anything") == (DEFAULT, False)
    assert store.resolve(DEFAULT_PROFILE) == (DEFAULT, True)
    assert store.resolve(None) == (DEFAULT, False)


def test_unknown_profile_resolves_to_default_and_is_flagged(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_text(GOOD)
    store = ProfileStore(path)
    store.load()
    profile, known = store.resolve("h100")
    assert known and profile.max_num_seqs == 128
    assert store.resolve("a100") == (DEFAULT, False)


def test_load_fails_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_text("profiles:\n  h100:\n    max_num_seqs: many\n")
    with pytest.raises(ProfileError, match=r"profiles\.h100\.max_num_seqs: must be a number"):
        ProfileStore(path).load()
    with pytest.raises(ProfileError, match="cannot read"):
        ProfileStore(tmp_path / "missing.yaml").load()
    path.write_text("profiles: [unclosed\n")
    with pytest.raises(ProfileError, match="invalid YAML"):
        ProfileStore(path).load()


class Clock:
    """Far from every file's mtime, so no read is "racy" unless a test says so."""

    def __init__(self) -> None:
        self.ns = 10**20

    def __call__(self) -> int:
        return self.ns


def rewrite(path: Path, text: str, tick: int) -> None:
    """Write and stamp a distinct mtime (file systems' clocks are coarse)."""
    path.write_text(text)
    os.utime(path, ns=(tick * 10**9, tick * 10**9))


def test_hot_reload_picks_up_edits_and_keeps_profiles_on_a_broken_edit(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    rewrite(path, GOOD, 1)
    store = ProfileStore(path, clock_ns=Clock())
    store.load()
    assert store.generation == 1 and store.error is None
    assert not store.poll()  # nothing changed

    rewrite(path, GOOD.replace("max_num_seqs: 128", "max_num_seqs: 64"), 2)
    assert store.poll()
    assert store.resolve("h100")[0].max_num_seqs == 64

    rewrite(path, GOOD.replace("max_num_seqs: 128", "max_num_sequences: 64"), 3)
    assert not store.poll()
    assert store.error is not None and "profiles.h100.max_num_sequences: unknown key" in store.error
    assert store.resolve("h100")[0].max_num_seqs == 64  # the previous profiles stay in use
    assert not store.poll()  # the same bad bytes again: still an error, nothing changes
    assert store.error is not None

    rewrite(path, "profiles: {h100: {max_num_seqs: [", 4)
    assert not store.poll()
    assert store.error is not None and "invalid YAML" in store.error

    path.unlink()
    assert not store.poll()
    assert store.error is not None and "cannot read" in store.error
    assert store.resolve("small")[0].prefill_tokens_per_s == 6000

    rewrite(path, GOOD, 5)
    assert store.poll()
    assert store.error is None
    assert store.resolve("h100")[0].max_num_seqs == 128
    assert store.generation == 3


def test_same_bytes_with_a_new_stamp_change_nothing(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    rewrite(path, GOOD, 1)
    store = ProfileStore(path, clock_ns=Clock())
    store.load()
    rewrite(path, GOOD, 2)
    assert not store.poll()
    rewrite(path, GOOD + "\n# a comment\n", 3)
    assert not store.poll()  # different bytes, same profiles
    assert store.generation == 1


def test_a_recent_write_is_read_again_even_with_the_same_stamp(tmp_path: Path) -> None:
    """Two writes within one mtime tick and of the same size look alike to stat: hash them."""
    path = tmp_path / "profiles.yaml"
    clock = Clock()
    rewrite(path, GOOD, 1)
    clock.ns = 10**9 + 1  # "now" is right after the write: the stamp cannot be trusted yet
    store = ProfileStore(path, clock_ns=clock)
    store.load()
    rewrite(path, GOOD.replace("128", "256"), 1)  # same size, same mtime
    assert store.poll()
    assert store.resolve("h100")[0].max_num_seqs == 256


def test_profile_lookup_maps_endpoints_through_their_worker_set(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_text(GOOD)
    store = ProfileStore(path)
    store.load()
    fast, odd = WorkerSetKey("ns/fast"), WorkerSetKey("ns/odd")

    def ep(n: int, key: WorkerSetKey) -> Endpoint:
        return Endpoint(EndpointAddress(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000, key)

    catalog = Catalog(
        worker_sets={
            fast: WorkerSet(fast, "h100", 16, (), (ep(1, fast),)),
            odd: WorkerSet(odd, "a100", 16, (), (ep(2, odd),)),
        }
    )
    unknown: list[str] = []
    profile_of = profile_lookup(store, lambda: catalog, on_unknown=unknown.append)
    assert profile_of(ep(1, fast)).max_num_seqs == 128
    assert profile_of(ep(2, odd)) == DEFAULT
    assert profile_of(ep(3, WorkerSetKey("ns/gone"))) == DEFAULT
    assert unknown == ["a100"]


def test_rendered_profiles_read_back_to_the_same_profiles() -> None:
    """What ``/debug/profiles`` writes is a valid ``--profiles`` file holding exactly those profiles."""
    profiles = {
        "h100-llama3-8b": Profile(prefill_tokens_per_s=15_955.25, decode_base_ms=6.125, queue_limit=None),
        "a100:small": Profile(max_num_seqs=64, max_num_batched_tokens=2048, queue_limit=8),
    }
    text = render_profiles(profiles, {"h100-llama3-8b": "fitted on default/llama\nsecond line"})
    assert "  # fitted on default/llama\n  # second line\n  h100-llama3-8b:\n" in text
    read = parse_profiles(yaml.safe_load(text))
    assert {name: read[name] for name in profiles} == profiles
