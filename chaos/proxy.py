"""A transparent TCP proxy that adds delay and jitter to a node's Raft connections.

``tc netem`` is not available here, so delay is made in user space. The proxy runs inside a node's
network namespace, where an nftables redirect (``Topology.redirect_raft``) hands it every outgoing
Raft connection; it reads the original destination with ``SO_ORIGINAL_DST`` and dials it with a
socket mark the redirect skips. Delay is set per destination address (or ``*``) over a Unix socket
(path sockets are not namespaced, so the harness reaches it from the hub), and applies at once to
connections already open: pysyncobj keeps one long-lived connection per pair of replicas.

Each chunk read is forwarded ``delay ± jitter`` seconds later, never before the previous chunk of
the same direction (TCP is a byte stream: reordering would corrupt it).

    python -m kvps_chaos.proxy --port 6999 --control /run/dir/proxy-0.sock --seed 7
    control lines (JSON): {"delay": {"*": [0.05, 0.02]}}  ->  {"ok": true}
                          {"delay": {}}                   ->  clears every delay
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys

from kvps_chaos.netns import PROXY_MARK

__all__ = ["DelayTable", "main", "serve", "set_delay"]

_SO_ORIGINAL_DST = 80
_CONNECT_TIMEOUT = 5.0
_CHUNK = 256 * 1024


class DelayTable:
    def __init__(self, seed: int) -> None:
        self.rules: dict[str, tuple[float, float]] = {}
        self.rng = random.Random(seed)

    def sample(self, dst: str) -> float:
        delay, jitter = self.rules.get(dst) or self.rules.get("*") or (0.0, 0.0)
        if delay <= 0 and jitter <= 0:
            return 0.0
        return max(0.0, delay + self.rng.uniform(-jitter, jitter))


def _original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, = struct.unpack("!H", raw[2:4])
    return socket.inet_ntoa(raw[4:8]), port


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dst: str,
                table: DelayTable) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    last = 0.0
    try:
        while True:
            try:
                data = await reader.read(_CHUNK)
            except ConnectionError:
                data = b""
            if not data:
                break
            last = max(last, loop.time() + table.sample(dst))
            queue.put_nowait((last, data))
        queue.put_nowait((last, None))
        await sender
    finally:
        sender.cancel()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, table: DelayTable) -> None:
    loop = asyncio.get_running_loop()
    up_writer = None
    try:
        dst = _original_dst(writer.get_extra_info("socket"))
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PROXY_MARK)
        up.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(up, dst), _CONNECT_TIMEOUT)
        except BaseException:
            up.close()
            raise
        up_reader, up_writer = await asyncio.open_connection(sock=up)
        pumps = [asyncio.create_task(_pump(reader, up_writer, dst[0], table)),
                 asyncio.create_task(_pump(up_reader, writer, dst[0], table))]
        # Either side closing ends the whole connection (pysyncobj reconnects by itself).
        _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    except (OSError, asyncio.TimeoutError):
        pass  # an unreachable peer: the caller sees a closed connection, as without the proxy
    finally:
        for w in (writer, up_writer):
            if w is not None:
                w.close()


async def _control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, table: DelayTable) -> None:
    try:
        while line := await reader.readline():
            try:
                msg = json.loads(line)
                table.rules = {dst: (float(d), float(j)) for dst, (d, j) in msg["delay"].items()}
                reply = {"ok": True}
            except (ValueError, KeyError, TypeError) as exc:
                reply = {"ok": False, "error": str(exc)}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
    finally:
        writer.close()


async def serve(port: int, control: str, seed: int) -> None:
    table = DelayTable(seed)
    tasks: set[asyncio.Task] = set()

    def on_connect(reader, writer):
        task = asyncio.create_task(_handle(reader, writer, table))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(on_connect, "127.0.0.1", port, reuse_address=True)
    ctl = await asyncio.start_unix_server(lambda r, w: _control(r, w, table), control)
    print(f"kvps_chaos.proxy: 127.0.0.1:{port}, control {control}", flush=True)
    async with server, ctl:
        await asyncio.Event().wait()


def set_delay(control: str, rules: dict[str, tuple[float, float]], timeout: float = 5.0) -> None:
    """Blocking: set the proxy's delay rules ({} clears them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(control)
        s.sendall(json.dumps({"delay": {k: list(v) for k, v in rules.items()}}).encode() + b"\n")
        reply = json.loads(s.makefile().readline())
    if not reply.get("ok"):
        raise RuntimeError(f"proxy {control} refused delay rules: {reply}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvps_chaos.proxy")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.control, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
