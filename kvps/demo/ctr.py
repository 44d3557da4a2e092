"""The ``--task ctr`` training task: click-through prediction on synthetic clicks from a known truth.

Truth (seeded): every user and item has a hidden vector and every item a bias; a user clicks an
item with probability ``sigmoid(2 <u, v> + b_item - 1)``. Impressions pair a user and an item,
each drawn popular-first (Zipf 1.2 over 10,000 users and 4,000 items: a long tail of ids seen a
few times, as in recommendation data; ``caps`` bound the tables at a fraction of them). The model
learns its own user and item embeddings (kvps tables, row-wise Adagrad, pooled by
``EmbeddingBagCollection``: one id per bag here) and an MLP over
``[u, v, u * v]`` (a ``PSModule``, Adagrad on the server). The baseline trains the same model on
the same batches in one process: the same initial rows (the tables' initializer is a pure
function of seed and id), the same optimizer code (``kvps.optimizer``) for the rows.
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

from kvps.initializer import Normal
from kvps.optimizer import RowWiseAdagrad

__all__ = ["CtrConfig", "CtrData", "CtrModel", "LocalBags", "QUICK", "auc", "baseline", "batches",
           "click_probability", "ctr_worker", "distinct_ids", "make_data", "make_model", "predict"]

PREFIX = "ctr/"
COUNTER = "demo/ctr-steps"  # Add counter: +1 per acknowledged step (exactly-once check)
TABLES = {"user": "ctr/users", "item": "ctr/items"}


@dataclass(frozen=True)
class CtrConfig:
    users: int = 10_000
    items: int = 4_000
    zipf: float = 1.2        # users and items are drawn popular-first: p(rank r) ~ r ** -zipf
    truth_dim: int = 8       # the hidden vectors' dimension
    dim: int = 16            # the model's embedding dimension
    train: int = 60_000      # impressions
    test: int = 5_000
    batch: int = 256
    epochs: int = 5
    emb_lr: float = 0.2      # row-wise Adagrad on the tables
    mlp_lr: float = 0.05     # Adagrad on the MLP
    workers: int = 3
    staleness: int | None = 4
    seed: int = 0
    caps: tuple[int, int] | None = None  # max_rows of the user and item tables (None: unbounded)
    evict: str = "lfu"

    def table_spec(self, feature: str) -> dict:
        """The kvps table spec of ``feature`` ("user" or "item"), its cap included."""
        spec = {"table": TABLES[feature], "dim": self.dim, "optimizer": self.row_optimizer(),
                "init": self.init(feature)}
        if self.caps is not None:
            spec.update(max_rows=self.caps[0 if feature == "user" else 1], evict=self.evict)
        return spec

    def total_steps(self) -> int:
        return sum(1 for r in range(self.workers) for _ in batches(self, r, self.workers))

    def row_optimizer(self) -> RowWiseAdagrad:
        return RowWiseAdagrad(lr=self.emb_lr)

    def init(self, table: str) -> Normal:
        return Normal(std=0.1, seed=self.seed * 10 + (1 if table == "user" else 2))


QUICK = CtrConfig(users=200, items=400, zipf=0.8, train=8000, test=3000, epochs=2)  # ~60 steps: a smoke test

CtrData = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# users_train, items_train, clicks_train, users_test, items_test, clicks_test


def _truth(cfg: CtrConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hidden user vectors, item vectors and item biases."""
    rng = np.random.default_rng([cfg.seed, 7])
    scale = cfg.truth_dim ** -0.25  # <u, v> has variance 1
    u = rng.standard_normal((cfg.users, cfg.truth_dim)) * scale
    v = rng.standard_normal((cfg.items, cfg.truth_dim)) * scale
    return u, v, rng.normal(0.0, 0.5, cfg.items)


