"""The chaos harness's checks, schedule planning and delay proxy, without a cluster."""
from __future__ import annotations

import asyncio
import math
import socket

import pytest

from kvps_chaos import checks
from kvps_chaos.linearizability import UNKNOWN, Operation
from kvps_chaos.proxy import DelayTable, _pump
from kvps_chaos.runner import ChaosOptions, plan_faults
from kvps_chaos.workloads import CounterTally, OpRecord, key_on_shard
from kvps.placement import block_shard


def tally(acked, unknown=0):
    return CounterTally(acked=acked, unknown=unknown)


@pytest.mark.parametrize("acked,unknown,value,lost,twice", [
    (10, 0, 10, 0, 0),
    (10, 3, 12, 0, 0),    # two of three unknown-outcome pushes applied: fine
    (10, 3, 10, 0, 0),    # none applied: fine
    (10, 0, 9, 1, 0),     # an acknowledged push is missing
    (10, 2, 13, 0, 1),    # more than acked + unknown: something applied twice
])
def test_counter_bounds(acked, unknown, value, lost, twice):
    res = checks.counter_check({"c": tally(acked, unknown)}, {"c": (float(value), value)})
    assert (res["lost"], res["applied_twice"]) == (lost, twice)
    assert res["ok"] == (lost == 0 and twice == 0)


def test_counter_verdict_is_unknown_when_the_counters_cannot_be_read():
    res = checks.counter_check({"c": tally(5, 1)}, None)
    assert res["ok"] is None and res["acked"] == 5 and res["lost"] is None


def test_counter_value_must_match_version():
    res = checks.counter_check({"c": tally(5)}, {"c": (5.0, 6)})
    assert not res["ok"]


def test_monotonic_reads_catch_a_version_going_back():
    def read(client, version, t):
        return Operation(client, ("read", None), (0.0, version), t, t + 0.1, "r")
    good = [read("a", 1, 0), read("a", 1, 1), read("a", 2, 2), read("b", 1, 3)]
    assert checks.monotonic_reads(good, {}, {})["ok"]
    bad = good + [read("a", 1, 4)]
    res = checks.monotonic_reads(bad, {}, {})
    assert not res["ok"] and res["violations"][0]["client"] == "a"
    # Successive pushes of one client must return strictly increasing versions.
    assert not checks.monotonic_reads([], {"c": {"x": [1, 3, 3]}}, {})["ok"]
    assert not checks.monotonic_reads([], {}, {"train0": [5, 4]})["ok"]


def test_availability_is_the_longest_gap_between_acks():
    recs = [OpRecord("counter", 0, "c", t - 0.01, t, True) for t in (1.0, 2.0, 6.0, 7.0)]
    recs.append(OpRecord("counter", 0, "c", 3.0, 4.0, False))  # failures do not count
    gaps = checks.availability(recs, 2, 0.0, 8.0)
    assert gaps[0] == pytest.approx(4.0)
    assert gaps[1] == pytest.approx(8.0)  # a shard with no traffic was never available


def test_failover_is_the_first_ack_of_an_op_invoked_after_the_fault():
    recs = [OpRecord("counter", 0, "c", 9.5, 10.5, True),    # invoked before the fault
            OpRecord("counter", 0, "c", 10.2, 12.0, True),
            OpRecord("counter", 1, "c", 10.1, 10.2, True)]
    out = checks.failovers([{"kind": "kill-leader", "shard": 0, "start": 10.0},
                            {"kind": "kill-node", "shard": None, "start": 10.0}], recs, 2)
    assert out[0]["recovery_s"] == pytest.approx(2.0)
    assert out[1]["recovery_s"] == pytest.approx(2.0)  # every shard: the slowest one
    out = checks.failovers([{"kind": "kill-leader", "shard": 1, "start": 11.0}], recs, 2)
    assert out[0]["recovery_s"] is None  # never recovered


def test_loss_falls():
    falling = [(t, 3.0 - t * 0.2) for t in range(10)]
    assert checks.loss_falls(falling)["ok"]
    assert not checks.loss_falls([(t, 2.0) for t in range(10)])["ok"]
    assert not checks.loss_falls([(0, 2.0)])["ok"]


def test_linearizability_report_names_the_stuck_operations():
    h = [Operation("a", ("write", 1.0), 1, 0, 1, "r"), Operation("b", ("read", None), (0.0, 0), 2, 3, "r"),
         Operation("a", ("write", 2.0), UNKNOWN, 4, math.inf, "q")]
    res = checks.linearizability(h, {"r": (0.0, 0), "q": (0.0, 0)})
    assert res["ok"] is False and res["keys"]["q"]["ok"] is True
    assert res["keys"]["r"]["stuck"][0]["client"] == "b"
    assert res["unknown"] == 1


