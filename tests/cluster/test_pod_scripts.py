"""The Kubernetes pod scripts, run unchanged against real nodes: one network namespace per pod.

``deploy/kubernetes/pod/run.sh`` (the StatefulSet's entry point) and ``prestop.sh`` (its preStop
hook) run with ``sh`` inside namespaces standing in for pods ``kvps-N``, each with its own address
and the pod DNS names of the headless Service (``kvps-N.kvps.<namespace>.svc.cluster.local``) in
its ``/etc/hosts``; each pod's volume is a directory, the ConfigMap a directory holding
``pod/cluster.toml`` (with fewer shards: ``SHARDS``), the Secret a directory holding ``secret`` and
``token`` (an admin and a write token). A tiny HTTP server in the hub namespace answers the one
Kubernetes API call prestop.sh makes (the StatefulSet's ``spec.replicas``). A client in the hub
namespace, resolving the pod DNS names, pushes +1 to a counter with the write token the whole time.

The scenario is what the StatefulSet goes through: pods 0-2 start; scale 3 -> 5 (pods 3 and 4
join through kvps-0, replicas spread onto them; a preStop of a pod that stays does not drain);
scale 5 -> 3 (the preStop hooks of pods 4, then 3 drain them); pod 1 deleted with its volume kept
(it comes back under its id); pod 2 deleted with its volume lost (refused, then replaced with
``KVPS_REPLACE=1``). At the end every acknowledged push is in the counter, once.

Skipped without root + iproute2 + nftables (``kvps_chaos.netns.netns_support``).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, wait_for
from kvps.errors import KvpsError
from kvps.node.local import wait_until
from kvps.service.auth import new_token
from kvps.service.http import request_json
from kvps_chaos import netns
from kvps_chaos.elastic import meta, replicas_agree, settled

pytestmark = pytest.mark.cluster

SUPPORTED, WHY = netns.netns_support()

POD = ROOT / "deploy" / "kubernetes" / "pod"
NAMESPACE = "training"                      # the pods' Kubernetes namespace (downward API)
SA_TOKEN = "service-account-token"          # what prestop.sh must send to the API
# the machines' topology.kubernetes.io/zone labels, read by run.sh (machine-4 has none)
ZONES = {"machine-0": "zone-a", "machine-1": "zone-b", "machine-2": "zone-c", "machine-3": "zone-d",
         "machine-4": None}
REPLICAS = 3                                # cluster.toml's [cluster] replicas
BIN = Path(sys.executable).parent           # kvps, python3: what the image has on its PATH
POLL = 0.2                                  # between checks that ask every node (2 cores)
# The ConfigMap is pod/cluster.toml with one change: 4 shards instead of its 16. With 16, every pod
# runs up to 16 replica processes and scaling 3 -> 5 -> 3 moves ~40 replicas one at a time: the
# test took 228 s on the 2-core machine (65-100 s with 4; the suite has a 15-minute budget).
# KVPS_POD_SHARDS=16 runs the file's own count.
SHARDS = int(os.environ.get("KVPS_POD_SHARDS", "4"))


def dns(n: int) -> str:
    return f"kvps-{n}.kvps.{NAMESPACE}.svc.cluster.local"


class FakeApi(ThreadingHTTPServer):
    """The Kubernetes API as the pod scripts use it: GET the StatefulSet (prestop.sh), answered with
    ``replicas``; GET a machine (run.sh), answered with its zone label."""
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self.replicas = 3
        self.asked = 0
        super().__init__(address, _ApiHandler)


class _ApiHandler(BaseHTTPRequestHandler):
    server: FakeApi

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") != f"Bearer {SA_TOKEN}":
            return self._reply(401, {"kind": "Status", "code": 401})
        machine = self.path.removeprefix("/api/v1/nodes/")
        if machine in ZONES:
            labels = {"kubernetes.io/hostname": machine}
            if ZONES[machine]:
                labels["topology.kubernetes.io/zone"] = ZONES[machine]
            return self._reply(200, {"kind": "Node", "metadata": {"name": machine, "labels": labels}})
        if self.path != f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/kvps":
            return self._reply(404, {"kind": "Status", "code": 404})
        self.server.asked += 1
        self._reply(200, {"kind": "StatefulSet", "spec": {"replicas": self.server.replicas}})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class Pods:
    """Pods kvps-N as processes in network namespaces: the scripts' environment, start, preStop,
    deletion; the cluster seen from the hub (the test runs in it: ``Topology.entered``)."""

    def __init__(self, topo: netns.Topology, api: FakeApi, tmp: Path) -> None:
        self.topo, self.api, self.tmp = topo, api, tmp
        self.procs: dict[int, subprocess.Popen] = {}
        self.started = time.monotonic()
        self.admin_token, self.write_token = new_token(), new_token()
        self.config, self.secret, self.sa = tmp / "config", tmp / "secret", tmp / "serviceaccount"
        for d in (self.config, self.secret, self.sa):
            d.mkdir()
        text, changed = re.subn(r"(?m)^shards = \d+$", f"shards = {SHARDS}", (POD / "cluster.toml").read_text())
        assert changed == 1, "pod/cluster.toml has no 'shards = N' line"
        (self.config / "cluster.toml").write_text(text)  # the ConfigMap
        (self.secret / "secret").write_text(secrets.token_hex(32) + "\n")
        (self.secret / "token").write_text(f"{self.admin_token}\n{self.write_token} write\n")
        (self.sa / "token").write_text(SA_TOKEN + "\n")
        # what the harness helpers (kvps_chaos.elastic) need: the initial nodes' admin URLs by address
        self.view = SimpleNamespace(endpoints=[f"http://{topo.address(n)}:7100" for n in range(3)],
                                    token=self.admin_token, cfg=SimpleNamespace(replicas=REPLICAS),
                                    cluster_map=self.cluster_map)

    def phase(self, what: str) -> None:
        """A line of the scenario's timeline (pytest shows it when the test fails)."""
        print(f"{time.monotonic() - self.started:6.1f} s  {what}", flush=True)

    def volume(self, n: int) -> Path:
        return self.tmp / f"pvc-{n}"

    def log(self, n: int) -> Path:
        return self.tmp / f"kvps-{n}.log"

    def _env(self, n: int, *extra: str) -> list[str]:
        """A pod's environment: the StatefulSet's (POD_NAMESPACE), the mounts moved to directories."""
        return ["env", "-i", f"PATH={BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                f"HOME={self.volume(n)}", f"HOSTNAME=kvps-{n}", f"POD_NAMESPACE={NAMESPACE}",
                f"KVPS_DATA={self.volume(n)}", f"KVPS_CONFIG={self.config}", f"KVPS_SECRET={self.secret}",
                *extra]

    def _api(self) -> list[str]:
        """Where the scripts find the Kubernetes API and the ServiceAccount's token."""
        return [f"KVPS_API=http://{self.topo.hub_address}:{self.api.server_port}", f"KVPS_SERVICEACCOUNT={self.sa}"]

    def start(self, n: int, *extra: str) -> subprocess.Popen:
        """The container's command: ``sh run.sh`` (its output appended to the pod's log)."""
        self.phase(f"start kvps-{n} {' '.join(extra)}")
        with open(self.log(n), "ab") as out:
            out.write(f"===== start {' '.join(extra)}\n".encode())
            out.flush()
            env = self._env(n, f"NODE_NAME=machine-{n}", *self._api(), *extra)
            proc = subprocess.Popen(self.topo.exec_args(n, [*env, "sh", str(POD / "run.sh")]),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.procs[n] = proc
        return proc

    def prestop(self, n: int) -> subprocess.CompletedProcess:
        """The preStop hook, as the kubelet runs it inside the container."""
        env = self._env(n, *self._api())
        self.phase(f"preStop of kvps-{n} (the StatefulSet has {self.api.replicas} replicas)")
        hook = subprocess.run(self.topo.exec_args(n, [*env, "sh", str(POD / "prestop.sh")]),
                              capture_output=True, text=True, timeout=300, check=False)
        self.phase(f"preStop of kvps-{n} exited {hook.returncode}: {' | '.join(hook.stdout.splitlines()[-3:])} "
                   f"{' | '.join(hook.stderr.splitlines()[-3:])}")
        return hook

    def pids(self, n: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.topo.ns(n)], capture_output=True, text=True,
                             check=False).stdout
        return [int(p) for p in out.split() if int(p) != os.getpid()]

    def _kill_all(self, n: int) -> bool:
        """SIGKILL to every process in the pod's namespace; whether there was any."""
        if n in self.procs:
            self.procs[n].poll()  # reap the entry point once it is dead
        pids = self.pids(n)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return bool(pids)

    def kill(self, n: int) -> None:
        """The pod is gone: every process in its namespace is killed (-9)."""
        if self.pids(n):
            self.phase(f"kill kvps-{n}")
        wait_until(lambda: not self._kill_all(n), 30, f"every process of kvps-{n} to die", period=0.05)
        if n in self.procs:
            self.procs.pop(n).wait(timeout=30)

    def terminate(self, n: int, timeout: float = 60) -> int:
        """What the kubelet does after the preStop hook: SIGTERM to the entry point, then -9."""
        proc = self.procs[n]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            self.kill(n)
        return rc

    # ---- the cluster, seen from the hub (by address: the test process has the host's /etc/hosts) ----

    def by_address(self, text: str) -> str:
        return re.sub(r"kvps-(\d+)\.kvps\." + NAMESPACE + r"\.svc\.cluster\.local",
                      lambda m: self.topo.address(int(m.group(1))), text)

    def cluster_map(self) -> dict | None:
        """``GET /v1/cluster`` from the first initial node that answers, its URLs by address."""
        for url in self.view.endpoints:
            try:
                cmap = request_json("GET", url + "/v1/cluster", token=self.admin_token, timeout=5)
            except KvpsError:
                continue
            return json.loads(self.by_address(json.dumps(cmap)))
        return None

    def meta(self) -> dict | None:
        return meta(self.view)

    def node(self, n: int) -> dict | None:
        """Pod kvps-N's entry in the metadata node list (the newest with its DNS name)."""
        m = self.meta()
        mine = [node for node in (m or {"nodes": []})["nodes"] if node["host"] == dns(n)]
        return mine[-1] if mine else None

    def node_id(self, n: int) -> int:
        return self.node(n)["id"]

    def healthy(self, back: int | None = None, old_pids: frozenset[int] = frozenset()) -> bool:
        """Every shard has its replicas, every replica answers as leader or follower (none still
        recovering), every shard's leader serves, and every node's incarnation is recorded.
        ``back``: and that pod's replicas are new processes (none of ``old_pids``)."""
        cmap, m = self.cluster_map(), self.meta()
        if cmap is None or m is None:
            return False
        if back is not None:
            mine = [r for s in cmap["shards"] for r in s["replicas"] if r["node"] == back]
            if not mine or any(r.get("pid") is None or r["pid"] in old_pids for r in mine):
                return False
        for shard in cmap["shards"]:
            roles = [r.get("role") for r in shard["replicas"]]
            if len(roles) != REPLICAS or not set(roles) <= {"leader", "follower"} or roles.count("leader") != 1:
                return False
            if any(r.get("recovering") for r in shard["replicas"]):
                return False
            if not any(r.get("role") == "leader" and r.get("serving") for r in shard["replicas"]):
                return False
        return all(n.get("incarnation") for n in m["nodes"] if n["state"] != "removed")

    def replica_pids(self, node_id: int) -> frozenset[int]:
        cmap = self.cluster_map() or {"shards": []}
        return frozenset(r["pid"] for s in cmap["shards"] for r in s["replicas"]
                         if r["node"] == node_id and r.get("pid") is not None)

    def ready(self, n: int) -> bool:
        """The pod's readiness probe (``GET /readyz`` on port 7100)."""
        try:
            return request_json("GET", f"http://{self.topo.address(n)}:7100/readyz", timeout=2)["ready"]
        except KvpsError:
            return False

    def dump(self) -> None:
        for path in sorted([*self.tmp.glob("kvps-*.log"), *self.tmp.glob("pvc-*/node-*/logs/*.log"),
                            self.tmp / "workload.log"]):
            lines = path.read_text(errors="replace").splitlines()[-40:]
            print(f"----- {path.relative_to(self.tmp)} -----\n" + "\n".join(lines), file=sys.stderr)


