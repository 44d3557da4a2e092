"""Train a small model with several workers under torchrun; the rendezvous, the process group and
the parameters all live on one kvps cluster (Raft-replicated: a leader can die meanwhile).

    kvps up --data-dir /tmp/kvps &          # a local cluster (prints its endpoints)
    export KVPS_TOKEN=$(cat /tmp/kvps/token)
    torchrun --nproc-per-node 3 --rdzv-backend kvps --rdzv-endpoint 127.0.0.1:7100 --rdzv-id demo \\
        examples/torchrun_train.py --endpoint http://127.0.0.1:7100

Each worker: ``init_process_group("gloo", store=KvpsStore(...))``; ``SyncPSModule.from_env``
(RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RUN_ID) with synchronous steps (``max_staleness=0``);
every push also adds 1 to a step counter (exactly once, whatever fails). At the end the process
group checks that every worker holds the same parameters, and each worker prints one JSON line.
``--hold-at STEP --hold-key KEY`` makes every worker stop before step STEP until KEY is set in
the store (after setting ``held/<rank>``): a way to act on a running job at a known step.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import kvps_client as kc
from kvps_client.torch import KvpsStore, SyncPSModule, TorchrunEnv


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default=None, help="kvps admin URL (default $KVPS_ENDPOINT)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefix", default="torchrun/", help="key prefix of the model")
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--hold-key", default="go")
    return p.parse_args()


def same_everywhere(model: nn.Module) -> bool:
    """Through the process group: does every worker hold exactly these parameters?"""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def main() -> None:
    args = parse()
    env = TorchrunEnv.read()
    store = KvpsStore(args.endpoint, prefix=f"pg/{env.run_id}/")
    dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size)
    torch.manual_seed(0)  # the first worker's initial values win anyway
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    pm = SyncPSModule.from_env(model, args.endpoint, prefix=args.prefix, optimizer=kc.SGD(lr=0.05),
                               max_staleness=0)
    counter = args.prefix + "steps"
    ps = pm.client  # the SyncClient from_env opened
    ps.create(counter, np.zeros(1, np.float32))  # create if absent: one counter for the job
    g = torch.Generator().manual_seed(env.rank)
    truth = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for step in range(args.steps):
        if step == args.hold_at:
            store.set(f"held/{env.rank}", "1")
            store.wait([args.hold_key])
        x = torch.randn(32, 4, generator=g)
        pm.pull()
        loss = nn.functional.mse_loss(model(x), x @ truth)
        loss.backward()
        pm.push(extra={counter: np.ones(1, np.float32)})
    pm.pull()  # after every worker's last push (synchronous steps)
    same = same_everywhere(model)
    dist.barrier()
    line = json.dumps({"rank": env.rank, "world_size": env.world_size, "loss": loss.detach().item(),
                       "same_params": same, "steps": int(ps.pull(counter)[counter][0])})
    # one write of the whole line: every rank prints right after the barrier into one shared
    # stdout, and print() writes the newline separately (lines came out run together)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    pm.close()
    dist.destroy_process_group()
    store.close()


if __name__ == "__main__":
    main()
