"""The demo's training task: scikit-learn's digits (it ships the data: no download), an MLP
64-128-10, plain SGD — trained by worker processes through kvps, and by one process alone as the
no-fault baseline with the same data, initial weights, batch size, learning rate and epochs.

Calibration (DESIGN §10): plain SGD for 30 epochs reaches ~96.5-97.5 % on the 360 test images (one
image = 0.28 points); fewer epochs under-train and lose points under staleness, and momentum with
stale gradients diverges, so the server runs plain SGD.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["TrainConfig", "accuracy", "baseline", "batches", "load", "make_model", "train_worker"]

PREFIX = "digits/"
COUNTER = "demo/steps"  # Add counter: +1 per acknowledged step (exactly-once check)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 30  # to convergence: under-trained runs lose 1-3 points under staleness
    batch: int = 32
    lr: float = 0.1  # plain SGD, no momentum (momentum with stale gradients diverges)
    workers: int = 3
    staleness: int | None = 4  # SSP bound (server-kept clocks); None = asynchronous
    seed: int = 0

    def total_steps(self, n_train: int) -> int:
        """Steps of all workers together (= the baseline's steps: the same batches, split)."""
        return sum(1 for r in range(self.workers) for _ in batches(n_train, self, r, self.workers))


Data = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # X_train, y_train, X_test, y_test


def load(seed: int) -> Data:
    """(X_train, y_train, X_test, y_test): an 80/20 stratified split, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)  # (1797, 64)
    y = d.target.astype(np.int64)  # (1797,)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)
    return Xtr, ytr, Xte, yte


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every worker builds the same initial weights as the baseline
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def batches(n: int, cfg: TrainConfig, rank: int, workers: int) -> Iterator[np.ndarray]:
    """Index batches for worker ``rank`` of ``workers``: its share of the training set, reshuffled
    every epoch (workers=1: the whole set, as the baseline sees it)."""
    share = np.random.default_rng(cfg.seed).permutation(n)[rank::workers]
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([cfg.seed, rank, epoch]).permutation(share)
        for start in range(0, len(order), cfg.batch):
            yield order[start:start + cfg.batch]


def accuracy(model: nn.Module, X: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(X)).argmax(1).numpy() == y).mean() * 100)


def baseline(cfg: TrainConfig, data: Data) -> tuple[float, list[float]]:
    """One process, no parameter server, no faults: (test accuracy %, loss per step)."""
    torch.set_num_threads(1)
    Xtr, ytr, Xte, yte = data
    model = make_model(cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    X, y = torch.from_numpy(Xtr), torch.from_numpy(ytr)
    losses = []
    for idx in batches(len(ytr), cfg, 0, 1):
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return accuracy(model, Xte, yte), losses


def train_worker(rank: int, cfg: TrainConfig, train_npz: str, endpoints: list[str], token: str,
                 out: mp.Queue, go: Any) -> None:
    """A worker process: once ``go`` is set, pull, forward, backward, push through
    ``SyncPSModule`` (+1 on the exactly-once counter in the same call). Reports
    ("step", rank, loss, started, finished) per acknowledged step, then ("done", rank, steps)."""
    import kvps_client as kc
    from kvps_client.torch import SyncPSModule

    torch.set_num_threads(1)  # a whole cluster shares the cores: one thread per worker
    with np.load(train_npz) as f:  # saved by the parent: importing scikit-learn here costs seconds
        Xtr, ytr = f["X"], f["y"]
    X, y = torch.from_numpy(Xtr), torch.from_numpy(ytr)
    model = make_model(cfg.seed)
    one = np.ones(1, np.float64)
    acked = 0
    if not go.wait(timeout=300):  # the cluster never came up: the demo has given up already
        return
    with kc.SyncClient(endpoints, token=token, seed=cfg.seed * 10 + rank, timeout=120) as ps:
        pm = SyncPSModule(model, ps, prefix=PREFIX, optimizer=kc.SGD(lr=cfg.lr),
                          max_staleness=cfg.staleness, job="demo", worker=f"worker-{rank}",
                          workers=cfg.workers, lease_s=30.0)
        for idx in batches(len(ytr), cfg, rank, cfg.workers):
            started = time.time()
            pm.pull()
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            pm.push(extra={COUNTER: one})  # the counter rides in the gradients' push call
            acked += 1
            out.put(("step", rank, loss.item(), started, time.time()))
        pm.close()
    out.put(("done", rank, acked))