WORKLOAD = r'''
"""Pushes +1 to 8 counters (spread over the shards) in one call until the stop file appears (2
tasks); the acknowledged count goes to the progress file after each push; at the end: acked, each
counter's (value, version), errors as JSON."""
import asyncio, json, os, sys
import numpy as np
import kvps_client as kc

endpoints, progress, stop, result = sys.argv[1].split(","), *sys.argv[2:]
KEYS = [f"pod/counter{i}" for i in range(8)]


async def main():
    acked, errors = [0], []
    async with kc.Client(endpoints, timeout=120, seed=0) as ps:
        for key in KEYS:
            await ps.create(key, np.zeros(1, np.float32), optimizer=kc.Add())

        async def pusher():
            one = np.ones(1, np.float32)
            while not os.path.exists(stop) and not errors:
                try:
                    await ps.push({key: one for key in KEYS})
                except kc.KvpsError as exc:  # outcome unknown: the count can no longer be exact
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return
                acked[0] += 1
                with open(progress + ".tmp", "w") as f:
                    f.write(str(acked[0]))
                os.replace(progress + ".tmp", progress)

        await asyncio.gather(pusher(), pusher())
        counters = {}
        for key in KEYS:
            value, version = await ps.get(key)
            counters[key] = [float(value[0]), int(version)]
    with open(result, "w") as f:
        json.dump({"acked": acked[0], "counters": counters, "errors": errors}, f)


asyncio.run(main())
'''


