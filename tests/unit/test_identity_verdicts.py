"""Which incarnation a node directory is, and the verdicts at start (kvps.node.identity), and the
metadata group's record of incarnations (kvps.meta)."""
from __future__ import annotations

import pytest

from kvps.errors import ConfigError
from kvps.meta import MetaState
from kvps.node.identity import Identity, decide

A, B = "a" * 32, "b" * 32


def answer(node: int, incarnation: str | None, known: dict[int, str]) -> dict:
    return {"node": node, "incarnation": incarnation, "known": {str(k): v for k, v in known.items()}}


def test_a_wiped_node_the_cluster_knows_is_refused_with_what_to_do():
    verdict, reason = decide(2, None, [answer(0, "x", {2: A})], replace=False, peers=2)
    assert verdict == "refuse"
    assert "kvps node join" in reason and "--replace" in reason and A in reason


def test_a_new_cluster_starts_new_incarnations_but_silence_is_not_a_new_cluster():
    assert decide(2, None, [answer(0, None, {})], replace=False, peers=2)[0] == "new"
    assert decide(2, None, [answer(0, "x", {0: "x"})], replace=False, peers=2)[0] == "new"
    assert decide(2, None, [], replace=False, peers=2)[0] == "wait"
    assert decide(0, None, [], replace=False, peers=0)[0] == "new"  # a one-node cluster


def test_a_known_incarnation_starts_and_a_replaced_one_is_refused():
    mine = Identity(2, A)
    assert decide(2, mine, [answer(0, "x", {2: A})], replace=False, peers=2)[0] == "start"
    assert decide(2, mine, [], replace=False, peers=2)[0] == "start"
    verdict, reason = decide(2, mine, [answer(0, "x", {2: B})], replace=False, peers=2)
    assert verdict == "refuse" and "replaced" in reason
    assert decide(2, Identity(1, A), [], replace=False, peers=2)[0] == "refuse"  # another node's dir


def test_replace_makes_a_new_incarnation_whatever_the_cluster_knows():
    assert decide(2, None, [answer(0, "x", {2: A})], replace=True, peers=2)[0] == "new"


def test_identity_round_trips_and_a_damaged_file_is_a_clear_error(tmp_path):
    Identity(3, A).save(tmp_path)
    assert Identity.load(tmp_path) == Identity(3, A)
    (tmp_path / "identity.json").write_text("{not json")
    with pytest.raises(ConfigError, match="--replace"):
        Identity.load(tmp_path)
    assert Identity.load(tmp_path / "missing") is None


def _state(n: int = 3) -> MetaState:
    from kvps.assignment import Assignment
    nodes = [{"id": i, "host": "127.0.0.1", "admin_port": 7000 + 100 * i, "port_base": 7001 + 100 * i,
              "scheme": "http", "state": "active"} for i in range(n)]
    return MetaState(nodes, Assignment(0, ((0, 1, 2),), (0,)))


def test_a_recorded_incarnation_is_replaced_only_by_one_that_names_it():
    st = _state()
    assert st.apply({"op": "set_incarnation", "id": 1, "incarnation": A}).result["ok"]
    refused = st.apply({"op": "set_incarnation", "id": 1, "incarnation": B, "replaces": None}).result
    assert isinstance(refused, Exception) and st.nodes[1]["incarnation"] == A
    assert st.apply({"op": "set_incarnation", "id": 1, "incarnation": B, "replaces": A}).result["ok"]
    assert st.nodes[1]["incarnation"] == B


def test_a_join_from_a_new_directory_never_gets_an_old_id():
    st = _state()
    spec = {"host": "10.0.0.9", "admin_port": 7100, "port_base": 7101, "scheme": "http"}
    first = st.apply({"op": "add_node", **spec, "incarnation": A}).result
    again = st.apply({"op": "add_node", **spec, "incarnation": A}).result  # a retried join
    assert again["id"] == first["id"] == 3
    wiped = st.apply({"op": "add_node", **spec, "incarnation": B}).result
    assert isinstance(wiped, Exception) and "drain node 3" in str(wiped).lower()
    assert len(st.nodes) == 4 and st.nodes[3]["incarnation"] == A
