"""Small blocks packed into one frame array per dtype (``kvps.delta.pack``) and read back, on
the client (``unpack``) and on the server (``requests.packed``), with junk refused."""
from __future__ import annotations

import numpy as np
import pytest

from kvps.delta import frame
from kvps.delta.pack import pack_into, unpack
from kvps.errors import CodecError, InvalidRequest
from kvps.replica import requests as rq

VALUES = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(2.5, np.float64), np.zeros((0, 4), np.float32),
          np.full(5, 7, np.float16), np.arange(3, dtype=np.float32)[::-1]]  # last: not contiguous


def _packed_frame():
    entries = [{"key": f"k{i}", "block": 0} for i in range(len(VALUES))]
    arrays = [np.ones(2, np.float32)]  # an unpacked array before them keeps indexes honest
    assert pack_into(entries, VALUES, arrays) == 3  # float32, float64, float16
    data = frame.encode(frame.KIND_REQUEST, {"dense": entries}, arrays)
    return entries, frame.decode(data, max_raw_bytes=1 << 20, kinds=(frame.KIND_REQUEST,))


def test_packed_blocks_read_back_exactly_on_both_sides():
    entries, req = _packed_frame()
    assert len(req.arrays) == 4
    for entry, value in zip(req.meta["dense"], VALUES):
        server, client = rq.packed(req, entry), unpack(req.arrays, entry)
        for got in (server, client):
            assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)
        assert not client.flags.writeable and not np.shares_memory(client, req.arrays[entry["packed"]])


@pytest.mark.parametrize("change", [
    {"at": 10_000}, {"at": -1}, {"shape": [100]}, {"shape": [-1]}, {"shape": [True]}, {"shape": "3"},
    {"packed": 99}, {"packed": "0"}, {"at": 1.5}, {"shape": [1] * 9},
])
def test_a_bad_packed_reference_is_refused(change):
    entries, req = _packed_frame()
    entry = {**req.meta["dense"][0], **change}
    with pytest.raises(InvalidRequest):
        rq.packed(req, entry)
    with pytest.raises(CodecError):
        unpack(req.arrays, entry)


def test_a_packed_reference_to_a_2d_array_is_refused():
    req = frame.decode(frame.encode(frame.KIND_REQUEST, {}, [np.zeros((2, 2), np.float32)]),
                       max_raw_bytes=1 << 20, kinds=(frame.KIND_REQUEST,))
    with pytest.raises(InvalidRequest):
        rq.packed(req, {"packed": 0, "at": 0, "shape": [2]})
    with pytest.raises(CodecError):
        unpack(req.arrays, {"packed": 0, "at": 0, "shape": [2]})
