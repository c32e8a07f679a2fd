"""The engine contract: what every strategy may ask of one inference instance.

An ``Instance`` is one engine replica (a local vLLM ``AsyncLLM``, a veRL server replica, or a
simulated engine). Strategies only ever talk to instances through this contract:

* ``generate(request, on_tokens=None)``: submit a request and await its completion
  (``Completion``); ``on_tokens(delta)``, when given, is called with each batch of new tokens
  as the engine produces them (engines that cannot stream call it once, at the end; they say so
  with ``streams_tokens = False``);
* ``stream(request)``: submit a request and iterate over token deltas as they are produced;
* ``abort(request_id)``: stop a running request; its ``generate``/``stream`` finishes with
  ``finish_reason == "abort"`` and the tokens produced so far;
* ``telemetry()``: a cheap, non-blocking snapshot of load (``Telemetry``);
* ``progress(request_id)`` (optional): ``(tokens generated, engine steps)`` of a running request
  so far, for engines that do not stream (``on_tokens`` already tells streaming callers); None
  when unknown;
* ``partial(request_id)`` (optional): the tokens a running request has generated so far, for
  engines that do not stream (``SimInstance``); None when unknown.
* ``refresh_progress(request_ids=None, tokens=False)`` (optional, async): where ``progress``
  and ``partial`` answer from a reading of the engine (veRL's servers, through the drafter),
  take a new one (``partial`` only from a reading with ``tokens``); False where there was
  nothing to read, an exception where the engine did not answer.
* ``set_spec_windows(windows, modes=None)`` (optional, async): new draft windows ``{request_id:
  tokens}`` for running requests on a drafting engine (SpecActor's Algorithm 2), and where the
  engine models decoupled speculation (the simulator) their modes ``{request_id: "coupled" |
  "decoupled"}``; returns how many it changed;
* ``keyed_sampling``: whether the engine samples keyed requests (``SamplingSpec.keyed``) by
  position keys, so that chunks, copies and drafted runs of one emit the same tokens;
* ``drafter_stats()`` (async): the engine drafter's counters (``verl_ext.pipe.mechanisms``);
  None without a drafter.

The contract is deliberately small so that the same strategy code runs on real engines, on
veRL's replicas and in a trace-driven simulator. Implementations: ``verl_ext.vllm.local``
(in-process vLLM) and ``verl_ext.rollout.replica_instance`` (veRL server handles).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from verl_ext.engine.drafter_ops import DrafterOp

#: ``generate``'s streaming callback: called with each batch of newly generated token ids
TokenCallback = Callable[[Sequence[int]], None]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class SamplingSpec:
    """Engine-agnostic sampling parameters for one request (one sample, ``n == 1``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    #: position-keyed sampling (``verl_ext.engine.keyed_sampling``): the token at each absolute
    #: position depends only on ``seed``, the position and the logits, so chunks, copies and
    #: drafted runs of the request emit the same tokens; needs ``seed``
    keyed: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.keyed and self.seed is None:
            raise ValueError("keyed sampling needs a seed (SamplingSpec.seed)")

    @property
    def keyed_seed(self) -> Optional[int]:
        """The seed the engine keys this request's samples on; None when it samples unkeyed
        (not keyed, or greedy: a greedy token needs no key)."""
        return self.seed if self.keyed and self.temperature > 0 else None

    def with_max_tokens(self, max_tokens: int) -> "SamplingSpec":
        return dataclasses.replace(self, max_tokens=max_tokens)

    def for_chunk(self, max_tokens: int, chunk: int) -> "SamplingSpec":
        """Chunk ``chunk`` (0-based) of a request generated in pieces: ``max_tokens`` and, for a
        seeded request, a seed derived per chunk so that chunks do not replay one random stream
        (chunk 0 keeps the request's own seed). A keyed request keeps its seed: its samples are
        keyed on absolute positions, so a continuation lines up with the whole request."""
        spec = self.with_max_tokens(max_tokens)
        if self.seed is None or chunk == 0 or self.keyed:
            return spec
        return dataclasses.replace(spec, seed=chunk_seed(self.seed, chunk))


def chunk_seed(seed: int, chunk: int) -> int:
    """Seed of chunk ``chunk`` of a request seeded ``seed`` (a fixed mix; stays in [0, 2**31))."""
    if chunk == 0:
        return seed
    return (seed * 0x9E3779B1 + chunk * 0x85EBCA77 + 0x27D4EB2F) % (1 << 31)


#: ``SamplingParams.extra_args["verl_ext"]`` key of a keyed request's seed (its engines' hook:
#: ``verl_ext.vllm.keyed``)
KEYED_SEED = "keyed_seed"

#: ``GenRequest.extra`` key: response tokens already generated (the tail of ``prompt_ids``)
PRIOR_TOKENS_KEY = "prior_tokens"


@dataclass
class GenRequest:
    """One sample to generate. ``group_id`` is the GRPO group (veRL's ``uid``); ``prompt_key``
    names the prompt across steps (its history, ``history_key``), where it differs from the group:
    inside veRL two groups of one prompt (a prompt twice in a batch, or in overlapping async
    steps) share a prompt key. A request that resumes an aborted one (veRL's async trainers)
    carries in ``extra[PRIOR_TOKENS_KEY]`` how many of its ``prompt_ids`` are response tokens
    generated before."""

    request_id: str
    group_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    sample_index: int = 0
    # Free-form engine-specific extras (passed to the engine where it supports them).
    extra: dict = field(default_factory=dict)
    prompt_key: Optional[str] = None

    @property
    def history_key(self) -> str:
        """The key of the prompt's history (rhyme's lengths, the drafter's history trees)."""
        return self.group_id if self.prompt_key is None else self.prompt_key


@dataclass
class Completion:
    """What an instance returns for one request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[float]] = None
    # Number of engine steps in which this request produced tokens (1 token per step without
    # speculation). ``None`` when the engine cannot tell.
    num_steps: Optional[int] = None
    extra: dict = field(default_factory=dict)


@dataclass
class DraftCounters:
    """An engine's cumulative decoding and drafting counters, named as ``Telemetry``'s fields
    they fill (``Telemetry(..., **counters.fields())``): one object per instance adapter."""

    generated_tokens: int = 0
    steps: int = 0
    request_steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add_decoded(self, tokens: int, steps: int, request_steps: int) -> None:
        """``steps`` engine steps in which ``request_steps`` (request, step) pairs emitted ``tokens``."""
        self.generated_tokens += tokens
        self.steps += steps
        self.request_steps += request_steps

    def add_drafted(self, drafts: int, draft_tokens: int, accepted_tokens: int) -> None:
        """``drafts`` verification steps with a draft, of ``draft_tokens``, ``accepted_tokens`` accepted."""
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens

    def fields(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Telemetry:
    """A load snapshot. Fields an engine cannot observe are ``None``."""

    running: int
    waiting: Optional[int] = None
    kv_cache_usage: Optional[float] = None  # fraction in [0, 1]
    generated_tokens: int = 0  # cumulative since the instance started
    steps: int = 0  # cumulative engine iterations
    # cumulative (request, step) pairs in which a request produced tokens; generated_tokens /
    # request_steps is the mean tokens a request gains per step (1.0 without speculation)
    request_steps: int = 0
    # speculative decoding, cumulative: verification steps with a draft, drafted tokens, and
    # drafted tokens the target accepted (0 when drafting is off)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # capacity, where the engine knows it: KV-cache size in tokens and the most requests it runs
    # at once (vLLM: num_gpu_blocks x block_size and max_num_seqs)
    kv_capacity_tokens: Optional[int] = None
    max_running: Optional[int] = None
    timestamp: float = field(default_factory=time.monotonic)


class Instance(abc.ABC):
    """One inference engine replica. See the module docstring for the contract."""

    #: stable name, e.g. ``"vllm-0"``
    name: str
    #: whether ``generate`` calls ``on_tokens`` as tokens come (False: once, at the end)
    streams_tokens: bool = False
    #: whether the engine samples keyed requests (``SamplingSpec.keyed``) by their position keys
    #: (``verl_ext.engine.keyed_sampling``); where False, keyed requests sample as unkeyed ones
    keyed_sampling: bool = False

    @abc.abstractmethod
    async def generate(self, request: GenRequest, on_tokens: Optional[TokenCallback] = None) -> Completion:
        """Run ``request`` to completion (or abort) and return its tokens; see the module docstring
        for ``on_tokens``."""

    async def stream(self, request: GenRequest) -> AsyncIterator[list[int]]:
        """Yield token deltas. Default: one delta with the whole completion."""
        completion = await self.generate(request)
        yield completion.token_ids

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` if it is running; a no-op otherwise."""

    @abc.abstractmethod
    def telemetry(self) -> Telemetry:
        """Current load; must not block."""

    def progress(self, request_id: str) -> Optional[tuple[int, int]]:
        """``(tokens generated, engine steps)`` of running ``request_id`` so far; None if unknown."""
        return None

    def partial(self, request_id: str) -> Optional[Sequence[int]]:
        """Tokens running ``request_id`` has generated so far; None if unknown."""
        return None

    async def refresh_progress(self, request_ids: Optional[Sequence[str]] = None, tokens: bool = False) -> bool:
        """Read how much running requests (default: all this instance runs) have generated so far,
        for ``progress`` to answer from, and with ``tokens`` what, for ``partial``; False where
        nothing was read."""
        return False

    async def drafter_stats(self) -> Optional[dict]:
        """The engine drafter's cumulative counters (``verl_ext.vllm.proposer``'s ``stats``:
        ``scope_tokens`` = {scope: [drafted, accepted]}, ``select_steps``, ...); None where no
        verl_ext drafter answers. Read by ``verl_ext.pipe.mechanisms``."""
        return None

    async def start(self) -> None:
        """Bring the instance up (idempotent)."""

    async def shutdown(self) -> None:
        """Release the instance's resources (idempotent)."""


@runtime_checkable
class DraftingInstance(Protocol):
    """What an instance whose engine runs verl_ext's drafter (``verl_ext.vllm.proposer``)
    offers besides ``Instance``: local vLLM engines and veRL's vLLM servers. Strategies check
    ``isinstance(inst, DraftingInstance) and inst.drafting`` before they use it."""

    #: whether the engine runs the drafter (False: every method below is a no-op or refuses)
    drafting: bool

    async def drafter_call(self, op: DrafterOp) -> Any:
        """One drafter operation (``verl_ext.engine.drafter_ops``) on every worker; the first
        worker's answer as ``op.result`` gives it where the engine's RPC returns one (None on
        veRL's servers, whose ``collective_rpc`` returns nothing)."""

    async def set_spec_windows(self, windows: dict, modes: Optional[dict] = None) -> int:
        """New draft windows of running requests (``{request id: window}``); how many were set."""

    async def import_drafts(self, blobs: list) -> list[int]:
        """Grouped draft server deltas into the drafter; per blob, the tokens it added (0: nothing
        new) or -1 where the drafter refused it (the server then resends that group in full)."""

