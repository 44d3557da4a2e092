"""bridge.py: every pysyncobj FAIL_REASON maps to one error class; propose() turns tick-thread
callbacks into awaitable results and raised errors."""
from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
from conftest import free_ports, wait_for
from pysyncobj.config import FAIL_REASON

from kvps.config import RaftConfig
from kvps.errors import (
    InvalidRequest,
    KvpsError,
    NotLeader,
    Overloaded,
    RetryableError,
    Unavailable,
    VersionConflict,
)
from kvps.raft import bridge
from kvps.raft.bridge import FAIL_REASON_ERRORS, error_for
from kvps.raft.group import COMMAND_TOO_LARGE, GROUP_STOPPED, ShardGroup

REASONS = {name: value for name, value in vars(FAIL_REASON).items() if not name.startswith("_")}


def test_every_fail_reason_maps_to_an_error_class():
    failures = {name: value for name, value in REASONS.items() if name != "SUCCESS"}
    missing = sorted(name for name, value in failures.items() if value not in FAIL_REASON_ERRORS)
    assert not missing, f"FAIL_REASON values without an error class: {missing}"
    assert REASONS["SUCCESS"] not in FAIL_REASON_ERRORS
    assert set(FAIL_REASON_ERRORS) == set(failures.values()) | {COMMAND_TOO_LARGE, GROUP_STOPPED}


def test_the_mapping():
    assert FAIL_REASON_ERRORS == {
        FAIL_REASON.QUEUE_FULL: Overloaded,
        FAIL_REASON.MISSING_LEADER: Unavailable,
        FAIL_REASON.DISCARDED: Unavailable,
        FAIL_REASON.NOT_LEADER: NotLeader,
        FAIL_REASON.LEADER_CHANGED: Unavailable,
        FAIL_REASON.REQUEST_DENIED: Unavailable,
        FAIL_REASON.UNKNOWN_OUTCOME: Unavailable,
        COMMAND_TOO_LARGE: InvalidRequest,
        GROUP_STOPPED: Unavailable,
    }
    # Only the command that can never fit is a definitive "no"; everything else may be retried.
    for reason, cls in FAIL_REASON_ERRORS.items():
        assert issubclass(cls, RetryableError) == (reason != COMMAND_TOO_LARGE)


@pytest.mark.parametrize("reason", sorted(FAIL_REASON_ERRORS))
def test_error_for_builds_structured_errors(reason):
    err = error_for(reason, leader_hint="http://10.0.0.1:7201")
    assert type(err) is FAIL_REASON_ERRORS[reason]
    assert err.fields["outcome"] in ("not_applied", "unknown")
    assert err.fields["reason"] and err.message
    if reason == FAIL_REASON.NOT_LEADER:
        assert err.leader_hint == "http://10.0.0.1:7201"
    assert err.to_dict()["error"] == type(err).__name__


def test_outcome_is_unknown_exactly_when_the_command_may_have_applied():
    unknown = {r for r in FAIL_REASON_ERRORS if error_for(r).fields["outcome"] == "unknown"}
    assert unknown == {FAIL_REASON.LEADER_CHANGED, FAIL_REASON.UNKNOWN_OUTCOME, GROUP_STOPPED}


def test_unknown_reason_is_unavailable():
    err = error_for(99)
    assert type(err) is Unavailable and err.fields["outcome"] == "unknown"


class FakeGroup:
    """Answers each proposal from another thread (as pysyncobj's tick thread does), or inline."""

    def __init__(self, answer: tuple[Any, int], inline: bool = False) -> None:
        self.answer = answer
        self.inline = inline
        self.proposed: list[bytes] = []
        self.threads: list[threading.Thread] = []

    def propose(self, data: bytes, callback) -> None:
        self.proposed.append(data)
        if self.inline:
            callback(*self.answer)
            return
        t = threading.Thread(target=callback, args=self.answer)
        self.threads.append(t)
        t.start()

    def leader_address(self) -> str | None:
        return "127.0.0.1:7200"


@pytest.mark.parametrize("inline", [False, True])
def test_propose_returns_the_applier_result(inline):
    group = FakeGroup(({"version": 3}, FAIL_REASON.SUCCESS), inline)
    assert asyncio.run(bridge.propose(group, b"cmd")) == {"version": 3}
    assert group.proposed == [b"cmd"]


