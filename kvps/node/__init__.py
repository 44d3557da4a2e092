"""The node process: it hosts a host's replicas and serves the admin HTTP API.

- ``node``: ``Node``, the supervisor of its replica processes and the admin app
- ``meta_service``: the metadata Raft group (node list, shard assignment) in the node process
- ``rebalance``: moving replicas between nodes, one at a time, on the metadata leader
- ``snapshots``: the coordinator of cluster-wide user snapshots; ``snapshot_api`` its routes
- ``openapi``: the OpenAPI document of the admin and data APIs
- ``local``: ``LocalCluster``, a cluster of local node processes (``kvps up``, tests, demo)
- ``process``: child processes that die with their parent
- ``main``: the node process's body
"""
