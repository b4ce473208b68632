"""The chaos bench's people reconnect as the web client does: by the numbers
`services/gateway/web/connection.js` declares and its `retryDelay` schedule (checked in
the browser by services/gateway/tests/test_browser_client.py), so what `make chaos`
measures is what a person with the page open waits."""

from __future__ import annotations

from .benches import bench_module


def test_a_person_waits_in_the_web_clients_window_after_a_lost_socket() -> None:
    bench = bench_module("chaos")
    assert (bench.FIRST_RETRY, bench.MAX_RETRY, bench.JOIN_TIMEOUT) == (0.5, 10.0, 10.0)
    ceilings = [bench.retry_delay(n, 1.0) for n in range(7)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [bench.retry_delay(n, 0.0) for n in range(6)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0]