def test_domain_errors_from_the_applier_are_returned_not_raised():
    conflict = VersionConflict("stale", 1, 2)
    assert asyncio.run(bridge.propose(FakeGroup((conflict, FAIL_REASON.SUCCESS)), b"cmd")) is conflict


@pytest.mark.parametrize("reason", sorted(FAIL_REASON_ERRORS))
def test_failures_are_raised_as_mapped_errors(reason):
    with pytest.raises(KvpsError) as info:
        asyncio.run(bridge.propose(FakeGroup((None, reason)), b"cmd"))
    assert type(info.value) is FAIL_REASON_ERRORS[reason]
    if reason == FAIL_REASON.NOT_LEADER:
        assert info.value.raft_leader == "127.0.0.1:7200"


def test_a_callback_after_the_loop_closed_is_harmless():
    captured = []

    class Late(FakeGroup):
        def propose(self, data, callback):
            captured.append(callback)

    async def main():
        task = asyncio.ensure_future(bridge.propose(Late((None, 0)), b"cmd"))
        await asyncio.sleep(0)
        task.cancel()

    asyncio.run(main())
    captured[0]("late result", FAIL_REASON.SUCCESS)  # loop closed: must not raise


def test_propose_through_a_real_single_replica_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    applied: list[bytes] = []

    def applier(data: bytes | memoryview) -> Any:
        data = bytes(data)  # a view of the log entry
        applied.append(data)
        return InvalidRequest("domain error") if data == b"bad" else len(applied)

    raft = RaftConfig(election_timeout_min=0.2, election_timeout_max=0.4, connection_timeout=1.0,
                      max_command_bytes=1 << 20, max_frame_bytes=3 << 20)
    group = ShardGroup(self_address=address, peers=[], raft=raft, secret=b"k" * 32, context="bridge",
                       journal_dir=tmp_path, applier=applier, snapshot_state=lambda: b"",
                       restore_state=lambda blob: None)
    try:
        async def main():
            # a lone member elects itself after one election timeout
            await asyncio.to_thread(wait_for, group.is_leader, 10, "the lone member to lead")
            first = await bridge.propose(group, b"one")
            results = await asyncio.gather(*(bridge.propose(group, b"x%d" % i) for i in range(20)))
            domain = await bridge.propose(group, b"bad")
            with pytest.raises(InvalidRequest, match="max_command_bytes"):
                await bridge.propose(group, b"z" * ((1 << 20) + 1))
            return first, results, domain

        first, results, domain = asyncio.run(asyncio.wait_for(main(), 20))
        assert first == 1 and sorted(results) == list(range(2, 22))
        assert isinstance(domain, InvalidRequest) and domain.message == "domain error"
        assert applied[0] == b"one" and len(applied) == 22
    finally:
        group.stop()


def test_a_leader_journals_its_own_frames_without_hashing_them_again(tmp_path):
    """A proposal of ``FrameParts`` reaches the leader's journal with the digest it was built
    with: the group's ``command_digest`` (the full check) runs only for other proposals, every
    entry applies, and nothing stays noted once the proposals settled."""
    import numpy as np

    from kvps.delta import frame

    checked: list[int] = []

    def command_digest(view):
        checked.append(len(view))
        return frame.verified_digest(view)

    applied: list[bytes] = []
    raft = RaftConfig(election_timeout_min=0.2, election_timeout_max=0.4, connection_timeout=1.0)
    group = ShardGroup(self_address=f"127.0.0.1:{free_ports(1)[0]}", peers=[], raft=raft, secret=b"k" * 32,
                       context="bridge", journal_dir=tmp_path, applier=lambda d: applied.append(bytes(d)),
                       snapshot_state=lambda: b"", restore_state=lambda blob: None,
                       command_digest=command_digest)
    parts = [frame.encode_parts(frame.KIND_COMMAND, {"k": k}, [np.full(4096, k, np.float32)], at=2)
             for k in range(5)]
    try:
        async def main():
            await asyncio.to_thread(wait_for, group.is_leader, 10, "the lone member to lead")
            await asyncio.gather(*(bridge.propose(group, p) for p in parts))
            await bridge.propose(group, list(parts[0]))  # the same frame, not known as built here
        asyncio.run(asyncio.wait_for(main(), 20))
        frames = [b"".join(p) for p in parts]
        assert [a for a in applied if a in frames] == frames + [frames[0]]
        assert checked == [len(frames[0])]  # only the plain list was hashed
        assert len(group._own_digests) == 0
    finally:
        group.stop()
