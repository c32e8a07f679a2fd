"""The keyed Gumbel-argmax (``verl_ext.engine.keyed_sampling``) as one Triton kernel for GPUs: each
program streams a part of a row's logits once, hashing (key, token) with SplitMix64 and keeping
the running argmax, instead of the torch rule's several vocabulary-sized int64 temporaries; the
parts' best are reduced after. The same arithmetic as ``keyed_sampling.gumbel_noise`` and vLLM's
CPU kernel (uniform from the top 53 bits of ``mix(mix(key) + (v + 1) * GOLDEN)``, Gumbel and
comparison in float64, the first index winning a tie), so it picks their tokens.

``available()`` says whether it can run here (Triton with a GPU backend); ``gumbel_argmax``
raises otherwise.
"""

from __future__ import annotations

import torch

from verl_ext.engine.keyed_sampling import GOLDEN, M1, M2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs
    triton = None


if triton is not None:

    @triton.jit
    def _mix(x, m1, m2):
        x = (x ^ (x >> 30)) * m1
        x = (x ^ (x >> 27)) * m2
        return x ^ (x >> 31)

    @triton.jit
    def _keyed_argmax_kernel(logits_ptr, stride, keys_ptr, best_ptr, idx_ptr, vocab, span, golden, m1, m2,
                             BLOCK: tl.constexpr):
        """Program (row, part): the best perturbed logit of the row's tokens [part * span, + span)."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        key = _mix(tl.load(keys_ptr + row).to(tl.uint64), m1, m2)
        best = tl.full([], float("-inf"), tl.float64)
        best_i = tl.full([], 0, tl.int64)
        lo = part * span
        for start in range(lo, lo + span, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = (offs < vocab) & (offs < lo + span)
            x = tl.load(logits_ptr + row * stride + offs, mask=inside, other=float("-inf")).to(tl.float64)
            h = _mix(key + (offs + 1).to(tl.uint64) * golden, m1, m2)
            u = ((h >> 11).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)
            g = -tl.log(-tl.log(u))
            y = tl.where(inside, x + g, float("-inf"))
            m = tl.max(y, axis=0)
            i = tl.argmax(y, axis=0).to(tl.int64) + start
            take = m > best
            best_i = tl.where(take, i, best_i)
            best = tl.where(take, m, best)
        tl.store(best_ptr + row * parts + part, best)
        tl.store(idx_ptr + row * parts + part, best_i)


def available() -> bool:
    """Triton with a GPU backend, and a GPU."""
    return triton is not None and torch.cuda.is_available()


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, span: int = 8192, block: int = 2048) -> torch.Tensor:
    """The keyed sample of each row of ``logits`` (``[n, vocab]`` on a GPU): int64 ``[n]``. Each
    row is split into parts of ``span`` tokens, one program each (a small batch still fills the
    GPU), and the parts' best are reduced in torch (the first best part wins a tie, as
    ``argmax`` does)."""
    if not available() or logits.device.type != "cuda":
        raise RuntimeError("the Triton keyed sampler needs Triton and logits on a CUDA GPU")
    x = logits.contiguous()
    n, vocab = x.shape
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    span = max(block, -(-span // block) * block)  # whole blocks per part
    parts = -(-vocab // span)
    best = torch.empty((n, parts), dtype=torch.float64, device=x.device)
    idx = torch.empty((n, parts), dtype=torch.int64, device=x.device)
    _keyed_argmax_kernel[(n, parts)](x, x.stride(0), keys.to(device=x.device, dtype=torch.int64).contiguous(), best,
                                     idx, vocab, span, GOLDEN, M1, M2, BLOCK=block)
    return idx.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)
