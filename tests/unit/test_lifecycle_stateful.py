"""A table's row lifecycle (cap with LRU or LFU eviction, time-to-live, count or probability
admission) in ShardState against a plain-Python model of the same rules, including
snapshot -> restore -> continue. The model keeps dicts and sorts with Python tuples; the table keeps
numpy arrays, a hash index and partitions, so agreement checks both the rules and the machinery."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvps.command import CreateTable, Push, PushId, RowDelta
from kvps.initializer import Normal, initializer_to_dict
from kvps.shard import ShardState

M64 = (1 << 64) - 1
INIT = Normal(std=0.5, seed=7)
IDS = range(-2, 14)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _admitted_by_hash(seed: int, i: int, p: float) -> bool:
    return (_splitmix64(_splitmix64(seed) ^ (i & M64)) >> 11) < p * 2.0**53


def _init(i: int) -> np.ndarray:
    return INIT.rows(np.array([i], np.int64), 2, np.dtype("float64"))[0]


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(evict=st.sampled_from(["lru", "lfu"]), cap=st.one_of(st.none(), st.integers(1, 6)),
                shards=st.integers(1, 3), ttl=st.one_of(st.none(), st.sampled_from([1.0, 2.5, 6.0])),
                admit=st.one_of(st.none(), st.integers(1, 3).map(lambda m: ("count", m)),
                                st.tuples(st.just("probability"), st.sampled_from([0.3, 0.7]),
                                          st.integers(0, 2**20))))
    def create(self, evict, cap, shards, ttl, admit):
        self.max_rows = None if cap is None else cap * shards - (shards - 1)  # ceil(.../shards) == cap
        self.cap, self.evict, self.ttl, self.admit = cap, evict, ttl, admit
        admit_dict = (None if admit is None else {"name": "count", "min_count": admit[1]} if admit[0] == "count"
                      else {"name": "probability", "p": admit[1], "seed": admit[2]})
        life = {"max_rows": self.max_rows, "shards": shards, "evict": evict, "ttl_s": ttl, "admit": admit_dict}
        self.s = ShardState(0, session_ttl=1e9)
        cmd = CreateTable("e", 2, "float64", {"name": "add"}, initializer_to_dict(INIT), "sum", life)
        assert self.s.apply(cmd).result == {"created": True}
        self.rows: dict[int, dict] = {}  # id -> value, version, last, count
        self.pending: dict[int, tuple[int, float]] = {}  # id -> (count, last)
        self.floor = 0
        self.now = 0.0
        self.seq = 0

    def _admits(self, i: int, total: int) -> bool:
        if self.admit is None:
            return True
        if self.admit[0] == "count":
            return total >= self.admit[1]
        return _admitted_by_hash(self.admit[2], i, self.admit[1])

    def _model_push(self, ids: list[int], grads: np.ndarray, counts: list[int]) -> None:
        now = self.now
        pushed = set()
        for i, g, c in zip(ids, grads, counts):
            if i in self.rows:
                r = self.rows[i]
                r.update(value=r["value"] + g, version=r["version"] + c, last=now, count=r["count"] + c)
                pushed.add(i)
                continue
            total = self.pending.get(i, (0, 0.0))[0] + c
            if self._admits(i, total):
                self.pending.pop(i, None)
                n = total if self.admit is not None and self.admit[0] == "count" else c
                self.rows[i] = {"value": _init(i) + g, "version": self.floor + c, "last": now, "count": n}
                pushed.add(i)
            elif self.admit[0] == "count":
                self.pending[i] = (total, now)
        gone = [i for i, r in self.rows.items() if self.ttl is not None and now - r["last"] > self.ttl]
        alive = [i for i in self.rows if i not in gone]
        if self.cap is not None and len(alive) > self.cap:
            def order(i):
                r = self.rows[i]
                return ((i in pushed, r["count"], r["last"], i) if self.evict == "lfu"
                        else (i in pushed, r["last"], i))
            gone += sorted(alive, key=order)[:len(alive) - self.cap]
        if gone:
            self.floor = max(self.floor, max(self.rows[i]["version"] for i in gone) + 1)
            for i in gone:
                del self.rows[i]
        if self.admit is not None and self.admit[0] == "count":
            self.pending = {i: v for i, v in self.pending.items() if self.ttl is None or now - v[1] <= self.ttl}
            if self.cap is not None and len(self.pending) > self.cap:
                drop = sorted(self.pending, key=lambda i: (self.pending[i][1], i))[:len(self.pending) - self.cap]
                for i in drop:
                    del self.pending[i]

    @rule(ids=st.sets(st.sampled_from(IDS), min_size=1, max_size=5), dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
          seed=st.integers(0, 2**16))
    def push(self, ids, dt, seed):
        rng = np.random.default_rng(seed)
        ids = sorted(ids)
        grads = rng.integers(-8, 8, (len(ids), 2)) / 4.0
        counts = rng.integers(1, 3, len(ids))
        self.now += dt
        self.seq += 1
        cmd = Push(self.now, (PushId("c", self.seq, self.seq, ("e",)),), (),
                   (RowDelta("e", np.array(ids, np.int64), grads, counts.astype(np.int64)),))
        got = self.s.apply(cmd).result
        assert isinstance(got, dict), got
        self._model_push(ids, grads, counts.tolist())

    @rule()
    def snapshot_restore_continue(self):
        data = self.s.snapshot()
        self.s = ShardState.restore(data)
        assert self.s.snapshot() == data

    @invariant()
    def table_matches_model(self):
        if not hasattr(self, "s"):
            return
        ids = np.array(list(IDS), np.int64)
        values, versions = self.s.read_rows("e", ids)
        for i, v, ver in zip(ids.tolist(), values, versions.tolist()):
            r = self.rows.get(i)
            want = (r["value"], r["version"]) if r is not None else (_init(i), self.floor)
            assert np.array_equal(v, want[0]) and ver == want[1], (i, v, ver, want)
        info = self.s.describe("e")
        assert info["rows"] == len(self.rows) and info["pending"] == len(self.pending)
        assert info["floor"] == self.floor
        if self.cap is not None:
            assert info["rows"] <= self.cap


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
