"""Host-side costs of verl_ext's real paths that the simulator charges (issue 35 part 2), each
measured on this project's CI machine (2-core x86_64, 2026-11-27) with the command in its comment;
docs/BENCHMARKS.md ("Host costs") has the runs. GPU hosts' CPUs are usually faster and have more
cores, so these err on the side of charging too much.
"""

#: seconds the engine's loop stops per history token delivered: the ``set_histories`` RPC's whole
#: round trip (int32 bytes, build off the loop), an upper bound of the stall (the decoding
#: requests' longest gap grew by 0.51 s of the 1.20 s round trip at 67.1M tokens)
#: OMP_NUM_THREADS=1 python scripts/bench_history_delivery.py (async row: rpc_s / tokens)
HISTORY_RPC_S_PER_TOKEN = 1.78e-8

#: seconds per history token of the drafter's tree build on its build thread, while the engine
#: decodes beside it (10.9 s for 67.1M tokens; 6.2 s with the engine's loop stopped)
#: OMP_NUM_THREADS=1 python scripts/bench_history_delivery.py (async row: history_build_s / tokens)
HISTORY_BUILD_S_PER_TOKEN = 1.63e-7

#: CPU seconds of veRL's one dispatcher actor's event loop per server call, per response token
#: it carries back and per prompt token it sends (a continuation resends the response so far):
#: the three unknowns solved from three rows of
#: python scripts/bench_dispatcher.py --requests 2000 --response-tokens 256,8192
#: (baseline at 256 and 8192 tokens, seer at 8192: 8 calls and 28.7k prompt tokens per request)
DISPATCHER_S_PER_CALL = 3.32e-4
DISPATCHER_S_PER_TOKEN = 3.02e-8
DISPATCHER_S_PER_PROMPT_TOKEN = 1.20e-7
