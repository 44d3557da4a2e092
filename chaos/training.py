"""The training workload: worker processes training a small PyTorch MLP through kvps.

Each worker wraps its model in ``kvps_client.torch.PSModule``: every step pulls the parameters into
the module, runs forward and backward with torch on a minibatch, and pushes the gradients (the shard
leaders apply SGD). The data is a seeded synthetic classification task (labels from a fixed random
"teacher"), so the loss must fall whatever faults happen. Each step appends one JSON line to the
worker's log: times, outcome, minibatch loss, the version the push returned, the worker's clock
step and, every few steps, the loss on the worker's whole data shard. SIGTERM ends the worker after
the current step (it leaves the job's clock).

Asynchronous by default; ``--staleness S`` runs bounded staleness (0: synchronous) on the server's
clocks (job ``--job``, lease ``--lease-s``), ``--wait-workers N`` makes the first step wait until N
workers are live. A worker started later joins the running job (``StepClock.start``). Ranks past
``--workers`` train on the data shard of ``rank % workers``.

    python -m kvps_chaos.training --endpoints URL,... --token-file F --rank 0 --workers 2 \
        --seed 7 --out train-0.jsonl [--staleness 0 --lease-s 4 --wait-workers 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

__all__ = ["PREFIX", "command", "main", "train"]

FEATURES, HIDDEN, CLASSES, ROWS = 32, 64, 8, 4096
PREFIX = "train/"   # keys: train/0.weight, train/0.bias, train/2.weight, train/2.bias
LR = 0.2
EVAL_EVERY = 10


def command(endpoints: list[str], token_file: str, *, rank: int, workers: int, seed: int, out: str,
            **options: object) -> list[str]:
    """The argv of one worker process; ``options`` are the other flags (``op_timeout=15`` for
    ``--op-timeout 15``; ``None`` leaves a flag out)."""
    args = [sys.executable, "-m", "kvps_chaos.training", "--endpoints", ",".join(endpoints),
            "--token-file", token_file, "--rank", str(rank), "--workers", str(workers),
            "--seed", str(seed), "--out", out]
    for name, value in options.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def _data(seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(ROWS, FEATURES, generator=g)                       # (rows, features)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (X @ teacher + 0.3 * torch.randn(ROWS, CLASSES, generator=g)).argmax(dim=1)   # (rows,)
    return X, y


def _model(seed: int):
    from torch import nn
    import torch
    torch.manual_seed(seed)  # every worker builds the same initial model ("create if absent")
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


async def train(args: argparse.Namespace, stop: asyncio.Event) -> None:
    import torch
    import torch.nn.functional as F

    import kvps_client as kc
    from kvps.errors import KvpsError
    from kvps_client.torch import PSModule

    torch.set_num_threads(1)  # two cores shared by a whole cluster: one thread per worker
    X, y = _data(args.seed)
    shard = args.rank % args.workers
    part = slice(shard * ROWS // args.workers, (shard + 1) * ROWS // args.workers)
    X, y = X[part], y[part]
    gen = torch.Generator().manual_seed(args.seed * 31 + args.rank)
    model = _model(args.seed)
    token = open(args.token_file).read().split()[0]
    out = open(args.out, "a", buffering=1)
    async with kc.Client(args.endpoints.split(","), token=token, timeout=args.op_timeout,
                         request_timeout=2.0, seed=args.seed * 17 + args.rank,
                         client_id=f"train{args.rank}-{args.seed}") as ps:
        pm = PSModule(model, ps, prefix=PREFIX, optimizer=kc.SGD(lr=LR), max_staleness=args.staleness,
                      job=args.job, lease_s=args.lease_s, workers=args.wait_workers or None)
        step = 0
        while not stop.is_set():
            rec: dict = {"step": step, "t0": time.monotonic()}
            try:
                await pm.pull()
                model.zero_grad(set_to_none=True)  # a failed push leaves its gradients behind
                idx = torch.randint(0, len(y), (64,), generator=gen)
                loss = F.cross_entropy(model(X[idx]), y[idx])
                loss.backward()
                versions = await pm.push()
                rec.update(ok=True, loss=loss.item(), version=max(versions.values()),
                           clock=pm.clock.step if pm.clock is not None else None)
                if step % EVAL_EVERY == 0:
                    with torch.no_grad():
                        rec["eval"] = float(F.cross_entropy(model(X), y))
            except KvpsError as exc:
                rec.update(ok=False, error=type(exc).__name__)
            rec["t1"] = time.monotonic()
            out.write(json.dumps(rec) + "\n")
            step += 1
            await asyncio.sleep(args.pause)
        await pm.close()


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
    p.add_argument("--staleness", type=int, default=None, help="bounded staleness; 0: synchronous")
    p.add_argument("--job", default="train")
    p.add_argument("--lease-s", type=float, default=10.0)
    p.add_argument("--wait-workers", type=int, default=0)
    args = p.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await train(args, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
