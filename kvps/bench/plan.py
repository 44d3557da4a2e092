"""What one ``kvps bench`` run measures, and for how long: ``full``, ``quick`` and ``tiny`` (tests)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvps.bench.small_keys import SmallKeys
from kvps.bench.sparse import SparseWork
from kvps.bench.workload import Model

__all__ = ["PLANS", "Plan", "SECTIONS", "SYSTEMS", "with_overrides"]

KiB, MiB = 1 << 10, 1 << 20
SECTIONS = ("b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7")
SYSTEMS = ("kvps", "redis", "rpc", "inmem")


@dataclass(frozen=True)
class Plan:
    name: str
    # B1: workers each pulling the whole model and pushing a gradient per tensor, repeatedly.
    workers: int = 4
    model: Model = field(default_factory=Model)            # 64 × 1 MiB
    # s of steps before counting starts: long enough for a fresh kvps cluster's first log
    # compactions (each replica's journal segments and spare snapshot are allocated once, then
    # recycled): a training job runs for hours, so what a step costs after that is what counts
    b1_warmup: float = 12.0
    b1_seconds: float = 15.0                                # s counted
    # B1's fairness rows: Redis with its append-only file fsynced every second on all three, and
    # kvps with fsync "never" (each one more cluster and one more window)
    b1_fairness: bool = True
    # The kvps cluster every section uses: `kvps up`'s defaults (3 nodes, 8 shards, 3 replicas).
    nodes: int = 3
    shards: int = 8
    # The journal's fsync policy for the kvps cluster: kvps's default. The Redis peer persists
    # nothing; the full plan's fairness row runs kvps with "never" beside it. (With compactions
    # every 256 MiB, "never" let dirty journal pages pile up until the kernel throttled the tick
    # threads: 78 elections and 1.66 steps/s vs 0 and 2.43; with every 32 MiB the two tie, 2.68
    # vs 2.70 steps/s.) `kvps bench --fsync never` runs it for every section.
    kvps_fsync: str = "interval"
    # s a started kvps cluster may take to spread its leaders over the nodes before anything is
    # measured (leaders.py waits for elections to settle first: 7-9 s here for 2 shards); 0: do
    # not wait (the tiny plan: its numbers mean nothing, only that every section runs)
    spread_wait: float = 30.0
    # Where the kvps nodes run their replicas (ServerConfig.procs: 1, the default, all in the
    # node's process; 0, a process per replica), and whether B1 also runs the other one beside it.
    kvps_procs: int = 1
    b1_procs_row: bool = True
    # B1 also with the workers' shared-memory pulls off (TCP only: what workers on other hosts
    # get), in the same cluster, on keys of its own
    b1_tcp_row: bool = True
    # B0: an idle cluster of the plan's size, for each process model: settle (leaders spread,
    # then this many s), then CPU counted over b0_seconds.
    b0_settle: float = 5.0
    b0_seconds: float = 20.0
    # B2: payload sizes, seconds per (system, size, batching).
    b2_sizes: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB)
    b2_seconds: float = 4.0
    # B3: leader kills under a training loop on its own, smaller model.
    b3_kills: int = 12
    b3_model: Model = field(default_factory=lambda: Model(tensors=16))
    # B4: pulls of B1's model, repeats per case.
    b4_repeats: int = 5
    # B5: seconds per machine limit.
    b5_seconds: float = 2.0
    # B6: Zipf-distributed embedding rows pulled and pushed by the B1 workers.
    b6_work: SparseWork = field(default_factory=SparseWork)
    b6_warmup: float = 2.0
    b6_seconds: float = 10.0
    # B7: many small keys (10,000 × 1 KiB), created, then pulled all and pushed all per round.
    b7_work: SmallKeys = field(default_factory=SmallKeys)

    def estimates(self, sections: tuple[str, ...], systems: tuple[str, ...]) -> dict[str, float]:
        """Phase -> rough seconds on the 2-core machine (for the progress bar only)."""
        b1 = self.b1_warmup + self.b1_seconds
        other = 1 - self.kvps_procs
        est = {"B5 limits": 2 * self.b5_seconds + 3,
               "B0 kvps (procs 0)": 15 + self.shards + self.b0_settle + self.b0_seconds,
               "B0 kvps (procs 1)": 15 + self.shards + self.b0_settle + self.b0_seconds,
               f"start kvps (procs {other})": 15 + self.shards, f"B1 kvps (procs {other})": b1 + 10,
               "B1 inmem": b1 + 3, "B1 rpc": b1 + 25, "start redis": 2, "B1 redis": b1 + 8,
               "start redis (aof)": 2, "B1 redis (aof)": b1 + 8,
               "start kvps (fsync never)": 15 + self.shards, "B1 kvps (fsync never)": b1 + 10,
               "B2 redis": 2 * len(self.b2_sizes) * self.b2_seconds + 2,
               "start kvps": 15 + self.shards, "B1 kvps": b1 + 10, "B1 kvps (TCP only)": b1 + 10,
               "B2 kvps": 2 * len(self.b2_sizes) * (self.b2_seconds + 0.5) + 2,
               "B4 kvps": 4 + 5 * self.b4_repeats * 1.0,
               "B3 kvps": 5 + 3.5 * self.b3_kills,
               "B6 rpc": self.b6_warmup + self.b6_seconds + 25,
               "B6 redis": self.b6_warmup + self.b6_seconds + 8,
               "B6 kvps": self.b6_warmup + self.b6_seconds + 8,
               "B7 redis": 1 + 0.5 * self.b7_work.rounds * self.b7_work.keys / 10_000,
               "B7 kvps": 4 + 2.0 * self.b7_work.rounds * self.b7_work.keys / 10_000}
        wanted = {}
        for phase, seconds in est.items():
            if "(procs" in phase and not phase.startswith("B0"):
                if not self.b1_procs_row:
                    continue  # the other process model's B1 row
            elif phase == "B1 kvps (TCP only)":
                if not self.b1_tcp_row:
                    continue
            elif "(" in phase and not phase.startswith("B0") and not self.b1_fairness:
                continue  # a fairness row: "start redis (aof)", "B1 kvps (fsync never)"
            section, _, system = phase.partition(" ")
            system = system.split(" ")[0]
            if section == "start":
                if system in systems and ({"b1", "b2", "b6", "b7"} & set(sections) or system == "kvps"):
                    wanted[phase] = seconds
            elif section.lower() in sections and (section == "B5" or system in systems):
                wanted[phase] = seconds
        return wanted


PLANS = {
    "full": Plan("full"),
    "quick": Plan("quick", b1_warmup=6.0, b1_seconds=6.0, b1_fairness=False, b0_settle=3.0, b0_seconds=8.0,
                  b2_sizes=(4 * KiB, 64 * KiB, MiB, 4 * MiB), b2_seconds=1.5, b3_kills=3, b4_repeats=3, b5_seconds=1.0, b6_warmup=1.0, b6_seconds=4.0,
                  b7_work=SmallKeys(rounds=3)),
    # For tests: seconds, not minutes. Small model, 2 shards, one of everything.
    "tiny": Plan("tiny", workers=2, model=Model(tensors=4, tensor_bytes=256 * KiB), b1_warmup=0.3,
                 b1_seconds=1.0, b1_fairness=False, b1_procs_row=False, spread_wait=0.0, b0_settle=0.2, b0_seconds=1.0,
                 shards=2, b2_sizes=(64 * KiB,), b2_seconds=0.4, b3_kills=1,
                 b3_model=Model(tensors=2, tensor_bytes=64 * KiB), b4_repeats=1, b5_seconds=0.2,
                 b6_work=SparseWork(rows=5000, dim=16, lookups=256, batches=4), b6_warmup=0.3,
                 b6_seconds=1.0, b7_work=SmallKeys(keys=300, rounds=2)),
}


def with_overrides(plan: Plan, **changes) -> Plan:
    return replace(plan, **{k: v for k, v in changes.items() if v is not None})