def test_plan_faults_drops_packet_faults_in_loopback_and_rejects_unknown_names():
    run, not_run = plan_faults(ChaosOptions(), "loopback")
    assert "kill-leader" in run and "partition-leader" in not_run and "delay" in not_run
    assert "membership" in run and "lose-node" in run
    run, not_run = plan_faults(ChaosOptions(), "netns")
    assert not not_run and len(run) == 12 and "lose-node" in run  # joiners get a namespace too
    with pytest.raises(ValueError, match="unknown fault"):
        plan_faults(ChaosOptions(faults=("kill-leader", "meteor")), "netns")


def test_replay_command_carries_the_seed():
    cmd = ChaosOptions(seed=42, duration=30, faults=("kill-leader",)).replay_command()
    assert "--seed 42" in cmd and "--faults kill-leader" in cmd


def test_keys_land_on_the_shard_asked_for():
    for s in range(8):
        assert block_shard(key_on_shard("chaos/x", s, 8), 0, 8) == s


def test_delay_table_per_destination():
    t = DelayTable(seed=1)
    assert t.sample("10.0.0.1") == 0.0
    t.rules = {"10.0.0.1": (0.05, 0.01)}
    assert 0.04 <= t.sample("10.0.0.1") <= 0.06 and t.sample("10.0.0.2") == 0.0
    t.rules = {"*": (0.02, 0.0)}
    assert t.sample("anything") == 0.02


def test_proxy_pump_delays_and_keeps_order():
    """Bytes come out in order, each chunk no earlier than its delay, even with jitter."""
    async def main():
        table = DelayTable(seed=3)
        table.rules = {"*": (0.05, 0.04)}
        a, b = socket.socketpair()
        c, d = socket.socketpair()
        r1, w1 = await asyncio.open_connection(sock=a)
        r2, w2 = await asyncio.open_connection(sock=d)
        src_r, src_w = await asyncio.open_connection(sock=b)
        dst_r, dst_w = await asyncio.open_connection(sock=c)
        pump = asyncio.create_task(_pump(src_r, dst_w, "x", table))
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = b"".join(bytes([i]) * 100 for i in range(20))
        for i in range(20):
            w1.write(bytes([i]) * 100)
            await w1.drain()
            await asyncio.sleep(0.002)
        w1.close()
        got = await r2.readexactly(len(sent))
        elapsed = loop.time() - start
        await pump
        for w in (w2, src_w, dst_w):
            w.close()
        return got == sent, elapsed
    same, elapsed = asyncio.run(main())
    assert same
    assert elapsed >= 0.01  # at least the smallest possible delay


def test_report_of_a_failing_run_names_every_failure(tmp_path):
    """build_report / markdown / timeline on a synthetic run: a lost push, a stale read, a
    diverged shard and a flat loss must all be named."""
    from types import SimpleNamespace

    from kvps_chaos.faults import FaultRecord
    from kvps_chaos.report import build_report, write_report

    opts = ChaosOptions(duration=10, seed=9, shards=2)
    state = SimpleNamespace(opts=opts, workload_start=100.0, workload_end=110.0, mode="loopback",
                            mode_note="test", faults=["kill-leader"], not_run={"delay": "netns only"},
                            fault_records=[FaultRecord("kill-leader", 103.0, 103.1, 104.0, shard=0, node=1),
                                           FaultRecord("isolate-follower", 105, 106, 106.6, shard=1, node=0)],
                            leader_events=[{"t": 103.5, "shard": 0, "node": 2, "term": 3},
                                           {"t": 106.5, "shard": 1, "node": 1, "term": 5}], log_lines=[],
                            raft_findings=["node-1/logs/shard-1.log: truncating already-applied log entries"])
    wl = SimpleNamespace(
        records=[OpRecord("counter", s, "c", 100 + t, 100.01 + t, True) for s in (0, 1) for t in range(10)],
        tally={"k": CounterTally(acked=5, versions={"c": [1, 2]})},
        history=[Operation("a", ("write", 1.0), 1, 101, 102, "r"),
                 Operation("b", ("read", None), (0.0, 0), 103, 104, "r")],
        initial={"r": (0.0, 0)}, replies_lost=0)
    convergence = {"ok": False, "converged": False, "diverged_shards": [1], "shards": {}}
    train = {"train0": [{"t0": 100 + i, "t1": 100.5 + i, "ok": True, "version": i, "eval": 2.0}
                        for i in range(8)]}
    report = build_report(state, wl, {"k": (4.0, 4)}, convergence, train)
    text = " | ".join(report["failures"])
    for needle in ("1 acknowledged pushes LOST", "NOT linearizable", "STATE DIVERGENCE on shard(s) [1]",
                   "training loss did not fall", "Raft truncated entries they had applied"):
        assert needle in text
    assert report["faults"][0]["recovery_s"] == pytest.approx(0.01, abs=0.02)
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "FAILED" in md and "--seed 9" in md and "kill-leader" in md
    assert report["faults"][1]["elections_after_heal"] == 1 and "| 1 of 1 (the leader was deposed" in md
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_raft_log_findings_name_every_replica_that_truncated_applied_entries(tmp_path):
    """The line pysyncobj logs when Raft overwrites entries a replica had applied (its state
    machine diverged) fails a chaos run, whatever the other checks say."""
    logs = tmp_path / "node-1" / "logs"
    logs.mkdir(parents=True)
    (logs / "shard-2.log").write_text(
        "2026-11-30 INFO kvps.replica[1]: serving\n"
        "2026-11-30 CRITICAL pysyncobj[1]: truncating already-applied log entries from index 4 "
        "(last applied: 8) - state machine may have diverged from other cluster members\n")
    (logs / "shard-3.log").write_text("2026-11-30 INFO kvps.replica[2]: serving\n")
    found = checks.raft_log_findings(tmp_path)
    assert len(found) == 1 and found[0].startswith("node-1/logs/shard-2.log: ")
    assert "index 4" in found[0]
    assert checks.raft_log_findings(tmp_path / "missing") == []