def click_probability(cfg: CtrConfig, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    u, v, bias = _truth(cfg)
    return 1.0 / (1.0 + np.exp(-(2.0 * (u[users] * v[items]).sum(1) + bias[items] - 1.0)))


def _popularity(count: int, zipf: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** zipf
    return weights / weights.sum()


def distinct_ids(data: CtrData) -> tuple[int, int]:
    """Distinct users and items in the training impressions (what a cap is a fraction of)."""
    return len(np.unique(data[0])), len(np.unique(data[1]))


def make_data(cfg: CtrConfig) -> CtrData:
    rng = np.random.default_rng([cfg.seed, 8])
    n = cfg.train + cfg.test
    users, items = (rng.choice(count, size=n, p=_popularity(count, cfg.zipf)).astype(np.int64)
                    for count in (cfg.users, cfg.items))
    clicks = (rng.random(n) < click_probability(cfg, users, items)).astype(np.float32)
    t = cfg.train
    return users[:t], items[:t], clicks[:t], users[t:], items[t:], clicks[t:]


def batches(cfg: CtrConfig, rank: int, workers: int) -> Iterator[np.ndarray]:
    """Worker ``rank``'s index batches (workers=1: all of them, as the baseline sees them)."""
    share = np.random.default_rng([cfg.seed, 11]).permutation(cfg.train)[rank::workers]
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([cfg.seed, rank, epoch]).permutation(share)
        for start in range(0, len(order), cfg.batch):
            yield order[start:start + cfg.batch]


class CtrModel(nn.Module):
    def __init__(self, bags: nn.Module, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every worker builds the baseline's initial MLP
        self.bags = bags
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    @staticmethod
    def features(users: np.ndarray, items: np.ndarray) -> dict:
        one = torch.arange(len(users))  # one id per bag
        return {"user": (torch.from_numpy(users), one), "item": (torch.from_numpy(items), one)}

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.bags(batch)
        u, v = out["user"], out["item"]  # (B, dim) each
        return self.mlp(torch.cat([u, v, u * v], dim=1)).squeeze(1)  # (B,) logits


def make_model(cfg: CtrConfig, bags: nn.Module) -> CtrModel:
    return CtrModel(bags, cfg.dim, cfg.seed)


class LocalBags(nn.Module):
    """The baseline's tables: numpy rows stepped by the server's own optimizer code."""

    def __init__(self, cfg: CtrConfig) -> None:
        super().__init__()
        self.opt = cfg.row_optimizer()
        self.rows = {f: cfg.init(f).rows(np.arange(n), cfg.dim, np.float32)
                     for f, n in (("user", cfg.users), ("item", cfg.items))}
        self.state = {f: self.opt.init_state(r) for f, r in self.rows.items()}
        self.steps = {f: np.zeros(len(r), np.int64) for f, r in self.rows.items()}
        self._leaves: dict[str, tuple[np.ndarray, torch.Tensor]] = {}

    def forward(self, batch: dict) -> dict:
        out = {}
        for f, (ids, _) in batch.items():
            uniq, inverse = np.unique(ids.numpy(), return_inverse=True)
            leaf = torch.from_numpy(self.rows[f][uniq].copy()).requires_grad_(torch.is_grad_enabled())
            if torch.is_grad_enabled():
                self._leaves[f] = (uniq, leaf)
            out[f] = leaf[torch.from_numpy(inverse.reshape(-1))]  # (B, dim): one id per bag
        return out

    def step(self) -> None:
        for f, (ids, leaf) in self._leaves.items():
            state = {k: v[ids] for k, v in self.state[f].items()}
            new, state = self.opt.step(self.rows[f][ids], leaf.grad.numpy(), state, self.steps[f][ids] + 1)
            self.rows[f][ids] = new
            for k, v in state.items():
                self.state[f][k][ids] = v
            self.steps[f][ids] += 1
        self._leaves = {}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score(labels, scores))


def predict(model: CtrModel, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(CtrModel.features(users, items)).numpy()


def baseline(cfg: CtrConfig, data: CtrData) -> tuple[float, list[float]]:
    """One process, no parameter server, no faults: (test AUC, loss per step)."""
    torch.set_num_threads(1)
    utr, itr, ytr, ute, ite, yte = data
    model = make_model(cfg, LocalBags(cfg))
    opt = torch.optim.Adagrad(model.mlp.parameters(), lr=cfg.mlp_lr)
    losses = []
    for idx in batches(cfg, 0, 1):
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(CtrModel.features(utr[idx], itr[idx])), torch.from_numpy(ytr[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.bags.step()
        losses.append(loss.item())
    return auc(predict(model, ute, ite), yte), losses


def ctr_worker(rank: int, cfg: CtrConfig, train_npz: str, endpoints: list[str], token: str,
               out: mp.Queue, go: Any) -> None:
    """A worker process (``run.Workers`` starts it): pull, forward, backward, push through
    ``SyncPSModule``; the next batch's rows are prefetched during the current step."""
    import kvps_client as kc
    from kvps_client.torch import EmbeddingBagCollection, SyncPSModule

    torch.set_num_threads(1)
    with np.load(train_npz) as f:
        users, items, clicks = f["users"], f["items"], f["clicks"]
    one, acked = np.ones(1, np.float64), 0
    if not go.wait(timeout=300):
        return
    with kc.SyncClient(endpoints, token=token, seed=cfg.seed * 10 + rank, timeout=120) as ps:
        model = make_model(cfg, EmbeddingBagCollection(ps, {f: cfg.table_spec(f) for f in TABLES}))
        pm = SyncPSModule(model, ps, prefix=PREFIX, optimizer=kc.Adagrad(lr=cfg.mlp_lr),
                          max_staleness=cfg.staleness, job="demo-ctr", worker=f"worker-{rank}",
                          workers=cfg.workers, lease_s=30.0)
        plan = list(batches(cfg, rank, cfg.workers))
        for step, idx in enumerate(plan):
            started = time.time()
            pm.pull()
            loss = nn.functional.binary_cross_entropy_with_logits(
                model(CtrModel.features(users[idx], items[idx])), torch.from_numpy(clicks[idx]))
            if step + 1 < len(plan):  # the next rows travel while this step computes and pushes
                nxt = plan[step + 1]
                model.bags.prefetch(CtrModel.features(users[nxt], items[nxt]))
            loss.backward()
            pm.push(extra={COUNTER: one})
            acked += 1
            out.put(("step", rank, loss.item(), started, time.time()))
        pm.close()
    out.put(("done", rank, acked))
