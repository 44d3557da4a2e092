"""kvps.replica.leadership with a fake group: who may serve, and what the others answer."""
from __future__ import annotations

import asyncio

import pytest

from kvps.config import ClusterConfig, NodeConfig
from kvps.errors import NoQuorum, NotLeader, Unavailable
from kvps.replica.leadership import Leadership


class FakeGroup:
    def __init__(self, *, leader: bool, connected: int, members: int = 3) -> None:
        self.leader, self.connected, self.members, self._term = leader, connected, members, 4
        self.proposed: list[bytes] = []

    def is_leader(self) -> bool:
        return self.leader

    def leader_reachable(self) -> bool:
        return True

    def term(self) -> int:
        return self._term

    def quorum(self) -> tuple[int, int]:
        return self.connected, self.members

    def abandon_pending(self) -> int:
        return 0


def _leadership(group: FakeGroup) -> Leadership:
    cfg = ClusterConfig(nodes=[NodeConfig(id=0, host="127.0.0.1", admin_port=7100, port_base=7101)],
                        shards=1, replicas=1)

    async def propose(data: bytes) -> dict:
        group.proposed.append(data)
        return {"barrier": group.term()}

    async def wait_applied(timeout: float) -> None:
        await asyncio.sleep(0)

    return Leadership(cfg, 0, "127.0.0.1:7101", group, propose=propose, wait_applied=wait_applied,
                      not_leader=lambda: NotLeader(0, "http://elsewhere", "127.0.0.1:7101"))


def test_a_leader_serves_after_its_barrier():
    group = FakeGroup(leader=True, connected=2)

    async def main() -> None:
        lead = _leadership(group)
        await lead.ensure_serving()
        assert lead.serving(4) and len(group.proposed) == 1  # one barrier of its term
    asyncio.run(main())


def test_a_leader_cut_off_from_its_majority_answers_no_quorum_at_once():
    group = FakeGroup(leader=True, connected=1)  # only itself of three

    async def main() -> None:
        with pytest.raises(NoQuorum) as err:
            await _leadership(group).ensure_serving()
        assert err.value.connected == 1 and err.value.members == 3
        assert group.proposed == []  # no barrier that could not commit
    asyncio.run(main())


def test_a_follower_points_at_the_leader_and_held_writes_are_unavailable():
    async def main() -> None:
        with pytest.raises(NotLeader) as err:
            await _leadership(FakeGroup(leader=False, connected=3)).ensure_serving()
        assert err.value.leader_hint == "http://elsewhere"
        held = _leadership(FakeGroup(leader=True, connected=3))
        held.hold_writes(60)
        with pytest.raises(Unavailable):
            await held.ensure_serving()
    asyncio.run(main())
