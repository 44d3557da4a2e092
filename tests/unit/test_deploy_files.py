"""The deployment files are valid: every Kubernetes manifest against the Kubernetes schemas
(kubernetes-validate), the kustomization's files exist, the pod's cluster.toml loads, the shell
scripts parse, and the Dockerfile copies what exists."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvps.config import load_cluster

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"


def _documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "statefulset.yaml").read_text()) if d]


def test_every_manifest_validates_against_the_kubernetes_schemas():
    docs = _documents()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "PodDisruptionBudget", "Role", "RoleBinding",
                     "Service", "ServiceAccount", "StatefulSet"]
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_statefulset_spreads_pods_and_drains_only_through_its_scripts():
    sts = next(d for d in _documents() if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"  # its zone label
    zone_reader = next(d for d in _documents() if d["kind"] == "ClusterRole")
    assert zone_reader["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1] == "/etc/kvps/prestop.sh"
    pdb = next(d for d in _documents() if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_kustomization_files_exist_and_the_pod_config_loads(tmp_path):
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = [f for g in kust["configMapGenerator"] for f in g["files"]]
    assert all((K8S / f).is_file() for f in files)
    for f in ("statefulset.yaml", *kust["resources"]):
        assert (K8S / f).is_file()
    text = (K8S / "pod" / "cluster.toml").read_text()
    text = text.replace("__NAMESPACE__", "training").replace("__SECRET__", "/etc/kvps-secret")  # as run.sh
    (tmp_path / "cluster.toml").write_text(text)
    cfg = load_cluster(tmp_path / "cluster.toml")
    assert [n.host for n in cfg.nodes] == [f"kvps-{i}.kvps.training.svc.cluster.local" for i in range(3)]
    # the Secret's mount; node directories inside the volume run.sh writes cluster.toml into
    assert (cfg.secret_file, cfg.token_file) == ("/etc/kvps-secret/secret", "/etc/kvps-secret/token")
    assert [n.data_dir for n in cfg.nodes] == ["node-0", "node-1", "node-2"]


@pytest.mark.parametrize("script", ["run.sh", "prestop.sh"])
def test_pod_scripts_parse(script):
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    subprocess.run(["sh", "-n", str(K8S / "pod" / script)], check=True)



def test_the_prestop_hook_reaches_the_node_because_it_listens_on_every_address():
    # the hook asks 127.0.0.1 from inside the pod; the node is reached at its DNS name by others
    assert "http://127.0.0.1:7100" in (K8S / "pod" / "prestop.sh").read_text()
    assert (K8S / "pod" / "run.sh").read_text().count("--bind 0.0.0.0") == 2


def test_the_dockerfile_copies_what_exists():
    text = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
