"""pysyncobj is pinned to 0.3.17 and kvps/raft/ relies on some of its internals: these tests fail
first, and say which assumption broke, when an upgrade moves one of them."""
from __future__ import annotations

import ast
import inspect
import pickle
import re
import socket
from pathlib import Path

import pytest

import pysyncobj
import pysyncobj.journal
import pysyncobj.monotonic
import pysyncobj.pickle
import pysyncobj.syncobj
import pysyncobj.transport
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.config import FAIL_REASON
from pysyncobj.journal import FileJournal, Journal
from pysyncobj.node import TCPNode
from pysyncobj.poller import createPoller
from pysyncobj.serializer import Serializer
from pysyncobj.syncobj import _COMMAND_TYPE, _RAFT_STATE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.transport import TCPTransport
from pysyncobj.version import VERSION

import kvps
from kvps.config import RaftConfig
from kvps.raft import group as group_module
from kvps.raft import internals
from kvps.raft.compaction import is_last_install_chunk
from kvps.raft.connection import PeerConnection
from kvps.raft.group import COMMAND_TOO_LARGE, GROUP_STOPPED, ShardGroup, syncobj_options
from kvps.raft.journal import RaftJournal
from kvps.raft.peer_settings import PeerSettings, TransportStats
from kvps.raft.transport import AuthTransport


def src(obj) -> str:
    """Source with all whitespace runs collapsed, so formatting changes do not matter."""
    return re.sub(r"\s+", " ", inspect.getsource(obj))


def params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_version_is_pinned():
    assert VERSION == "0.3.17"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"pysyncobj==0.3.17"' in pyproject


# ---- transport.py: the TCPTransport hooks we override or call ------------------------------------

def test_tcp_transport_methods_we_override_or_call():
    assert params(TCPTransport.__init__) == ["self", "syncObj", "selfNode", "otherNodes"]
    assert params(TCPTransport._createServer) == ["self"]
    assert params(TCPTransport.addNode) == ["self", "node"]
    assert params(TCPTransport._onIncomingMessageReceived) == ["self", "conn", "message"]
    assert params(TCPTransport._onMessageReceived) == ["self", "node", "message"]
    assert params(TCPTransport._onDisconnected) == ["self", "conn"]
    assert params(TCPTransport._onNewIncomingConnection) == ["self", "conn"]
    assert params(TCPTransport._onOutgoingConnected) == ["self", "conn"]
    assert params(TCPTransport._onTick) == ["self"]
    assert params(TCPTransport.send) == ["self", "node", "message"]
    assert params(TCPTransport._connToNode) == ["self", "conn"]


def test_tcp_transport_state_we_use():
    init = src(TCPTransport.__init__)
    for needle in ("self._syncObj = syncObj", "self._server = None", "self._connections = {}",
                   "self._unknownConnections = set()", "self._nodeAddrToNode = {}",
                   "self._selfNode = selfNode", "self._ready = False",
                   "self._syncObj.addOnTickCallback(self._onTick)"):
        assert needle in init, needle
    # addNode runs for the initial peers before _createServer (our overrides need nothing else).
    assert init.index("self.addNode(node)") < init.index("self._createServer()")
    # The server is only bound / unbound through these two calls.
    assert set(re.findall(r"self\._server\.(\w+)", inspect.getsource(pysyncobj.transport))) == {"bind", "unbind"}
    # _maybeBind retries after any exception from bind() and sets _ready on success.
    assert "self._server.bind() except Exception" in src(TCPTransport._maybeBind)
    # send() returns False when the connection is not CONNECTED (our pipelining bookkeeping).
    assert "state != CONNECTION_STATE.CONNECTED: return False" in src(TCPTransport.send)


def test_our_connection_has_everything_tcp_transport_touches():
    source = inspect.getsource(pysyncobj.transport)
    used = set(re.findall(r"\bconn\.(\w+)", source))
    used |= set(re.findall(r"self\._connections\[node\]\.(\w+)", source))
    assert used, "pattern no longer matches: re-check how TCPTransport uses connections"
    settings = PeerSettings(b"s" * 32, b"ctx", 1 << 20, 0, TransportStats())
    conn = PeerConnection(settings, createPoller("auto"), 1.0, None)
    missing = sorted(name for name in used if not hasattr(conn, name))
    assert not missing, f"TCPTransport now uses connection attributes we lack: {missing}"
    assert set(vars(CONNECTION_STATE)) >= {"DISCONNECTED", "CONNECTING", "CONNECTED"}
    assert (CONNECTION_STATE.DISCONNECTED, CONNECTION_STATE.CONNECTING, CONNECTION_STATE.CONNECTED) == (0, 1, 2)


def test_stock_connection_without_socket_is_inert():
    """AuthTransport.addNode lets the stock addNode build a TcpConnection, then replaces it."""
    conn = TcpConnection(poller=createPoller("auto"), timeout=1.0)
    assert conn.state == CONNECTION_STATE.DISCONNECTED and conn.fileno() is None
    add = src(TCPTransport.addNode)
    assert "self._connections[node] = conn" in add and "TcpConnection(" in add
    assert "self._nodeAddrToNode[node.address] = node" in add


