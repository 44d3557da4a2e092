"""kvps_client: the asyncio client (and a blocking wrapper) for kvps.

    import kvps_client as kc
    async with kc.Client(["http://127.0.0.1:7100"]) as ps:
        await ps.create("w", np.zeros((4096, 1024), np.float32), optimizer=kc.SGD(lr=0.1))
        await ps.push({"w": grad})
        vals = await ps.pull(["w"])
"""
from kvps.errors import (
    CapacityExceeded,
    CodecError,
    ConnectError,
    Forbidden,
    InvalidRequest,
    KeyExists,
    KeyNotFound,
    KvpsError,
    NoQuorum,
    NotFound,
    NotLeader,
    Overloaded,
    PushExpired,
    RejectedError,
    RequestTooLarge,
    RetryableError,
    ShapeMismatch,
    Timeout,
    Unauthorized,
    Unavailable,
    VersionConflict,
    VersionNotIssued,
)
from kvps.initializer import Constant, Normal, Uniform, Zeros
from kvps.lifecycle import CountAdmission, ProbabilityAdmission
from kvps.optimizer import FTRL, SGD, Adagrad, Adam, Add, RowWiseAdagrad

from ._client import Client, ClientStats, RetryPolicy
from ._clock import StepClock
from ._sync import SyncClient
from ._transport import Body, HttpTransport, MockTransport, Transport

__all__ = [
    "Adagrad",
    "Adam",
    "Add",
    "Body",
    "CapacityExceeded",
    "Client",
    "ClientStats",
    "CodecError",
    "ConnectError",
    "Constant",
    "CountAdmission",
    "FTRL",
    "Forbidden",
    "HttpTransport",
    "InvalidRequest",
    "KeyExists",
    "KeyNotFound",
    "KvpsError",
    "MockTransport",
    "NoQuorum",
    "Normal",
    "NotFound",
    "NotLeader",
    "Overloaded",
    "ProbabilityAdmission",
    "PushExpired",
    "RejectedError",
    "RequestTooLarge",
    "RetryPolicy",
    "RetryableError",
    "RowWiseAdagrad",
    "SGD",
    "ShapeMismatch",
    "StepClock",
    "SyncClient",
    "Timeout",
    "Transport",
    "Unauthorized",
    "Unavailable",
    "Uniform",
    "VersionConflict",
    "VersionNotIssued",
    "Zeros",
]