class Workload:
    """The training job: ``WORKLOAD`` in a process in the hub, resolving the pods' DNS names."""

    def __init__(self, pods: Pods) -> None:
        self.pods, self.tmp = pods, pods.tmp
        script = self.tmp / "workload.py"
        script.write_text(WORKLOAD)
        self.progress, self.stop_file, self.result = (self.tmp / n for n in ("acked", "stop", "result.json"))
        endpoints = ",".join(f"http://{dns(n)}:7100" for n in range(3))
        with open(self.tmp / "workload.log", "wb") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", pods.topo.hub, "env", "-i", f"KVPS_TOKEN={pods.write_token}",
                 sys.executable, str(script), endpoints, str(self.progress), str(self.stop_file), str(self.result)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def acked(self) -> int:
        try:
            return int(self.progress.read_text())
        except (OSError, ValueError):
            return 0

    def more(self, n: int, what: str, timeout: float = 120) -> None:
        """Wait for ``n`` more acknowledged pushes (training goes on through ``what``). Generous:
        right after a drained pod's address disappears, pushes stalled for 10-35 s in some runs."""
        want = self.acked() + n
        wait_for(lambda: self.acked() >= want or self.proc.poll() is not None, timeout, f"{n} pushes {what}")
        assert self.proc.poll() is None, f"the workload stopped {what}: {self.finish()}"
        self.pods.phase(f"{self.acked()} pushes acknowledged {what}")

    def finish(self) -> dict:
        self.stop_file.touch()
        self.proc.wait(timeout=180)
        return json.loads(self.result.read_text()) if self.result.exists() else \
            {"rc": self.proc.returncode, "log": (self.tmp / "workload.log").read_text()[-2000:]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _leftovers(topo: netns.Topology) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(f"{netns.PREFIX}{topo.run_id}-")]
    files = [str(p) for p in netns.ETC_NETNS.glob(f"{netns.PREFIX}{topo.run_id}-*")] \
        if netns.ETC_NETNS.is_dir() else []
    return names + files