def test_outgoing_connected_and_incoming_first_message_paths():
    # Without an encryptor the outgoing side names itself and reports the node connected.
    out = src(TCPTransport._onOutgoingConnected)
    assert "self._sendSelfAddress(conn)" in out and "self._onNodeConnected(self._connToNode(conn))" in out
    # The first incoming message is the peer's address (a str), 'readonly', or a utility list.
    inc = src(TCPTransport._onIncomingMessageReceived)
    assert "isinstance(message, list) and self._onUtilityMessage(conn, message)" in inc
    assert "self._connections[node] = conn" in inc
    assert "conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))" in inc


def test_what_the_port_probe_relies_on():
    """transport.AuthTransport probes (kvps.raft.probe) a member whose connection the peer closed."""
    # TCPTransport reports a lost member through _onDisconnected, which we extend; voting members
    # are in _nodes (dropNode removes them, so a removed member is never probed).
    dis = src(TCPTransport._onDisconnected)
    assert "node = self._connToNode(conn)" in dis and "if node in self._nodes: self._onNodeDisconnected(node)" in dis
    assert "self._nodes = set()" in src(TCPTransport.__init__)
    assert "self._nodes.discard(node)" in src(TCPTransport.dropNode)
    # Our destroy override closes the probes, then the stock one runs; SyncObj calls it on stop.
    assert params(TCPTransport.destroy) == ["self"]
    assert "self.__transport.destroy()" in src(SyncObj._doDestroy)
    # dropNode and destroy disconnect connections through conn.disconnect() (never "by the peer").
    assert "conn.disconnect()" in src(TCPTransport.dropNode)
    # The probe dials the member's resolved ip and port, as TCPTransport does.
    assert "connect(node.ip, node.port)" in src(TCPTransport._connectIfNecessarySingle)
    assert isinstance(inspect.getattr_static(TCPNode, "ip"), property)
    assert isinstance(inspect.getattr_static(TCPNode, "port"), property)
    # The probe's window is conf.raftMinTimeout.
    assert SyncObjConf(raftMinTimeout=0.7).raftMinTimeout == 0.7


# ---- group.py: SyncObj internals ------------------------------------------------------------------

def test_syncobj_methods_and_properties_we_use():
    assert "transportClass" in params(SyncObj.__init__)
    assert params(SyncObj._applyCommand) == ["self", "command", "callback", "commandType"]
    assert _COMMAND_TYPE.REGULAR == 0 and _COMMAND_TYPE.MEMBERSHIP == 2
    for name in ("_isLeader", "_getLeader", "_getTerm", "_getRaftLogSize", "_getFuncName", "isReady",
                 "forceLogCompaction", "destroy", "destroy_synchronous", "addOnTickCallback",
                 "isNodeConnected", "addNodeToCluster", "removeNodeFromCluster"):
        assert callable(getattr(SyncObj, name, None)), name
    for name in ("raftLastApplied", "raftCommitIndex", "raftCurrentTerm", "otherNodes", "conf", "encryptor"):
        assert isinstance(inspect.getattr_static(SyncObj, name), property), name
    init = src(SyncObj.__init__)
    assert "self._poller = createPoller(self.__conf.pollerType)" in init
    assert "transportClass(self, self.__selfNode, self.__otherNodes)" in init
    assert "self._methodToID[method] = currMethodID" in init
    assert (_RAFT_STATE.FOLLOWER, _RAFT_STATE.CANDIDATE, _RAFT_STATE.LEADER) == (0, 1, 2)
    assert internals.ROLES == {0: "follower", 1: "candidate", 2: "leader"}


def test_command_format_and_apply_order():
    """propose() queues _ENTRY_PREFIX + data as is; ShardGroup overrides __doApplyCommand for it.
    Entries pickled by an older kvps ((funcID, (data,)), protocol 5) still go to pysyncobj's."""
    apply = src(SyncObj._SyncObj__doApplyCommand)
    assert "command = pickle.loads(command[1:])" in apply and "funcID, args = command" in apply
    # the override takes effect: pysyncobj calls it through the mangled name on self
    assert "self.__doApplyCommand(entry[0])" in src(SyncObj._SyncObj__applyLogEntries)
    assert "_SyncObj__doApplyCommand" in ShardGroup.__dict__
    # A follower's large entries are views of their frame (kvps.raft.wire): pysyncobj reads every
    # appended entry's type byte with ord(), which a view does not take; ShardGroup answers it.
    parse = src(SyncObj._SyncObj__parseChangeClusterRequest)
    assert "commandType = ord(command[:1])" in parse and "_COMMAND_TYPE.MEMBERSHIP" in parse
    assert "self.__parseChangeClusterRequest(entry[0])" in src(SyncObj._SyncObj__onMessageReceived)
    assert "_SyncObj__parseChangeClusterRequest" in ShardGroup.__dict__
    # a commandType of None queues the command untouched (our prefix carries the type byte)
    queued = src(SyncObj._applyCommand)
    assert "if commandType is None:" in queued and "put_nowait((command, callback))" in queued
    assert group_module._ENTRY_PREFIX[0] == _COMMAND_TYPE.REGULAR
    assert group_module._ENTRY_PREFIX[1] != pickle.PROTO[0]  # no pickle stream starts with it
    assert pysyncobj.pickle.loads(pickle.dumps((0, (b"x" * 100,)), protocol=5)) == (0, (b"x" * 100,))
    # apply_command computes its index as raftLastApplied + 1: lastApplied moves after the call.
    entries = src(SyncObj._SyncObj__applyLogEntries)
    assert entries.index("self.__doApplyCommand(entry[0])") < entries.index("self.__raftLastApplied += 1")
    # Commands are queued with the type byte prepended.
    assert "(_bchr(commandType) + command, callback)" in src(SyncObj._applyCommand)
    # commandsWaitLeader=False makes a proposal without a known leader fail at once.
    check = src(SyncObj._checkCommandsToApply)
    assert "if self.__raftLeader is None and self.__conf.commandsWaitLeader: break" in check
    assert "self.__callErrCallback(FAIL_REASON.MISSING_LEADER, callback)" in check
    # The journal stores commands as bytes.
    assert "to_bytes(command)" in src(FileJournal.add)


