"""Configuration: frozen dataclasses with commented defaults, validated with one message per field.

Pure: no I/O except the explicit ``load_cluster`` / ``dump_cluster`` helpers that read and write a
``cluster.toml`` given a path (called only from the wiring layer).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvps.errors import ConfigError

__all__ = [
    "ClusterConfig", "FSYNC_POLICIES", "NodeConfig", "RaftConfig", "ServerConfig", "dump_cluster",
    "load_cluster",
]

MiB = 1 << 20

# When a replica's Raft journal reaches stable storage (kvps/raft/journal.py, README "Durability").
FSYNC_POLICIES = ("never", "interval", "always")


@dataclass(frozen=True)
class RaftConfig:
    # Election timeout range (s): how long followers wait for a silent leader before they stand.
    # A leader whose process dies is replaced without waiting for it (fast_failover, ~0.3 s); this
    # is for partitioned and hung leaders. It must outlast the stalls of a loaded machine: with
    # 0.4-0.8 s, B1 on 2 cores held a node's Raft thread 0.4-0.6 s now and then (one tick applying
    # megabytes for each of its replicas in turn), and 2 of 3 full runs had 6 elections and up to
    # 16 client retries with no fault injected. etcd's default is 1 s, randomised up to 2x.
    election_timeout_min: float = 1.0
    election_timeout_max: float = 2.0
    # Heartbeat / append period (s). Must be < election_timeout_min / 3 (pysyncobj asserts it).
    heartbeat_period: float = 0.05
    # A leader that has not heard from a majority for this long steps down. pysyncobj's default is
    # 30 s, which lets a partitioned leader serve stale reads for 30 s: keep it near the election
    # timeout, and below its minimum, so a cut-off leader has stepped down before a new one can win.
    leader_fallback_timeout: float = 0.8
    # A peer connection with no traffic for this long is dropped (>= election_timeout_max); one
    # with nothing to send for a quarter of it sends a keepalive.
    connection_timeout: float = 4.0
    # A leader whose group has been still for quiet_after s (everything committed, applied and
    # acknowledged, every member connected) heartbeats only every quiet_heartbeat_period s, and
    # its followers wait that much longer before they stand (kvps/raft/quiet.py): an idle cluster
    # of 3 nodes x 8 shards sent ~720 heartbeats and replies a second here. A cut-off leader of a
    # quiet group is then replaced up to this much later; a dead one as fast as before. 0 turns
    # it off. Capped at connection_timeout / 4 (quiet_period), so that the quiet heartbeats take
    # the keepalives' place instead of adding to them.
    quiet_heartbeat_period: float = 0.8
    quiet_after: float = 1.0
    # Reconnect attempts to a lost peer every this many seconds (pysyncobj's default is 5 s).
    connection_retry: float = 0.2
    # When the leader's process dies, its kernel closes its peer connections and its Raft port
    # refuses new ones; a follower that sees both stands for election after a short delay instead
    # of a full election timeout (kvps/raft/failover.py). Partitions and slow leaders close nothing
    # and still wait for the timeout. Safety never depends on timeouts, only availability does.
    fast_failover: bool = True
    # Between the surviving replicas' elections (s): the k-th by address waits k * stagger plus up
    # to a quarter stagger, so the first one's vote request arrives before the next one stands
    # (0.1 s was too little on a loaded 2-core machine). Above pysyncobj's 50 ms tick.
    fast_failover_stagger: float = 0.15
    # Largest command a leader proposes. appendEntriesBatchSizeBytes is set just above it, so
    # pysyncobj never takes its chunked path (which truncates entries, see DESIGN).
    max_command_bytes: int = 8 * MiB
    # Largest peer frame accepted; checked on the frame header before anything is buffered.
    max_frame_bytes: int = 64 * MiB
    # Socket buffers for peer connections; 0 keeps the kernel's autotuning.
    socket_buffer_bytes: int = 0
    # Compact the log (our snapshot format) after this many applied bytes / entries; for a shard
    # bigger than compact_bytes, once the log has grown by compact_ratio x the last snapshot's size
    # (writing a 1 GB snapshot every 32 MB of pushes would keep the disk busy with compactions).
    # Small, because the log lives in fresh memory until a compaction frees it: 256 MiB per
    # replica (the earlier default) put every pushed byte of a B1 run into pages the replicas had
    # never touched (41k page faults and 1.5 s of system CPU per step); 32 MiB recycles them
    # (5-6k faults, 0.5 s; B1 of `kvps bench` on 2 cores).
    compact_bytes: int = 32 * MiB
    compact_entries: int = 20000
    compact_ratio: float = 1.0
    # Commands waiting in pysyncobj's queue before it answers QUEUE_FULL.
    queue_size: int = 4096
    # When journal appends reach stable storage. Every policy survives kill -9 (the page cache
    # holds the write); they differ on power loss of a majority: "never" can lose any unsynced
    # acks, "interval" those of the last fsync_interval seconds, "always" none (fdatasync before
    # an append is acknowledged). Default chosen by benchmarks/fsync_policy.py, see README.
    fsync: str = "interval"
    fsync_interval: float = 0.05
    # Size of each journal segment file: preallocated once and recycled after compactions, so
    # appends never grow a file or touch fresh memory (kvps/raft/segments.py). A command larger
    # than a segment gets a segment of its own. Twice max_command_bytes: a compaction retires only
    # whole segments, and 64 MiB ones held up to 96 MiB of log per replica (and their
    # preallocation showed as 180 MiB of page cache per B1 step) where 16 MiB ones hold ~48.
    journal_segment_bytes: int = 16 * MiB
    # An entry's command leaves memory once it is applied and every follower has it (the journal
    # holds it; kvps/raft/log_memory.py); a leader holding more than this of commands some
    # follower still lacks releases them anyway, and serves that follower from its journal.
    log_memory_bytes: int = 64 * MiB

    @property
    def quiet_period(self) -> float:
        """The quiet heartbeat period in effect (0: off): see quiet_heartbeat_period."""
        return min(self.quiet_heartbeat_period, self.connection_timeout / 4)

    def validate(self) -> "RaftConfig":
        _positive(self, "election_timeout_min", "heartbeat_period", "leader_fallback_timeout",
                  "connection_timeout", "max_command_bytes", "max_frame_bytes", "compact_bytes",
                  "compact_entries", "queue_size", "fsync_interval", "compact_ratio",
                  "log_memory_bytes")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {self.fsync!r}",
                              field="fsync")
        if self.election_timeout_max <= self.election_timeout_min:
            raise ConfigError("election_timeout_max must be greater than election_timeout_min",
                              field="election_timeout_max")
        if self.heartbeat_period * 3 >= self.election_timeout_min:
            raise ConfigError("heartbeat_period must be less than election_timeout_min / 3",
                              field="heartbeat_period")
        if self.leader_fallback_timeout <= self.heartbeat_period:
            raise ConfigError("leader_fallback_timeout must exceed heartbeat_period",
                              field="leader_fallback_timeout")
        if self.connection_timeout < self.election_timeout_max:
            raise ConfigError("connection_timeout must be >= election_timeout_max",
                              field="connection_timeout")
        if self.connection_retry < 0:
            raise ConfigError("connection_retry must be >= 0", field="connection_retry")
        if self.quiet_heartbeat_period and not self.heartbeat_period < self.quiet_heartbeat_period:
            raise ConfigError("quiet_heartbeat_period must be 0 (off) or above heartbeat_period",
                              field="quiet_heartbeat_period")
        if not self.quiet_after >= 0:
            raise ConfigError("quiet_after must be >= 0", field="quiet_after")
        if not isinstance(self.fast_failover, bool):
            raise ConfigError("fast_failover must be true or false", field="fast_failover")
        if not 0 < self.fast_failover_stagger < self.election_timeout_min:
            raise ConfigError("fast_failover_stagger must be > 0 and less than election_timeout_min",
                              field="fast_failover_stagger")
        if self.max_frame_bytes < 2 * self.max_command_bytes + MiB:
            raise ConfigError("max_frame_bytes must be >= 2 * max_command_bytes + 1 MiB (an append "
                              "message may carry up to two batches)", field="max_frame_bytes")
        if self.journal_segment_bytes < MiB // 16:
            raise ConfigError("journal_segment_bytes must be at least 64 KiB",
                              field="journal_segment_bytes")
        if self.socket_buffer_bytes < 0:
            raise ConfigError("socket_buffer_bytes must be >= 0", field="socket_buffer_bytes")
        return self


@dataclass(frozen=True)
class ServerConfig:
    # Data-plane request bodies above this are refused (413) before they are read.
    max_request_bytes: int = 64 * MiB
    # Leadership transfers spread the shards' leaders evenly over the nodes once the cluster has
    # settled (kvps/node/leaders.py): whoever wins an election leads, which can put most of the
    # leader work on one node.
    spread_leaders: bool = True
    # Decompressed size cap for a request frame (decompression bombs).
    max_raw_bytes: int = 256 * MiB
    # A request body must arrive within this many seconds (slow or stalled clients).
    body_timeout: float = 30.0
    # Leader batching: pushes waiting for a proposal slot are merged into one command of at most
    # batch_bytes (merged size: a block pushed by several workers counts once); it must leave
    # room under raft.max_command_bytes.
    batch_bytes: int = 6 * MiB
    # An idle leader waits this long before proposing, so the pushes of one training step from
    # several workers merge into one entry (under load the commit round trip is the window); only
    # while more than one client pushes to it (a lone writer's push goes out at once).
    merge_window: float = 0.002
    # Proposals in flight at once; more pushes wait and get merged.
    max_inflight_proposals: int = 2
    # Bytes of pushes accepted but not yet committed; beyond it pushes wait up to
    # overload_wait seconds, then fail with Overloaded (retryable).
    max_inflight_bytes: int = 256 * MiB
    overload_wait: float = 2.0
    # How long a new leader waits for its barrier, and a follower read for min_version.
    barrier_wait: float = 2.0
    # Pulls send exact XOR deltas against the last delta_depth versions of a block, kept within
    # delta_history_bytes per replica (references to immutable blocks; a miss is a full block).
    delta_depth: int = 4
    delta_history_bytes: int = 256 * MiB
    # Applied-table sessions idle for longer than this are forgotten (leader-stamped time).
    session_ttl: float = 3600.0
    # Gradients with NaN/Inf: "reject" (InvalidRequest) or "skip" (drop the push, answer ok).
    nonfinite: str = "reject"
    # Debug switch for the chaos harness: disables the duplicate table (never in production).
    unsafe_disable_dedup: bool = False
    # User snapshots: while one is being cut, acknowledgements of pushes applied after the cut are
    # held until its timestamp is fixed, at most snapshot_hold seconds (a coordinator that takes
    # longer abandons the snapshot). snapshot_every > 0 takes one every that many seconds;
    # snapshot_keep > 0 keeps only the newest that many (0: keep all).
    snapshot_hold: float = 5.0
    snapshot_every: float = 0.0
    snapshot_keep: int = 0
    # Data and admin ports (kvps/service/connections.py): a connection with no request in
    # progress is closed after idle_timeout seconds. Above the clients' keep-alive (aiohttp's
    # connector drops a pooled connection after 15 s idle), so a client never sends on a
    # connection the server is closing; far below aiohttp's own default (an hour).
    idle_timeout: float = 60.0
    # Connections open at once from one remote IP; more are answered 429 and closed. A client
    # opens at most 16 per server (limit_per_host) and a training host runs tens of workers
    # (8 GPUs x dataloader/worker processes, each a client): 1024 leaves room for 64 clients on
    # one address and still stops one address from holding every descriptor (ulimit -n is
    # often 1024-65536 per process).
    max_connections_per_peer: int = 1024
    # Bytes of embedding-table rows each shard replica may hold (accounted per row: values,
    # optimizer state, a 48-byte record and index entry); a push past it is refused with
    # CapacityExceeded, decided in apply so every replica agrees. None: unbounded.
    memory_limit: int | None = None
    # A node the metadata leader cannot reach for this many seconds is declared dead: its
    # replicas are re-created on live nodes (one move at a time, zones respected) and it is
    # removed; it can only come back as a new node (kvps/node/liveness.py).
    node_dead_after: float = 600.0
    # Where a node runs the replicas it hosts. 1 (the default): all of them in the node's own
    # process, one event loop for their data ports and a few Raft tickers for their groups
    # (kvps/replica/resident.py); a replica that cannot follow its log is restarted there alone,
    # a crash of the process takes the node's replicas down together. Measured side by side in
    # one bench run: idle 0.17 vs 0.25 cores, B1 2.52 vs 2.28 steps/s with 0 vs 3 elections,
    # 744 vs 2,068 page faults per step, ready 2.0 vs 9.0 s after start. 0: one OS process per
    # replica (the first design: a crashed replica process takes nothing else down; every process
    # ticks, polls and heartbeats on its own). `kvps node --procs`, `kvps up --procs`.
    procs: int = 1
    # With procs = 1: threads that tick the node's Raft groups (kvps/raft/ticker.py), the groups
    # spread over them. One thread for all of them let one round of applies and journal writes
    # hold back a leader's heartbeats past the election timeout under load (B1 here: 15 role
    # changes in a 15 s window with 1, 6 with 2, 0-3 with 4); idle, 4 cost what 1 does.
    raft_threads: int = 4
    # With procs = 1: serve the binary data plane (kvps/delta/wire.py) on the node's wire port,
    # port_base + 2 * shards + 1: one pipelined connection per client for every replica the node
    # hosts, where HTTP costs an exchange per request. Clients use it where the cluster map names
    # it (Client(wire=False): HTTP only); the replicas' HTTP data ports keep serving either way.
    wire: bool = True
    # A leader asked by a client on its host keeps its dense blocks in a shared-memory mirror of
    # up to this many bytes (kvps/replica/mirror.py; a sparse file in /dev/shm, pages taken as
    # blocks are written; a full one is replaced by a new one). 0: no mirrors, TCP pulls only.
    mirror_bytes: int = 1 << 30

    def validate(self) -> "ServerConfig":
        _positive(self, "max_request_bytes", "max_raw_bytes", "body_timeout", "batch_bytes",
                  "max_inflight_proposals", "max_inflight_bytes", "overload_wait", "barrier_wait",
                  "delta_depth", "delta_history_bytes",
                  "session_ttl", "idle_timeout", "max_connections_per_peer", "node_dead_after")
        if self.merge_window < 0:
            raise ConfigError("merge_window must be >= 0", field="merge_window")
        if self.nonfinite not in ("reject", "skip"):
            raise ConfigError("nonfinite must be 'reject' or 'skip'", field="nonfinite")
        _positive(self, "snapshot_hold")
        if self.memory_limit is not None and (isinstance(self.memory_limit, bool)
                                              or not isinstance(self.memory_limit, int) or self.memory_limit < 1):
            raise ConfigError("memory_limit must be a positive int of bytes (or absent)", field="memory_limit")
        if isinstance(self.raft_threads, bool) or not isinstance(self.raft_threads, int) \
                or not 1 <= self.raft_threads <= 64:
            raise ConfigError("raft_threads must be an int from 1 to 64", field="raft_threads")
        if isinstance(self.procs, bool) or self.procs not in (0, 1):
            raise ConfigError("procs must be 0 (one process per replica) or 1 (every replica in "
                              "the node's process)", field="procs")
        if isinstance(self.mirror_bytes, bool) or not isinstance(self.mirror_bytes, int) or self.mirror_bytes < 0:
            raise ConfigError("mirror_bytes must be an int >= 0", field="mirror_bytes")
        if self.snapshot_every < 0 or self.snapshot_keep < 0:
            raise ConfigError("snapshot_every and snapshot_keep must be >= 0", field="snapshot_every")
        return self


@dataclass(frozen=True)
class NodeConfig:
    id: int
    host: str = "127.0.0.1"
    # The node's admin HTTP port.
    admin_port: int = 7100
    # Replica of shard s on this node: raft port = port_base + 2*s, data port = port_base + 2*s + 1;
    # then the metadata replica's Raft port (port_base + 2*shards) and the node's wire port
    # (port_base + 2*shards + 1, ClusterConfig.wire_port).
    port_base: int = 7200
    data_dir: str = ""
    # "https" when the cluster serves TLS (see ClusterConfig.tls_cert); Raft peer traffic is
    # authenticated with the cluster secret either way.
    scheme: str = "http"
    # The address this node's sockets listen on, when it is not ``host`` (the address the others
    # reach it at): e.g. "0.0.0.0" in a container whose DNS name resolves to the pod's address
    # only. Empty: listen on ``host``. ``kvps node --bind`` sets it for one process.
    bind: str = ""
    # The failure domain this node is in (a rack, a zone: Kubernetes' topology.kubernetes.io/zone).
    # The rebalancer never puts two replicas of a shard in one zone while another zone can take
    # one. Empty: the node is a failure domain of its own.
    zone: str = ""

    def raft_address(self, shard: int) -> str:
        return f"{self.host}:{self.port_base + 2 * shard}"

    def data_url(self, shard: int) -> str:
        return f"{self.scheme}://{self.host}:{self.port_base + 2 * shard + 1}"

    def data_port(self, shard: int) -> int:
        return self.port_base + 2 * shard + 1

    @property
    def admin_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.admin_port}"

    @property
    def listen_host(self) -> str:
        return self.bind or self.host

    def raft_bind(self, port: int) -> str | None:
        """pysyncobj's ``bindAddress`` for a Raft port of this node (None: its own address)."""
        return f"{self.bind}:{port}" if self.bind else None


