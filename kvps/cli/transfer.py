"""``kvps export PATH`` and ``kvps import PATH``: every key to and from a PyTorch file."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvps.errors import KvpsError

__all__ = ["export_live", "import_file"]


async def export_live(args: argparse.Namespace) -> int:
    import torch

    from kvps_client import Client
    async with Client([args.endpoint], token=args.token, ssl=args.cafile) as ps:
        state = await ps.state_dict()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    tmp = Path(args.path + ".tmp")
    torch.save(tensors, tmp)
    os.replace(tmp, args.path)  # never a half-written file under the final name
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"exported {len(tensors)} tensors ({total / 2**20:.1f} MiB) to {args.path}")
    return 0


async def import_file(args: argparse.Namespace) -> int:
    import torch

    from kvps.optimizer import optimizer_from_dict
    from kvps_client import Client
    try:
        state = torch.load(args.path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises many types for a bad file: one line, non-zero exit
        raise KvpsError(f"cannot read {args.path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise KvpsError(f"{args.path} is not a {{name: tensor}} state_dict")
    optimizer = optimizer_from_dict(json.loads(args.optimizer)) if args.optimizer else None
    async with Client([args.endpoint], token=args.token, ssl=args.cafile) as ps:
        written = await ps.load_state_dict({k: v.detach().cpu().numpy() for k, v in state.items()},
                                           optimizer=optimizer)
    print(f"imported {len(written)} keys from {args.path}")
    return 0