def test_syncobj_conf_knows_every_option_we_pass():
    opts = syncobj_options(RaftConfig(), Path("/tmp/journal"))
    defaults = SyncObjConf()
    unknown = sorted(k for k in (*opts, "serializer", "deserializer", "onStateChanged") if not hasattr(defaults, k))
    assert not unknown, f"SyncObjConf silently ignores: {unknown}"
    SyncObjConf(**opts, serializer=lambda p, d: None, deserializer=lambda p: None).validate()
    assert opts["appendEntriesUseBatch"] is False and opts["password"] is None
    assert opts["appendEntriesBatchSizeBytes"] > RaftConfig().max_command_bytes


def test_fail_reason_values():
    values = {k: v for k, v in vars(FAIL_REASON).items() if not k.startswith("_")}
    assert values == {"SUCCESS": 0, "QUEUE_FULL": 1, "MISSING_LEADER": 2, "DISCARDED": 3, "NOT_LEADER": 4,
                      "LEADER_CHANGED": 5, "REQUEST_DENIED": 6, "UNKNOWN_OUTCOME": 7}
    assert COMMAND_TOO_LARGE not in values.values() and GROUP_STOPPED not in values.values()


def test_serializer_hooks_contract():
    """Our serializer gets (tmpFile, (last, prev, cluster)); our deserializer returns that triple."""
    ser = src(Serializer.serialize)
    assert "self.__serializer(tmpFile, data[1:])" in ser
    assert "atomicReplace(tmpFile, self.__fileName)" in ser
    assert "self.__useFork = tryUseFork and hasattr(os, 'fork') and serializer is None" in src(Serializer.__init__)
    assert "return (None,) + self.__deserializer(self.__fileName)" in src(Serializer.deserialize)
    compaction = src(SyncObj._SyncObj__tryLogCompaction)
    assert ("self.__serializer.serialize((data, lastAppliedEntries[1], lastAppliedEntries[0], cluster), "
            "lastAppliedEntries[0][1])") in compaction
    assert "cluster = self.__otherNodes | {self.__selfNode}" in compaction
    assert "self.__forceLogCompaction" in compaction
    load = src(SyncObj._SyncObj__loadDumpFile)
    assert "self.__raftLog.add(*data[2]) self.__raftLog.add(*data[1])" in load
    assert "self.__raftLastApplied = data[1][1]" in load
    assert "self.__updateClusterConfiguration([node for node in data[3] if node != self.__selfNode])" in load
    # The snapshot is sent to lagging followers in logCompactionBatchSize chunks of file bytes.
    assert "transmission['file'].read(self.__transmissionBatchSize)" in src(Serializer.getTransmissionData)
    # restart_transmissions: outgoing transmissions are a dict of {'file': handle, ...} per node,
    # which pysyncobj's forked dump empties on success and our serializeChecker path does not
    assert "self.__transmissions = {}" in src(Serializer.__init__)
    assert "'file': open(self.__fileName, 'rb')," in src(Serializer.getTransmissionData)
    # transmissions_in_flight: a sent or abandoned transmission leaves the dict
    assert "self.__transmissions.pop(transmissionID, None)" in src(Serializer.getTransmissionData)
    assert "self.__serializer.cancelTransmisstion(node)" in src(SyncObj._SyncObj__sendAppendEntries)
    assert "self.__transmissions.pop(id, None)" in src(Serializer.cancelTransmisstion)
    check = src(Serializer.checkSerializing)
    assert check.count("self.__transmissions = {}") == 2
    assert check.index("self.__serializeChecker()") < check.index("self.__transmissions = {}")


