"""kvps_client.torch: train a PyTorch model on kvps in a few lines (the client modules that import
torch are ``_torch_*``; this one gathers their public names).

    import kvps_client as kc
    from kvps_client.torch import Embedding, EmbeddingBagCollection, KvpsStore, PSModule, SyncPSModule

    async with kc.Client(endpoints) as ps:                   # an asyncio training loop
        pm = PSModule(model, ps, prefix="mlp/", optimizer=kc.SGD(lr=0.1), overlap=True)
        for x, y in batches:
            await pm.pull()                                  # parameters into the module, in place
            await pm.backward(F.cross_entropy(model(x), y))  # hooks push each gradient once ready
            await pm.push()                                  # wait for the pushes, clear the grads
        await pm.close()

    with kc.SyncClient(endpoints) as ps:                     # an ordinary training loop
        pm = SyncPSModule(model, ps, prefix="mlp/", optimizer=kc.SGD(lr=0.1), overlap=True)
        sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=10)  # runs on the server
        for x, y in batches:
            pm.pull(); F.cross_entropy(model(x), y).backward(); pm.push(); sched.step()

Each parameter is a key ``prefix + name``, created on first use with the module's current value
("create if absent": the first worker's value wins, the others pull it); the weight of an
``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` is a table and only the rows a
batch touched are pushed. The optimizer runs on the server; ``pm.optimizer`` is a
``torch.optim.Optimizer`` for schedulers and ``torch.amp.GradScaler`` (``scaler=``).
``max_staleness`` picks the consistency mode (``kvps_client.StepClock``).

CUDA: copies run on a copy stream ordered after the caller's current stream (and the caller's
stream waits for copies into the parameters), end with blocking events waited for in the module's
worker thread, and stage through one pinned pool per module, reused every step.

torchrun: ``PSModule.from_env(model, endpoints)`` reads RANK, WORLD_SIZE, LOCAL_RANK and
TORCHELASTIC_RUN_ID; ``KvpsStore`` is a ``torch.distributed.Store`` on kvps keys for
``init_process_group(store=...)``; ``torchrun --rdzv-backend kvps`` rendezvous on one too.
"""
from __future__ import annotations

from ._torch_embedding import Embedding
from ._torch_embedding_bag import EmbeddingBagCollection
from ._torch_env import TorchrunEnv
from ._torch_module import PSModule
from ._torch_optim import PSOptimizer
from ._torch_store import KvpsStore, StoreTimeout
from ._torch_sync import SyncPSModule

__all__ = ["Embedding", "EmbeddingBagCollection", "KvpsStore", "PSModule", "PSOptimizer", "StoreTimeout", "SyncPSModule", "TorchrunEnv"]
