"""B4, pulls: what a full pull and an incremental pull cost, in bytes and in time.

The model is B1's (``tensors`` × 1 MiB keys, one block each). A *reader* client pulls it
repeatedly; between two pulls a *writer* client changes part of it:

* ``full``:              a fresh client (nothing cached) pulls everything;
* ``unchanged``:         incremental pull, nothing changed since the last pull;
* ``sparse``:            incremental pull after the writer pushed to 1/16 of the tensors;
* ``dense``:             incremental pull after the writer pushed to every tensor;
* ``dense_tiny_change``: like ``dense``, but each gradient is zero except one element.

When this bench was written, the reader sent the version of every block it held and only blocks
whose version changed came back, whole, so ``dense_tiny_change`` shipped as many bytes as ``dense``:
that row is the headroom exact in-block (XOR) deltas take; the report's note says which behaviour
the measured build has. Bytes are the reader's response bodies on the wire (``stats.bytes_received``).
"""
from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from kvps.bench.workload import Model

__all__ = ["pulls"]


def pulls(endpoints: list[str], token: str, model: Model, repeats: int) -> dict:
    import kvps_client as kc

    names = model.names("b4")
    sparse = names[:: 16] or names[:1]

    async def main() -> dict:
        async with kc.Client(endpoints, token=token, seed=21, timeout=60) as writer:
            await asyncio.gather(*(writer.create(n, v, optimizer=kc.SGD(lr=1e-4))
                                   for n, v in zip(names, model.values(4))))
            grad = np.ones(model.numel, np.float32)
            tiny = np.zeros(model.numel, np.float32)
            tiny[0] = 1.0
            cases: dict[str, dict] = {}

            async def fresh_reader() -> kc.Client:
                # deltas on, also on loopback (where "auto" leaves them off): B4 measures them,
                # over TCP, as workers on another host pull (not from the leaders' mirrors here)
                reader = kc.Client(endpoints, token=token, seed=22, timeout=60, deltas=True, shm=False)
                await reader.open()
                for n in names:  # layouts are cached per client: not what we measure
                    await reader.describe(n)
                return reader

            async def timed_pull(reader: kc.Client) -> tuple[float, int]:
                before = reader.stats.bytes_received
                t0 = time.monotonic()
                await reader.pull(names)
                return time.monotonic() - t0, reader.stats.bytes_received - before

            async def measure(case: str, change: dict | None, changed: int) -> None:
                samples = []
                reader = await fresh_reader()
                try:
                    await reader.pull(names)
                    for _ in range(repeats):
                        if case == "full":  # a new client holds nothing
                            await reader.aclose()
                            reader = await fresh_reader()
                        elif change is not None:
                            await writer.push(change)
                        samples.append(await timed_pull(reader))
                finally:
                    await reader.aclose()
                cases[case] = {"ms_p50": 1000 * statistics.median(t for t, _ in samples),
                               "bytes": int(statistics.median(b for _, b in samples)),
                               "changed_tensors": changed}

            await measure("full", None, len(names))
            await measure("unchanged", None, 0)
            await measure("sparse", {n: grad for n in sparse}, len(sparse))
            await measure("dense", {n: grad for n in names}, len(names))
            await measure("dense_tiny_change", {n: tiny for n in names}, len(names))
            full = cases["full"]["bytes"]
            for c in cases.values():
                c["fraction_of_full_bytes"] = c["bytes"] / full if full else float("nan")
            return {"model_bytes": model.nbytes, "tensors": len(names), "repeats": repeats,
                    "cases": cases, "note": _note(cases)}

    return asyncio.run(main())


def _note(cases: dict[str, dict]) -> str:
    """What the measurements say about incremental pulls (the client and server may change)."""
    tiny = cases["dense_tiny_change"]["fraction_of_full_bytes"]
    if tiny > 0.9:
        return ("incremental pulls skip unchanged blocks; a changed block comes back whole, however "
                "little of it changed (no XOR/in-block deltas on this build)")
    return (f"incremental pulls skip unchanged blocks and ship changed ones as deltas: one changed "
            f"element per block costs {tiny:.1%} of a full pull")
