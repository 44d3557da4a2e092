"""``kvps demo``: training on a local cluster while shard leaders are killed.

- ``run``: the demo (cluster, workers, faults, checks, report)
- ``digits``: the model, data and training loop of its workers
"""
