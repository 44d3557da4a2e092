"""Training consistency modes on a real cluster, three workers in one event loop: bounded
staleness (SSP) never lets a worker run more than s steps ahead, synchronous (BSP) runs in
lockstep, and a dead worker's lease ends so the others go on.

Every clock tick a worker sends is logged *before* it is sent, and every step start after the
worker was allowed to begin it; the loop is single-threaded, so the log's order is a true order:
a start can only follow the ticks that allowed it.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from torch import nn

import kvps_client as kc
from conftest import module_cluster
from kvps.node.local import wait_until
from kvps.placement import block_shard
from kvps_client.torch import PSModule

pytestmark = pytest.mark.cluster
WORKERS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from module_cluster(tmp_path_factory, "consistency", shards=2)


def _log_ticks(ps: kc.Client, worker: int, log: list) -> None:
    send = ps.clock_tick

    async def clock_tick(job, name, step, *, lease_s):
        log.append(("tick", worker, step, lease_s, time.time()))
        return await send(job, name, step, lease_s=lease_s)
    ps.clock_tick = clock_tick  # type: ignore[method-assign]


async def _worker(cluster, rank: int, job: str, staleness: int, steps: int, log: list, *,
                  compute_s: float, lease_s: float = 10.0, die_after: int | None = None) -> PSModule:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    rng = random.Random(rank)
    g = torch.Generator().manual_seed(rank)
    async with kc.Client(cluster.endpoints, token=cluster.token, seed=rank) as ps:
        _log_ticks(ps, rank, log)
        pm = PSModule(model, ps, prefix=job + "/", optimizer=kc.SGD(lr=0.01), max_staleness=staleness,
                      job=job, worker=f"w{rank}", workers=WORKERS, lease_s=lease_s)
        for t in range(steps):
            if t == die_after:
                return pm  # gone without a word: no leave, no more ticks
            await pm.pull()
            log.append(("start", rank, t, time.time()))
            x = torch.randn(8, 4, generator=g)
            nn.functional.mse_loss(model(x).squeeze(1), x.sum(1)).backward()
            await asyncio.sleep(rng.uniform(0.5, 1.0) * compute_s)  # simulated compute time
            versions = await pm.push()
            log.append(("pushed", rank, t, min(versions.values())))
        await pm.close()
    return pm


def _leads(log: list) -> list[int]:
    """For every step start: how far the starting worker was ahead of the slowest live worker."""
    reported: dict[int, int] = {}
    left: set[int] = set()
    leads = []
    for event in log:
        if event[0] == "tick":
            _, w, step, lease_s, _ = event
            if lease_s == 0:
                left.add(w)
            reported[w] = max(step, reported.get(w, 0))
        elif event[0] == "start":
            _, w, t, _ = event
            assert len(reported) == WORKERS, "a worker started before everyone joined"
            others = [s for v, s in reported.items() if v != w and v not in left]
            leads.append(t - min(others, default=t))  # everyone else finished: no one to wait for
    return leads


def _run(cluster, job: str, staleness: int, steps: int, compute: list[float], per_worker=None):
    log: list = []

    async def main():
        async with asyncio.timeout(60):  # a clock that never releases fails here, not at pytest's limit
            return await asyncio.gather(*(
                _worker(cluster, r, job, staleness, steps, log, compute_s=compute[r],
                        **(per_worker or {}).get(r, {}))
                for r in range(WORKERS)))
    return asyncio.run(main()), log


def test_bounded_staleness_never_lets_a_worker_run_more_than_s_steps_ahead(cluster):
    s = 2
    # worker 0 is slow by far more than a step of the others takes, also on a loaded machine
    pms, log = _run(cluster, "ssp", s, 12, compute=[0.3, 0.0, 0.0])
    leads = _leads(log)
    assert max(leads) == s  # the fast workers ran ahead up to the bound ...
    assert all(pm.clock.polls > 0 for pm in pms[1:])  # ... and were made to wait there
    assert all(pm.steps == 12 for pm in pms)


def test_synchronous_mode_runs_in_lockstep(cluster):
    pms, log = _run(cluster, "bsp", 0, 8, compute=[0.04, 0.0, 0.01])
    assert max(_leads(log)) == 0
    # Every worker's push of step t lands after all pushes of steps < t and before any of t + 1.
    for _, _, t, version in (e for e in log if e[0] == "pushed"):
        assert WORKERS * t < version <= WORKERS * (t + 1)
    assert all(pm.steps == 8 for pm in pms)


def test_a_dead_workers_lease_ends_and_unblocks_the_others(cluster):
    lease = 1.5
    pms, log = _run(cluster, "dead", 0, 6, compute=[0.0, 0.0, 0.0],
                    per_worker={2: {"lease_s": lease, "die_after": 2}})
    last_tick = max(e[4] for e in log if e[0] == "tick" and e[1] == 2)
    blocked = [e for e in log if e[0] == "start" and e[2] == 3]  # the first step the dead one never reached
    assert sorted(e[1] for e in blocked) == [0, 1]
    assert all(e[3] >= last_tick + lease for e in blocked)  # released by the lease's end, not earlier
    assert [pm.steps for pm in pms] == [6, 6, 2]
    assert all(pm.clock.polls > 0 for pm in pms[:2])


def test_clocks_survive_a_kill_of_their_shards_leader(cluster):
    """The clocks are replicated state: a new leader answers with the clocks the old one held."""
    shard = block_shard("__clock/failover", 0, cluster.cfg.shards)

    async def tick():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            await ps.clock_tick("failover", "a", 7, lease_s=120)
            return await ps.clock_tick("failover", "b", 3, lease_s=120)

    async def read():
        async with kc.Client(cluster.endpoints, token=cluster.token, seed=0) as ps:
            return await ps.clocks("failover")

    assert asyncio.run(tick()) == {"a": 7, "b": 3}
    old = wait_until(lambda: cluster.leader(shard), 30, "a serving leader")
    cluster.kill_replica(old)
    # A newer term: right after the kill the node's view may pair the restarted pid with the old role.
    wait_until(lambda: (cluster.leader(shard) or {}).get("term", 0) > old["term"], 30, "a new leader")
    assert asyncio.run(read()) == {"a": 7, "b": 3}
