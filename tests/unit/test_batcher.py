"""The leader's group-commit batcher, driven with a fake proposer (no Raft, no network)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvps.replica.batcher import PushBatcher
from kvps.command import decode_command
from kvps.config import ServerConfig
from kvps.errors import NoQuorum, Overloaded
from kvps.merge import PushRequest
from kvps.raft.group import ENTRY_OFFSET


class FakeRaft:
    """Records proposals; each one completes only when the test releases it."""

    def __init__(self):
        self.proposed: list = []
        self.gates: list[asyncio.Future] = []
        self.copied = 0  # entries whose gradients decoded as copies, not views of the entry

    async def propose(self, data):
        # as ShardGroup.propose: one bytes object, the command behind the entry's prefix
        entry = bytes(ENTRY_OFFSET) + (b"".join(data) if isinstance(data, list) else data)
        cmd = decode_command(memoryview(entry)[ENTRY_OFFSET:])
        whole = np.frombuffer(entry, np.uint8)
        self.copied += not all(np.shares_memory(d.grad, whole) for d in cmd.dense)
        self.proposed.append(cmd)
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        outcome = await gate
        if isinstance(outcome, Exception):
            raise outcome
        return {"results": {(p.client, p.seq): {"versions": {"w": len(self.proposed)}}
                            for p in cmd.pushes}}

    def release(self, i: int, outcome=None):
        self.gates[i].set_result(outcome)


def push(client: str, seq: int, value: float = 1.0) -> PushRequest:
    return PushRequest(client, seq, seq, dense=(("w", 0, np.full(256, value, np.float32)),))


async def until(predicate, timeout: float = 2.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0)


def make(raft: FakeRaft, **cfg) -> PushBatcher:
    cfg.setdefault("merge_window", 0.0)
    return PushBatcher(raft.propose, ServerConfig(**cfg), clock=lambda: 1000.0)


def test_entries_are_encoded_for_their_place_behind_the_raft_prefix():
    """Every replica applies an entry's gradients in place (``Push.to_parts(at=ENTRY_OFFSET)``);
    encoded for offset 0 they were misaligned by the 2-byte prefix and copied on every apply."""
    async def main():
        raft = FakeRaft()
        b = make(raft)
        pushes = [asyncio.create_task(b.submit(push(c, 1))) for c in "abc"]
        released = 0
        while not all(p.done() for p in pushes):
            await until(lambda: len(raft.gates) > released or all(p.done() for p in pushes))
            if len(raft.gates) > released:
                raft.release(released)
                released += 1
        await asyncio.gather(*pushes)
        assert raft.proposed and raft.copied == 0

    asyncio.run(main())


def test_pushes_to_a_block_in_flight_wait_and_merge_even_with_a_free_slot():
    """With two proposal slots, the second worker's push to the block in flight used to take the
    free slot alone: 4 workers' pushes of one block became 3 entries. They now wait for the one
    in flight and share the next entry; a push to another block still goes out in parallel."""
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=2)
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        same = [asyncio.create_task(b.submit(push(c, 1))) for c in "bcd"]
        other = asyncio.create_task(b.submit(
            PushRequest("e", 1, 1, dense=(("v", 0, np.ones(8, np.float32)),))))
        await until(lambda: len(raft.proposed) == 2)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(raft.proposed) == 2  # the free slot went to the other block only
        assert [p.client for p in raft.proposed[1].pushes] == ["e"]
        raft.release(0)
        await until(lambda: len(raft.proposed) == 3)
        assert sorted(p.client for p in raft.proposed[2].pushes) == ["b", "c", "d"]
        raft.release(1)
        raft.release(2)
        return await first, await asyncio.gather(*same), await other

    first, same, other = asyncio.run(main())
    assert "versions" in first and "versions" in other
    assert same[0] == same[1] == same[2]  # one entry answered all three


def test_idle_push_is_proposed_at_once_and_later_ones_merge_behind_it():
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1)
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)        # proposed alone, no waiting window
        rest = [asyncio.create_task(b.submit(push(c, 1))) for c in "bcd"]
        await asyncio.sleep(0)
        assert len(raft.proposed) == 1                       # slot busy: they wait and merge
        raft.release(0)
        await until(lambda: len(raft.proposed) == 2)
        merged = raft.proposed[1]
        assert sorted(p.client for p in merged.pushes) == ["b", "c", "d"]
        assert merged.dense[0].count == 3
        np.testing.assert_array_equal(merged.dense[0].grad, np.full(256, 3, np.float32))
        raft.release(1)
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(main())
    assert first == {"versions": {"w": 1}}
    assert rest == [{"versions": {"w": 2}}] * 3


def test_a_retry_of_a_pending_push_shares_its_result():
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1)
        a = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        again = asyncio.create_task(b.submit(push("a", 1)))  # same id while in flight
        await asyncio.sleep(0)
        raft.release(0)
        return await a, await again, len(raft.proposed)

    a, again, proposals = asyncio.run(main())
    assert a == again and proposals == 1


def test_overloaded_when_the_in_flight_budget_stays_full():
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1, max_inflight_bytes=2400, overload_wait=0.05)
        first = asyncio.create_task(b.submit(push("a", 1)))  # ~1.1 KiB accepted
        await until(lambda: len(raft.proposed) == 1)
        second = asyncio.create_task(b.submit(push("b", 1)))  # fits: ~2.3 KiB in all
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await b.submit(push("c", 1))                      # would exceed: waits, then refused
        raft.release(0)
        await until(lambda: len(raft.proposed) == 2)
        raft.release(1)
        await first, await second
        return await asyncio.wait_for(_submit_and_release(b, raft, push("c", 2)), 2)

    assert asyncio.run(main()) == {"versions": {"w": 3}}    # budget freed: accepted again


async def _submit_and_release(b, raft, req):
    task = asyncio.create_task(b.submit(req))
    await until(lambda: len(raft.proposed) == 3)
    raft.release(2)
    return await task


def test_a_failed_proposal_fails_every_push_merged_into_it():
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1)
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        merged = [asyncio.create_task(b.submit(push(c, 1))) for c in "bc"]
        await asyncio.sleep(0)
        raft.release(0)
        await first
        await until(lambda: len(raft.proposed) == 2)
        raft.release(1, NoQuorum(0, 1, 3))
        return await asyncio.gather(*merged, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, NoQuorum) for r in results)


def test_batches_are_bounded_in_merged_bytes():
    """Pushes of the same block merge into one block's bytes; distinct blocks add up."""
    def other_block(client, seq):
        return PushRequest(client, seq, seq, dense=(("w", int(ord(client)), np.ones(256, np.float32)),))

    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1, batch_bytes=2500)
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        rest = [asyncio.create_task(b.submit(other_block(c, 1))) for c in "bcde"]
        await asyncio.sleep(0)
        for i in range(1, 3):
            raft.release(i - 1)
            await until(lambda: len(raft.proposed) == i + 1)
        raft.release(2)
        await first
        await asyncio.gather(*rest)
        return [len(c.pushes) for c in raft.proposed]

    assert asyncio.run(main()) == [1, 2, 2]


