"""Drive verl_ext strategies on local vLLM engines from Python (no veRL trainer involved).

    python examples/local_engines.py [--model DIR] [--instances 2]

Starts the engines, runs the default arithmetic workload through each registered strategy, and
prints the metrics that `verl-ext ab` reports.
"""

import argparse
import asyncio

from transformers import AutoTokenizer

from verl_ext.ab.runner import ABConfig, build_requests
from verl_ext.compare.run import run_strategy
from verl_ext.vllm.local import VLLMInstanceFactory
from verl_ext.model import resolve_model
from verl_ext.pipe import available_strategies, make_strategy
from verl_ext.workload import encode_prompts, make_problems, make_scorer


async def main(model, instances: int) -> None:
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = ABConfig(prompts=8, samples=4, max_tokens=64)
    problems = make_problems(cfg.prompts, seed=cfg.seed)
    requests = build_requests(problems, encode_prompts(tokenizer, problems), cfg, (tokenizer.eos_token_id,))
    score = make_scorer(tokenizer, problems)

    engines = await VLLMInstanceFactory(str(model_dir), max_model_len=1024).create(instances)
    try:
        for name in available_strategies():
            arm = await run_strategy(make_strategy(name), engines, requests, score)
            print(name, {k: round(v, 3) for k, v in arm.metrics.items() if isinstance(v, float)})
    finally:
        for engine in engines:
            await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--instances", type=int, default=2)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.instances))