def test_next_index_handling_the_pipelining_fix_relies_on():
    """replication.AppendPipeline restores nextIndex with a synthetic reset reply (its module doc)."""
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert ("if message['type'] == 'next_node_idx': reset = message['reset'] nextNodeIdx = "
            "message['next_node_idx'] success = message['success'] currentNodeIdx = nextNodeIdx - 1 "
            "if reset: self.__raftNextIndex[node] = nextNodeIdx if success: "
            "if self.__raftMatchIndex[node] < currentNodeIdx: self.__raftMatchIndex[node] = currentNodeIdx "
            "self.__raftNextIndex[node] = nextNodeIdx") in receive
    send = src(SyncObj._SyncObj__sendAppendEntries)
    assert "self.__raftNextIndex[node] = entries[-1][1] + 1" in send  # optimistic advance
    # The chunked path we keep out of reach with appendEntriesBatchSizeBytes > max_command_bytes.
    assert "if len(entries) == 1 and len(entries[0][0]) >= batchSizeBytes:" in send


def test_follower_append_handling_the_rebase_relies_on():
    """replication.rebase_append (its module doc): SyncObj keeps its log in
    __raftLog as (command, index, term) entries, truncates after prevLogIdx whenever it holds more,
    and never lowers a follower's matchIndex (so a truncated follower stays counted)."""
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert ("prevLogIdx = message['prevLogIdx'] prevLogTerm = message['prevLogTerm'] "
            "prevEntries = self.__getEntries(prevLogIdx)") in receive
    assert "if len(prevEntries) > 1:" in receive
    assert "self.__deleteEntriesFrom(prevLogIdx + 1) for entry in newEntries: self.__raftLog.add(*entry)" in receive
    assert "if self.__raftMatchIndex[node] < currentNodeIdx:" in receive
    assert "self.__raftLog = createJournal(" in src(SyncObj.__init__)


def test_the_election_deadline_fast_failover_moves():
    """failover.schedule_election writes SyncObj.__raftElectionDeadline, a monotonic time that the tick
    compares with the same clock; a leader's append resets it to a full timeout, as does a vote."""
    assert pysyncobj.syncobj.monotonicTime is pysyncobj.monotonic.monotonic
    init = src(SyncObj.__init__)
    assert "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()" in init
    tick = src(SyncObj._onTick)
    assert ("if self.__raftState in (_RAFT_STATE.FOLLOWER, _RAFT_STATE.CANDIDATE) and self.__selfNode is not None: "
            "if self.__raftElectionDeadline < monotonicTime() and self.__connectedToAnyone(): "
            "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout() "
            "self.__transferInProgress = False self.__raftLeader = None") in tick
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert receive.count("self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()") == 2
    # The follower acts only while it follows the lost peer: _getLeader is pysyncobj's raftLeader.
    assert "return self.__raftLeader" in src(SyncObj._getLeader)
    assert isinstance(inspect.getattr_static(SyncObj, "selfNode"), property)
    # The stagger must exceed the tick's idle poll (pysyncobj's default; we do not set it).
    assert SyncObjConf().autoTickPeriod == 0.05
    assert "autoTickPeriod" not in syncobj_options(RaftConfig(), Path("/tmp/journal"))
    assert RaftConfig().fast_failover_stagger > SyncObjConf().autoTickPeriod
    assert "self._onTick(self.__conf.autoTickPeriod)" in src(SyncObj._autoTickThread)
    assert "self._poller.poll(timeToWait)" in tick


def test_what_recovery_of_lost_state_relies_on():
    """kvps.raft.recovery: vote requests arrive through __onMessageReceived, which the transport
    calls through the mangled name on self (so ShardGroup's override sees them first); every
    election deadline comes from __generateRaftTimeout; the check reads commit index, term and
    entries as (command, index, term)."""
    init = src(SyncObj.__init__)
    assert "self.__transport.setOnMessageReceivedCallback(self.__onMessageReceived)" in init
    for name in ("_SyncObj__onMessageReceived", "_SyncObj__generateRaftTimeout"):
        assert name in ShardGroup.__dict__, name
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert "if message['type'] == 'request_vote' and self.__selfNode is not None:" in receive
    assert "monotonicTime() + self.__generateRaftTimeout()" in src(SyncObj._onTick)
    assert params(SyncObj._SyncObj__getEntries) == ["self", "fromIDx", "count", "maxSizeBytes"]
    assert "return self.__raftLog[-1][2]" in src(SyncObj._SyncObj__getCurrentLogTerm)
    for name in ("_SyncObj__raftCommitIndex", "_SyncObj__raftCurrentTerm", "_SyncObj__raftElectionDeadline"):
        assert f"self.{name.replace('_SyncObj', '')} =" in init, name