def test_same_block_from_many_workers_merges_into_one_entry():
    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1, batch_bytes=2500)  # room for ~2 distinct blocks
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        rest = [asyncio.create_task(b.submit(push(c, 1))) for c in "bcdefgh"]  # all block 0
        await asyncio.sleep(0)
        raft.release(0)
        await until(lambda: len(raft.proposed) == 2)
        raft.release(1)
        await first
        await asyncio.gather(*rest)
        return raft.proposed[1]

    merged = asyncio.run(main())
    assert len(merged.pushes) == 7 and len(merged.dense) == 1 and merged.dense[0].count == 7


def test_pushes_of_blocks_already_in_a_batch_join_it_even_past_batch_bytes():
    """B1's shape: one worker's push to a shard is bigger than batch_bytes on its own. Other
    workers' pushes of the same blocks add only their ids and still merge into that entry; a
    push that brings a new block does not."""
    def big(client, seq, blocks=(0, 1, 2)):
        return PushRequest(client, seq, seq, dense=tuple(("w", b, np.ones(256, np.float32)) for b in blocks))

    async def main():
        raft = FakeRaft()
        b = make(raft, max_inflight_proposals=1, batch_bytes=2000)  # < one push of 3 blocks
        first = asyncio.create_task(b.submit(push("a", 1)))
        await until(lambda: len(raft.proposed) == 1)
        rest = [asyncio.create_task(b.submit(big(c, 1))) for c in "bcd"]
        rest.append(asyncio.create_task(b.submit(big("e", 1, blocks=(0, 1, 2, 3)))))
        await asyncio.sleep(0)
        raft.release(0)
        await until(lambda: len(raft.proposed) == 2)
        raft.release(1)
        await until(lambda: len(raft.proposed) == 3)
        raft.release(2)
        await first
        await asyncio.gather(*rest)
        return raft.proposed[1:]

    merged, alone = asyncio.run(main())
    assert [p.client for p in merged.pushes] == ["b", "c", "d"]
    assert [d.count for d in merged.dense] == [3, 3, 3]
    assert [p.client for p in alone.pushes] == ["e"]


def test_idle_leader_waits_one_merge_window():
    async def main():
        raft = FakeRaft()
        b = make(raft, merge_window=0.05)
        # two clients have pushed before: the leader is shared, so it waits for the others
        for i, c in enumerate("xy"):
            first = asyncio.create_task(b.submit(push(c, 1)))
            await until(lambda: len(raft.proposed) > i)
            raft.release(i)
            await first
        raft.proposed.clear()
        raft.gates.clear()
        tasks = [asyncio.create_task(b.submit(push(c, 1))) for c in "ab"]
        await asyncio.sleep(0)
        assert raft.proposed == []                   # waiting for the window ...
        late = asyncio.create_task(b.submit(push("c", 1)))
        await until(lambda: len(raft.proposed) == 1)  # ... then one entry for all three
        raft.release(0)
        await asyncio.gather(*tasks, late)
        return raft.proposed[0]

    assert len(asyncio.run(main()).pushes) == 3


def test_a_lone_writer_is_not_held_for_the_merge_window():
    """With one client there is nothing to merge with: each push is proposed at once (a window of
    an hour would hold it for an hour if it applied)."""
    async def main():
        raft = FakeRaft()
        b = make(raft, merge_window=3600.0)
        for seq in range(1, 4):
            task = asyncio.create_task(b.submit(push("solo", seq)))
            await until(lambda: len(raft.proposed) == seq)
            raft.release(seq - 1)
            await task
        # a second client makes the leader shared: its next push waits for the window
        other = asyncio.create_task(b.submit(push("other", 1)))
        # pending while the window runs; without it the batch leaves pending and is proposed
        await until(lambda: b._pending or len(raft.proposed) > 3)
        held = bool(b._pending) and len(raft.proposed) == 3
        other.cancel()
        return held

    assert asyncio.run(main())