@dataclass(frozen=True)
class ClusterConfig:
    nodes: tuple[NodeConfig, ...]
    shards: int = 8
    replicas: int = 3
    # Dense keys are split into blocks of at most this many bytes along dim 0.
    block_bytes: int = 1 * MiB
    # Files next to cluster.toml (relative paths are resolved against its directory).
    secret_file: str = "secret"
    token_file: str = "token"
    # Optional TLS for client and admin traffic (PEM files). Empty: plain HTTP on loopback.
    # tls_ca is what clients and nodes verify servers with (default: tls_cert itself, which
    # suits a self-signed certificate).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    raft: RaftConfig = field(default_factory=RaftConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> "ClusterConfig":
        if not self.nodes:
            raise ConfigError("a cluster needs at least one node", field="nodes")
        ids = [n.id for n in self.nodes]
        if sorted(ids) != list(range(len(ids))):
            raise ConfigError("node ids must be 0..n-1", field="nodes")
        if self.shards < 1:
            raise ConfigError("shards must be >= 1", field="shards")
        if not 1 <= self.replicas <= len(self.nodes):
            raise ConfigError("replicas must be between 1 and the number of nodes", field="replicas")
        if self.block_bytes < 1024:
            raise ConfigError("block_bytes must be >= 1024", field="block_bytes")
        if self.block_bytes * 2 > self.raft.max_command_bytes:
            raise ConfigError("block_bytes must be at most half of raft.max_command_bytes",
                              field="block_bytes")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together", field="tls_cert")
        scheme = "https" if self.tls_cert else "http"
        if any(n.scheme != scheme for n in self.nodes):
            raise ConfigError(f"every node's scheme must be {scheme!r} when tls_cert is "
                              f"{'set' if self.tls_cert else 'empty'}", field="nodes")
        self.raft.validate()
        self.server.validate()
        if self.server.batch_bytes > self.raft.max_command_bytes - MiB:
            raise ConfigError("server.batch_bytes must be at most raft.max_command_bytes - 1 MiB",
                              field="batch_bytes")
        return self

    def node(self, node_id: int) -> NodeConfig:
        return self.nodes[node_id]

    def wire_port(self, node_id: int) -> int:
        """Node ``node_id``'s wire port (the binary data plane, ``server.wire``)."""
        return self.nodes[node_id].port_base + 2 * self.shards + 1

    def with_bind(self, node_id: int, bind: str | None) -> "ClusterConfig":
        """This config with node ``node_id`` listening on ``bind`` (None: unchanged)."""
        if not bind:
            return self
        nodes = tuple(dataclasses.replace(n, bind=bind) if n.id == node_id else n for n in self.nodes)
        return dataclasses.replace(self, nodes=nodes)

    def replica_nodes(self, shard: int) -> list[int]:
        """Nodes hosting ``shard``; the first is the preferred leader."""
        n = len(self.nodes)
        return [(shard + j) % n for j in range(self.replicas)]

    def shards_on(self, node_id: int) -> list[int]:
        return [s for s in range(self.shards) if node_id in self.replica_nodes(s)]


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ConfigError(f"{name} must be > 0", field=name)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) in [{where}]: {', '.join(unknown)}", field=where)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"bad [{where}]: {exc}", field=where) from exc


