"""Raw Raft throughput and failover of one ShardGroup, 3 replica processes on 127.0.0.1.

    .venv/bin/python benchmarks/raft_raw.py [--seconds 10] [--size 1048576] [--inflight 4]
        [--kills 5] [--buffers 0,4194304] [--under-load] [--glibc-malloc]

For each socket buffer setting (0 = kernel autotuning) it starts 3 replica processes (spawn),
each running a ShardGroup with a trivial applier and the default RaftConfig, then:

* throughput: the leader's process proposes ``--size`` commands with ``--inflight`` outstanding for
  ``--seconds``; prints MB/s committed, p50/p99 commit latency (propose -> result callback on the
  leader) and how many payload bytes the leader sent per committed byte (2.0 = each entry sent
  once to each of the two followers);
* failover: ``kill -9`` of the leader ``--kills`` times; prints kill -> first commit of a new
  command by the new leader (median/max); the killed replica is restarted from its journal and
  must catch up before the next kill (``--under-load``: again, with every leader keeping
  ``--inflight`` commands outstanding).

It also prints the CPU seconds each replica spent per committed GiB, which is less sensitive to
other work on the machine than MB/s. The replicas run with the malloc settings a kvps node gives
its replica processes (``kvps.service.lifecycle.MALLOC_SETTINGS``); ``--glibc-malloc`` shows what
glibc's defaults cost.

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC, shared by all processes on Linux).
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
SECRET = b"raft-raw-benchmark-secret-0123456789"


# ---- replica process ------------------------------------------------------------------------

def replica_main(address: str, addresses: list[str], journal_dir: str, socket_buffer_bytes: int,
                 conn) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{address}] %(levelname)s %(name)s %(message)s")
    from kvps.config import RaftConfig
    from kvps.raft.group import ShardGroup

    applied = [0, 0]  # entries, bytes
    background = BackgroundLoad()

    def applier(data: bytes) -> int:
        applied[0] += 1
        applied[1] += len(data)
        return len(data)

    group = ShardGroup(
        self_address=address, peers=addresses, raft=RaftConfig(socket_buffer_bytes=socket_buffer_bytes),
        secret=SECRET, context="bench/shard=0", journal_dir=Path(journal_dir), applier=applier,
        snapshot_state=lambda: b"", restore_state=lambda data: None)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "status":
                t = os.times()
                conn.send(dict(group.status(), applied=applied[0], pid=os.getpid(),
                               transport=group.transport_stats(), cpu=t.user + t.system))
            elif cmd == "load":
                conn.send(run_load(group, *args) if group.is_leader() else None)
            elif cmd == "probe":
                conn.send(probe(group, *args))
            elif cmd == "background":
                if args[0]:
                    background.start(group, *args[1:])
                else:
                    background.stop()
                conn.send("ok")
            elif cmd == "exit":
                break
    finally:
        background.stop()
        group.stop()
        conn.send("stopped")


class BackgroundLoad:
    """While this replica leads, keep ``inflight`` commands of ``size`` bytes outstanding."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.halt = threading.Event()

    def start(self, group, size: int, inflight: int) -> None:
        self.stop()
        self.halt.clear()
        payload = os.urandom(size)
        slots = threading.Semaphore(inflight)

        def run() -> None:
            while not self.halt.is_set():
                if not group.is_leader():
                    self.halt.wait(0.005)
                    continue
                if slots.acquire(timeout=0.1):
                    group.propose(payload, lambda result, reason: slots.release())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.halt.set()
            self.thread.join()
            self.thread = None


