"""Setting flags: a flag's default and type come from its settings field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from extproc.flags import field_default, flag_values, setting_flag


@dataclass(frozen=True)
class _Settings:
    interval: float = 1.0
    count: int = 3
    name: str = "a"
    budget_s: float = 0.25
    limit: int | None = None
    tags: tuple[str, ...] = field(default_factory=lambda: ("x",))


@dataclass(frozen=True)
class _Cache:
    cache_bytes: int = 64 * 1024 * 1024
    size: int = 8


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    setting_flag(p, "--interval", _Settings, "interval", "seconds")
    setting_flag(p, "--count", _Settings, "count", "how many")
    setting_flag(p, "--name", _Settings, "name", "a name")
    setting_flag(p, "--budget-ms", _Settings, "budget_s", "milliseconds", scale=1000)
    setting_flag(p, "--limit", _Settings, "limit", "at most", type=int)
    return p


def test_defaults_are_the_fields() -> None:
    args = _parser().parse_args([])
    assert (args.interval, args.count, args.name, args.budget_ms, args.limit) == (1.0, 3, "a", 250.0, None)


def test_values_parse_as_the_field_type() -> None:
    args = _parser().parse_args(["--interval", "2", "--count", "7", "--budget-ms", "5", "--limit", "9"])
    assert args.interval == 2.0 and isinstance(args.interval, float)
    assert args.count == 7 and isinstance(args.count, int)
    assert args.budget_ms == 5.0 and isinstance(args.budget_ms, float)
    assert args.limit == 9


def test_an_int_field_refuses_a_fraction() -> None:
    with pytest.raises(argparse.ArgumentError, match=r"invalid int value: '2\.5'"):
        _parser().parse_args(["--count", "2.5"])


def test_help_shows_the_field_default() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    setting_flag(p, "--budget-ms", _Settings, "budget_s", "milliseconds", scale=1000)
    assert "milliseconds (default: 250.0)" in p.format_help()


def test_a_factory_default_is_called() -> None:
    assert field_default(_Settings, "tags") == ("x",)


def test_a_flag_for_a_field_that_is_not_there_fails_when_declared() -> None:
    p = argparse.ArgumentParser()
    with pytest.raises(LookupError, match="_Settings has no field 'intervall'"):
        setting_flag(p, "--interval", _Settings, "intervall", "seconds")


def test_a_field_without_default_cannot_back_a_flag() -> None:
    @dataclass
    class _Required:
        port: int

    with pytest.raises(LookupError, match=r"_Required.port has no default"):
        field_default(_Required, "port")


def test_values_go_back_to_their_settings_in_the_field_units() -> None:
    p = _parser()
    group = p.add_argument_group("cache")
    setting_flag(group, "--cache-mb", _Cache, "cache_bytes", "MiB", scale=1 / (1024 * 1024))
    setting_flag(group, "--cache-size", _Cache, "size", "entries")
    args = p.parse_args(["--budget-ms", "40", "--cache-mb", "1.5", "--count", "5"])
    assert _Settings(**flag_values(args, _Settings)) == _Settings(count=5, budget_s=0.04)
    cache = flag_values(args, _Cache)
    assert cache == {"cache_bytes": 1_572_864, "size": 8}
    assert isinstance(cache["cache_bytes"], int)


def test_subcommands_keep_their_own_flags() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    one, two = sub.add_parser("one"), sub.add_parser("two")
    setting_flag(one, "--count", _Settings, "count", "how many")
    setting_flag(two, "--size", _Cache, "size", "entries")
    assert flag_values(p.parse_args(["one", "--count", "4"]), _Settings) == {"count": 4}
    assert flag_values(p.parse_args(["one"]), _Cache) == {}
    assert flag_values(p.parse_args(["two", "--size", "2"]), _Cache) == {"size": 2}


def test_a_bool_field_needs_an_action() -> None:
    @dataclass
    class _Switches:
        on: bool = True

    p = argparse.ArgumentParser()
    with pytest.raises(TypeError, match=r"--on: _Switches\.on is a bool"):
        setting_flag(p, "--on", _Switches, "on", "switch")
    setting_flag(p, "--on", _Switches, "on", "switch", action=argparse.BooleanOptionalAction)
    assert flag_values(p.parse_args(["--no-on"]), _Switches) == {"on": False}
