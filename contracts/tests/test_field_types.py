"""Every text and integer a caller can send is one of the storable types of `contracts.common`.

Walks each request model of `contracts.catalog.COMMANDS`, each payload model of
`contracts.events.PAYLOADS` and each WebSocket client frame, down through nested
models, lists, unions and `Annotated`, and fails on a plain `str`, `int` or free
`dict[str, Any]`: a new field cannot forget NUL, surrogates or the int64 range.
"""

from __future__ import annotations

import types
import typing
from datetime import date, datetime
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from uuid import UUID

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from contracts import gateway
from contracts.catalog import COMMANDS
from contracts.common import (
    INT64_CHECK,
    INT64_MAX,
    JSON_CHECK,
    TEXT_CHECK,
    Int64,
    JsonObject,
    Text,
)
from contracts.events import PAYLOADS

CLIENT_FRAMES = get_args(get_args(gateway.ClientFrame)[0])
MODELS: list[type[BaseModel]] = sorted(
    {c.request for c in COMMANDS} | set(PAYLOADS.values()) | set(CLIENT_FRAMES),
    key=lambda m: f"{m.__module__}.{m.__qualname__}",
)
SAFE_LEAVES = (bool, float, UUID, datetime, date, type(None))


def _problems(tp: Any, metadata: list[Any], where: str, seen: set[type]) -> list[str]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return _problems(base, [*metadata, *extra], where, seen)
    if origin in (Union, types.UnionType):
        return [p for arg in get_args(tp) for p in _problems(arg, metadata, where, seen)]
    if origin is Literal:
        return []
    if origin in (list, tuple, set, frozenset):
        args = [arg for arg in get_args(tp) if arg is not ...]
        return [p for arg in args for p in _problems(arg, [], f"{where}[]", seen)]
    if origin is dict:
        key, value = get_args(tp)
        if value is Any:
            return [] if JSON_CHECK in metadata else [f"{where}: free dict without JsonObject"]
        keys = _problems(key, [], f"{where}{{key}}", seen)
        return keys + _problems(value, [], f"{where}{{}}", seen)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _model_problems(tp, seen)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return []
    if tp is str:
        return [] if TEXT_CHECK in metadata else [f"{where}: plain str (use Text, Key…)"]
    if tp is int:
        return [] if INT64_CHECK in metadata else [f"{where}: plain int (use Int64)"]
    if tp in SAFE_LEAVES:
        return []
    return [f"{where}: unchecked type {tp!r}"]


def _model_problems(model: type[BaseModel], seen: set[type]) -> list[str]:
    if model in seen:
        return []
    seen.add(model)
    hints = typing.get_type_hints(model, include_extras=True)
    problems = []
    for name, info in model.model_fields.items():
        where = f"{model.__module__}.{model.__qualname__}.{name}"
        # pydantic moves a field's top-level Annotated metadata into `info.metadata`.
        problems += _problems(hints[name], list(info.metadata), where, seen)
    return problems


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__qualname__)
def test_every_field_is_a_storable_type(model: type[BaseModel]) -> None:
    assert _model_problems(model, set()) == []


def test_the_walker_catches_a_plain_field() -> None:
    class Careless(BaseModel):
        name: str
        count: int | None = None
        blob: dict[str, Any]
        fine: Text
        also_fine: list[Int64]
        payload: JsonObject

    problems = _model_problems(Careless, set())
    assert [p.rsplit(".", 1)[1].split(":")[0] for p in problems] == ["name", "count", "blob"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a\x00b", "NUL"),
        ("a\ud800b", "surrogate|unicode"),
    ],
)
def test_text_refuses_what_postgres_or_utf8_cannot_keep(value: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        TypeAdapter(Text).validate_python(value)


@pytest.mark.parametrize("value", [INT64_MAX + 1, -(2**63) - 1, 10**30])
def test_int64_refuses_what_a_bigint_cannot_hold(value: int) -> None:
    with pytest.raises(ValidationError, match="64-bit"):
        TypeAdapter(Int64).validate_python(value)
    assert TypeAdapter(Int64).validate_python(INT64_MAX) == INT64_MAX


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"a": {"b": ["x", "y\x00"]}}, r"a\.b\[1\]: must not contain the NUL"),
        ({"k\x00": 1}, "a key"),
        ({"n": 2**63}, "n: must be between"),
        ({"f": float("nan")}, "finite"),
    ],
)
def test_json_object_refuses_what_jsonb_cannot_keep(value: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        TypeAdapter(JsonObject).validate_python(value)


def test_json_object_refuses_deep_nesting() -> None:
    value: dict[str, Any] = {}
    for _ in range(100):
        value = {"x": value}
    with pytest.raises(ValidationError, match="deeper than"):
        TypeAdapter(JsonObject).validate_python(value)
