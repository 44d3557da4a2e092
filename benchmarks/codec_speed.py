"""Frame codec throughput and ratio on parameter-server-shaped data.

    .venv/bin/python benchmarks/codec_speed.py [--mb 64] [--repeat 3]

Cases:
  weights  float32 weights, randn * 0.05
  xor      bit patterns of the weights XOR the weights after one SGD step (lr 1e-3, grad randn * 0.01):
           what an incremental "what changed" pull would ship
  small    many small gradients (1024 float32 each, randn * 1e-3), one frame per gradient:
           per-frame overhead dominates
MB/s are raw (uncompressed) megabytes per second, single-threaded for kvps codecs. blosc2 is
measured only if it is importable (it is not a kvps dependency), with 1 thread and with all cores.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kvps.delta.frame import KIND_REQUEST, decode, encode

try:
    import blosc2
except ImportError:  # optional: only measured when installed
    blosc2 = None

MB = 1e6


def make_cases(mb: int, rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    n = mb * 2**20 // 4
    w = (rng.standard_normal(n, dtype=np.float32) * 0.05).astype(np.float32)  # (n,) float32
    grad = rng.standard_normal(n, dtype=np.float32) * 0.01
    w2 = (w - np.float32(1e-3) * grad).astype(np.float32)
    xor = w.view(np.uint32) ^ w2.view(np.uint32)  # (n,) uint32 -> shipped as int32 bits
    small = [rng.standard_normal(1024, dtype=np.float32) * 1e-3 for _ in range(4096)]
    return {"weights": [w], "xor": [xor.view(np.int32)], "small": small}


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_kvps(arrays: list[np.ndarray], codec: str, repeat: int) -> tuple[float, float, float]:
    frames = [encode(KIND_REQUEST, {}, [a], codec=codec) for a in arrays]
    for a, f in zip(arrays, frames, strict=True):  # the benchmark checks what it measures
        assert decode(f, max_raw_bytes=2**31).arrays[0].tobytes() == a.tobytes()
    t_enc = best_of(repeat, lambda: [encode(KIND_REQUEST, {}, [a], codec=codec) for a in arrays])
    t_dec = best_of(repeat, lambda: [decode(f, max_raw_bytes=2**31) for f in frames])
    return t_enc, t_dec, sum(map(len, frames))


def bench_blosc2(arrays, repeat: int, threads: int, filt) -> tuple[float, float, float]:
    blosc2.set_nthreads(threads)

    def comp():
        return [blosc2.compress(a, typesize=a.itemsize, clevel=5, filter=filt, codec=blosc2.Codec.LZ4)
                for a in arrays]

    wires = comp()
    for a, c in zip(arrays, wires, strict=True):
        assert blosc2.decompress(c) == a.tobytes()
    t_enc = best_of(repeat, comp)
    t_dec = best_of(repeat, lambda: [blosc2.decompress(c) for c in wires])
    return t_enc, t_dec, sum(map(len, wires))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the weights case in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="best of N timings")
    args = parser.parse_args()
    cases = make_cases(args.mb, np.random.default_rng(0))
    cores = os.cpu_count() or 1
    print(f"numpy {np.__version__}, blosc2 {getattr(blosc2, '__version__', 'not installed')}, {cores} cores")
    print(f"{'case':8} {'codec':26} {'raw MB':>8} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
    for name, arrays in cases.items():
        raw = sum(a.nbytes for a in arrays)
        runs = [(c, lambda c=c, a=arrays: bench_kvps(a, c, args.repeat))
                for c in ("none", "lz4", "shuffle-lz4", "auto")]
        if blosc2 is not None:
            for threads in sorted({1, cores}):
                for label, filt in (("shuffle", blosc2.Filter.SHUFFLE), ("bitshuffle", blosc2.Filter.BITSHUFFLE)):
                    runs.append((f"blosc2-lz4-{label} t{threads}",
                                 lambda t=threads, f=filt, a=arrays: bench_blosc2(a, args.repeat, t, f)))
        for label, run in runs:
            t_enc, t_dec, wire = run()
            enc, dec = raw / MB / t_enc, raw / MB / t_dec
            print(f"{name:8} {label:26} {raw / MB:8.1f} {raw / wire:6.3f} {enc:9.0f} {dec:9.0f}")


if __name__ == "__main__":
    main()
