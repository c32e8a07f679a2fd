"""The engine drafter's operations, one small dataclass each (the drafter: ``verl_ext.vllm.proposer``).

An operation's fields are what the caller asks; its ``result`` turns the drafter's answer into
what the caller gets (documented on each class). ``DraftingInstance.drafter_call(op)`` runs one on
every worker of an engine. On the wire an operation is its ``name`` followed by its fields as
plain values (``wire``: vLLM's ``collective_rpc`` serializes those without pickle); the drafter
rebuilds the dataclass (``from_wire``) and runs the handler it registered for that class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, NamedTuple, Optional, Sequence


class DrafterOp:
    """Base of the operations: ``name`` is the wire name; subclasses are frozen dataclasses."""

    name: ClassVar[str]

    def wire(self) -> tuple:
        """``(name, *fields)``: the ``collective_rpc`` arguments of ``verl_ext_drafter``."""
        return (self.name, *(getattr(self, f.name) for f in dataclasses.fields(self)))

    def result(self, answer: Any) -> Any:
        """What the caller gets from the drafter's ``answer`` (default: the answer itself)."""
        return answer


@dataclass(frozen=True)
class AddHistory(DrafterOp):
    """Add responses to the history tree of the prompt ``key``, one weight each, after the builds
    queued before it. Result: the responses added (int)."""

    name: ClassVar[str] = "add_history"
    key: str
    responses: Sequence  # int32 bytes or token lists
    weights: Sequence[float]


@dataclass(frozen=True)
class DropHistory(DrafterOp):
    """Drop the history tree of the prompt ``key``, after the builds queued before it. Result:
    whether there was one (bool)."""

    name: ClassVar[str] = "drop_history"
    key: str


@dataclass(frozen=True)
class SetHistories(DrafterOp):
    """One step's histories: ``items`` = ``[(prompt key, [responses], [weights])]`` (responses as
    int32 bytes or token lists), each key's tree replaced once its new one is built on the
    drafter's build thread; the keys in ``drop`` dropped, in order. Result: the responses queued."""

    name: ClassVar[str] = "set_histories"
    items: Sequence
    drop: Sequence[str] = ()


@dataclass(frozen=True)
class AwaitHistories(DrafterOp):
    """Wait until the queued history builds are installed (at most ``timeout_s``). Result: the
    trees installed (int)."""

    name: ClassVar[str] = "await_histories"
    timeout_s: float = 600.0


@dataclass(frozen=True)
class ImportGroups(DrafterOp):
    """Grouped draft server deltas (``verl_ext.spec.dgds``) into the group trees. Result: per
    blob, the tokens it added (0: nothing new) or -1 where the drafter refused it."""

    name: ClassVar[str] = "import_groups"
    blobs: Sequence[bytes]

    def result(self, answer: Any) -> list[int]:
        return [int(n) for n in answer]


class GroupCount(NamedTuple):
    """A group's requests: ``closed`` (finished) of ``total`` the drafter has seen."""

    closed: int
    total: int


@dataclass(frozen=True)
class GroupCounts(DrafterOp):
    """How many of each group's requests have finished. Result: ``{group: GroupCount}``."""

    name: ClassVar[str] = "group_counts"
    groups: Sequence[str]

    def result(self, answer: Any) -> dict[str, GroupCount]:
        return {str(g): GroupCount(int(c[0]), int(c[1])) for g, c in answer.items()}


@dataclass(frozen=True)
class GroupWrite(DrafterOp):
    """Whether requests started from now on write their group trees (off where the grouped draft
    server feeds them). Result: the previous setting (bool), for callers that restore it."""

    name: ClassVar[str] = "group_write"
    enabled: bool

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ValueError(f"group_write needs true or false, got {self.enabled!r}")


@dataclass(frozen=True)
class DropGroups(DrafterOp):
    """Drop the group trees of groups whose rollout is over. Result: the trees dropped (int)."""

    name: ClassVar[str] = "drop_groups"
    groups: Sequence[str]


@dataclass(frozen=True)
class SetWindows(DrafterOp):
    """New draft windows of running requests, ``{request id: window}`` (SpecActor's per-request
    reconfiguration). Result: the windows set (int)."""

    name: ClassVar[str] = "set_windows"
    windows: Mapping[str, int]

    def __post_init__(self):
        if not isinstance(self.windows, Mapping):
            raise ValueError(f"set_windows needs {{request id: window}}, got {type(self.windows).__name__}")


class RequestProgress(NamedTuple):
    """A running request's ``tokens`` so far and its engine ``steps``; with ``Progress(tokens=True)``
    the ``token_ids`` too."""

    tokens: int
    steps: int
    token_ids: Optional[list] = None


@dataclass(frozen=True)
class Progress(DrafterOp):
    """How far running requests are. Result: ``{request id: RequestProgress}`` for those this
    worker runs."""

    name: ClassVar[str] = "progress"
    request_ids: Sequence[str]
    tokens: bool = False

    def result(self, answer: Any) -> dict[str, RequestProgress]:
        return {str(rid): RequestProgress(int(r[0]), int(r[1]), list(r[2]) if len(r) > 2 else None)
                for rid, r in (answer or {}).items()}


@dataclass(frozen=True)
class Stats(DrafterOp):
    """The drafter's cumulative counters and settings (dict): ``steps``, ``proposed_tokens``,
    ``scope_tokens`` = {scope: [drafted, accepted]}, the index's and history builds' counters,
    ``options``, ``greedy_only``, the cut-off's and the selector's counters."""

    name: ClassVar[str] = "stats"


#: every operation by wire name
OPS: dict[str, type[DrafterOp]] = {op.name: op for op in (
    AddHistory, DropHistory, SetHistories, AwaitHistories, ImportGroups, GroupCounts, GroupWrite, DropGroups,
    SetWindows, Progress, Stats)}


def from_wire(name: str, args: Sequence) -> DrafterOp:
    """The operation ``DrafterOp.wire`` sent; ``ValueError`` for an unknown name or bad arguments."""
    cls = OPS.get(name)
    if cls is None:
        raise ValueError(f"unknown drafter op '{name}'; valid: {', '.join(OPS)}")
    try:
        return cls(*args)
    except TypeError as exc:
        raise ValueError(f"drafter op '{name}': {exc}") from None
