"""Wall clocks that jump do not break exactly-once pushes or worker leases (kvps.clocks).

Every process of a real 3-node cluster runs with an LD_PRELOAD shim (``clock_shim.c``, compiled
here) that shifts its wall clock by the seconds in one file; the test writes +1 h or -1 h there
while the cluster runs, as an NTP step or a resumed VM would, and waits until every node and
replica answers with the shifted ``Date`` header. The monotonic clock is left alone, as a real
wall-clock step leaves it. Before the cluster time, the leader stamped its wall time into commands
and reads judged leases by the replica's wall clock: +1 h expired every exactly-once session (a
retried push applied twice) and every lease (the staleness bound broken); -1 h kept a dead
worker's lease alive for an hour (its job wedged)."""
from __future__ import annotations

import asyncio
import email.utils
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import dump_logs, wait_for

import kvps_client as kc
from kvps.config import ServerConfig
from kvps.node.local import LocalCluster

pytestmark = pytest.mark.cluster

HOUR = 3600.0


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the clock shim")
    out = tmp_path_factory.mktemp("shim") / "clock_shim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out),
                    str(Path(__file__).with_name("clock_shim.c")), "-ldl"], check=True)
    return out


@pytest.fixture(scope="module")
def jumpy(tmp_path_factory, shim):
    """A cluster whose wall clocks follow ``offset`` (seconds) in a file the test writes."""
    root = tmp_path_factory.mktemp("clock-jump")
    offset = root / "offset"
    offset.write_text("0\n")
    # sessions expire after 30 min: a 1 h jump of the stamped time would expire them
    c = LocalCluster(root / "cluster", nodes=3, shards=1,
                     server=ServerConfig(session_ttl=1800.0),
                     env={"LD_PRELOAD": str(shim), "KVPS_CLOCK_OFFSET_FILE": str(offset),
                          "KVPS_LOG_LEVEL": "info"})
    try:
        c.start(timeout=90)
        c.offset_file = offset
        yield c
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.stop()


def jump(cluster: LocalCluster, seconds: float) -> None:
    """Shift every process's wall clock to ``seconds`` off the real one; return once each node
    and replica answers with a ``Date`` that shows it."""
    cluster.offset_file.write_text(f"{seconds}\n")
    urls = [n.admin_url for n in cluster.cfg.nodes]
    urls += [r["data_url"] for s in cluster.cluster_map()["shards"] for r in s["replicas"]]

    def shifted() -> bool:
        for url in urls:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                    served = email.utils.parsedate_to_datetime(resp.headers["Date"]).timestamp()
            except OSError:  # a replica (re)starting: asked again on the next poll
                return False
            if abs(served - time.time() - seconds) > 5:
                return False
        return True
    wait_for(shifted, 20, f"every process's wall clock to be {seconds:+.0f} s off")


def run(coro):
    return asyncio.run(coro)


def test_a_retried_push_is_not_applied_twice_after_the_leaders_wall_clock_jumps_ahead(jumpy):
    jump(jumpy, 0)
    endpoints, token = jumpy.endpoints, jumpy.token

    async def scenario() -> float:
        async with kc.Client(endpoints, token, client_id="worker-a") as a:
            await a.create("count", np.zeros(4, np.float32), optimizer=kc.Add())
            await a.push({"count": np.ones(4, np.float32)})  # (worker-a, 1): applied
        jump(jumpy, HOUR)
        async with kc.Client(endpoints, token) as b:  # a later entry, stamped after the jump
            await b.push({"count": np.ones(4, np.float32)})
        # worker-a's retry of push 1 (a new client object with the same id starts at seq 1,
        # the same content: what a retry after a lost reply sends)
        async with kc.Client(endpoints, token, client_id="worker-a") as again:
            await again.push({"count": np.ones(4, np.float32)})
            return float((await again.pull(["count"]))["count"][0])
    assert run(scenario()) == 2.0  # worker-a once, the other client once


def test_a_dead_workers_lease_ends_on_time_after_the_wall_clock_jumps_back(jumpy):
    jump(jumpy, 0)
    endpoints, token = jumpy.endpoints, jumpy.token

    async def scenario() -> float:
        async with kc.Client(endpoints, token) as c:
            # taken before the tick is sent: the leader stamps the lease's start after this,
            # so an on-time end is at least 3 s later (taken after the reply, it can look early
            # by the reply's own latency)
            ticked = time.monotonic()
            await c.clock_tick("job-back", "dead", 5, lease_s=3.0)
            await c.clock_tick("job-back", "alive", 1, lease_s=60.0)
            assert "dead" in await c.clocks("job-back")  # its lease lives
            jump(jumpy, -HOUR)
            while "dead" in await c.clocks("job-back"):
                await c.clock_tick("job-back", "alive", 1, lease_s=60.0)  # the survivor renews
                if time.monotonic() - ticked > 30:
                    raise AssertionError("the dead worker's lease outlived its 3 s by 30 s: "
                                         "the job would wedge waiting for it")
            return time.monotonic() - ticked
    ended_after = run(scenario())
    assert 3.0 <= ended_after < 30


def test_a_live_workers_lease_holds_after_the_wall_clock_jumps_ahead(jumpy):
    """SSP's bound: the others wait for a worker whose lease lives. A jump ahead must not end it."""
    jump(jumpy, 0)
    endpoints, token = jumpy.endpoints, jumpy.token

    async def scenario() -> tuple[dict, dict]:
        async with kc.Client(endpoints, token) as c:
            await c.clock_tick("job-ahead", "slow", 2, lease_s=120.0)
            jump(jumpy, HOUR)
            after_read = await c.clocks("job-ahead")
            after_tick = await c.clock_tick("job-ahead", "fast", 9, lease_s=120.0)
            return after_read, after_tick
    after_read, after_tick = run(scenario())
    assert after_read == {"slow": 2}
    assert after_tick == {"fast": 9, "slow": 2}
