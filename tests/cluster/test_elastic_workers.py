"""Workers leave and join a synchronous (BSP) training job while it runs, as real processes
(``kvps_chaos.training``: PyTorch, ``PSModule`` with ``max_staleness=0`` on the server's clocks):
one is killed with ``kill -9`` and the others wait for it only until its clock lease ends; then a
new worker process joins at the job's current step and takes part in every barrier after that."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import kvps_client as kc
from kvps.node.local import wait_until
from kvps.node.process import spawn, stop_process
from kvps_chaos import training

pytestmark = pytest.mark.cluster

SEED = int(os.environ.get("KVPS_WORKERS_SEED", "5"))
JOB = "elastic-workers"
LEASE = 10.0  # the default: above the longest step on a loaded 2-core machine, or healthy workers expire too


def ok_steps(path: Path) -> list[dict]:
    """The worker's acknowledged steps so far (a line being written is skipped)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("ok"):
            out.append(rec)
    return out


def wait(cond, timeout: float, what: str):
    """``cond()``'s first truthy value, polled every 0.2 s (each poll reads files and clocks)."""
    try:
        return wait_until(cond, timeout, what, period=0.2)
    except TimeoutError as exc:
        raise AssertionError(f"{exc} (seed {SEED})") from None


def test_bsp_workers_survive_a_kill_9_and_take_in_a_joiner(cluster_factory, tmp_path):
    cluster = cluster_factory(nodes=3, shards=2).start(timeout=120)
    name = {r: f"train{r}-{SEED}" for r in range(4)}
    logs = {r: tmp_path / f"train-{r}.jsonl" for r in range(4)}
    procs = {}

    def start(rank: int, wait_workers: int | None) -> None:
        args = training.command(cluster.endpoints, str(cluster.data_dir / "token"), rank=rank, workers=3,
                                seed=SEED, out=str(logs[rank]), staleness=0, job=JOB, lease_s=LEASE,
                                wait_workers=wait_workers, pause=0.01)
        procs[rank] = spawn(args, tmp_path / f"train-{rank}.log")

    def alive(ranks) -> None:
        for r in ranks:
            assert procs[r].poll() is None, f"worker {r} exited (seed {SEED}):\n" + \
                (tmp_path / f"train-{r}.log").read_text()[-3000:]

    def clock(rank: int) -> int:
        steps = ok_steps(logs[rank])
        return steps[-1]["clock"] if steps else -1

    try:
        with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=SEED) as ps:
            for r in range(3):
                start(r, wait_workers=3)
            wait(lambda: alive(range(3)) or all(len(ok_steps(logs[r])) >= 5 for r in range(3)),
                     240, "3 workers to train 5 steps each (torch import included)")

            procs[2].send_signal(signal.SIGKILL)
            procs[2].wait()
            killed = time.monotonic()
            # While the dead worker's lease lives, BSP holds each survivor within one step of it.
            held: list[dict] = []

            def lease_ended() -> dict | None:
                live = ps.clocks(JOB)
                if name[2] in live:
                    held.append(live)
                    return None
                return live
            after = wait(lease_ended, LEASE + 60, "the killed worker's clock lease to end")
            released = time.monotonic()
            assert held, "the dead worker's clock was gone before the first read"
            dead = held[-1][name[2]]
            assert all(max((v for w, v in live.items() if w != name[2]), default=0) <= dead + 1
                       for live in held), held
            assert name[2] not in after and released - killed <= LEASE + 30
            # ... and then they go on without it.
            wait(lambda: alive((0, 1)) or min(clock(0), clock(1)) >= dead + 5, 120,
                     f"the survivors to pass step {dead + 5} without the killed worker")

            start(3, wait_workers=None)
            wait(lambda: alive((0, 1, 3)) or len(ok_steps(logs[3])) >= 5, 240,
                     "the joining worker to train 5 steps")
            joined_at = ok_steps(logs[3])[0]["clock"] - 1  # its clock before its first step
            assert joined_at >= dead + 5, f"the joiner started at step {joined_at}, not the job's step"
            # Every barrier now includes the joiner: no one is more than one step ahead of it.
            samples: list[dict] = []

            def lockstep_sampled() -> bool:
                live = ps.clocks(JOB)
                assert set(live) == {name[0], name[1], name[3]}, live
                samples.append(live)
                return len(samples) >= 20 and min(clock(0), clock(1)) >= joined_at + 10
            wait(lambda: alive((0, 1, 3)) or lockstep_sampled(), 180,
                     "the survivors to do 10 more steps with the joiner")
            assert all(max(s.values()) - min(s.values()) <= 1 for s in samples), samples
            # the joiner kept up with them (its log line follows its step's tick on the server)
            wait(lambda: clock(3) >= joined_at + 9, 30, "the joiner's log to show it kept up")
            progress = {r: clock(r) for r in (0, 1, 3)}
        for r in (0, 1, 3):  # SIGTERM: each ends after its current step and leaves the job
            procs[r].send_signal(signal.SIGTERM)
        for r in (0, 1, 3):
            wait(lambda r=r: procs[r].poll() is not None, 60, f"worker {r} to exit")
            assert procs[r].returncode == 0, (tmp_path / f"train-{r}.log").read_text()[-3000:]
        print(f"workers: seed {SEED}, killed at step {dead}, lease ended {released - killed:.1f} s "
              f"after the kill, joiner from step {joined_at}, final clocks {progress}")
    except BaseException:
        print(f"seed {SEED}; worker logs in {tmp_path}")
        raise
    finally:
        for p in procs.values():
            stop_process(p, timeout=10)