@pytest.fixture
def pods(tmp_path):
    """Namespaces for pods 0-2 (3 and 4 are added when they are scheduled) with the pod DNS names,
    the fake Kubernetes API; every pod's processes killed, the namespaces and their /etc/netns
    files removed afterwards, whatever happened."""
    if not SUPPORTED:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    netns.remove_stale()
    topo = netns.Topology(3).create()
    api = made = None
    try:
        topo.set_hosts({dns(n): topo.address(n) for n in range(5)})
        with topo.entered():  # the fake API listens in the hub, where the pods reach it
            api = FakeApi((topo.hub_address, 0))
        threading.Thread(target=api.serve_forever, daemon=True).start()
        made = Pods(topo, api, tmp_path)
        yield made
    finally:
        try:
            if made is not None:
                for n in range(5):
                    if topo.ns(n) in topo.created:
                        made.kill(n)
        finally:
            if api is not None:
                api.shutdown()
                api.server_close()
            topo.destroy()
    assert not _leftovers(topo), "namespaces or /etc/netns files left behind"


def test_pod_scripts_scale_3_5_3_and_pods_deleted_with_and_without_their_volume(pods):
    started = time.monotonic()
    work = None
    try:
        with pods.topo.entered():  # the test reaches the pods from the hub, as a client would
            for n in range(3):
                pods.start(n)
            wait_until(pods.healthy, 120, "pods 0-2 to form a healthy cluster", period=POLL)
            wait_until(lambda: all(pods.ready(n) for n in range(3)), 60, "pods 0-2 to be ready", period=POLL)
            pods.phase("pods 0-2 ready")
            work = Workload(pods)
            work.more(20, "on pods 0-2")
            _scale_to_5(pods, work)
            _scale_back_to_3(pods, work)
            _delete_pod_keeping_its_volume(pods, work, 1)
            _delete_pod_losing_its_volume(pods, work, 2)
            res = work.finish()
            assert not res.get("errors") and res.get("acked", 0) > 0, res
            for key, (value, version) in res["counters"].items():  # nothing lost, nothing applied twice
                what = "LOST" if value < res["acked"] else "APPLIED TWICE"
                assert value == res["acked"], f"{key}: {res['acked']} pushes acknowledged, value {value}: {what}"
                assert version == res["acked"], f"{key}: {res['acked']} pushes acknowledged, version {version}"
            wait_until(lambda: replicas_agree(pods.view), 60, "every shard's replicas to agree", period=POLL)
    except BaseException:
        pods.dump()
        raise
    finally:
        if work is not None:
            work.kill()
    print(f"pod scripts: {res['acked']} pushes acknowledged, {time.monotonic() - started:.0f} s")


