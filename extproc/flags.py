"""Command-line flags that set a settings field take their default, and its type, from the field,
and hand their value back to it.

A default is then stated once, in the settings dataclass: ``--help`` (every subcommand uses
``ArgumentDefaultsHelpFormatter``) and ``docs/flags.md`` show it from there, and a flag cannot
parse its value as another type than the field holds. A flag in other units than its field
(``--decode-base-ms`` for seconds) states its scale once, and :func:`flag_values` converts back, so
no flag can be parsed and then forgotten on the way to its settings. serve, sim and reconcile all
declare their setting flags this way; flags with no field behind them (``--source``, ``--replicas``)
or that need more than a unit (``--tokenizer MODEL=PATH``) stay plain and are read by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

#: The parser default (so an attribute of the parsed namespace) that maps each setting flag's dest
#: to its field. A subcommand's parser keeps its own.
_BINDINGS = "setting_flags"

#: Field annotations a flag parses itself; any other (``Path | None``, an enum) names its ``type=``.
_PARSED = {"int": int, "float": float, "str": str}


def _field(settings: type[Any], name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(settings):
        if f.name == name:
            return f
    raise LookupError(f"{settings.__name__} has no field {name!r}")


def field_default(settings: type[Any], name: str) -> Any:
    """The default of dataclass field ``name`` of ``settings`` (a factory is called).

    LookupError when there is no such field or it has no default: the parser is built at startup,
    so a flag pointing at a renamed field fails every test at once rather than at a user.
    """
    return _default(settings, _field(settings, name))


def _default(settings: type[Any], f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise LookupError(f"{settings.__name__}.{f.name} has no default for a flag to show")


def setting_flag(
    group: argparse._ActionsContainer,
    flag: str,
    settings: type[Any],
    name: str,
    help: str,
    *,
    scale: float | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Add ``flag`` for field ``name`` of ``settings``: its default is the field's, and so is its
    type when the field is an ``int``, ``float`` or ``str`` (others give ``type=`` or ``action=``).

    ``scale`` is for a flag in other units than its field (``--decode-base-ms`` for seconds): its
    default is the field's times ``scale`` and it parses a float; :func:`flag_values` divides it back.
    """
    f = _field(settings, name)
    default, annotation = _default(settings, f), f.type
    if annotation in ("bool", bool) and "action" not in kwargs:
        # Without an action argparse would keep the word itself: "--x false" would set "false", true.
        raise TypeError(f"{flag}: {settings.__name__}.{name} is a bool, so the flag needs an action=")
    parsed = _PARSED.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
    if scale is not None:
        default, parsed = default * scale, float
    if "action" not in kwargs and "type" not in kwargs and parsed is not None:
        kwargs["type"] = parsed
    action = group.add_argument(flag, default=default, help=help, **kwargs)
    # An argument group shares its parser's defaults, so every group of a command adds to one map.
    bindings = dict(group.get_default(_BINDINGS) or {})
    bindings[action.dest] = _Binding(settings, name, scale, annotation in ("int", int))
    group.set_defaults(**{_BINDINGS: bindings})
    return action


def flag_values(args: argparse.Namespace, settings: type[Any]) -> dict[str, Any]:
    """The fields of ``settings`` that its setting flags set, from parsed ``args``, in the field's
    units: the keyword arguments to build ``settings`` with (besides what is read by hand)."""
    values: dict[str, Any] = {}
    for dest, binding in getattr(args, _BINDINGS, {}).items():
        if binding.settings is settings:
            values[binding.name] = binding.value(getattr(args, dest))
    return values


@dataclass(frozen=True, slots=True)
class _Binding:
    settings: type[Any]
    name: str
    scale: float | None
    #: The field holds an int: a scaled value is cut back to one.
    integer: bool

    def value(self, parsed: Any) -> Any:
        if self.scale is None or parsed is None:
            return parsed
        unscaled = parsed / self.scale
        return int(unscaled) if self.integer else unscaled
