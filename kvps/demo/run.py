"""``kvps demo``: real PyTorch training on a local cluster while every shard's leader is killed.

Three worker processes train an MLP on scikit-learn's digits through ``kvps_client.torch``
(``SyncPSModule``, bounded staleness kept by the server's clocks; the shard leaders apply SGD).
After each step a worker adds 1 to an exactly-once ``Add`` counter. While they train, the demo
kill -9s the serving leader of every shard in turn, waiting for the shard to serve again before the
next kill. At the end it checks that every acknowledged push was applied exactly once (the counter
and every parameter's version equal the acknowledged steps), compares the test accuracy with the
same training run in one process without kvps or faults, and draws the loss curve with the kills.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvps.demo.digits import (
    COUNTER, PREFIX, Data, TrainConfig, accuracy, baseline, load, make_model, train_worker,
)
from kvps.node.local import LocalCluster, wait_until

__all__ = ["Kill", "Killer", "Run", "Workers", "main"]

TOLERANCE = 1.0  # accuracy points the faulty distributed run may lose against the baseline
QUICK_TOLERANCE = 6.0  # a 3-epoch run is under-trained: staleness costs it a few points


@dataclass
class Kill:
    shard: int
    step: int  # acknowledged steps when the leader was killed
    node: int
    pid: int
    term: int  # the killed leader's term
    at: float  # wall time of the kill
    serving_after: float | None = None  # kill -> the shard has a serving leader again (s)
    next_step_after: float | None = None  # kill -> first step begun after it acknowledged (s)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)  # per acknowledged step, in arrival order
    finished: list[float] = field(default_factory=list)  # wall time each step was acknowledged
    acked: dict[int, int] = field(default_factory=dict)  # worker -> steps it saw acknowledged
    kills: list[Kill] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """From the first acknowledged step to the last (worker start-up left out)."""
        return self.finished[-1] - self.finished[0] if self.finished else 0.0


class Killer:
    """Kills the serving leader of each shard once, at evenly spaced points of the run, and
    only after the previous victim's shard is serving again."""

    def __init__(self, cluster: LocalCluster, total_steps: int, say: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.say = say  # a line above the progress bar
        shards = cluster.cfg.shards
        self.plan = [(total_steps * (i + 1) // (shards + 1), s) for i, s in enumerate(range(shards))]
        self.current: Kill | None = None
        self._checked = 0.0

    def poll(self, run: Run, steps: int) -> None:
        now = time.time()
        if now - self._checked < 0.05:  # the admin API is asked at most 20 times a second
            return
        self._checked = now
        if self.current is not None:
            leader = self.cluster.leader(self.current.shard)
            # A newer term: the node's view pairs a restarted replica's pid with its predecessor's
            # last polled role for a moment, so a new pid alone does not prove a new leader.
            if leader is not None and (leader.get("term") or 0) > self.current.term:
                self.current.serving_after = now - self.current.at
                self.say(f"  shard {self.current.shard} serving again after "
                         f"{self.current.serving_after:.2f} s (new leader on node {leader['node']})")
                self.current = None
        elif self.plan and steps >= self.plan[0][0]:
            shard = self.plan[0][1]
            leader = self.cluster.leader(shard)
            if leader is None:
                return  # mid-election: try again on the next poll
            self.plan.pop(0)
            self.current = Kill(shard, steps, leader["node"], leader["pid"], leader.get("term") or 0,
                                time.time())
            whole_node = self.cluster.kill_replica(leader)  # procs = 1: its node, started again
            run.kills.append(self.current)
            what = f"node {leader['node']} (pid {leader['pid']}) with" if whole_node else "the process of"
            self.say(f"  >>> step {steps}: kill -9 {what} the leader of shard {shard}")

    @property
    def finished(self) -> bool:
        return not self.plan and self.current is None


class Workers:
    """The worker processes, started early: they import torch and load the data while the
    cluster elects its leaders, and begin training on ``go()``. Leaving the ``with`` block ends
    any that are still running."""

    def __init__(self, cluster: LocalCluster, cfg: Any, data: Data | None, *,
                 target: Callable = train_worker, arrays: dict[str, np.ndarray] | None = None) -> None:
        # Arguments travel through a pipe the parent blocks on until a child has imported torch,
        # so the data goes through a file: the children then start in parallel. ``target`` and
        # ``arrays`` (saved as the npz it loads) let another task reuse this (``--task ctr``).
        train_npz = cluster.data_dir / "train.npz"
        np.savez(train_npz, **(arrays if arrays is not None else {"X": data[0], "y": data[1]}))
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self._go = ctx.Event()
        self.procs = [ctx.Process(target=target, daemon=True,
                                  args=(r, cfg, str(train_npz), cluster.endpoints, cluster.token, self.out,
                                        self._go))
                      for r in range(cfg.workers)]
        for p in self.procs:
            p.start()

    def go(self) -> None:
        self._go.set()

    def failed(self) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _train(cluster: LocalCluster, workers: Workers, cfg: TrainConfig, total: int, deadline_s: float,
           kills: bool = True) -> Run:
    tty = sys.stdout.isatty()  # off a terminal only the kills and recoveries are printed
    with tqdm(total=total, unit="step", file=sys.stdout, disable=not tty, dynamic_ncols=True,
              bar_format="  {l_bar}{bar}| {n_fmt}/{total_fmt} steps{postfix}") as bar:
        return _train_with(cluster, workers, cfg, total, deadline_s, bar, kills)


def _train_with(cluster: LocalCluster, workers: Workers, cfg: TrainConfig, total: int,
                deadline_s: float, bar: tqdm, kills: bool = True) -> Run:
    workers.go()
    run, killer = Run(), Killer(cluster, total, lambda line: bar.write(line, file=sys.stdout))
    if not kills:  # the same run without faults: what the faults cost is the difference
        killer.plan.clear()
    deadline = time.monotonic() + deadline_s
    while len(run.acked) < cfg.workers or not killer.finished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"training did not finish within {deadline_s:.0f} s")
        if workers.failed():
            raise RuntimeError("a worker process failed (its traceback is above)")
        killer.poll(run, len(run.losses))
        try:
            msg = workers.out.get(timeout=0.05)
        except queue.Empty:
            continue
        if msg[0] == "step":
            _on_step(run, msg)
            bar.update(1)
            if len(run.losses) % 20 == 0:
                bar.set_postfix_str(f"loss {np.mean(run.losses[-45:]):.4f}", refresh=False)
        else:
            run.acked[msg[1]] = msg[2]
    return run


def _on_step(run: Run, msg: tuple) -> None:
    _, _, loss, started, finished = msg
    run.losses.append(loss)
    run.finished.append(finished)
    for kill in run.kills:
        if kill.next_step_after is None and started > kill.at:
            kill.next_step_after = finished - kill.at


def _final_state(cluster: LocalCluster, cfg: TrainConfig, data: Data) -> tuple[int, dict[str, int], float]:
    """(counter, {key: version}, test accuracy of the parameters on the server)."""
    import kvps_client as kc
    from kvps_client.torch import SyncPSModule

    _, _, Xte, yte = data
    model = make_model(cfg.seed + 1)  # other weights: the server's must overwrite them
    with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=cfg.seed) as ps:
        counter, _ = ps.get(COUNTER, consistency="linearizable")
        pm = SyncPSModule(model, ps, prefix=PREFIX, optimizer=kc.SGD(lr=cfg.lr))  # same definition
        pm.pull()
        versions = {key: ps.describe(key, refresh=True)["version"] for key in pm.keys.values()}
    return int(counter[0]), versions, accuracy(model, Xte, yte)


def _plot(path: Path, run: Run, base_losses: list[float], window: int,
          title: str = "kvps demo: MLP on digits while every shard's leader is killed") -> None:
    """Loss against updates (with the baseline), and steps per second against time; kills marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rate) = plt.subplots(2, 1, figsize=(9, 6.5), height_ratios=[2, 1])
    for losses, style, label in ((base_losses, "--", "one process, no faults"),
                                 (run.losses, "-", "kvps: 3 workers, every shard's leader killed")):
        k = min(window, len(losses))
        ax.plot(np.arange(k, len(losses) + 1), np.convolve(losses, np.ones(k) / k, mode="valid"),
                style, color="gray" if style == "--" else "C0", label=label)
    t0 = min(run.finished, default=0.0)
    seconds = np.array(run.finished) - t0
    bins = np.arange(0, max(seconds.max(initial=0), 1) + 0.5, 0.5)
    rate.plot(bins[:-1], np.histogram(seconds, bins)[0] / 0.5, color="C0", drawstyle="steps-post")
    for kill in run.kills:
        ax.axvline(kill.step, color="C3", alpha=0.6)
        rate.axvline(kill.at - t0, color="C3", alpha=0.6)
        for axis, x in ((ax, kill.step), (rate, kill.at - t0)):
            axis.text(x, 1, f" shard {kill.shard}: leader killed", transform=axis.get_xaxis_transform(),
                      color="C3", va="top", rotation=90, fontsize=8)
    ax.set(xlabel="updates applied (steps of all workers)", ylabel=f"training loss (mean of {window})",
           yscale="log", title=title)
    ax.legend(loc="lower left")
    rate.set(xlabel="seconds since the first step", ylabel="steps / s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: Path = Path("demo-out"), seed: int = 0, quick: bool = False,
         staleness: int | None = 4) -> int:
    cfg = TrainConfig(epochs=3 if quick else 30, staleness=staleness, seed=seed)
    shards = 2 if quick else 4
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    data = load(seed)
    total = cfg.total_steps(len(data[1]))
    print(f"training an MLP 64-128-10 on scikit-learn digits: {cfg.workers} workers, {cfg.epochs} epochs, "
          f"batch {cfg.batch}, plain SGD lr {cfg.lr}, "
          f"{'asynchronous' if staleness is None else f'bounded staleness {staleness}'}", flush=True)
    base_acc, base_losses = baseline(cfg, data)
    print(f"baseline (one process, no kvps, no faults): {base_acc:.1f} % test accuracy", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvps-demo-") as tmp, \
            LocalCluster(Path(tmp), nodes=3, shards=shards) as cluster, \
            Workers(cluster, cfg, data) as workers:
        print(cluster.describe(), flush=True)
        cluster.start(timeout=120)
        import kvps_client as kc
        with kc.SyncClient(cluster.endpoints, token=cluster.token, seed=seed) as ps:
            ps.create(COUNTER, np.zeros(1, np.float64))
        run = _train(cluster, workers, cfg, total, deadline_s=60 if quick else 240)
        wait_until(cluster.ready, 60, "every shard to serve")
        counter, versions, acc = _final_state(cluster, cfg, data)
        print("stopping the cluster ...", flush=True)
        # In parallel: each node takes seconds to stop its replicas (the exit stops any left).
        with ThreadPoolExecutor(len(cluster.cfg.nodes)) as pool:
            list(pool.map(cluster.stop_node, [n.id for n in cluster.cfg.nodes]))
    summary = _summary(cfg, run, counter, versions, acc, base_acc, quick, time.monotonic() - started)
    _plot(out / "loss.png", run, base_losses, window=45 if not quick else 15)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary, out)
    return 0 if summary["ok"] else 1


def _summary(cfg: TrainConfig, run: Run, counter: int, versions: dict[str, int], acc: float,
             base_acc: float, quick: bool, elapsed: float) -> dict:
    acked = sum(run.acked.values())
    bad_versions = {k: v for k, v in versions.items() if v != acked}
    killed = sorted(k.shard for k in run.kills if k.serving_after is not None)
    tolerance = QUICK_TOLERANCE if quick else TOLERANCE
    ok = (counter == acked and not bad_versions and killed == list(range(len(killed)))
          and len(killed) == len(run.kills) and acc >= base_acc - tolerance)
    return {"config": asdict(cfg), "acknowledged": acked, "counter": counter,
            "lost": max(0, acked - counter), "applied_twice": max(0, counter - acked),
            "param_versions": versions, "accuracy": acc, "baseline_accuracy": base_acc,
            "tolerance": tolerance, "kills": [asdict(k) for k in run.kills], "train_s": run.seconds,
            "elapsed_s": elapsed,
            "ok": ok}


def _print_summary(s: dict, out: Path) -> None:
    print("\n=== kvps demo summary ===")
    print(f"workers: {s['config']['workers']} processes   steps acknowledged: {s['acknowledged']} "
          f"in {s['train_s']:.0f} s   counter on the server: {s['counter']}")
    print(f"lost: {s['lost']}   applied twice: {s['applied_twice']}   parameter versions: "
          f"{sorted(set(s['param_versions'].values()))} (each must equal the acknowledged steps)")
    for k in s["kills"]:
        print(f"kill -9 leader of shard {k['shard']} (node {k['node']}) at step {k['step']}: serving again "
              f"after {k['serving_after']:.2f} s, next step acknowledged after {k['next_step_after'] or 0:.2f} s")
    diff = s["accuracy"] - s["baseline_accuracy"]
    print(f"test accuracy: {s['accuracy']:.1f} % with kvps and faults vs {s['baseline_accuracy']:.1f} % "
          f"in one process without faults ({diff:+.1f} points; allowed -{s['tolerance']:.0f})")
    print(f"loss curve: {out / 'loss.png'}   summary: {out / 'summary.json'}   "
          f"elapsed: {s['elapsed_s']:.0f} s")
    print("result:", "OK" if s["ok"] else "FAILED")


if __name__ == "__main__":
    sys.exit(main())
