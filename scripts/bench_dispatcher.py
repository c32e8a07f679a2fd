"""The veRL dispatcher's own cost (issue 35 part 2): CPU seconds per request and per response
token in the ``StrategyDispatcher`` actor, and the throughput limit that follows (it is one
asyncio actor: one core).

Inside veRL every agent-loop request goes through one dispatcher actor, which calls veRL's server
(``ReplicaInstance``) and returns the response. Here the servers answer at once (Ray actors with
``vLLMHttpServer.generate``'s signature and no model): what remains is the dispatcher's
bookkeeping, the strategy's and the Ray hops. Per strategy and response length it reports
* the CPU seconds per request, per server call and per 1k response tokens of the dispatcher's
  event loop thread (which runs all of its coroutines: the one-core limit) and of its whole
  process (Ray's threads too), read inside the actor, so the figures do not depend on how busy
  the other processes keep this machine;
* ``max_requests_per_s`` = 1 / CPU seconds per request: the most one dispatcher can carry;
* the latency one request gets through the dispatcher against a direct server call (one at a time).

    python scripts/bench_dispatcher.py --requests 2000 --response-tokens 256,8192 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time


def _server_class():
    import ray

    @ray.remote(num_cpus=0)
    class InstantServer:
        """veRL's ``vLLMHttpServer.generate``: ``max_tokens`` tokens at once, no model."""

        def __init__(self, tokens: int):
            self.tokens = tokens
            self.calls = self.sent = 0

        async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                           audio_data=None, mm_processor_kwargs=None, priority=0, kv_transfer_params=None):
            from verl.workers.rollout.replica import TokenOutput

            self.calls += 1
            self.sent += len(prompt_ids)
            n = min(self.tokens, int(sampling_params.get("max_tokens", self.tokens)))
            toks = list(range(1, n + 1))
            return TokenOutput(token_ids=toks, log_probs=[-0.5] * n, stop_reason="completed", extra_fields={})

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return None

    return InstantServer


def _cpu_s(handle) -> tuple[float, float]:
    """(the actor process's CPU seconds, its event loop thread's): Ray's own threads serialize
    and send in parallel with the loop (Ray's "AsyncIO Thread: default"), which runs every
    coroutine of the actor. Read from /proc: ``__ray_call__`` runs on another thread."""
    import ray

    def probe(self):
        import os
        import threading

        tick = os.sysconf("SC_CLK_TCK")
        loop = next(t.native_id for t in threading.enumerate() if t.name.startswith("AsyncIO Thread"))
        with open(f"/proc/self/task/{loop}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return time.process_time(), (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    return ray.get(handle.__ray_call__.remote(probe))


def _server_load(handles) -> tuple[int, int]:
    """(generate calls, prompt tokens sent) over all servers so far."""
    import ray

    got = ray.get([h.__ray_call__.remote(lambda self: (self.calls, self.sent)) for h in handles])
    return sum(c for c, _ in got), sum(s for _, s in got)


async def _run(handle, calls, concurrency: int) -> list[float]:
    """Issue ``calls`` (coroutine factories) ``concurrency`` at a time; per-call latencies."""
    sem = asyncio.Semaphore(concurrency)
    lat = []

    async def one(make):
        async with sem:
            t = time.perf_counter()
            await make()
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(one(c) for c in calls))
    return lat


def measure(strategy: str, options: dict, tokens: int, requests: int, servers: int, group: int,
            concurrency: int, latency_requests: int) -> dict:
    import ray

    from verl_ext.config.settings import VerlExtSettings
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    Server = _server_class()
    handles = {f"s{i}": Server.remote(tokens) for i in range(servers)}
    dispatcher = (ray.remote(StrategyDispatcher).options(num_cpus=0, max_concurrency=100_000)
                  .remote(VerlExtSettings(strategy=strategy, options=options), handles, tokens))
    params = {"temperature": 1.0, "max_tokens": tokens}

    def via_dispatcher(i):
        prompt = [7, 11, 13, i // group]  # a group's samples share their prompt
        return lambda: dispatcher.generate.remote(f"r{i}", prompt, params)

    server = next(iter(handles.values()))

    def direct(i):
        return lambda: server.generate.remote([7, 11, 13, i // group], params, f"d{i}")

    async def main():
        await _run(None, [via_dispatcher(-1 - i) for i in range(50)], concurrency)  # warm-up
        ray.get(dispatcher.begin_step.remote(1, requests))
        load0, cpu0, t0 = _server_load(handles.values()), _cpu_s(dispatcher), time.perf_counter()
        await _run(None, [via_dispatcher(i) for i in range(requests)], concurrency)
        cpu1 = _cpu_s(dispatcher)
        wall, cpu, loop_cpu = time.perf_counter() - t0, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        load = [b - a for a, b in zip(load0, _server_load(handles.values()))]
        lat_d = await _run(None, [via_dispatcher(requests + i) for i in range(latency_requests)], 1)
        lat_s = await _run(None, [direct(i) for i in range(latency_requests)], 1)
        return wall, cpu, loop_cpu, load, lat_d, lat_s

    wall, cpu, loop_cpu, (calls, sent), lat_d, lat_s = asyncio.run(main())
    for h in [dispatcher, *handles.values()]:
        ray.kill(h)
    per_req = loop_cpu / requests
    return {
        "strategy": strategy, "options": options, "response_tokens": tokens, "requests": requests,
        "server_calls_per_request": calls / requests,
        "prompt_tokens_sent_per_request": sent / requests,  # continuations resend the response so far
        "process_cpu_s_per_request": cpu / requests,  # every thread of the actor's process
        "dispatcher_cpu_s_per_request": per_req,  # its event loop's thread: the one-core limit
        "dispatcher_cpu_s_per_server_call": loop_cpu / calls,
        "dispatcher_cpu_s_per_1k_tokens": loop_cpu / (requests * tokens) * 1e3,
        "max_requests_per_s": 1.0 / per_req if per_req > 0 else None,
        "max_tokens_per_s": tokens / per_req if per_req > 0 else None,
        "wall_requests_per_s": requests / wall,
        "latency_ms_via_dispatcher": 1e3 * statistics.median(lat_d),
        "latency_ms_direct": 1e3 * statistics.median(lat_s),
        "latency_ms_added": 1e3 * (statistics.median(lat_d) - statistics.median(lat_s)),
    }


ARMS = {
    "baseline": ("baseline", {}),
    "seer": ("seer", {"speculative": False}),  # divided rollout: chunk calls, no drafter
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="baseline,seer", help=f"comma-separated, from {sorted(ARMS)}")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--response-tokens", default="256,8192", help="comma-separated response lengths")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--group", type=int, default=16, help="samples per prompt")
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight (agent-loop coroutines)")
    ap.add_argument("--latency-requests", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for tokens in [int(x) for x in args.response_tokens.split(",")]:
            for arm in args.arms.split(","):
                strategy, options = ARMS[arm]
                rows.append(measure(strategy, options, tokens, args.requests, args.servers, args.group,
                                    args.concurrency, args.latency_requests))
                if not args.json:
                    r = rows[-1]
                    print(f"{arm:>9} {tokens:>6} tok: {1e3 * r['dispatcher_cpu_s_per_request']:.3f} ms CPU/request "
                          f"-> max {r['max_requests_per_s']:.0f} req/s, {r['max_tokens_per_s'] / 1e6:.2f}M tok/s; "
                          f"latency +{r['latency_ms_added']:.2f} ms")
    finally:
        ray.shutdown()
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
