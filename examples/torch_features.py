"""kvps_client.torch, one short training loop per feature (the README's torch section shows them):

    python examples/torch_features.py --endpoint http://127.0.0.1:7100 [schedule amp bf16 sparse streams]

schedule  a warm-up + StepLR schedule on ``pm.optimizer``, applied by the server
amp       autocast + GradScaler: an overflowing step is skipped, the scale backs off
bf16      a bfloat16 model; the server keeps float32 master weights
sparse    nn.Embedding(sparse=True): only the rows a batch touched are pushed
streams   a loop on a non-default CUDA stream (needs a GPU; skipped without one)

The token comes from ``$KVPS_TOKEN``. Each example uses its own key prefix and prints one line.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import kvps_client as kc
from kvps_client.torch import SyncPSModule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def data(steps: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        yield x.to(DEVICE, dtype), (x.sum(1, keepdim=True) > 0).float().to(DEVICE, dtype)


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEVICE, dtype)


def schedule(ps: kc.SyncClient) -> str:
    net = model()
    pm = SyncPSModule(net, ps, prefix="ex-schedule/", optimizer=kc.SGD(lr=0.5))
    warmup = torch.optim.lr_scheduler.LinearLR(pm.optimizer, start_factor=0.1, total_iters=5)
    decay = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=10, gamma=0.5)
    sched = torch.optim.lr_scheduler.SequentialLR(pm.optimizer, [warmup, decay], milestones=[5])
    for x, y in data(20):
        pm.pull()
        nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
        pm.push()      # the schedule's lr reaches the server before this step's gradients
        sched.step()
    pm.close()
    lr = ps.describe("ex-schedule/0.weight", refresh=True)["hyperparams"]["values"]["lr"]
    return f"server lr after 20 steps: {lr:g}"


def amp(ps: kc.SyncClient) -> str:
    net, device = model(), DEVICE
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    pm = SyncPSModule(net, ps, prefix="ex-amp/", optimizer=kc.SGD(lr=0.1), scaler=scaler)
    skipped = 0
    for i, (x, y) in enumerate(data(6)):
        pm.pull()
        with torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16):
            loss = nn.functional.binary_cross_entropy_with_logits(net(x), y)
        scaler.scale(loss * (float("inf") if i == 3 else 1.0)).backward()  # step 3 overflows
        skipped += not pm.push()  # push() ran scaler.step + scaler.update: {} when skipped
    pm.close()
    return f"skipped {skipped} step(s), scale now {scaler.get_scale():g}"


def bf16(ps: kc.SyncClient) -> str:
    net = model(torch.bfloat16)
    pm = SyncPSModule(net, ps, prefix="ex-bf16/", optimizer=kc.SGD(lr=0.1))
    for x, y in data(5, torch.bfloat16):
        pm.pull()
        nn.functional.binary_cross_entropy_with_logits(net(x).float(), y.float()).backward()
        pm.push()
    pm.pull()
    pm.close()
    return f"parameters {next(net.parameters()).dtype}, kept on the server as {ps.describe('ex-bf16/0.weight')['dtype']}"


def sparse(ps: kc.SyncClient) -> str:
    torch.manual_seed(0)
    emb, head = nn.Embedding(10_000, 16, sparse=True), nn.Linear(16, 1)
    net = nn.ModuleDict({"emb": emb, "head": head}).to(DEVICE)
    pm = SyncPSModule(net, ps, prefix="ex-sparse/", optimizer=kc.SGD(lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 10_000, (64, 4), generator=g).to(DEVICE)
        pm.pull()
        head(emb(ids).mean(1)).square().mean().backward()
        pm.push()       # push_rows of at most 256 rows, not the 10,000-row table
    pm.close()
    kind = ps.describe("ex-sparse/emb.weight")["kind"]
    return f"the weight is a kvps {kind}; each step pushed only its batch's rows"


def streams(ps: kc.SyncClient) -> str:
    if DEVICE != "cuda":
        return "skipped (no GPU)"
    net, side = model(), torch.cuda.Stream()
    pm = SyncPSModule(net, ps, prefix="ex-streams/", optimizer=kc.SGD(lr=0.1), overlap=True)
    with torch.cuda.stream(side):  # copies are ordered after this stream's work, and it waits for them
        for x, y in data(5):
            pm.pull()
            nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
            pm.push()
    pm.close()
    return "trained on a side stream"


EXAMPLES = {"schedule": schedule, "amp": amp, "bf16": bf16, "sparse": sparse, "streams": streams}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default=None, help="kvps admin URL (default $KVPS_ENDPOINT)")
    p.add_argument("names", nargs="*", help=f"some of {', '.join(EXAMPLES)} (default: all)")
    args = p.parse_args()
    unknown = sorted(set(args.names) - set(EXAMPLES))
    if unknown:
        p.error(f"unknown example(s): {', '.join(unknown)}")
    with kc.SyncClient(args.endpoint) as ps:
        for name in args.names or EXAMPLES:
            print(f"{name}: {EXAMPLES[name](ps)}", flush=True)


if __name__ == "__main__":
    main()