def test_what_prevote_relies_on():
    """kvps.raft.prevote: ShardGroup._onTick runs before the stock tick looks at the election
    deadline; the election it holds back is the stock one (term + 1, vote, request_vote); a
    leader's timeout_now sets __transferInProgress (cleared when the election starts); unknown
    message types fall through __onMessageReceived; the transport's send takes (node, message)."""
    tick = src(SyncObj._onTick)
    assert tick.index("if self.__raftElectionDeadline < monotonicTime()") < tick.index("self._poller.poll(timeToWait)")
    assert ("self.__setCurrentTerm(self.__raftCurrentTerm + 1, self.__selfNode.id) self.__votesCount = 1 "
            "for node in self.__otherNodes: self.__transport.send(node, { 'type': 'request_vote',") in tick
    assert "self.__transferInProgress = False self.__raftLeader = None" in tick
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert ("if message['term'] >= self.__raftCurrentTerm and node == self.__raftLeader: "
            "self.__raftElectionDeadline = 0 self.__transferInProgress = True") in receive
    # a follower takes a leader from an append of its term or higher, and then follows it
    assert "if message['type'] == 'append_entries' and message['term'] >= self.__raftCurrentTerm:" in receive
    assert "self.__raftLeader = node" in receive
    assert "'pre_vote'" not in inspect.getsource(pysyncobj.syncobj)  # our message types are free
    assert "self.__transport = transportClass(self, self.__selfNode, self.__otherNodes)" in src(SyncObj.__init__)
    assert "return self.__raftLog[-1][1]" in src(SyncObj._SyncObj__getCurrentLogIndex)
    assert params(ShardGroup._onTick) == params(SyncObj._onTick) == ["self", "timeToWait"]


def test_restart_transmissions_closes_every_snapshot_being_sent(syncobj, tmp_path):
    dump = tmp_path / "dump"
    dump.write_bytes(b"snapshot")
    transmissions = syncobj._SyncObj__serializer._Serializer__transmissions
    handle = dump.open("rb")
    transmissions["a"] = {"file": handle, "transmitted": 0}
    transmissions["b"] = {"data": b"in memory", "transmitted": 0}
    assert internals.transmissions_in_flight(syncobj) == 2
    assert internals.restart_transmissions(syncobj) == 2
    assert handle.closed and transmissions == {} and internals.transmissions_in_flight(syncobj) == 0
    assert internals.restart_transmissions(syncobj) == 0


def test_prevote_accessors(syncobj):
    assert internals.transfer_in_progress(syncobj) is False
    assert internals.send(syncobj, TCPNode("127.0.0.1:1"), {"type": "pre_vote"}) is False  # no such member
    syncobj._SyncObj__raftLeader = TCPNode("127.0.0.1:1")
    internals.forget_leader(syncobj)
    assert internals.leader(syncobj) is None


def test_a_fresh_syncobj_is_what_first_election_takes_for_fresh(syncobj):
    # kvps.raft.first_election: term 0 and only pysyncobj's initial no-op entry, at index 1
    assert internals.current_term(syncobj) == 0 and internals.last_log_index(syncobj) == 1
    assert len(syncobj._SyncObj__raftLog) == 1 and syncobj._SyncObj__raftLog[0][1:] == (1, 0)


def test_quiet_heartbeat_accessors(syncobj):
    assert internals.last_log_index(syncobj) == syncobj._SyncObj__raftLog[-1][1]
    assert internals.match_indexes(syncobj) == {}  # a follower: none
    assert internals.last_responses(syncobj) == list(syncobj._SyncObj__lastResponseTime.values())
    internals.set_next_heartbeat(syncobj, 12.5)
    assert internals.next_heartbeat(syncobj) == 12.5


def test_what_the_install_rename_guard_relies_on():
    """ShardGroup links the snapshot an install replaces before pysyncobj renames over it on the
    tick thread: it recognises the last chunk by ``serialized`` = (data, is_first, is_last)."""
    from pysyncobj.serializer import Serializer
    receive = src(SyncObj._SyncObj__onMessageReceived)
    assert "serialized = message.get('serialized', None)" in receive
    assert "if self.__serializer.setTransmissionData(serialized):" in receive
    setdata = src(Serializer.setTransmissionData)
    assert "data, isFirst, isLast = data" in setdata
    assert "atomicReplace(tmpFile, self.__fileName)" in setdata
    assert is_last_install_chunk({"type": "append_entries", "serialized": (b"", False, True)})
    assert not is_last_install_chunk({"type": "append_entries", "serialized": (b"", True, False)})
    assert not is_last_install_chunk({"type": "append_entries", "entries": []})


def test_tick_thread_lifetime_we_document():
    tick = src(SyncObj._autoTickThread)
    assert "if not self.__mainThread.is_alive(): break" in tick
    assert "weakref.proxy(self)" in src(SyncObj.__init__)


# ---- journal.py: how SyncObj builds and uses its journal ------------------------------------------

def test_syncobj_creates_its_journal_through_the_module_global():
    """kvps.raft.internals.journal_factory replaces pysyncobj.syncobj.createJournal; that only
    works while SyncObj.__init__ looks the name up as a module global and passes it
    conf.journalFile."""
    assert "createJournal" in SyncObj.__init__.__code__.co_names
    assert "self.__raftLog = createJournal(self.__conf.journalFile)" in src(SyncObj.__init__)
    assert pysyncobj.syncobj.createJournal in (internals._stock_create_journal,
                                                internals._create_journal)
    assert internals._stock_create_journal is pysyncobj.journal.createJournal
    assert params(pysyncobj.journal.createJournal) == ["journalFile"]


