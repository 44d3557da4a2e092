"""kvps: a fault-tolerant parameter server for PyTorch training (server side and pure core)."""

__version__ = "0.1.0"
