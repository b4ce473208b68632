"""The pool's json/jsonb codec (`servicekit.db`) against real Postgres."""

from __future__ import annotations

import asyncpg
import pytest


@pytest.mark.parametrize("kind", ["json", "jsonb"])
async def test_json_values_go_in_and_come_back_as_python_objects_whatever_orjson_refuses(
    pool: asyncpg.Pool, kind: str
) -> None:
    """The pool's codec writes with orjson, and with `json.dumps` what orjson refuses but
    Postgres takes: an int beyond 64 bits (read back exact, not as a float) and a key
    that is not a string."""
    value = {"text": "é\n", "n": [1, 2.5, None, True], "big": 2**70, 7: "seven"}
    back = await pool.fetchval(f"SELECT $1::{kind}", value)
    assert back == {"text": "é\n", "n": [1, 2.5, None, True], "big": 2**70, "7": "seven"}
    assert await pool.fetchval(f"SELECT $1::{kind} ->> 'big'", value) == str(2**70)