def test_journal_factory_builds_the_journal_of_a_syncobj(tmp_path):
    path, made = tmp_path / "raft.journal", []

    def make(journal_file: str) -> Journal:
        made.append(journal_file)
        return pysyncobj.journal.MemoryJournal()

    address = _free_address()
    with internals.journal_factory(path, make):
        obj = SyncObj(address, [], SyncObjConf(autoTick=False, journalFile=str(path)))
    try:
        assert made == [str(path)] and isinstance(internals.raft_log(obj), pysyncobj.journal.MemoryJournal)
    finally:
        obj.destroy()
        obj._onTick(0.0)


def test_our_journal_has_every_method_syncobj_calls():
    used = set(re.findall(r"self\.__raftLog\.(\w+)", inspect.getsource(pysyncobj.syncobj)))
    assert used, "pattern no longer matches: re-check how SyncObj uses its journal"
    interface = {name for name in vars(Journal) if not name.startswith("__")}
    assert used <= interface | {"flush"}, f"SyncObj calls journal methods outside Journal: {used - interface}"
    for name in interface | {"flush", "__getitem__", "__len__"}:
        ours = getattr(RaftJournal, name)
        assert ours is not getattr(Journal, name, None) or name == "onOneSecondTimer", name
        assert params(ours) == params(getattr(Journal, name, None) or getattr(FileJournal, name)), name
    # Entries are read as self.__raftLog[i] and self.__raftLog[a:b] (a list back), and compared
    # with the snapshot's (command, index, term) tuples.
    source = inspect.getsource(pysyncobj.syncobj)
    assert "self.__raftLog[diff:diff + count]" in source and "self.__raftLog[0] != data[2]" in source


# ---- internals.py: every private name, one accessor each --------------------------------------------

def _mangled_attributes(cls: type) -> set[str]:
    """``self.__name`` attributes assigned in ``cls``, as they appear on instances."""
    return {f"_{cls.__name__}{name}" for name in re.findall(r"self\.(__[A-Za-z]\w*) =", inspect.getsource(cls))}


@pytest.mark.parametrize("name", internals.SYNCOBJ_ATTRIBUTES)
def test_syncobj_attribute_still_exists(name):
    init = src(SyncObj.__init__)
    assert f"self.{name.replace('_SyncObj', '')} = " in init, name
    # every accessor is read after __init__, and the transport's poller before the transport
    # (the next heartbeat time is set after it: only a ticking leader's is read, kvps.raft.quiet)
    if name != "_SyncObj__newAppendEntriesTime":
        assert init.index(f"self.{name.replace('_SyncObj', '')} = ") < init.index("self.__transport = transportClass")


@pytest.mark.parametrize("name", internals.SYNCOBJ_METHODS + internals.TRANSPORT_METHODS)
def test_method_still_exists(name):
    owner = SyncObj if name in internals.SYNCOBJ_METHODS else TCPTransport
    assert callable(getattr(owner, name, None)), name


@pytest.mark.parametrize("name", internals.TRANSPORT_ATTRIBUTES)
def test_transport_attribute_still_exists(name):
    assert f"self.{name} = " in src(TCPTransport.__init__), name


@pytest.mark.parametrize("ours,theirs,names", [
    (ShardGroup, SyncObj, internals.SYNCOBJ_OVERRIDES),
    (AuthTransport, TCPTransport, internals.TRANSPORT_OVERRIDES),
    (RaftJournal, Journal, internals.JOURNAL_OVERRIDES),
])
def test_overrides_match_what_they_override(ours, theirs, names):
    for name in names:
        assert callable(getattr(theirs, name, None)) and name in vars(ours), name
        assert params(vars(ours)[name]) == params(getattr(theirs, name)), name
    # pysyncobj calls them through self, so ours are the ones it calls
    assert "self.__raftLog._destroy()" in inspect.getsource(pysyncobj.syncobj)
    assert "self._syncObj.addOnTickCallback(self._onTick)" in src(TCPTransport.__init__)
    assert "self.__generateRaftTimeout()" in src(SyncObj.__init__)


def test_module_level_names_still_exist():
    assert internals.REGULAR_COMMAND == _COMMAND_TYPE.REGULAR == 0
    assert internals.ROLES == {_RAFT_STATE.FOLLOWER: "follower", _RAFT_STATE.CANDIDATE: "candidate",
                               _RAFT_STATE.LEADER: "leader"}
    assert callable(pysyncobj.syncobj.createJournal)


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def syncobj():
    """A plain SyncObj that never ticks on its own and stands for no election."""
    address = _free_address()
    obj = SyncObj(address, [], SyncObjConf(autoTick=False, commandsWaitLeader=False, raftMinTimeout=30.0,
                                           raftMaxTimeout=31.0, connectionTimeout=31.0))
    try:
        yield obj
    finally:
        obj.destroy()
        obj._onTick(0.0)  # destroy() takes effect on the next tick