def _scale_to_5(pods: Pods, work: Workload) -> None:
    """kubectl scale --replicas=5: pods 3 and 4 are scheduled and join through kvps-0."""
    pods.api.replicas = 5
    for n in (3, 4):
        pods.topo.add_node(n)
        pods.start(n)
    grown = wait_until(lambda: settled(pods.view, range(5)), 240, "replicas to spread over pods 0-4", period=POLL)
    pods.phase(f"replicas spread over pods 0-4 ({grown['rebalance']['moves_done']} moves)")
    assert sorted(n["host"] for n in grown["nodes"]) == [dns(n) for n in range(5)]
    # every node runs with its machine's zone label (none where the machine has none)
    want = {dns(n): ZONES[f"machine-{n}"] or "" for n in range(5)}
    wait_until(lambda: {node["host"]: node.get("zone", "") for node in (pods.meta() or {"nodes": []})["nodes"]}
               == want, 30, f"the nodes' zones {want} to be recorded", period=POLL)
    assert all(any(pods.node_id(n) in s["nodes"] for s in grown["assignment"]["shards"]) for n in (3, 4))
    wait_until(lambda: all(pods.ready(n) for n in range(5)), 60, "pods 0-4 to be ready", period=POLL)
    for n in (3, 4):  # a joined pod takes the training job's write token, not only the admin one
        url = f"http://{pods.topo.address(n)}:7100/v1/node"
        assert request_json("GET", url, token=pods.write_token, timeout=10)["node"] == pods.node_id(n)
    work.more(20, "after scaling to 5")
    # kvps-3 stops while the StatefulSet keeps it (an eviction, a rolling update): no drain
    asked = pods.api.asked
    hook = pods.prestop(3)
    assert hook.returncode == 0 and "stays in the StatefulSet (5 replicas): no drain" in hook.stdout, hook
    assert pods.api.asked == asked + 1
    # kvps-1 never drains (it runs the metadata group), without asking the API
    hook = pods.prestop(1)
    assert (hook.returncode, hook.stdout, pods.api.asked) == (0, "", asked + 1), hook
    assert [node["state"] for node in pods.meta()["nodes"]] == ["active"] * 5


