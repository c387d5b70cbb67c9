"""A TCP proxy that adds round-trip time: a far worker's view of the ledger on this machine.

``LatencyProxy(unix_socket, rtt_s)`` listens on a loopback TCP port and forwards every connection to
the PostgreSQL server's Unix socket, holding each chunk of bytes ``rtt_s / 2`` in each direction before
it passes it on. Chunks are pipelined, not serialized: the delay is latency, as across regions, and
costs no bandwidth (two chunks sent 1 ms apart arrive 1 ms apart). ``url(server_url)`` is the same
database reached through the proxy.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


def socket_path(url: str) -> str:
    """The Unix socket of a PostgreSQL URL whose host is a socket directory (the embedded server's)."""
    params = conninfo_to_dict(url)
    return f"{params['host']}/.s.PGSQL.{params.get('port') or 5432}"


class LatencyProxy:
    def __init__(self, unix_socket: str, rtt_s: float):
        self.unix_socket, self.half = unix_socket, rtt_s / 2
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="latency-proxy")

    def __enter__(self) -> "LatencyProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    async def _close(self) -> None:
        """Stop listening and end every connection still open."""
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def url(self, server_url: str) -> str:
        params = conninfo_to_dict(server_url)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo(**params)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(self.unix_socket)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Copy src to dst, each chunk held ``half`` seconds after it arrived; then close dst."""
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                dst.write(data)
                await dst.drain()
            dst.close()

        sender = asyncio.create_task(send())
        try:
            while data := await src.read(1 << 16):
                queue.put_nowait((loop.time() + self.half, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((loop.time() + self.half, None))
        try:
            await sender
        except (ConnectionError, OSError):
            pass
