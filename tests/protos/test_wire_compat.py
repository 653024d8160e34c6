"""Our restated Envoy protos must be wire-identical to Envoy's full definitions.

Every message we use is filled field by field (one instance per oneof member, at every depth),
encoded with our classes and decoded with envoy-data-plane's (generated from Envoy's own protos),
and the other way round. Both sides are compared through proto3 JSON with field names, so a wrong
field number, type or enum value shows up as a difference instead of passing as an unknown field.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from typing import Any

import betterproto2
import pytest
from google.protobuf import descriptor, json_format, message, struct_pb2, unknown_fields

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

# envoy-data-plane warns when a field Envoy deprecated (e.g. HeaderValueOption.append) is set;
# we set every field on purpose to check its number.
pytestmark = pytest.mark.filterwarnings(r"ignore:.* is deprecated:DeprecationWarning")
FD = descriptor.FieldDescriptor
with warnings.catch_warnings():
    # envoy-data-plane's generated classes use a pydantic idiom that pydantic >= 2.12 deprecates.
    warnings.simplefilter("ignore", DeprecationWarning)
    THEIRS = importlib.import_module("envoy_data_plane.envoy.service.ext_proc.v3")
WELL_KNOWN = {"google.protobuf.Struct", "google.protobuf.Any"}


def _oneof_choices(desc: descriptor.Descriptor, seen: set[str]) -> Iterator[tuple[str, str]]:
    """Every (oneof full name, member name) reachable from ``desc``."""
    if desc.full_name in seen or desc.full_name in WELL_KNOWN:
        return
    seen.add(desc.full_name)
    for oneof in desc.oneofs:
        for field in oneof.fields:
            yield oneof.full_name, field.name
    for field in desc.fields:
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            yield from _oneof_choices(field.message_type, seen)


def _fill(msg: message.Message, choice: dict[str, str], depth: int = 0) -> None:
    """Set every field to a distinct non-default value; in oneofs, only the chosen member."""
    for field in msg.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and choice.get(oneof.full_name, oneof.fields[0].name) != field.name:
            continue
        _set(msg, field, choice, depth)


def _set(msg: message.Message, field: FD, choice: dict[str, str], depth: int) -> None:
    container: Any = getattr(msg, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        if value_field.message_type is None:
            container[f"k{field.number}"] = f"v{field.number}"
        elif value_field.message_type.full_name == "google.protobuf.Struct":
            container[f"k{field.number}"].update({"x": "y", "n": 2.5})
        return  # map<string, Any> stays empty: Any needs a type registry on both sides
    if field.message_type is not None:
        if field.message_type.full_name == "google.protobuf.Struct":
            target = container.add() if field.is_repeated else container
            target.update({"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.1:8000"}})
            return
        if field.message_type.full_name == "google.protobuf.Duration":
            # Whole seconds: envoy-data-plane's JSON drops nanoseconds (a printing quirk only).
            container.seconds = 2
            return
        if depth > 6:
            return
        target = container.add() if field.is_repeated else container
        target.SetInParent()
        _fill(target, choice, depth + 1)
        return
    value = _scalar(field)
    if field.is_repeated:
        container.append(value)
    else:
        setattr(msg, field.name, value)


def _scalar(field: FD) -> Any:
    if field.type == FD.TYPE_STRING:
        return f"s{field.number}"
    if field.type == FD.TYPE_BYTES:
        return f"b{field.number}".encode()
    if field.type == FD.TYPE_BOOL:
        return True
    if field.type == FD.TYPE_ENUM:
        values = field.enum_type.values
        return values[-1].number  # the last value: differs from the default, and checks numbering
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return 1.5
    return field.number + 1


def _cases() -> list[Any]:
    cases = []
    for cls in (ep.ProcessingRequest, ep.ProcessingResponse):
        for oneof, member in sorted(set(_oneof_choices(cls.DESCRIPTOR, set()))):
            cases.append(pytest.param(cls, {oneof: member}, id=f"{cls.__name__}.{member}"))
    return cases


def _ours_json(msg: message.Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _theirs_json(msg: betterproto2.Message) -> dict[str, Any]:
    return msg.to_dict(casing=betterproto2.Casing.SNAKE)


@pytest.mark.parametrize(("cls", "choice"), _cases())
def test_ours_decode_as_envoys(cls: type[message.Message], choice: dict[str, str]) -> None:
    """A message we encode reads back field for field with Envoy's full definitions."""
    ours = cls()
    _fill(ours, choice)
    theirs = getattr(THEIRS, cls.__name__).parse(ours.SerializeToString())
    assert _theirs_json(theirs) == _ours_json(ours)


@pytest.mark.parametrize(("cls", "choice"), _cases())
def test_envoys_decode_as_ours(cls: type[message.Message], choice: dict[str, str]) -> None:
    """A message encoded with Envoy's definitions reads back field for field with ours."""
    source = cls()
    _fill(source, choice)
    theirs = getattr(THEIRS, cls.__name__).from_dict(_ours_json(source))
    ours = cls.FromString(bytes(theirs))
    assert _ours_json(ours) == _theirs_json(theirs)
    assert not _unknown_fields(ours), "fields Envoy sends that our protos do not know"


def _unknown_fields(msg: message.Message) -> list[str]:
    found = [msg.DESCRIPTOR.full_name] if len(unknown_fields.UnknownFieldSet(msg)) else []
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for item in value if field.is_repeated else [value]:
            found += _unknown_fields(item)
    return found


def test_cases_cover_every_message_we_use() -> None:
    """The filled instances reach every message type of our ext_proc protos."""
    reached: set[str] = set()

    def walk(msg: message.Message) -> None:
        reached.add(msg.DESCRIPTOR.full_name)
        for field, value in msg.ListFields():
            if field.message_type is not None and not field.message_type.GetOptions().map_entry:
                for item in value if field.is_repeated else [value]:
                    walk(item)

    for param in _cases():
        cls, choice = param.values
        instance = cls()
        _fill(instance, choice)
        walk(instance)
    ours = {m.full_name for m in ep.DESCRIPTOR.message_types_by_name.values()}
    assert ours <= reached
    assert struct_pb2.Struct.DESCRIPTOR.full_name in reached
