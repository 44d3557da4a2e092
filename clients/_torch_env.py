"""``TorchrunEnv``: what torchrun tells a worker, for ``PSModule.from_env``."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvps.errors import InvalidRequest

__all__ = ["TorchrunEnv"]


@dataclass(frozen=True)
class TorchrunEnv:
    """A worker's place in a torchrun job: ``RANK`` (worker id), ``WORLD_SIZE`` (worker count),
    ``LOCAL_RANK`` (its GPU on this host) and ``TORCHELASTIC_RUN_ID`` (the job id)."""

    rank: int
    world_size: int
    local_rank: int
    run_id: str

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "TorchrunEnv":
        env = os.environ if environ is None else environ
        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in env]
        if missing:
            raise InvalidRequest(f"{' and '.join(missing)} not set: start this script with torchrun "
                                 "(or set RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RUN_ID)")
        try:
            out = cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                      env.get("TORCHELASTIC_RUN_ID", "none"))
        except ValueError as exc:
            raise InvalidRequest(f"torchrun variables must be integers: {exc}") from None
        if not 0 <= out.rank < out.world_size:
            raise InvalidRequest(f"RANK {out.rank} is not in [0, WORLD_SIZE={out.world_size})")
        return out

    def device(self) -> torch.device:
        """This worker's GPU (``cuda:LOCAL_RANK``) when there is one, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def module_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """PSModule options with the job (run id), worker (rank) and worker count filled in."""
        return {"job": f"torchrun-{self.run_id}", "worker": f"rank-{self.rank}",
                "workers": self.world_size, **options}

    def place(self, module: nn.Module) -> None:
        device = self.device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        module.to(device)
