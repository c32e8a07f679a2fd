"""The drafting engine's idle cost: an engine started with verl_ext's drafter, drafting nothing
(window 0), against a plain engine, on the same requests, in alternating rounds.

``verl-ext fit engine-ladder`` measures this once per batch (``idle`` in the ladder JSON),
and ``specactor`` weighs it when deciding whether to start engines with a drafter
(``DraftLadder.drafter_gain``). This repeats that one measurement over several rounds so that its
spread on the machine shows. Prints idle / plain per round and writes them as JSON.

    OMP_NUM_THREADS=1 python scripts/bench_drafter_idle.py [--batch 16] [--max-tokens 64] [--rounds 4]
        [--temperature 0.7 --keyed] [--dtype float32] [--out runs/bench_drafter_idle.json]

``--temperature`` samples the requests (seeded per request; ``--keyed``: position-keyed, the
way the drafting strategies key them, so the drafting engine's keyed path runs); ``--dtype``
is the engines' (float32 by default, ``auto`` for the model's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path


async def measure(batch: int, max_tokens: int, rounds: int, temperature: float = 0.0, keyed: bool = False,
                  dtype: str = "float32") -> list[tuple[float, float]]:
    import dataclasses

    from verl_ext.engine.instance import SamplingSpec
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.model import default_model_dir
    from verl_ext.measure.engine_ladder import _requests, _timed, default_prompts
    from verl_ext.spec.options import SpecOptions

    model_dir = default_model_dir()
    prompts = default_prompts(model_dir, batch)
    engine_args = {} if dtype == "auto" else {"dtype": dtype}
    factory = VLLMInstanceFactory(str(model_dir), seed=0, max_model_len=max(map(len, prompts)) + max_tokens + 16,
                                  max_num_seqs=batch, kv_cache_gib=1, extra_engine_args=engine_args)
    (plain,) = await factory.create(1)
    (drafting,) = await factory.create(1, spec=SpecOptions(scopes="request", k=8))
    idle = lambda i: {"spec_window": 0}  # noqa: E731

    def reqs(n, tokens, tag, extra=None):
        out = _requests(prompts[:n], tokens, tag, extra)
        if temperature <= 0:
            return out
        return [dataclasses.replace(r, sampling=SamplingSpec(temperature=temperature, max_tokens=tokens, seed=i,
                                                              keyed=keyed, ignore_eos=True))
                for i, r in enumerate(out)]

    try:
        await _timed(plain, reqs(1, 8, "warm"))
        await _timed(drafting, reqs(1, 8, "warm", idle))
        out = []
        for r in range(rounds):
            t_plain, _, _ = await _timed(plain, reqs(batch, max_tokens, f"plain{r}"))
            t_idle, _, _ = await _timed(drafting, reqs(batch, max_tokens, f"idle{r}", idle))
            out.append((t_plain, t_idle))
            print(f"round {r}: plain {t_plain:.2f} s, drafting engine with nothing drafted {t_idle:.2f} s, "
                  f"ratio {t_idle / t_plain:.3f}", flush=True)
        return out
    finally:
        await drafting.shutdown()
        await plain.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--keyed", action="store_true", help="position-keyed sampling (with --temperature > 0)")
    ap.add_argument("--dtype", default="float32", help="the engines' dtype (auto: the model's)")
    ap.add_argument("--out", default="runs/bench_drafter_idle.json")
    args = ap.parse_args()
    runs = asyncio.run(measure(args.batch, args.max_tokens, args.rounds, args.temperature, args.keyed, args.dtype))
    ratios = [i / p for p, i in runs]
    print(f"idle / plain: mean {statistics.mean(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "max_tokens": args.max_tokens, "temperature": args.temperature,
                               "keyed": args.keyed, "dtype": args.dtype,
                               "rounds": [{"plain_s": p, "idle_s": i, "ratio": i / p} for p, i in runs]}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
