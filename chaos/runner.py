"""One chaos run: cluster up, workloads on, faults from a seeded schedule, quiesce, check, report.

``run_chaos(ChaosOptions(...))`` is what ``kvps chaos`` and the tests call; it returns the report
dict (also written to ``out/report.json``, ``report.md`` and ``timeline.png``). Every process,
namespace and nftables rule it made is removed in ``finally``, also when the run fails.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvps.config import RaftConfig, ServerConfig
from kvps.errors import KvpsError
from kvps.node.local import wait_until
from kvps.node.process import spawn, stop_process

from kvps_chaos import checks, netns, training
from kvps_chaos.cluster import ChaosCluster
from kvps_chaos.faults import ALL_FAULTS, NETNS_ONLY, FaultContext, FaultRecord, run_schedule
from kvps_chaos.progress import Progress
from kvps_chaos.report import build_report, write_report
from kvps_chaos.workloads import Workloads

__all__ = ["ChaosOptions", "RunState", "plan_faults", "resolve_mode", "run_chaos"]


@dataclass(frozen=True)
class ChaosOptions:
    duration: float = 120.0            # seconds of workload + faults (startup and checks come on top)
    seed: int = 0
    faults: tuple[str, ...] = ()       # empty: every fault this environment can run
    out: Path = Path("chaos-out")
    mode: str = "auto"                 # "netns" | "loopback" | "auto" (netns when root + nft)
    nodes: int = 3
    shards: int = 4
    counter_clients: int = 4           # one per shard (client i pushes to shard i % shards)
    register_clients: int = 3
    train_workers: int = 2
    op_timeout: float = 15.0           # client deadline per operation; past it the outcome is unknown
    hold: tuple[float, float] = (2.0, 4.0)    # fault duration range (s)
    quiet: tuple[float, float] = (1.0, 3.0)   # pause between faults (s)
    # run every fault kind once even if that takes longer than ``duration`` (the CI scenario)
    every_kind: bool = False
    # where the nodes run their replicas (ServerConfig.procs); with 1, a fault that kills or wipes
    # one replica's process kills its node's process (and so every replica of that node)
    procs: int = ServerConfig.procs
    # Register reads: "linearizable" (checked strictly), or "leader" to measure the documented
    # window in which a partitioned leader that has not stepped down yet serves stale reads.
    register_reads: str = "linearizable"
    unsafe_disable_dedup: bool = False  # the deliberately broken build (harness self-test)
    fsync: str = RaftConfig.fsync      # the replicas' journal fsync policy (kill -9 is survived by all)
    keep_data: bool = False            # keep journals and snapshots even when the run passes
    progress: bool = True

    def replay_command(self) -> str:
        faults = f" --faults {','.join(self.faults)}" if self.faults else ""
        broken = " --unsafe-disable-dedup" if self.unsafe_disable_dedup else ""
        fsync = f" --fsync {self.fsync}" if self.fsync != RaftConfig.fsync else ""
        reads = f" --register-reads {self.register_reads}" if self.register_reads != "linearizable" else ""
        every = " --every-kind" if self.every_kind else ""
        every += f" --procs {self.procs}" if self.procs != ServerConfig.procs else ""
        return (f"kvps chaos --seed {self.seed} --duration {self.duration:g} --shards {self.shards}"
                f"{faults} --mode {self.mode}{reads}{fsync}{every}{broken}")


@dataclass
class RunState:
    opts: ChaosOptions
    mode: str
    mode_note: str
    faults: list[str]
    not_run: dict[str, str]
    started: float = 0.0
    workload_start: float = 0.0
    workload_end: float = 0.0
    fault_records: list[FaultRecord] = field(default_factory=list)
    leader_events: list[dict] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    raft_findings: list[str] = field(default_factory=list)  # applied entries truncated (logs)


def resolve_mode(opts: ChaosOptions) -> tuple[str, str]:
    ok, why = netns.netns_support()
    if opts.mode == "loopback":
        return "loopback", "loopback mode requested"
    if opts.mode == "netns" and not ok:
        raise RuntimeError(f"network-namespace mode unavailable: {why}")
    if ok:
        return "netns", "one network namespace per node (iproute2 + nftables)"
    return "loopback", f"network namespaces unavailable ({why}): loopback, no packet-level faults"


def plan_faults(opts: ChaosOptions, mode: str) -> tuple[list[str], dict[str, str]]:
    wanted = list(opts.faults) or list(ALL_FAULTS)
    unknown = [f for f in wanted if f not in ALL_FAULTS]
    if unknown:
        raise ValueError(f"unknown fault(s): {', '.join(unknown)}; known: {', '.join(ALL_FAULTS)}")
    not_run = {f: "needs network-namespace mode (nftables / transparent proxy)"
               for f in wanted if f in NETNS_ONLY and mode != "netns"}
    return [f for f in wanted if f not in not_run], not_run


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    mode, note = resolve_mode(opts)
    faults, not_run = plan_faults(opts, mode)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "cluster"
    shutil.rmtree(data, ignore_errors=True)
    state = RunState(opts, mode, note, faults, not_run, started=time.monotonic())
    topo, cluster = None, None
    try:
        if mode == "netns":
            netns.remove_stale()
            topo = netns.Topology(opts.nodes).create()
        cluster = ChaosCluster(data, nodes=opts.nodes, shards=opts.shards, topology=topo,
                               seed=opts.seed,
                               raft=RaftConfig(compact_entries=2000, fsync=opts.fsync),  # snapshot installs
                               # lose-node: a lost node is declared dead after a few seconds, not
                               # minutes; longer than any other fault keeps a node away
                               server=ServerConfig(unsafe_disable_dedup=opts.unsafe_disable_dedup,
                                                   node_dead_after=6.0, procs=opts.procs))
        if topo is not None:
            with topo.entered():
                report = asyncio.run(_run(state, cluster))
        else:
            report = asyncio.run(_run(state, cluster))
    finally:
        if cluster is not None:
            cluster.stop()
        if topo is not None:
            topo.destroy()
    write_report(report, out)
    if report["ok"] and not opts.keep_data:
        for path in data.glob("node-*/shard-*"):
            shutil.rmtree(path, ignore_errors=True)  # journals; the logs stay
    return report


async def _run(state: RunState, cluster: ChaosCluster) -> dict[str, Any]:
    opts = state.opts
    progress = Progress(opts.duration, enabled=opts.progress)
    progress.line(f"kvps chaos: seed {opts.seed}, {opts.duration:g}s, mode {state.mode}, "
                  f"faults {','.join(state.faults) or '-'}")
    if state.not_run:
        progress.line(f"  not run here: {', '.join(state.not_run)} ({next(iter(state.not_run.values()))})")
    await asyncio.to_thread(cluster.start, timeout=120)
    wl = Workloads(cluster.endpoints, cluster.token, opts.shards, opts.seed,
                   counter_clients=opts.counter_clients, register_clients=opts.register_clients,
                   op_timeout=opts.op_timeout, register_reads=opts.register_reads)
    await wl.setup()
    trainers: list[subprocess.Popen] = []
    try:
        trainers = _start_trainers(cluster, opts)
        # Importing torch takes seconds on a busy machine: start the clock once every worker trains.
        await asyncio.to_thread(wait_until, lambda: _trainers_running(cluster, trainers, opts), 180,
                                "every training worker to finish its first step", 0.2)
        await _drive(state, cluster, wl, progress)
    finally:
        _stop_trainers(trainers)
    progress.line("quiescing: waiting for every shard to serve and every replica to converge ...")
    final = None
    try:
        await asyncio.to_thread(cluster.wait_ready, 120)
        convergence = await asyncio.to_thread(_wait_converged, cluster, 90.0)
        final = await wl.final_reads()
    except (TimeoutError, KvpsError) as exc:  # a cluster that never comes back is a finding, not a crash
        state.log_lines.append(f"after the run: {type(exc).__name__}: {exc}")
        convergence = await asyncio.to_thread(_wait_converged, cluster, 1.0)
        convergence["not_serving"] = str(exc)
    state.raft_findings = checks.raft_log_findings(cluster.data_dir)
    train = _read_training(cluster.data_dir.parent, opts.train_workers)
    report = build_report(state, wl, final, convergence, train)
    progress.done(report)
    return report


async def _drive(state: RunState, cluster: ChaosCluster, wl: Workloads, progress: Progress) -> None:
    """Workloads and the fault schedule until the deadline; then stop the workloads."""
    opts = state.opts
    ctx = FaultContext(cluster, _rng(opts.seed), wl.set_reply_loss, hold=opts.hold,
                       log=lambda line: _log(state, progress, line))
    stop_monitor = asyncio.Event()
    monitor = asyncio.create_task(_monitor(state, cluster, wl, progress, stop_monitor))
    state.workload_start = time.monotonic()
    deadline = state.workload_start + opts.duration
    workload = asyncio.create_task(wl.run())
    try:
        await run_schedule(ctx, state.faults, deadline, opts.quiet, state.fault_records,
                           every_kind=opts.every_kind)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the rest of the run, fault-free
    finally:
        wl.set_reply_loss(0.0)
        wl.stop.set()
        stop_monitor.set()
        try:
            await workload
        finally:
            state.workload_end = time.monotonic()
            await monitor


def _rng(seed: int):
    import random
    return random.Random(seed)


def _log(state: RunState, progress: Progress, line: str) -> None:
    stamp = time.monotonic() - state.workload_start
    state.log_lines.append(f"{stamp:8.2f}s {line}")
    progress.event(line)


def _start_trainers(cluster: ChaosCluster, opts: ChaosOptions) -> list[subprocess.Popen]:
    procs = []
    for rank in range(opts.train_workers):
        path = cluster.data_dir.parent / f"train-{rank}.jsonl"
        path.unlink(missing_ok=True)
        args = training.command(cluster.endpoints, str(cluster.data_dir / "token"), rank=rank,
                                workers=opts.train_workers, seed=opts.seed, out=str(path),
                                op_timeout=opts.op_timeout)
        procs.append(spawn(args, cluster.data_dir.parent / f"train-{rank}.log"))
    return procs


def _trainers_running(cluster: ChaosCluster, procs: list[subprocess.Popen], opts: ChaosOptions) -> bool:
    dead = [p.args for p in procs if p.poll() is not None]
    if dead:
        raise RuntimeError(f"a training worker exited early: {dead[0]} (see its log in {opts.out})")
    return all((cluster.data_dir.parent / f"train-{r}.jsonl").stat().st_size > 0
               if (cluster.data_dir.parent / f"train-{r}.jsonl").exists() else False
               for r in range(opts.train_workers))


def _stop_trainers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        stop_process(p, timeout=30.0)  # SIGTERM again, then SIGKILL if a step hangs


def _read_training(out: Path, workers: int) -> dict[str, list[dict]]:
    runs = {}
    for rank in range(workers):
        path = out / f"train-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        runs[f"train{rank}"] = [json.loads(line) for line in lines if line.strip()]
    return runs


async def _monitor(state: RunState, cluster: ChaosCluster, wl: Workloads, progress: Progress,
                   stop: asyncio.Event) -> None:
    """Leader changes (polled from the cluster map) and the progress bar."""
    last: dict[int, Any] = {}
    while not stop.is_set():
        leaders = await asyncio.to_thread(cluster.leaders)
        now = time.monotonic()
        for shard, rep in leaders.items():
            who = (rep["node"], rep.get("term")) if rep else None
            if shard in last and who != last[shard]:
                state.leader_events.append({"t": now, "shard": shard, "node": who and who[0],
                                            "term": who and who[1],
                                            "won_by": rep.get("won_by") if rep else None})
            last[shard] = who
        acked = sum(t.acked for t in wl.tally.values())
        progress.update(now - state.workload_start, len(state.fault_records), acked,
                        sum(1 for r in wl.records if not r.ok))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


def _wait_converged(cluster: ChaosCluster, timeout: float) -> dict[str, Any]:
    """Wait until every shard's replicas report the same state hash; then report per shard.
    Same applied index with different hashes is a divergence (a stop-everything bug)."""
    shards: dict[int, Any] = {}

    def all_equal() -> bool:
        for s in range(cluster.cfg.shards):
            hashes = cluster.state_hashes(s)
            shards[s] = hashes
            if None in hashes.values() or len({h for h, _ in hashes.values()}) != 1:
                return False
        return True

    try:
        wait_until(all_equal, timeout, "replica state hashes to agree", 0.5)
        converged = True
    except TimeoutError:
        converged = False
    per_shard, diverged = {}, []
    for s, hashes in shards.items():
        per_shard[s] = {str(n): (list(v) if v else None) for n, v in hashes.items()}
        by_index: dict[int, set] = {}
        for v in hashes.values():
            if v is not None:
                by_index.setdefault(v[1], set()).add(v[0])
        if any(len(hs) > 1 for hs in by_index.values()):
            diverged.append(s)
    return {"ok": converged and not diverged, "converged": converged, "diverged_shards": diverged,
            "shards": per_shard}

