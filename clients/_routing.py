"""The client's view of the cluster: which replicas hold each shard and which one leads."""
from __future__ import annotations

import functools
import ipaddress
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvps.errors import Unavailable

__all__ = ["ClusterMap", "is_loopback_host", "is_loopback_url"]


@dataclass
class ClusterMap:
    shards: int
    block_bytes: int
    max_push_bytes: int
    replicas: list[list[str]]                 # shard -> data URLs of its replicas
    leaders: list[str | None] = field(default_factory=list)  # shard -> believed leader URL
    # admin URLs of the cluster's nodes (joined ones too): where to refetch the map from when
    # the endpoints the client was given have left the cluster
    admin_urls: list[str] = field(default_factory=list)
    # data URL -> (host, wire port, shard, tls) of the replicas whose node serves the binary data
    # plane (kvps.delta.wire); a replica missing here is called over HTTP
    wire: dict[str, tuple[str, int, int, bool]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClusterMap":
        try:
            info = data["cluster"]
            shards = sorted(data["shards"], key=lambda s: s["id"])
            return cls(
                shards=int(info["shards"]), block_bytes=int(info["block_bytes"]),
                max_push_bytes=int(info["max_push_bytes"]),
                replicas=[[r["data_url"] for r in s["replicas"]] for s in shards],
                leaders=[s.get("leader_url") for s in shards],
                admin_urls=[n["admin_url"] for n in data.get("nodes", [])
                            if n.get("state", "active") != "removed" and "admin_url" in n],
                wire={r["data_url"]: _wire_address(r["wire"], s["id"], r["data_url"])
                      for s in shards for r in s["replicas"] if r.get("wire")})
        except (KeyError, TypeError, ValueError) as exc:
            raise Unavailable(f"malformed cluster map: {exc}") from exc

    def on_loopback(self, shard: int) -> bool:
        """Whether every replica of ``shard`` is on a loopback address (this host)."""
        return bool(self.replicas[shard]) and all(is_loopback_url(u) for u in self.replicas[shard])

    def target(self, shard: int, *, any_replica: bool, attempt: int, rng: random.Random) -> str:
        """The URL to try next: the believed leader, else the replicas in turn."""
        replicas = self.replicas[shard]
        if any_replica:
            return replicas[(rng.randrange(len(replicas)) + attempt) % len(replicas)]
        leader = self.leaders[shard]
        if leader is not None:
            return leader
        return replicas[attempt % len(replicas)]

    def set_leader(self, shard: int, url: str | None) -> None:
        self.leaders[shard] = url


def _wire_address(address: str, shard: int, data_url: str) -> tuple[str, int, int, bool]:
    host, _, port = str(address).rpartition(":")
    return host, int(port), int(shard), data_url.startswith("https:")


@functools.lru_cache(maxsize=4096)
def is_loopback_url(url: str) -> bool:
    """``url``'s host is ``localhost`` or a loopback address (127.0.0.0/8, ::1). Cached: asked
    for every shard of every pull, and parsing an address costs ~15 µs."""
    return is_loopback_host(urlsplit(url).hostname or "")


def is_loopback_host(host: str) -> bool:
    """``host`` is ``localhost`` or a loopback address; a DNS name is not (it would need resolving)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
