"""`sse_data`: the data of each server-sent event, however the body is cut into reads."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from metering.providers.base import sse_data


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def data_of(*parts: bytes) -> list[bytes]:
    return [data async for data in sse_data(chunks(*parts))]


BODY = (
    b'event: message_start\ndata: {"a": 1}\n\n'
    b": a comment\n\n"
    b"event: ping\n\n"
    b'data: {"b":\ndata:  2}\nid: 7\n\n'
    b"data\n\n"
    b'event: message_stop\ndata: {"c": 3}\n\n'
)
EXPECTED = [b'{"a": 1}', b'{"b":\n 2}', b"", b'{"c": 3}']


async def test_named_unnamed_multi_line_and_empty_data_events() -> None:
    assert await data_of(BODY) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
async def test_the_same_events_whatever_the_reads_cut(size: int) -> None:
    parts = [BODY[i : i + size] for i in range(0, len(BODY), size)]
    assert await data_of(*parts) == EXPECTED


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [1, 5, 1000])
async def test_crlf_and_cr_line_endings_even_split_across_reads(newline: bytes, size: int) -> None:
    body = BODY.replace(b"\n", newline)
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    assert await data_of(*parts) == EXPECTED


async def test_an_event_the_body_ends_in_the_middle_of_is_dropped() -> None:
    assert await data_of(b'data: {"a": 1}\n\ndata: {"cut') == [b'{"a": 1}']
    assert await data_of(b'data: {"a": 1}\n\ndata: {"b": 2}\n') == [b'{"a": 1}']
