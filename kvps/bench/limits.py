"""B5, the machine's own limits, measured in the same run as the systems.

* loopback: a blocking TCP socket on 127.0.0.1, one sender (this process) and one receiver
  (a spawn-ed process doing ``recv_into`` a reused buffer), 1 MiB writes, 4 MiB socket buffers;
* memcpy: ``np.copyto`` between two 64 MiB arrays, one thread.

Both are what moving a byte costs at best; every system's bytes/s is also reported as a fraction.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import time

import numpy as np

__all__ = ["loopback_bytes_per_s", "memcpy_bytes_per_s"]

MiB = 1 << 20


def _sink(port_q, done_q) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        buf = bytearray(4 * MiB)
        view = memoryview(buf)
        total = 0
        with conn:
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                total += n
        done_q.put(total)


def loopback_bytes_per_s(seconds: float) -> float:
    ctx = mp.get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sink, args=(port_q, done_q), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        payload = memoryview(np.ones(MiB, np.uint8))
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.monotonic()
            sent = 0
            while time.monotonic() - start < seconds:
                s.sendall(payload)
                sent += MiB
            s.shutdown(socket.SHUT_WR)
            received = done_q.get(timeout=60)
            elapsed = time.monotonic() - start
        return received / elapsed
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def memcpy_bytes_per_s(seconds: float, nbytes: int = 64 * MiB) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages once
    copied = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        np.copyto(dst, src)
        copied += nbytes
    return copied / (time.monotonic() - start)
