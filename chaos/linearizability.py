"""A linearizability checker for per-key histories (Wing & Gong's search with Lowe's memoisation,
as in porcupine's ``checkSingle``), and the register model the chaos harness checks against.

A history is a list of ``Operation``s, each with the times it was invoked and returned. An
operation whose outcome is unknown (the client gave up: a timeout, a lost connection) has
``ret = inf``: it may have taken effect at any point after its invocation, or never. The model's
``step`` must therefore accept any state for an unknown output (the harness drops failed reads, so
only writes can be unknown).

The search walks the history in time order, keeping a stack of linearised operations. At a call it
tries to linearise that operation now (the model must accept its output in the current state, and
the pair (set of linearised operations, state) must not have been explored before); at a return of
an operation not yet linearised it backtracks. The history is linearizable iff every operation gets
linearised. ``budget`` bounds the number of steps so a pathological history yields "unknown"
instead of hanging the harness.

Pure: no I/O, no clocks, no randomness.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "CheckResult",
    "Model",
    "Operation",
    "RegisterModel",
    "UNKNOWN",
    "check",
    "check_per_key",
]

UNKNOWN = "unknown"  # the output of an operation whose outcome the client never learned


@dataclass(frozen=True)
class Operation:
    client: int | str
    input: Any                # e.g. ("write", value), ("cas", (expected_version, value)), ("read", None)
    output: Any               # the model's view of the answer, or UNKNOWN
    call: float               # invocation time
    ret: float = math.inf     # return time; inf when the outcome is unknown
    key: str = ""


class Model(Protocol):
    def init(self) -> Any: ...

    def step(self, state: Any, input: Any, output: Any) -> tuple[bool, Any]: ...


@dataclass
class CheckResult:
    ok: bool | None            # None: the budget ran out before a verdict
    steps: int = 0
    # On failure: the longest prefix of operations the search managed to linearise, in order,
    # and the operations left over (what a human looks at first).
    best_prefix: list[Operation] = field(default_factory=list)
    stuck: list[Operation] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return {True: "linearizable", False: "NOT linearizable", None: "unknown (budget exceeded)"}[self.ok]


# ---- the search ------------------------------------------------------------------------------

class _Entries:
    """Call and return entries in time order as a doubly linked list over arrays (0 = head)."""

    def __init__(self, ops: Sequence[Operation]) -> None:
        events = []
        for i, op in enumerate(ops):
            events.append((op.call, 0, i))   # at equal times calls come first: overlapping ops
            events.append((op.ret, 1, i))    # may be ordered either way
        events.sort(key=lambda e: (e[0], e[1], e[2]))
        n = len(events) + 1
        self.op = [-1] * n          # operation index of each entry
        self.is_call = [False] * n
        self.match = [0] * n        # a call's return entry
        self.next = list(range(1, n + 1))
        self.next[-1] = 0
        self.prev = list(range(-1, n - 1))
        call_at: dict[int, int] = {}
        for pos, (_, kind, i) in enumerate(events, start=1):
            self.op[pos] = i
            if kind == 0:
                self.is_call[pos] = True
                call_at[i] = pos
            else:
                self.match[call_at[i]] = pos

    def lift(self, e: int) -> None:
        for x in (e, self.match[e]):
            self.next[self.prev[x]] = self.next[x]
            if self.next[x]:
                self.prev[self.next[x]] = self.prev[x]

    def unlift(self, e: int) -> None:
        for x in (self.match[e], e):
            self.next[self.prev[x]] = x
            if self.next[x]:
                self.prev[self.next[x]] = x


def check(ops: Sequence[Operation], model: Model, *, budget: int = 2_000_000) -> CheckResult:
    """Is ``ops`` (one key's history) linearizable with respect to ``model``?"""
    ops = list(ops)
    entries = _Entries(ops)
    state = model.init()
    linearized = 0                      # bitset of linearised operations
    seen: set[tuple[int, Any]] = {(0, state)}
    stack: list[tuple[int, Any]] = []   # (call entry, state before it)
    best: list[int] = []
    e = entries.next[0]
    steps = 0
    while entries.next[0]:
        steps += 1
        if steps > budget:
            return CheckResult(None, steps, [ops[i] for i in best])
        if entries.is_call[e]:
            i = entries.op[e]
            ok, new_state = model.step(state, ops[i].input, ops[i].output)
            if ok and (linearized | 1 << i, new_state) not in seen:
                seen.add((linearized | 1 << i, new_state))
                stack.append((e, state))
                state, linearized = new_state, linearized | 1 << i
                entries.lift(e)
                if len(stack) > len(best):
                    best = [entries.op[c] for c, _ in stack]
                e = entries.next[0]
            else:
                e = entries.next[e]
            continue
        # A return entry of an operation we could not linearise before it returned: backtrack.
        if not stack:
            done = set(best)
            return CheckResult(False, steps, [ops[i] for i in best],
                               [op for i, op in enumerate(ops) if i not in done])
        e, state = stack.pop()
        linearized &= ~(1 << entries.op[e])
        entries.unlift(e)
        e = entries.next[e]
    return CheckResult(True, steps)


def check_per_key(ops: Iterable[Operation], model_for: Callable[[str], Model], *,
                  budget: int = 2_000_000) -> dict[str, CheckResult]:
    """Keys are independent registers (P-compositionality): check each key's history alone."""
    by_key: dict[str, list[Operation]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)
    return {key: check(kops, model_for(key), budget=budget) for key, kops in sorted(by_key.items())}


# ---- the register model ----------------------------------------------------------------------

@dataclass(frozen=True)
class RegisterModel:
    """A single-block kvps key used as a register: state ``(value, version)``.

    Every update (``set``, with or without ``expected_version``) writes a value and advances the
    version by one, so outputs carry versions and the check is much sharper than value-only.

    inputs / outputs:
      ("read", None)               -> (value, version)
      ("write", value)             -> version after the write, or UNKNOWN
      ("cas", (expected, value))   -> ("ok", version after) | ("conflict", actual version) | UNKNOWN
    """

    initial: tuple[float, int] = (0.0, 0)

    def init(self) -> tuple[float, int]:
        return self.initial

    def step(self, state: tuple[float, int], input: Any, output: Any) -> tuple[bool, Any]:
        value, version = state
        kind, arg = input
        if kind == "read":
            return (output[0] == value and output[1] == version), state
        if kind == "write":
            return (output == UNKNOWN or output == version + 1), (arg, version + 1)
        if kind == "cas":
            expected, new_value = arg
            matches = version == expected
            if output == UNKNOWN:   # it took effect here (or never: then it is simply not linearised)
                return True, (new_value, version + 1) if matches else state
            if output[0] == "ok":
                return (matches and output[1] == version + 1), (new_value, version + 1)
            return (not matches and output[1] == version), state
        raise ValueError(f"unknown register operation {kind!r}")
