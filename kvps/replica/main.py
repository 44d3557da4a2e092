"""The replica process's composition root: one shard replica and its data endpoint.

A node starts one per hosted shard (``kvps replica --config ... --node N --shard S``): this builds
the ``Replica`` from the cluster config, serves its data-plane app, and stops both on SIGINT or
SIGTERM."""
from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from kvps.config import load_cluster
from kvps.service.auth import TokenStore
from kvps.service.connections import ConnectionLimits
from kvps.service.tls import client_context, server_context
from kvps.replica.dataplane import make_app
from kvps.replica.replica import Replica
from kvps.service.lifecycle import GcCollector, freeze_heap, stop_event, tune_for_replicas

__all__ = ["run_replica"]


async def run_replica(config: Path, node_id: int, shard: int, peers: list[str] | None = None,
                      joining: bool = False, bind: str | None = None) -> None:
    tune_for_replicas()  # malloc is tuned by the node through this process's environment
    cfg = load_cluster(config).with_bind(node_id, bind)
    base = config.parent
    node = cfg.node(node_id)
    secret = (base / cfg.secret_file).read_bytes().strip()
    tokens = TokenStore(base / cfg.token_file)
    stop = stop_event()
    replica = await Replica.open(cfg, node_id, shard, secret=secret, data_dir=base / node.data_dir,
                                 token=tokens.admin_token,
                                 client_ssl=client_context(cfg, base), peers=peers, joining=joining)
    limits = ConnectionLimits(idle_timeout=cfg.server.idle_timeout,
                              per_peer=cfg.server.max_connections_per_peer,
                              registry=replica.stats.metrics.registry, node=node_id,
                              server=f"shard-{shard}")
    replica.stats.metrics.registry.register(GcCollector({"node": str(node_id), "process": f"shard-{shard}"}))
    freeze_heap()
    app = make_app(replica, tokens)
    app.middlewares.insert(0, limits.middleware)
    runner = web.AppRunner(app, access_log=None, **limits.runner_kwargs())
    await runner.setup()
    limits.install(runner)
    await web.TCPSite(runner, node.listen_host, node.data_port(shard), reuse_address=True,
                      ssl_context=server_context(cfg, base)).start()
    logging.getLogger("kvps.replica").info("shard %d replica on node %d serving %s", shard, node_id,
                                           node.data_url(shard))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await replica.stop()