def test_a_leadership_transfer_after_a_heal_is_counted_apart_from_elections():
    """The leader spreader may hand a shard over right after a cut heals; the report names that
    a transfer, and an election (or a moment without a serving leader) still counts as one."""
    from kvps_chaos.report import _elections_after_heal, _rejoins

    cut = {"kind": "isolate-follower", "shard": 0, "end": 10.0}
    transfer = {"t": 11.0, "shard": 0, "node": 1, "term": 5, "won_by": "transfer"}
    election = {"t": 11.5, "shard": 0, "node": 2, "term": 6, "won_by": "election"}
    gap = {"t": 12.0, "shard": 0, "node": None, "term": None, "won_by": None}
    other = {"t": 11.0, "shard": 1, "node": 1, "term": 5, "won_by": "election"}
    late = {"t": 13.5, "shard": 0, "node": 0, "term": 7, "won_by": "election"}
    assert _elections_after_heal(cut, [transfer, other, late]) == 0
    assert _elections_after_heal(cut, [transfer, other, late], transfers=True) == 1
    assert _elections_after_heal(cut, [transfer, election, gap]) == 2
    assert _elections_after_heal({**cut, "kind": "kill-leader"}, [election]) is None
    # a poll that caught a transfer handing over (no serving leader, then the transfer's winner)
    handover = {"t": 10.6, "shard": 0, "node": None, "term": None, "won_by": None}
    assert _elections_after_heal(cut, [handover, transfer]) == 0
    assert _elections_after_heal(cut, [handover, transfer], transfers=True) == 1
    assert _elections_after_heal(cut, [handover, election]) == 2  # no transfer: a real gap
    # the next fault began at 11.2: the election at 11.5 is that fault's doing, not this heal's
    assert _elections_after_heal(cut, [transfer, election, gap], until=11.2) == 0
    faults = [{**cut, "elections_after_heal": 0, "transfers_after_heal": 1},
              {**cut, "elections_after_heal": 0, "transfers_after_heal": 0}]
    assert _rejoins(faults) == "0 of 2; 1 more followed by a leadership transfer (leaders spreading)"


def test_a_partitioned_leaders_failover_finishing_after_the_heal_is_not_an_election_on_heal():
    """A leader cut for a short hold may be replaced only just after the heal: that election is
    the cut's own failover, reported as such. A second election after it, or one after a cut whose
    failover finished in time, still counts; so does one after an isolated follower returns."""
    from kvps_chaos.report import _elections_after_heal, _late_failover, _rejoins

    cut = {"kind": "partition-leader", "shard": 1, "node": 0, "invoked": 7.9, "start": 8.0, "end": 10.0}
    failover = {"t": 10.03, "shard": 1, "node": 1, "term": 28, "won_by": "election"}
    again = {"t": 11.0, "shard": 1, "node": 2, "term": 29, "won_by": "election"}
    late = _late_failover(cut, [failover, again])
    assert late is failover
    assert _elections_after_heal(cut, [failover], skip=late) == 0
    assert _elections_after_heal(cut, [failover, again], skip=late) == 1
    in_time = {"t": 9.5, "shard": 1, "node": 1, "term": 28, "won_by": "election"}
    assert _late_failover(cut, [in_time, failover]) is None  # it finished during the cut
    back = {"t": 10.03, "shard": 1, "node": 0, "term": 28, "won_by": "election"}
    assert _late_failover(cut, [back]) is None  # the cut leader itself: no failover
    assert _late_failover({**cut, "kind": "isolate-follower"}, [failover]) is None
    faults = [{**cut, "elections_after_heal": 0, "transfers_after_heal": 0, "failover_after_heal": True}]
    assert _rejoins(faults).startswith("0 of 1; 1 partitioned leader's failover finished just after")


