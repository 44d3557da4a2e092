"""ShardState against a plain dict/numpy model: creates, merged pushes with duplicates and retries,
compare-and-set, deletes, learning-rate schedule steps, snapshot -> restore -> continue, and user
snapshots restored later (values back, versions moved past every current one, duplicate table kept)."""
from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvps.command import CreateKey, CreateTable, DeleteKey, Hyperparams, Set, SnapshotStep
from kvps.delta import frame
from kvps.replica.snapshot_store import digest_of
from kvps.errors import InvalidRequest, KeyExists, KeyNotFound, PushExpired, Unavailable, VersionConflict
from kvps.initializer import Constant, Normal, Zeros, initializer_to_dict
from kvps.merge import PushRequest, merge
from kvps.placement import DenseLayout
from kvps.shard import ShardState

KEYS = ("a", "b", "c")  # one namespace for dense keys and tables: kinds collide on purpose
CLIENTS = ("x", "y", "z")
LR = 0.5  # SGD steps stay exact in float64 for gradients that are multiples of 1/4
OPTS = {False: {"name": "add"}, True: {"name": "sgd", "lr": LR}}
INITS = (Zeros(), Constant(0.25), Normal(std=0.5, seed=11))


def _step(value: np.ndarray, grad: np.ndarray, sgd: bool, lr: float) -> np.ndarray:
    return value - lr * grad if sgd else value + grad


class ShardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = ShardState(0, session_ttl=1e9)
        self.dense: dict[str, dict] = {}  # key -> {layout, sgd, blocks: {b: [value, version]}}
        self.tables: dict[str, dict] = {}  # key -> {dim, sgd, init, rows: {id: [value, version]}}
        self.results: dict[tuple[str, int], dict] = {}
        self.floors: dict[str, int] = {}
        self.last_seq: dict[str, int] = {}
        self.now = 0.0
        self.snaps: dict[str, tuple] = {}  # id -> (file frame, digest, dense model, table model)

    # ---- model helpers ------------------------------------------------------------------------

    def _version(self, key: str) -> int:
        if key in self.dense:
            return max((v for _, v in self.dense[key]["blocks"].values()), default=0)
        return max((v for _, v in self.tables[key]["rows"].values()), default=0)

    def _known(self, client: str, seq: int):
        if seq < self.floors.get(client, 0):
            return PushExpired
        return self.results.get((client, seq))

    def _record(self, entries: list[tuple[str, int, int, dict]]) -> None:
        for client, seq, _, result in entries:
            self.results[(client, seq)] = result
        for client, _, floor, _ in entries:
            self.floors[client] = max(self.floors.get(client, 0), floor)
        self.results = {(c, q): r for (c, q), r in self.results.items() if q >= self.floors.get(c, 0)}

    def _next_id(self, data, client: str) -> tuple[int, int]:
        """(seq, floor): a new seq, or sometimes a retry of an old one (maybe below the floor)."""
        last = self.last_seq.get(client, 0)
        if last and data.draw(st.booleans(), label="retry"):
            seq = data.draw(st.integers(1, last), label="retried seq")
        else:
            seq = self.last_seq[client] = last + 1
        return seq, data.draw(st.integers(max(0, seq - 2), seq), label="floor")

    @staticmethod
    def _check(got, want) -> None:
        if isinstance(want, type):
            assert isinstance(got, want), (got, want)
        else:
            assert got == want, (got, want)

    # ---- rules --------------------------------------------------------------------------------

    @initialize(sgd=st.booleans(), init=st.sampled_from(INITS), seed=st.integers(0, 2**16))
    def start_with_a_key_and_a_table(self, sgd, init, seed):
        self.create_dense("a", 5, 2, 2, {0, 2}, sgd, seed)
        self.create_table("b", 2, not sgd, init)

    @rule(key=st.sampled_from(KEYS), rows=st.integers(0, 5), cols=st.integers(1, 2),
          block_rows=st.integers(1, 3), owned=st.sets(st.integers(0, 4)), sgd=st.booleans(),
          seed=st.integers(0, 2**16))
    def create_dense(self, key, rows, cols, block_rows, owned, sgd, seed):
        layout = DenseLayout((rows, cols), "float64", block_rows)
        rng = np.random.default_rng(seed)
        blocks = tuple((b, rng.integers(-8, 8, layout.block_shape(b)) / 4.0)
                       for b in sorted(owned) if b < layout.n_blocks)
        got = self.s.apply(CreateKey(key, (rows, cols), "float64", block_rows, OPTS[sgd], "sum", blocks)).result
        if key in self.tables or (key in self.dense and (self.dense[key]["layout"], self.dense[key]["sgd"])
                                  != (layout, sgd)):
            self._check(got, KeyExists)
        elif key in self.dense:  # the same definition: blocks it lacks are added, others kept
            added = {b: [v, 0] for b, v in blocks if b not in self.dense[key]["blocks"]}
            self._check(got, {"created": bool(added)})
            self.dense[key]["blocks"].update(added)
        else:
            self._check(got, {"created": True})
            self.dense[key] = {"layout": layout, "sgd": sgd, "blocks": {b: [v, 0] for b, v in blocks},
                               "lr": LR, "hstep": None}

    @rule(key=st.sampled_from(KEYS), dim=st.integers(1, 3), sgd=st.booleans(), init=st.sampled_from(INITS))
    def create_table(self, key, dim, sgd, init):
        got = self.s.apply(CreateTable(key, dim, "float64", OPTS[sgd], initializer_to_dict(init), "sum")).result
        if key in self.dense or (key in self.tables and (self.tables[key]["dim"], self.tables[key]["sgd"],
                                                         self.tables[key]["init"]) != (dim, sgd, init)):
            self._check(got, KeyExists)
        elif key in self.tables:
            self._check(got, {"created": False})
        else:
            self._check(got, {"created": True})
            self.tables[key] = {"dim": dim, "sgd": sgd, "init": init, "rows": {}, "lr": LR, "hstep": None}

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key):
        existed = self.dense.pop(key, None) is not None or self.tables.pop(key, None) is not None
        self._check(self.s.apply(DeleteKey(key)).result, {"deleted": existed})

    @rule(key=st.sampled_from(KEYS + ("missing",)), step=st.integers(0, 6),
          lr=st.sampled_from([0.25, 0.5, 0.75]))  # multiples of 1/4: SGD stays exact
    def schedule(self, key, step, lr):
        got = self.s.apply(Hyperparams(key, step, {"lr": lr})).result
        entry = self.dense.get(key) or self.tables.get(key)
        if entry is None:
            self._check(got, KeyNotFound)
        elif not entry["sgd"]:
            self._check(got, InvalidRequest)  # Add has no lr
        elif entry["hstep"] is not None and step < entry["hstep"]:
            event("schedule: older step ignored")
            self._check(got, {"applied": False, "step": entry["hstep"], "values": {"lr": entry["lr"]}})
        else:
            event("schedule: applied")
            entry["lr"], entry["hstep"] = lr, step
            self._check(got, {"applied": True, "step": step, "values": {"lr": lr}})

    def _draw_request(self, data, client: str, rng) -> PushRequest | None:
        seq, floor = self._next_id(data, client)
        dense, rows = [], []
        keys = data.draw(st.sets(st.sampled_from(KEYS), min_size=1), label="keys")
        if data.draw(st.integers(0, 9), label="add a missing key") == 0:
            keys.add("missing")
        for key in sorted(keys):
            if key in self.dense:
                layout = self.dense[key]["layout"]
                for b in sorted(self.dense[key]["blocks"]):
                    if rng.random() < 0.8:
                        dense.append((key, b, rng.integers(-8, 8, layout.block_shape(b)) / 4.0))
            elif key in self.tables:
                ids = rng.integers(-3, 8, int(rng.integers(1, 5))).astype(np.int64)
                rows.append((key, ids, rng.integers(-8, 8, (len(ids), self.tables[key]["dim"])) / 4.0))
            elif key == "missing":
                dense.append((key, 0, np.zeros(1)))
        if not dense and not rows:
            return None
        return PushRequest(client, seq, floor, tuple(dense), tuple(rows))

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def push(self, data, seed):
        rng = np.random.default_rng(seed)
        clients = data.draw(st.lists(st.sampled_from(CLIENTS), min_size=1, max_size=3, unique=True), label="clients")
        reqs = [r for r in (self._draw_request(data, c, rng) for c in clients) if r is not None]
        if not reqs:
            return
        self.now += 1.0
        got = self.s.apply(merge(reqs, {}, now=self.now)).result["results"]
        assert set(got) == {(r.client, r.seq) for r in reqs}
        for (pid, result), want in zip(got.items(), self._model_push(reqs)):
            self._check(result, want)

    def _model_push(self, reqs: list[PushRequest]) -> list:
        known = [self._known(r.client, r.seq) for r in reqs]
        if any(k is not None for k in known):
            event("push: duplicate in entry")
            return [k if k is not None else Unavailable for k in known]
        bad = [any(k not in self.dense and k not in self.tables for k in r.keys()) for r in reqs]
        if any(bad):
            event("push: rejected")
            return [KeyNotFound if b else Unavailable for b in bad]
        dense, rows = {}, {}
        for r in reqs:
            for key, b, g in r.dense:
                total, count = dense.get((key, b), (0.0, 0))
                dense[(key, b)] = (total + g, count + 1)
            for key, ids, g in r.rows:
                seen = set()
                for i, row in zip(ids.tolist(), g):
                    total, count = rows.get((key, i), (0.0, 0))
                    rows[(key, i)] = (total + row, count + (i not in seen))
                    seen.add(i)
        for (key, b), (g, count) in dense.items():
            block = self.dense[key]["blocks"][b]
            block[:] = [_step(block[0], g, self.dense[key]["sgd"], self.dense[key]["lr"]), block[1] + count]
        for (key, i), (g, count) in rows.items():
            t = self.tables[key]
            value, version = t["rows"].get(i, (t["init"].rows(np.array([i]), t["dim"], "float64")[0], 0))
            t["rows"][i] = [_step(value, g, t["sgd"], t["lr"]), version + count]
        event(f"push: applied {len(reqs)} merged")
        results = [{"versions": {k: self._version(k) for k in r.keys()}} for r in reqs]
        self._record([(r.client, r.seq, r.floor, res) for r, res in zip(reqs, results)])
        return results

    @rule(data=st.data(), key=st.sampled_from(KEYS + ("missing",)), seed=st.integers(0, 2**16))
    def set(self, data, key, seed):
        rng = np.random.default_rng(seed)
        seq, floor = self._next_id(data, "setter")
        entry = self.dense.get(key)
        layout = entry["layout"] if entry else DenseLayout((2, 1), "float64", 1)
        blocks = tuple((b, rng.integers(-8, 8, layout.block_shape(b)) / 4.0)
                       for b in sorted(data.draw(st.sets(st.integers(0, layout.n_blocks - 1)), label="blocks")))
        expected = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="expected")
        if entry and blocks and all(b in entry["blocks"] for b, _ in blocks) and data.draw(st.booleans()):
            expected = entry["blocks"][blocks[0][0]][1]  # often the right version
        self.now += 1.0
        got = self.s.apply(Set(self.now, "setter", seq, floor, key, blocks, expected)).result
        self._check(got, self._model_set(key, seq, floor, blocks, expected))

    def _model_set(self, key, seq, floor, blocks, expected):
        known = self._known("setter", seq)
        if known is not None:
            return known
        if key not in self.dense and key not in self.tables:
            return KeyNotFound
        entry = self.dense.get(key)
        if entry is None or not blocks or any(b not in entry["blocks"] for b, _ in blocks):
            return InvalidRequest
        if expected is not None and any(entry["blocks"][b][1] != expected for b, _ in blocks):
            event("set: conflict")
            return VersionConflict
        event("set: applied")
        for b, value in blocks:
            entry["blocks"][b] = [value, entry["blocks"][b][1] + 1]
        result = {"versions": {key: self._version(key)}}
        self._record([("setter", seq, floor, result)])
        return result

    @rule()
    def snapshot_restore(self):
        data = self.s.snapshot()
        event("snapshot restored")
        self.s = ShardState.restore(data)
        assert self.s.snapshot() == data

    @rule()
    def user_snapshot(self):
        sid = f"s{len(self.snaps)}"
        assert self.s.apply(SnapshotStep("cut", sid, at=self.now)).result["cut"]
        blob = frame.encode(frame.KIND_SNAPSHOT, *self.s.snapshot_parts())  # what a replica writes
        digest = digest_of(blob[:frame.head_size(blob)])
        assert self.s.apply(SnapshotStep("seal", sid, at=self.now)).result["snapshot"]["state"] == "sealed"
        assert self.s.apply(SnapshotStep("commit", sid, digest=digest, size=len(blob))).result["snapshot"]["state"] == "complete"
        assert not self.s.apply(SnapshotStep("cut", sid, at=self.now)).result["cut"]  # a retried cut
        self.snaps[sid] = (blob, digest, copy.deepcopy(self.dense), copy.deepcopy(self.tables))

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def user_restore(self, data):
        sid = data.draw(st.sampled_from(sorted(self.snaps)), label="snapshot")
        blob, digest, dense, tables = self.snaps[sid]
        assert isinstance(self.s.apply_restore(SnapshotStep("restore", sid, digest="0" * 64),
                                               ShardState.restore(blob)).result, InvalidRequest)
        floor = 1 + max([self._version(k) for k in [*self.dense, *self.tables]], default=0)
        result = self.s.apply_restore(SnapshotStep("restore", sid, digest=digest),
                                      ShardState.restore(blob)).result
        event("user snapshot restored")
        assert result["version_floor"] == floor and result["keys"] == len(dense) + len(tables)
        self.dense, self.tables = copy.deepcopy(dense), copy.deepcopy(tables)
        for entry in self.dense.values():
            for block in entry["blocks"].values():
                block[1] += floor
        for entry in self.tables.values():
            for row in entry["rows"].values():
                row[1] += floor

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def state_matches_model(self):
        assert sorted(k["key"] for k in self.s.keys()) == sorted([*self.dense, *self.tables])
        for key, entry in [*self.dense.items(), *self.tables.items()]:
            want = None if entry["hstep"] is None else {"step": entry["hstep"], "values": {"lr": entry["lr"]}}
            assert self.s.describe(key).get("hyperparams") == want
        for key, entry in self.dense.items():
            blocks = sorted(entry["blocks"])
            assert self.s.describe(key)["blocks"] == blocks
            for (version, value), b in zip(self.s.read_blocks(key, blocks), blocks):
                assert version == entry["blocks"][b][1]
                np.testing.assert_allclose(value, entry["blocks"][b][0], rtol=1e-12, atol=1e-12)
        for key, t in self.tables.items():
            ids = np.array(sorted(t["rows"]) + [1000], dtype=np.int64)  # 1000: never touched
            values, versions = self.s.read_rows(key, ids)
            assert versions.tolist() == [t["rows"][i][1] for i in ids[:-1].tolist()] + [0]
            want = [t["rows"][i][0] for i in ids[:-1].tolist()] + [t["init"].rows(ids[-1:], t["dim"], "float64")[0]]
            np.testing.assert_allclose(values, np.array(want).reshape(values.shape), rtol=1e-12, atol=1e-12)
        for (client, seq), result in self.results.items():
            assert self.s.lookup_push(client, seq) == result


ShardMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    # No "explain" phase: on this machine it alone took minutes to annotate a failure.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_shard_state_machine = ShardMachine.TestCase
