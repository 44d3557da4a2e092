"""The node process's body: one ``Node`` from the cluster config, until SIGINT or SIGTERM."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from kvps.config import load_cluster
from kvps.node.node import Node
from kvps.service.auth import TokenStore, admin_token
from kvps.service.lifecycle import freeze_heap, stop_event, tune_for_replicas
from kvps.service.tls import client_context, server_context

__all__ = ["run_node"]


async def run_node(config: Path, node_id: int, *, replace: bool = False, bind: str | None = None,
                   zone: str | None = None, procs: int | None = None) -> None:
    cfg = load_cluster(config).with_bind(node_id, bind)
    if procs is not None:  # --procs: where this node runs its replicas (ServerConfig.procs)
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, procs=procs).validate())
    if cfg.server.procs == 1:
        tune_for_replicas()
    base = config.parent
    token_file = base / cfg.token_file
    admin_token(token_file)  # without an admin token: ConfigError now rather than 401s later
    node = Node(cfg, node_id, config, base / cfg.node(node_id).data_dir, TokenStore(token_file),
                server_ssl=server_context(cfg, base), client_ssl=client_context(cfg, base), replace=replace,
                zone=zone)
    freeze_heap()  # start-up's objects: never walked by the collector again
    await node.run(stop_event())