def run_load(group, seconds: float, size: int, inflight: int) -> dict:
    payload = os.urandom(size)
    slots = threading.Semaphore(inflight)
    lock = threading.Lock()
    latencies: list[float] = []
    failures: dict[int, int] = {}
    sent_before = group.transport_stats()["bytes_sent"]

    def proposed(started: float):
        def done(result, reason):
            with lock:
                if reason == 0:
                    latencies.append(time.perf_counter() - started)
                else:
                    failures[reason] = failures.get(reason, 0) + 1
            slots.release()
        return done

    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        if not slots.acquire(timeout=5):
            break
        group.propose(payload, proposed(time.perf_counter()))
    for _ in range(inflight):  # wait for the tail
        slots.acquire(timeout=10)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "elapsed": elapsed, "committed": len(latencies), "bytes": len(latencies) * size,
        "p50": latencies[len(latencies) // 2] if latencies else float("nan"),
        "p99": latencies[int(len(latencies) * 0.99)] if latencies else float("nan"),
        "failures": failures,
        "sent_per_committed": (group.transport_stats()["bytes_sent"] - sent_before)
        / max(1, len(latencies) * size),
    }


def probe(group, old_leader: str, timeout: float) -> tuple[str, float | None]:
    """After the leader was killed: ("leader", commit time) on the new leader, ("follower", None)
    on a replica that sees another new leader."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if group.is_leader():
            done = threading.Event()
            box: list = []

            def callback(result, reason, box=box, done=done):
                box.append((reason, time.monotonic()))
                done.set()

            group.propose(b"probe", callback)
            if done.wait(timeout) and box[0][0] == 0:
                return "leader", box[0][1]
            continue  # lost leadership or the proposal failed: try again
        leader = group.leader_address()
        if leader is not None and leader != old_leader:
            return "follower", None
        time.sleep(0.001)
    return "timeout", None


# ---- driver ---------------------------------------------------------------------------------

class Cluster:
    def __init__(self, root: Path, socket_buffer_bytes: int) -> None:
        self.ctx = mp.get_context("spawn")
        from kvps.node.local import free_port_base
        base = free_port_base(3)
        self.addresses = [f"127.0.0.1:{base + i}" for i in range(3)]
        self.root = root
        self.socket_buffer_bytes = socket_buffer_bytes
        self.procs: dict[str, tuple] = {}
        for address in self.addresses:
            self.start(address)

    def start(self, address: str) -> None:
        parent, child = self.ctx.Pipe()
        journal = self.root / address.replace(":", "_")
        proc = self.ctx.Process(target=replica_main, daemon=True,
                                args=(address, self.addresses, str(journal), self.socket_buffer_bytes, child))
        proc.start()
        self.procs[address] = (proc, parent)

    def call(self, address: str, *msg, timeout: float = 60.0):
        _, conn = self.procs[address]
        conn.send(msg)
        if not conn.poll(timeout):
            raise TimeoutError(f"{address} did not answer {msg[0]}")
        return conn.recv()

    def statuses(self) -> dict[str, dict]:
        return {a: self.call(a, "status") for a in self.procs}

    def wait_leader(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for address, st in self.statuses().items():
                if st["role"] == "leader":
                    return address
            time.sleep(0.02)
        raise TimeoutError("no leader elected")

    def wait_caught_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.statuses()
            commits = {s["commit_index"] for s in st.values()}
            applied = {s["applied_index"] for s in st.values()}
            if len(commits) == 1 and applied == commits and all(s["leader"] for s in st.values()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"replicas did not converge: {self.statuses()}")

    def kill(self, address: str) -> float:
        proc, conn = self.procs.pop(address)
        t = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        conn.close()
        return t

    def close(self) -> None:
        for address, (proc, conn) in list(self.procs.items()):
            try:
                conn.send(("exit",))
                if conn.poll(10):
                    conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs.clear()


def bench(args, socket_buffer_bytes: int) -> None:
    with tempfile.TemporaryDirectory(prefix="raft_raw_") as tmp:
        cluster = Cluster(Path(tmp), socket_buffer_bytes)
        try:
            throughput(cluster, args)
            cluster.wait_caught_up()
            failover(cluster, args.kills, None)
            if args.under_load:
                failover(cluster, args.kills, (args.size, args.inflight))
        finally:
            cluster.close()


def throughput(cluster: Cluster, args) -> None:
    leader = cluster.wait_leader()
    cluster.call(leader, "load", 1.0, args.size, args.inflight)  # warm-up
    leader = cluster.wait_leader()
    cpu_before = {a: s["cpu"] for a, s in cluster.statuses().items()}
    r = cluster.call(leader, "load", args.seconds, args.size, args.inflight, timeout=args.seconds + 60)
    cpu = {a: s["cpu"] - cpu_before[a] for a, s in cluster.statuses().items()}
    if r is None:
        print("  leader changed before the load started; rerun")
        return
    print(f"  throughput: {r['bytes'] / r['elapsed'] / 1e6:7.1f} MB/s "
          f"({r['committed']} x {args.size} B in {r['elapsed']:.1f} s, {args.inflight} in flight)"
          f"  commit latency p50 {r['p50'] * 1e3:.1f} ms  p99 {r['p99'] * 1e3:.1f} ms"
          f"  leader sent {r['sent_per_committed']:.2f} B per committed B"
          + (f"  failures {r['failures']}" if r["failures"] else ""))
    gib = max(r["bytes"], 1) / 2 ** 30
    print(f"  CPU per committed GiB: leader {cpu[leader] / gib:.2f} s, followers "
          + ", ".join(f"{cpu[a] / gib:.2f} s" for a in cpu if a != leader)
          + f"  (machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


def failover(cluster: Cluster, kills: int, load: tuple[int, int] | None) -> None:
    """Kill -9 the leader ``kills`` times; with ``load`` = (size, inflight) every replica keeps that
    many commands in flight while it leads (so the new leader's probe competes with them)."""
    def background(on: bool) -> None:
        for address in cluster.procs:
            cluster.call(address, "background", on, *(load if on else ()))

    times = []
    for i in range(kills):
        if load:
            background(True)
        leader = cluster.wait_leader()
        t_kill = cluster.kill(leader)
        results = {a: cluster.call(a, "probe", leader, 20.0) for a in cluster.procs}
        commits = [t for role, t in results.values() if role == "leader"]
        if commits:
            times.append(commits[0] - t_kill)
        else:
            print(f"  kill {i + 1}: no new leader committed within 20 s: {results}")
        if load:
            background(False)
        cluster.start(leader)  # restart from its journal
        cluster.wait_caught_up()
    what = "idle" if load is None else f"under load ({load[1]} x {load[0]} B in flight)"
    if times:
        print(f"  failover {what}: kill -9 leader -> first commit by the new leader, {len(times)} kills: "
              f"median {statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms  "
              f"[{', '.join(f'{t * 1e3:.0f}' for t in times)}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=MiB)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--under-load", action="store_true",
                        help="also measure failover while the leader has --inflight commands outstanding")
    parser.add_argument("--glibc-malloc", action="store_true",
                        help="run the replicas with glibc's malloc defaults instead of the settings a "
                             "kvps node runs its replicas with (MB buffers then go back to the kernel)")
    parser.add_argument("--buffers", default=f"0,{4 * MiB}",
                        help="comma-separated socket_buffer_bytes values to compare (0 = autotuning)")
    args = parser.parse_args()
    if not args.glibc_malloc:  # as a node runs its replicas; inherited by the spawned processes
        from kvps.node.node import REPLICA_ENV
        os.environ.update(REPLICA_ENV)
    from kvps.config import RaftConfig
    cfg = RaftConfig()
    print(f"raft_raw: 3 replica processes, {os.cpu_count()} CPUs, default RaftConfig (election "
          f"{cfg.election_timeout_min}-{cfg.election_timeout_max} s, heartbeat {cfg.heartbeat_period} s)"
          + (", glibc malloc defaults" if args.glibc_malloc else ", malloc as in a kvps node"))
    for buf in (int(b) for b in args.buffers.split(",")):
        print(f"socket_buffer_bytes={buf}{' (kernel autotuning)' if buf == 0 else ''}:")
        bench(args, buf)


if __name__ == "__main__":
    main()