def _scale_back_to_3(pods: Pods, work: Workload) -> None:
    """kubectl scale --replicas=3: the preStop hooks of kvps-4, then kvps-3 drain them."""
    pods.api.replicas = 3
    for n in (4, 3):
        node_id = pods.node_id(n)
        hook = pods.prestop(n)
        assert hook.returncode == 0 and f"node {node_id} removed" in hook.stdout, hook
        m = pods.meta()
        assert m["nodes"][node_id]["state"] == "removed"
        assert not [s["id"] for s in m["assignment"]["shards"] if node_id in s["nodes"]]
        # a removed node's process exits by itself (deploy/README.md); then the kubelet's SIGTERM
        assert pods.procs[n].wait(timeout=60) == 0, f"kvps-{n} exited {pods.procs[n].returncode}"
        pods.phase(f"kvps-{n} exited by itself")
        pods.terminate(n)
        pods.topo.remove_node(n)
    wait_until(lambda: settled(pods.view, range(3)), 120, "replicas to settle on pods 0-2", period=POLL)
    pods.phase("replicas settled on pods 0-2")
    work.more(20, "after scaling back to 3")


def _delete_pod_keeping_its_volume(pods: Pods, work: Workload, n: int) -> None:
    """kubectl delete pod kvps-1: the pod is killed and comes back with its volume, under its id."""
    before = pods.node(n)
    hook = pods.prestop(n)
    assert (hook.returncode, hook.stdout) == (0, ""), hook
    old = pods.replica_pids(n)
    pods.kill(n)
    pods.start(n)
    wait_until(lambda: pods.healthy(n, old) and pods.ready(n), 120, f"kvps-{n} back with its volume", period=POLL)
    pods.phase(f"kvps-{n} back with its volume")
    assert pods.node(n)["incarnation"] == before["incarnation"]
    assert pods.node(n)["id"] == n
    assert not (pods.volume(n) / f"node-{n}" / "REPLACED").exists()
    work.more(20, f"after kvps-{n} came back")


def _delete_pod_losing_its_volume(pods: Pods, work: Workload, n: int) -> None:
    """kvps-2 is deleted and its PersistentVolume is gone: refused under its id, then replaced."""
    before = pods.node(n)
    hook = pods.prestop(n)
    assert (hook.returncode, hook.stdout) == (0, ""), hook
    old = pods.replica_pids(n)
    pods.kill(n)
    shutil.rmtree(pods.volume(n))
    refused = pods.start(n)
    rc = refused.wait(timeout=120)
    pods.phase(f"kvps-{n} without its volume exited {rc}")
    log = pods.log(n).read_text().rsplit("===== start", 1)[-1]
    assert rc != 0, log
    assert f"node {n} refused to start" in log and "--replace" in log, log
    pods.kill(n)
    pods.start(n, "KVPS_REPLACE=1")
    wait_until(lambda: pods.healthy(n, old) and pods.ready(n)
               and pods.node(n)["incarnation"] not in (None, before["incarnation"]), 180,
               f"kvps-{n} replaced: its replicas recovered and caught up", period=POLL)
    pods.phase(f"kvps-{n} replaced, its replicas caught up")
    assert (pods.volume(n) / f"node-{n}" / "REPLACED").exists()
    work.more(20, f"after kvps-{n} was replaced")
