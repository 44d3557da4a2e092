"""Worker clocks (SSP/BSP): the replicated clock table, its command, its place in the shard state
and its snapshot, and the client-side ``StepClock`` decision and lease renewal (no network)."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

import kvps_client as kc
from kvps.clocks import ClockTable, ClusterTime
from kvps.command import ClockTick, CreateKey, decode_command
from kvps.errors import CodecError, InvalidRequest
from kvps.merge import PushRequest, merge
from kvps.shard import ShardState


def test_tick_records_steps_and_returns_live_clocks():
    t = ClockTable()
    assert t.tick(10.0, "job", "a", 0, 5.0) == {"a": 0}
    assert t.tick(11.0, "job", "b", 3, 5.0) == {"a": 0, "b": 3}
    assert t.tick(12.0, "other", "a", 7, 5.0) == {"a": 7}  # jobs are independent
    assert t.live("job", 12.0) == {"a": 0, "b": 3}


def test_steps_never_go_back_while_the_lease_lives():
    t = ClockTable()
    t.tick(1.0, "j", "a", 5, 10.0)
    assert t.tick(2.0, "j", "a", 4, 10.0) == {"a": 5}  # a late retry of an older tick
    assert t.tick(3.0, "j", "a", 6, 10.0) == {"a": 6}


def test_leases_expire_by_command_time_and_renew():
    t = ClockTable()
    t.tick(0.0, "j", "dead", 1, 2.0)
    t.tick(0.0, "j", "live", 1, 2.0)
    t.tick(1.5, "j", "live", 2, 2.0)  # renewed until 3.5
    assert t.live("j", 1.9) == {"dead": 1, "live": 2}
    assert t.live("j", 2.0) == {"live": 2}  # a lease ending exactly now has ended
    assert t.tick(2.5, "j", "live", 3, 2.0) == {"live": 3}
    assert "dead" not in t.jobs["j"]  # forgotten, not just hidden
    t.tick(100.0, "k", "x", 0, 1.0)
    assert list(t.jobs) == ["k"]  # expiry sweeps every job: memory stays bounded


def test_zero_lease_removes_the_worker():
    t = ClockTable()
    t.tick(0.0, "j", "a", 4, 10.0)
    t.tick(0.0, "j", "b", 1, 10.0)
    assert t.tick(1.0, "j", "b", 1, 0.0) == {"a": 4}
    assert t.tick(1.0, "j", "a", 4, 0.0) == {} and t.jobs == {}


def test_clock_tick_round_trips_and_rejects_bad_fields():
    cmd = ClockTick(12.5, "job/x", "worker-1", 42, 7.5)
    data = cmd.to_bytes()
    assert decode_command(data) == cmd and decode_command(data).to_bytes() == data
    for bad in [lambda: ClockTick(1.0, "", "w", 0, 1.0), lambda: ClockTick(1.0, "j", "", 0, 1.0),
                lambda: ClockTick(1.0, "j", "w", -1, 1.0), lambda: ClockTick(1.0, "j", "w", 0, -1.0),
                lambda: ClockTick(1.0, "j", "w", 0, float("nan")), lambda: ClockTick(1.0, "j", "w", 0, 1e9),
                lambda: ClockTick(float("inf"), "j", "w", 0, 1.0), lambda: ClockTick(1.0, "j", "w", True, 1.0)]:
        with pytest.raises(InvalidRequest):
            bad()


def _random_log(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    log = [CreateKey("w", (4,), "float32", 4, {"name": "add"}, "sum", ((0, np.zeros(4, np.float32)),)).to_bytes()]
    now = 0.0
    for seq in range(1, 200):
        now += rng.random()
        if rng.random() < 0.6:
            log.append(ClockTick(now, rng.choice("jk"), rng.choice("abcd"), rng.randrange(50),
                                 rng.choice([0.0, 1.0, 5.0])).to_bytes())
        else:
            req = PushRequest("c", seq, seq, (("w", 0, np.float32(np.ones(4) * rng.random())),), ())
            log.append(merge([req], {}, now=now).to_bytes())
    return log


def test_same_log_gives_identical_snapshots_with_clocks_also_after_restore():
    log = _random_log(seed=7)
    a, b = ShardState(1), ShardState(1)
    half = len(log) // 2
    for data in log[:half]:
        a.apply(decode_command(data)).result
        b.apply(decode_command(data)).result
    assert a.snapshot() == b.snapshot() and a._clocks.jobs  # the log left live clocks behind
    c = ShardState.restore(a.snapshot())
    assert c.snapshot() == a.snapshot()
    for data in log[half:]:
        ra, rc = a.apply(decode_command(data)).result, c.apply(decode_command(data)).result
        b.apply(decode_command(data)).result
        assert ra == rc
    assert a.snapshot() == b.snapshot() == c.snapshot()
    assert a.state_hash() == c.state_hash()


def test_shard_apply_and_read_clocks():
    s = ShardState(0)
    before = s.snapshot()
    assert s.apply(ClockTick(10.0, "j", "a", 2, 5.0)).result == {"clocks": {"a": 2}}
    assert s.clocks("j", 14.9) == {"a": 2} and s.clocks("j", 15.0) == {}
    assert s.snapshot() != before  # the clocks are part of the replicated state
    assert isinstance(s.apply(ClockTick.__new__(ClockTick)).result, InvalidRequest)  # never raises
    s.apply(ClockTick(11.0, "j", "a", 2, 0.0)).result
    from kvps.delta import frame
    meta = frame.decode(s.snapshot()).meta
    assert "clocks" not in meta and meta["time"] == 11.0  # no clocks left; the time stays
    assert frame.decode(before).meta.keys() == meta.keys() - {"time"}
    s.apply(ClockTick(3.0, "j", "b", 1, 5.0)).result  # a stamp from behind: time does not go back
    assert s.time == 11.0 and s.clocks("j", 15.9) == {"b": 1} and s.clocks("j", 16.0) == {}


def test_cluster_time_follows_applied_stamps_and_monotonic_time_never_a_wall_clock():
    mono = [100.0]
    t = ClusterTime(lambda: mono[0])
    assert t.now() == 0.0
    mono[0] += 2.5
    assert t.now() == 2.5  # a new shard's time is the time since its replica started
    t.applied(1000.0)  # an entry stamped by a leader whose time is far ahead of ours
    assert t.now() == 1000.0
    mono[0] += 1.0
    assert t.now() == 1001.0
    t.applied(1000.5)  # our own stamp, applied a commit later: the estimate does not go back
    assert t.now() == 1001.0


def test_corrupt_clocks_in_a_snapshot_are_codec_errors():
    from kvps.delta import frame
    s = ShardState(0)
    s.apply(ClockTick(1.0, "j", "a", 2, 5.0)).result
    f = frame.decode(s.snapshot())
    bad = frame.encode(frame.KIND_SNAPSHOT, {**f.meta, "clocks": [["j", [["a", "two", 6.0]]]]}, f.arrays)
    with pytest.raises(CodecError):
        ShardState.restore(bad)


# ---- StepClock: the client-side decision, with a fake client ------------------------------------

class FakeClocks:
    """The server's clock table behind ``clock_tick``/``clocks``, with a settable time."""

    def __init__(self) -> None:
        self.table = ClockTable()
        self.now = 0.0
        self.ticks: list[tuple[str, int, float]] = []

    async def clock_tick(self, job, worker, step, *, lease_s):
        self.ticks.append((worker, step, lease_s))
        return self.table.tick(self.now, job, worker, step, lease_s)

    async def clocks(self, job):
        return self.table.live(job, self.now)


