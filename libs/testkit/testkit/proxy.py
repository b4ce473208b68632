"""A loopback TCP relay a test puts between a client and its server (Postgres, NATS), to
cut the link and restore it on the same port: the server is unreachable for that client
only, everything else runs on."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


class TcpProxy:
    """A loopback TCP relay to a server (Postgres or NATS, by its URL), which the test
    can cut (and restore on the same port)."""

    def __init__(self, url: str) -> None:
        self._target = urlsplit(url)
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and drop the open ones: the server is unreachable."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._links):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """To the server's TCP port, or its Unix socket (`?host=/dir`, as pgserver's)."""
        target, port = self._target, self._target.port or 5432
        socket_dir = dict(parse_qsl(target.query)).get("host")
        if target.hostname is None and socket_dir:
            return await asyncio.open_unix_connection(f"{socket_dir}/.s.PGSQL.{port}")
        return await asyncio.open_connection(target.hostname or "127.0.0.1", port)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await self._connect()
        self._links.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._links.difference_update((writer, up_writer))


def through(url: str, proxy: TcpProxy) -> str:
    """`url`, reaching its server through `proxy`."""
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "host"])
    return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{proxy.port}", query=query))
