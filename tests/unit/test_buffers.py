"""kvps.buffers: a receive buffer is handed out again only once nothing refers to it."""
from __future__ import annotations

import numpy as np

from kvps.buffers import MiB, RecycledBuffers


def test_a_buffer_comes_back_only_once_every_view_and_export_of_it_is_gone():
    pool = RecycledBuffers(max_bytes=8 * MiB)
    first = pool.take(3 * MiB)
    first[:] = 1
    second = pool.take(3 * MiB)  # the first is held: a new buffer
    assert not np.shares_memory(first, second) and pool.allocated == 2 and pool.reused == 0
    view = memoryview(first)[10:20].toreadonly()  # what a decoded log entry keeps
    arr = np.frombuffer(view, np.uint8)  # and an array over that
    del first
    third = pool.take(3 * MiB)  # still referenced through view and arr: not reused, no room left
    assert pool.reused == 0 and bytes(view) == b"\x01" * 10
    del view, arr
    fourth = pool.take(3 * MiB)
    assert pool.reused == 1 and fourth.base is not None and len(fourth) == 3 * MiB
    assert not np.shares_memory(fourth, second) and not np.shares_memory(fourth, third)


def test_sizes_share_buffers_within_a_factor_of_two_and_the_pool_stays_in_its_bytes():
    pool = RecycledBuffers(max_bytes=4 * MiB, min_bytes=1024)
    small = pool.take(100)  # below min_bytes: its own array, not kept
    assert small.base is None and pool.kept == 0
    a = pool.take(MiB + 1)  # kept as 2 MiB
    assert pool.kept == 2 * MiB
    del a
    b = pool.take(MiB)  # fits within 2x: the same buffer
    assert pool.reused == 1
    del b
    c = pool.take(5 * MiB)  # larger than the pool: its own array
    assert c.base is None and pool.kept == 2 * MiB
    d = pool.take(3 * MiB)  # needs 3 MiB: the unreferenced 2 MiB one is dropped to make room
    assert pool.kept == 3 * MiB and d.base is not None and len(d) == 3 * MiB


def test_a_shards_spare_block_values_stay_within_their_bounds():
    """kvps.dense.Slots keeps replaced values of 64 KiB or more, two per shape, max_bytes in all."""
    from kvps.dense import Slots
    slots = Slots(max_bytes=1 << 20, depth=2, min_bytes=64 << 10)
    slots.retire(np.zeros(100, np.float32))  # small: left to the allocator
    assert slots.kept == 0
    for _ in range(5):
        slots.retire(np.zeros((64, 256), np.float32))  # 64 KiB each: two kept
    assert slots.kept == 2 * (64 << 10)
    for n in range(8):
        slots.retire(np.zeros((n + 1, 64 << 10), np.uint8))  # growing shapes: the oldest go first
        assert slots.kept <= 1 << 20
    got = slots.take((8, 64 << 10), np.dtype(np.uint8))
    assert got is not None and got.flags.writeable and slots.take((8, 64 << 10), np.dtype(np.uint8)) is None
    assert slots.take((8, 64 << 10), np.dtype(np.float32)) is None  # another dtype: none