def test_step_clock_rules():
    fake = FakeClocks()
    ssp = kc.StepClock(fake, "j", "a", max_staleness=2)
    bsp = kc.StepClock(fake, "j", "a", max_staleness=0)
    free = kc.StepClock(fake, "j", "a", max_staleness=None)
    for clock, step, ok in [(ssp, 5, {3: True, 2: False}), (bsp, 5, {5: True, 4: False}),
                            (free, 5, {0: True})]:
        clock.step = step
        for slowest, allowed in ok.items():
            assert clock.may_start({"a": step, "b": slowest}) is allowed
    with pytest.raises(InvalidRequest):
        kc.StepClock(fake, "j", "a", max_staleness=-1)


def test_a_waiting_worker_renews_its_lease_and_proceeds_when_the_slow_one_expires():
    fake = FakeClocks()
    sleeps: list[float] = []

    async def sleep(dt):  # virtual time: the server's clock and the worker's advance together
        sleeps.append(dt)
        fake.now += dt

    async def main():
        slow = kc.StepClock(fake, "j", "slow", max_staleness=0, lease_s=3.0)
        fast = kc.StepClock(fake, "j", "fast", max_staleness=0, lease_s=3.0, sleep=sleep,
                            monotonic=lambda: fake.now)
        await slow.start()
        await fast.start()
        await fast.tick()  # fast has done 1 step, slow 0: BSP makes fast wait
        return await fast.wait(), fast

    clocks, fast = asyncio.run(main())
    assert clocks == {"fast": 1}  # released by the slow worker's lease ending, not by its progress
    assert fake.now >= 3.0 and fast.polls > 10
    renewals = [t for t in fake.ticks if t[0] == "fast" and t[1] == 1]
    assert len(renewals) >= 2  # it renewed its own lease while it waited (lease 3 s, every ~1 s)


def test_a_worker_joining_a_running_job_starts_at_the_slowest_live_step():
    fake = FakeClocks()

    async def main():
        a = kc.StepClock(fake, "j", "a", max_staleness=0, lease_s=5.0)
        b = kc.StepClock(fake, "j", "b", max_staleness=0, lease_s=5.0)
        await a.start()
        await b.start()
        for _ in range(7):
            await a.tick()
        for _ in range(6):
            await b.tick()
        late = kc.StepClock(fake, "j", "late", max_staleness=0, lease_s=5.0)
        await late.start()
        return b, late

    b, late = asyncio.run(main())
    assert late.step == 6 and ("late", 6, 5.0) in fake.ticks and ("late", 0, 5.0) not in fake.ticks
    live = fake.table.live("j", fake.now)
    assert late.may_start(live)  # it takes part in the next barrier ...
    assert b.may_start(live)     # ... and holds nobody back (registered at 0, b would wait for it)