def test_the_window_after_a_heal_ends_where_the_next_fault_began_not_where_it_took_effect():
    """A kill-all stamps its start once every process is dead; the monitor may see the shard
    leaderless a moment before that. The next fault's invocation bounds the window."""
    from types import SimpleNamespace

    from kvps_chaos.faults import FaultRecord
    from kvps_chaos.report import build_report

    opts = ChaosOptions(duration=20, seed=3, shards=1)
    cut = FaultRecord("partition-leader", 101.0, 104.0, 104.5, shard=0, node=2, invoked=100.9)
    kill_all = FaultRecord("kill-all", 106.2, 108.0, 110.0, invoked=106.0)
    state = SimpleNamespace(opts=opts, workload_start=100.0, workload_end=115.0, mode="loopback",
                            mode_note="test", faults=["partition-leader", "kill-all"], not_run={},
                            fault_records=[cut, kill_all],
                            leader_events=[{"t": 102.5, "shard": 0, "node": 0, "term": 7, "won_by": "election"},
                                           {"t": 106.1, "shard": 0, "node": None, "term": None, "won_by": None}],
                            log_lines=[], raft_findings=[])
    wl = SimpleNamespace(records=[OpRecord("counter", 0, "c", 100 + t, 100.01 + t, True) for t in range(15)],
                         tally={"k": CounterTally(acked=1, versions={"c": [1]})}, history=[],
                         initial={}, replies_lost=0)
    convergence = {"ok": True, "converged": True, "diverged_shards": [], "shards": {}}
    report = build_report(state, wl, {"k": (1.0, 1)}, convergence, {})
    assert report["faults"][0]["elections_after_heal"] == 0
    assert report["faults"][0]["invoked"] == pytest.approx(0.9)


def test_a_leader_that_once_won_by_transfer_and_briefly_stops_serving_is_no_new_transfer():
    """won_by belongs to a leader for as long as it leads: the same leader and term back after a
    moment without a serving leader is no transfer, and that moment still counts."""
    from kvps_chaos.report import _classify, _elections_after_heal

    cut = {"kind": "isolate-follower", "shard": 0, "end": 10.0}
    before = {"t": 9.0, "shard": 0, "node": 0, "term": 15, "won_by": "transfer"}
    gap = {"t": 10.5, "shard": 0, "node": None, "term": None, "won_by": None}
    back = {"t": 10.8, "shard": 0, "node": 0, "term": 15, "won_by": "transfer"}
    assert _classify([before, gap, back]) == ["transfer", "gap", "return"]
    assert _elections_after_heal(cut, [before, gap, back]) == 1
    assert _elections_after_heal(cut, [before, gap, back], transfers=True) == 0
    # a hand-over is a gap right before a transfer one term on, not two terms on
    moved = {"t": 10.9, "shard": 0, "node": 1, "term": 16, "won_by": "transfer"}
    assert _classify([before, gap, moved]) == ["transfer", "handover", "transfer"]
    skipped = {**moved, "term": 17}
    assert _classify([before, gap, skipped]) == ["transfer", "gap", "transfer"]


def test_a_late_failover_is_one_term_after_the_cut_leaders_and_before_the_next_fault():
    from kvps_chaos.report import _late_failover

    cut = {"kind": "partition-leader", "shard": 1, "node": 0, "invoked": 7.9, "start": 8.0, "end": 10.0}
    leading = {"t": 5.0, "shard": 1, "node": 0, "term": 27, "won_by": "election"}
    failover = {"t": 10.03, "shard": 1, "node": 1, "term": 28, "won_by": "election"}
    assert _late_failover(cut, [leading, failover]) is failover
    assert _late_failover(cut, [leading, {**failover, "term": 30}]) is None  # rounds after the heal
    assert _late_failover(cut, [leading, {**failover, "t": 11.5}], until=11.0) is None  # next fault's
