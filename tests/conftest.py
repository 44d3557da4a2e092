"""Shared fixtures: real local clusters on 127.0.0.1 with free ports, always torn down."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from kvps.config import RaftConfig, ServerConfig
from kvps.node.local import LocalCluster, wait_until

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: starts real multi-process clusters")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Shared-memory mirrors of leaders the tests killed (their files outlive them; a node that
    starts again removes them, one killed for good leaves them)."""
    from kvps.replica.mirror import sweep

    sweep()


def make_cluster(tmp_path: Path, *, nodes: int = 3, shards: int = 2, replicas: int = 3,
                 server: ServerConfig | None = None, raft: RaftConfig | None = None,
                 **kwargs) -> LocalCluster:
    return LocalCluster(tmp_path / "cluster", nodes=nodes, shards=shards, replicas=replicas,
                        server=server, raft=raft, env={"KVPS_LOG_LEVEL": "info"}, **kwargs)


def dump_logs(cluster: LocalCluster) -> None:
    """On failure, print the tail of every process log (pytest shows it with the report)."""
    for log in sorted(cluster.data_dir.glob("node-*/logs/*.log")):
        lines = log.read_text(errors="replace").splitlines()[-40:]
        print(f"----- {log.relative_to(cluster.data_dir)} -----", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (the kernel picks them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    """``cond()``'s first truthy value, polled until ``timeout`` (then the test fails, naming it)."""
    try:
        return wait_until(cond, timeout, what, period=0.01)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def module_cluster(tmp_path_factory, name: str, *, before_start=None, **kwargs):
    """Body of a module-scoped cluster fixture: ``yield from module_cluster(f, "api", shards=3)``.
    Started once for the module, logs shown if it cannot start, always stopped.
    ``before_start(cluster)``: runs once its files are written (e.g. to add tokens)."""
    c = make_cluster(tmp_path_factory.mktemp(name), **kwargs)
    try:
        if before_start is not None:
            before_start(c)
        c.start(timeout=90)
        yield c
    except BaseException:
        dump_logs(c)
        raise
    finally:
        c.stop()


@pytest.fixture
def cluster_factory(tmp_path, request):
    """Build clusters that are stopped (and their logs shown on failure) whatever happens."""
    made: list[LocalCluster] = []

    def factory(**kwargs) -> LocalCluster:
        c = make_cluster(tmp_path / f"c{len(made)}", **kwargs)
        made.append(c)
        return c

    yield factory
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for c in made:
        if failed or os.environ.get("KVPS_TEST_LOGS"):
            dump_logs(c)
        c.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