def load_cluster(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", field="path") from exc
    cluster = dict(data.get("cluster", {}))
    nodes = tuple(_build(NodeConfig, dict(n), "nodes") for n in data.get("nodes", []))
    raft = _build(RaftConfig, dict(data.get("raft", {})), "raft")
    server = _build(ServerConfig, dict(data.get("server", {})), "server")
    cfg = _build(ClusterConfig, {**cluster, "nodes": nodes, "raft": raft, "server": server}, "cluster")
    return cfg.validate()


def dump_cluster(cfg: ClusterConfig) -> str:
    """TOML text for ``cfg`` (the subset of TOML we need: scalars, one array of tables)."""
    lines = ["# kvps cluster configuration", "[cluster]"]
    for f in dataclasses.fields(cfg):
        if f.name not in ("nodes", "raft", "server"):
            lines.append(f"{f.name} = {_toml_value(getattr(cfg, f.name))}")
    for section, default in (("raft", RaftConfig()), ("server", ServerConfig())):
        # Only what differs from the defaults: a file written today must not pin defaults that
        # a later release changes (or validates differently).
        lines += ["", f"[{section}]", "# settings not listed here take their defaults (kvps/config.py)"]
        obj = getattr(cfg, section)
        lines += [f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
                  if getattr(obj, f.name) != getattr(default, f.name)]
    for node in cfg.nodes:
        lines += ["", "[[nodes]]"]
        lines += [f"{f.name} = {_toml_value(getattr(node, f.name))}" for f in dataclasses.fields(node)
                  if f.name not in ("bind", "zone") or getattr(node, f.name)]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} as TOML")