def test_syncobj_accessors_read_what_the_public_api_reads(syncobj):
    assert internals.current_term(syncobj) == internals.term(syncobj) == syncobj.raftCurrentTerm
    assert internals.commit_index(syncobj) == syncobj.raftCommitIndex
    assert not internals.is_leader(syncobj) and internals.leader(syncobj) is None
    log = internals.raft_log(syncobj)
    assert internals.log_size(syncobj) == len(log) >= 1
    first = log[0]
    assert len(first) == 3 and internals.entries(syncobj, first[1], 1) == [first]
    deadline = internals.election_deadline(syncobj)
    assert deadline > pysyncobj.monotonic.monotonic() + 10
    internals.set_election_deadline(syncobj, deadline + 1.0)
    assert internals.election_deadline(syncobj) == deadline + 1.0
    assert callable(internals.poller(syncobj).subscribe)
    assert 30.0 <= internals.stock_generate_raft_timeout(syncobj) <= 31.0


def test_syncobj_stock_methods_can_be_called(syncobj):
    results = []
    internals.apply_command(syncobj, bytes((internals.REGULAR_COMMAND, 0xFF)),
                            lambda result, reason: results.append(reason))
    syncobj._onTick(0.0)  # no leader yet: commandsWaitLeader=False fails it at once
    assert results == [FAIL_REASON.MISSING_LEADER]
    assert internals.stock_do_apply_command(syncobj, bytes((_COMMAND_TYPE.NO_OP,))) is None
    assert internals.stock_parse_change_cluster_request(syncobj, bytes((_COMMAND_TYPE.NO_OP,))) is None
    internals.stock_on_message_received(syncobj, TCPNode("127.0.0.1:1"),
                                        {"type": "next_node_idx", "next_node_idx": 2,
                                         "reset": True, "success": False})  # no leader: ignored


def test_transport_accessors(syncobj):
    transport = syncobj._SyncObj__transport
    assert internals.sync_obj(transport) is syncobj
    assert internals.connections(transport) == {} and internals.unknown_connections(transport) == set()
    assert internals.node_at(transport, "127.0.0.1:1") is None
    assert not internals.is_member(transport, TCPNode("127.0.0.1:1"))
    assert internals.self_node(transport) == syncobj.selfNode
    assert internals.node_of(transport, object()) is None
    server = transport._server
    internals.set_server(transport, "ours")
    assert transport._server == "ours"
    internals.set_server(transport, server)
    internals.mark_unbound(transport)
    assert transport._ready is False
    assert "self._ready = True" in src(TCPTransport._maybeBind)  # what mark_unbound undoes


def test_transport_hands_connections_to_the_stock_bookkeeping(syncobj):
    transport = syncobj._SyncObj__transport
    settings = PeerSettings(b"s" * 32, b"ctx", 1 << 20, 0, TransportStats())
    incoming = PeerConnection(settings, internals.poller(syncobj), 1.0, None)
    internals.add_incoming(transport, incoming)
    assert incoming in internals.unknown_connections(transport)
    assert incoming._onMessage is not None and incoming._onDisconnected is not None
    node, outgoing = TCPNode("127.0.0.1:1"), PeerConnection(settings, internals.poller(syncobj), 1.0, None)
    internals.connections(transport)[node] = outgoing
    assert internals.node_of(transport, outgoing) == node
    internals.outgoing_connected(transport, outgoing)  # names itself (dropped: not connected) ...
    assert syncobj.isNodeConnected(node)  # ... and reports the node connected


def test_every_accessor_is_pinned_here():
    """Each function of internals is called, or its pysyncobj source pinned, in this file."""
    source = Path(__file__).read_text()
    functions = [n for n in internals.__all__ if callable(getattr(internals, n))]
    assert functions and not [n for n in functions if f"internals.{n}(" not in source]


def _audit(path: Path, theirs: set[str]) -> list[str]:
    """Where ``path`` names a pysyncobj private name outside what internals allows (see below)."""
    overrides = {"ShardGroup": set(internals.SYNCOBJ_OVERRIDES),
                 "AuthTransport": set(internals.TRANSPORT_OVERRIDES),
                 "RaftJournal": set(internals.JOURNAL_OVERRIDES)}
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def mangled(name: str) -> bool:
        return re.fullmatch(r"_[A-Z][A-Za-z]*__\w+", name) is not None

    def visit(node: ast.AST, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            where = f"{path.name}:{getattr(child, 'lineno', '?')}"
            if isinstance(child, ast.FunctionDef) and cls in overrides and child.name in theirs:
                if child.name not in overrides[cls]:
                    found.append(f"{where} {cls} overrides {child.name}, not listed in internals")
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("pysyncobj"):
                found.extend(f"{where} imports {a.name}" for a in child.names if a.name.startswith("_"))
            if isinstance(child, ast.Attribute) and (child.attr in theirs or mangled(child.attr)):
                receiver = child.value
                on_self = (isinstance(receiver, ast.Name) and receiver.id == "self") or (
                    isinstance(receiver, ast.Call) and getattr(receiver.func, "id", "") == "super")
                if not on_self:
                    found.append(f"{where} .{child.attr}")
                elif cls in overrides and child.attr not in overrides[cls]:
                    found.append(f"{where} self.{child.attr} in {cls}")
            visit(child, cls)

    visit(tree, None)
    return found


def test_only_internals_touches_pysyncobj_private_names():
    """Every module of kvps but internals: no pysyncobj private name on anything but our own
    objects (``self`` in a class that does not extend pysyncobj's), and our subclasses of
    pysyncobj's classes touch only the overrides internals lists."""
    theirs = {"createJournal", *internals.SYNCOBJ_ATTRIBUTES}
    for cls in (SyncObj, TCPTransport, Journal):
        for klass in cls.__mro__:
            if klass.__module__.startswith("pysyncobj"):
                theirs |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
        theirs |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(inspect.getmodule(cls))))
    theirs |= _mangled_attributes(SyncObj)
    assert {"_poller", "_connections", "_SyncObj__raftLog", "_onTick", "_destroy"} <= theirs
    root = Path(kvps.__file__).parent
    found = [hit for path in sorted(root.rglob("*.py")) if path.name != "internals.py"
             for hit in _audit(path, theirs)]
    assert not found, "pysyncobj private names outside kvps/raft/internals.py:\n" + "\n".join(found)


