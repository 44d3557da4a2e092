"""``Client.set_hyperparams``: change a key's schedulable optimizer fields (an LR schedule).

The update goes to every shard that holds part of the key (a dense key's blocks, or every shard
for a table) as a replicated ``hyperparams`` command stamped with the worker step; each shard
ignores a step older than the last one it applied (see ``kvps.hyper``). Retrying is safe: the
same step and values applied twice leave the same state.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvps.errors import InvalidRequest
from kvps.hyper import check_values
from kvps.placement import DenseLayout, block_shard

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["set_hyperparams"]


async def set_hyperparams(client: "Client", key: str, values: Mapping[str, Any], *, step: int) -> dict:
    """Apply ``values`` (e.g. ``{"lr": 0.01}``) to ``key`` as of worker ``step``. Returns
    ``{"applied": bool, "step": int, "values": {...}}``: ``applied`` is False when some shard
    had already applied a later step (its step and overrides are returned then)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidRequest("step must be an int >= 0", field="step")
    meta = {"key": key, "step": step, "values": check_values(dict(values))}
    info = await client.describe(key)
    if info["kind"] == "dense":
        layout = DenseLayout(tuple(info["shape"]), info["dtype"], info["block_rows"])
        shards = sorted({block_shard(key, b, client.cluster_map.shards) for b in range(layout.n_blocks)})
    else:
        shards = list(range(client.cluster_map.shards))
    resps = await client.sender.fan_out([client.call(s, "hyperparams", meta) for s in shards])
    client._infos.pop(key, None)  # describe() shows the overrides: read them again next time
    results = [r.meta for r in resps]
    newest = max(results, key=lambda r: r["step"])
    return {"applied": all(r["applied"] for r in results), "step": newest["step"],
            "values": newest["values"]}
