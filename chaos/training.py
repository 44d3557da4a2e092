"""The training workload: worker processes training a small PyTorch MLP through kvps.

Each step pulls every parameter, computes the cross-entropy gradient of a minibatch with torch, and
pushes it (the shard leaders apply SGD). The data is a seeded synthetic classification task (labels
from a fixed random "teacher" network), so the loss must fall whatever faults happen. Each step
appends one JSON line to the worker's log: times, outcome, minibatch loss and, every few steps, the
loss on the worker's whole data shard. SIGTERM ends the worker after the current step.

    python -m kvps_chaos.training --endpoints URL,... --token-file F --rank 0 --workers 2 \
        --seed 7 --out train-0.jsonl
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import numpy as np

__all__ = ["PARAMS", "initial_params", "main"]

FEATURES, HIDDEN, CLASSES, ROWS = 32, 64, 8, 4096
PARAMS = {"train/w1": (FEATURES, HIDDEN), "train/b1": (HIDDEN,),
          "train/w2": (HIDDEN, CLASSES), "train/b2": (CLASSES,)}
LR = 0.2
EVAL_EVERY = 10


def initial_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.0)).astype(np.float32)
            for k, shape in PARAMS.items()}


def _data(seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(ROWS, FEATURES, generator=g)                       # (rows, features)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (X @ teacher + 0.3 * torch.randn(ROWS, CLASSES, generator=g)).argmax(dim=1)   # (rows,)
    return X, y


def _loss(params: dict, X, y):
    import torch.nn.functional as F
    h = F.relu(X @ params["train/w1"] + params["train/b1"])           # (batch, hidden)
    return F.cross_entropy(h @ params["train/w2"] + params["train/b2"], y)


async def train(args: argparse.Namespace, stop: asyncio.Event) -> None:
    import torch

    import kvps_client as kc
    from kvps.errors import KvpsError

    torch.set_num_threads(1)  # two cores shared by a whole cluster: one thread per worker
    X, y = _data(args.seed)
    part = slice(args.rank * ROWS // args.workers, (args.rank + 1) * ROWS // args.workers)
    X, y = X[part], y[part]
    gen = torch.Generator().manual_seed(args.seed * 31 + args.rank)
    token = open(args.token_file).read().split()[0]
    out = open(args.out, "a", buffering=1)
    async with kc.Client(args.endpoints.split(","), token=token, timeout=args.op_timeout,
                         request_timeout=2.0, seed=args.seed * 17 + args.rank,
                         client_id=f"train{args.rank}-{args.seed}") as ps:
        step = 0
        while not stop.is_set():
            rec: dict = {"step": step, "t0": time.monotonic()}
            try:
                values = await ps.pull(list(PARAMS))
                params = {k: torch.from_numpy(v).requires_grad_() for k, v in values.items()}
                idx = torch.randint(0, len(y), (64,), generator=gen)
                loss = _loss(params, X[idx], y[idx])
                loss.backward()
                versions = await ps.push({k: p.grad.numpy() for k, p in params.items()})
                rec.update(ok=True, loss=float(loss), version=max(versions.values()))
                if step % EVAL_EVERY == 0:
                    with torch.no_grad():
                        rec["eval"] = float(_loss({k: p.detach() for k, p in params.items()}, X, y))
            except KvpsError as exc:
                rec.update(ok=False, error=type(exc).__name__)
            rec["t1"] = time.monotonic()
            out.write(json.dumps(rec) + "\n")
            step += 1
            await asyncio.sleep(args.pause)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvps_chaos.training")
    p.add_argument("--endpoints", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--op-timeout", type=float, default=20.0)
    p.add_argument("--pause", type=float, default=0.02)
    args = p.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await train(args, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