def test_the_audit_would_notice(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(group):\n    return group._SyncObj__raftLog, group._isLeader()\n"
                      "class AuthTransport:\n    def _connToNode(self, conn):\n        return self._nodes\n")
    theirs = {"_isLeader", "_connToNode", "_nodes"}
    assert len(_audit(sample, theirs)) == 4


# ---- the ticker: groups without autoTick on one poller (kvps/raft/ticker.py) ----------------------

def test_a_group_without_auto_tick_builds_its_poller_through_create_poller_and_binds_on_ticks():
    """kvps.raft.internals.using_poller replaces pysyncobj.syncobj.createPoller for one
    construction; without autoTick, SyncObj.__init__ spins on the transport's ``ready`` (which
    AuthTransport reports while ``deferring_bind``), and ``_onTick`` binds when it is not."""
    init = src(SyncObj.__init__)
    assert "self._poller = createPoller(self.__conf.pollerType)" in init
    assert "createPoller" in SyncObj.__init__.__code__.co_names
    assert pysyncobj.syncobj.createPoller in (internals._stock_create_poller, internals._create_poller)
    assert "while not self.__transport.ready: self.__transport.tryGetReady()" in init
    assert "if self.__conf.autoTick:" in init
    tick = src(SyncObj._onTick)
    assert "if not self.__transport.ready: try: self.__transport.tryGetReady()" in tick
    assert tick.rstrip().endswith("self._poller.poll(timeToWait)")
    assert "self._ready" in src(TCPTransport.ready.fget)
    assert "self._maybeBind()" in src(TCPTransport._onTick)
    assert "self.__transport.destroy()" in src(SyncObj._doDestroy)
    assert params(SyncObj._onTick) == ["self", "timeToWait"]
    assert "autoTick" in src(SyncObjConf.__init__)


def test_the_ticker_accessors_drive_a_syncobj_without_auto_tick():
    """using_poller hands our poller to a SyncObj being built; tick runs it; the transport is
    bound once transport_ready says so; destroy_now closes it on this thread."""
    import time

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    poller = createPoller("auto")
    with internals.using_poller(poller):
        obj = SyncObj(address, [], SyncObjConf(autoTick=False, raftMinTimeout=0.2, raftMaxTimeout=0.3,
                                              appendEntriesPeriod=0.05))
    try:
        assert internals.poller(obj) is poller
        assert pysyncobj.syncobj.createPoller("auto") is not poller  # only the one construction
        deadline = time.monotonic() + 10
        while not internals.is_leader(obj) and time.monotonic() < deadline:
            internals.tick(obj)
            time.sleep(0.01)
        assert internals.is_leader(obj)
        assert internals.transport_ready(obj._SyncObj__transport)
    finally:
        internals.destroy_now(obj)
    with pytest.raises(RuntimeError, match="createPoller"):
        with internals.using_poller(poller):
            pass


def test_what_quiet_heartbeats_rely_on():
    """kvps.raft.quiet: a leader sends appends to everyone once __newAppendEntriesTime has passed
    and sets it a period after each send; heartbeats are appends with an empty ``entries`` list
    and a prevLogIdx; the fallback check reads conf.leaderFallbackTimeout on every tick; the match
    indexes are a dict by node; our onTick callbacks run after the sends of the same tick; a
    follower resets its deadline from an append before the callback of the next tick sees it."""
    tick = src(SyncObj._onTick)
    assert "if monotonicTime() > self.__newAppendEntriesTime or needSendAppendEntries:" in tick
    assert "deadline = monotonicTime() - self.__conf.leaderFallbackTimeout" in tick
    assert tick.index("self.__sendAppendEntries()") < tick.index("for callback in self.__onTickCallbacks:")
    send = src(SyncObj._SyncObj__sendAppendEntries)
    assert send.strip().startswith("def __sendAppendEntries(self): "
                           "self.__newAppendEntriesTime = monotonicTime() + self.__conf.appendEntriesPeriod")
    assert "'entries': entries, 'prevLogIdx': prevLogIdx," in send
    assert "entries = [] if nextNodeIndex <= self.__getCurrentLogIndex():" in send
    init = src(SyncObj.__init__)
    assert "self.__raftMatchIndex = {}" in init
    assert "self.__newAppendEntriesTime = 0" in init
    assert "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()" in src(
        SyncObj._SyncObj__onMessageReceived)
