"""The per-shard host: one shard replica's state machine, its Raft group and its data endpoint.

- ``replica``: ``Replica``, the host of one shard replica (state and lock, writes, reads, status)
- ``batcher``: the leader's group commit (merging concurrent pushes into one log entry)
- ``dataplane``: the aiohttp app of the data endpoint (``POST /v1/rpc/{op}``)
- ``membership``: the data endpoint's ``membership`` RPC (moving replicas between nodes)
- ``history``: recent block versions, for exact XOR deltas in pulls
- ``snapshot_store``: user snapshot files on disk
- ``metrics``: the replica's Prometheus series
- ``main``: the replica process's body (``server.procs = 0``: one process per replica)
- ``resident``: a replica in its node's process (``server.procs = 1``), restarted there alone

It imports nothing of ``kvps.node``: a node hosts replicas, never the other way round.
"""
