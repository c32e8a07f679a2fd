"""History worker cost (issue 6): ingest throughput, reward-weighted tree build time per prompt,
bytes per token held, checkpoint and restore time, and the cost of the ``set_histories`` payload
that carries a step's histories to an engine (token lists against int32 bytes).

Responses come from a synthetic long-response workload (``verl_ext.trace.synth``, published
similarity: text repeats across epochs as RhymeRL reports) so that snapshot compression is
realistic; ``--trace`` uses a recorded trace instead. One process, one thread: figures are per CPU
core. Prints a table and writes JSON.

    OMP_NUM_THREADS=1 python scripts/bench_history.py --prompts 64 --samples 16 --mean-len 4096 --out runs/bench_history.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def _payloads(hist: dict) -> dict:
    """The drafter's ``set_histories`` payload for every served prompt, as token lists (before)
    and as int32 bytes (``rhyme.delivery.set_histories_items``): seconds to build it, to serialize it
    (pickle, as Ray does), its size, and the engine side's decode into int32 arrays; per million
    tokens too."""
    import pickle

    from verl_ext.pipe.rhyme.delivery import set_histories_items
    from verl_ext.spec.history_build import token_array

    tokens = sum(len(t) for toks, _ in hist.values() for t in toks)
    out = {"tokens": tokens}
    for name, build in (("lists", lambda: [(u, [t.tolist() for t in toks], list(ws)) for u, (toks, ws) in hist.items()]),
                        ("int32_bytes", lambda: set_histories_items(hist))):
        t = time.perf_counter()
        items = build()
        t_build = time.perf_counter() - t
        t = time.perf_counter()
        blob = pickle.dumps(items, protocol=5)
        t_dump = time.perf_counter() - t
        t = time.perf_counter()
        back = pickle.loads(blob)
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        for _, toks, _ in back:
            for x in toks:
                token_array(x)
        t_decode = time.perf_counter() - t
        total = t_build + t_dump + t_load + t_decode
        out[name] = {"build_s": t_build, "pickle_s": t_dump, "unpickle_s": t_load, "decode_s": t_decode,
                     "bytes": len(blob), "bytes_per_token": len(blob) / max(1, tokens),
                     "seconds_per_million_tokens": total / max(1, tokens) * 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="a recorded trace (default: synthetic)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--mean-len", type=int, default=4096)
    ap.add_argument("--out", default="runs/bench_history.json")
    args = ap.parse_args()

    from verl_ext.history.worker import HistoryWorker
    from verl_ext.spec import DraftIndex
    from verl_ext.sim.runner import SimConfig, load_workload

    synth = dict(prompts=args.prompts, samples=args.samples, mean_len=args.mean_len, max_len=4 * args.mean_len)
    trace = load_workload(SimConfig(trace=args.trace, synth=synth, similarity="published"))
    epochs = sorted(set(trace.epoch.tolist()))
    rows_by_epoch = {e: np.flatnonzero(trace.epoch == e) for e in epochs}

    def rows_of(e):
        return [(str(trace.prompt_uid[i]), int(e), int(trace.sample_index[i]), trace.response(i).astype(np.int32).tobytes(),
                 float(trace.reward[i])) for i in rows_by_epoch[e]]

    out = {"workload": {"source": args.trace or "synthetic (published similarity)", "epochs": len(epochs),
                        "responses": int(sum(len(r) for r in rows_by_epoch.values())),
                        "tokens": int(trace.response_lengths().sum())}}
    with tempfile.TemporaryDirectory() as tmp:
        w = HistoryWorker(checkpoint_dir=tmp, nice=0)
        ingest_s, tokens = 0.0, 0
        for e in epochs:
            rows = rows_of(e)
            t = time.perf_counter()
            w.ingest(rows)
            ingest_s += time.perf_counter() - t
            tokens += sum(len(r[3]) // 4 for r in rows)
            w.close_step(e)
        uids = sorted({str(u) for u in trace.prompt_uid.tolist()})
        last = epochs[-1] + 1
        t = time.perf_counter()
        served = w.serve(uids, last)
        serve_s = time.perf_counter() - t
        build = []
        held = 0
        for u in uids:
            blobs, ws = served.get(u, ([], []))
            idx = DraftIndex(32, 0, 32)
            t = time.perf_counter()
            for b, wt in zip(blobs, ws):
                idx.add_history(u, np.frombuffer(b, np.int32), wt)
            build.append(time.perf_counter() - t)
            held += sum(len(b) // 4 for b in blobs)
        payload = _payloads({u: ([np.frombuffer(b, np.int32) for b in served[u][0]], served[u][1]) for u in served})
        st = w.stats()
        ck = w.checkpoint()
        t = time.perf_counter()
        w2 = HistoryWorker(checkpoint_dir=tmp, nice=0)
        restore_s = time.perf_counter() - t
        assert w2.stats()["tokens_held"] == st["tokens_held"]
    out.update({
        "ingest_tokens_per_s": tokens / ingest_s,
        "serve_s_all_prompts": serve_s,
        "served_tokens": held,
        "tree_build_ms_per_prompt_mean": 1e3 * float(np.mean(build)),
        "tree_build_ms_per_prompt_p99": 1e3 * float(np.percentile(build, 99)),
        "tree_build_tokens_per_s": held / sum(build),
        "tokens_held": st["tokens_held"],
        "bytes_per_token_held": st["bytes_held"] / max(1, st["tokens_held"]),
        "checkpoint_bytes": ck["bytes"],
        "checkpoint_bytes_per_token": ck["bytes"] / max(1, st["tokens_held"]),
        "checkpoint_s": ck["seconds"],
        "restore_s": restore_s,
        "set_histories_payload": payload,
        "threads": os.environ.get("OMP_NUM_THREADS"),
    })
    for k, v in out.items():
        print(f"{k:32s} {v}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
