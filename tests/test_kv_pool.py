"""The simulator's cluster KV pool (Seer's global KVCache pool; a KV connector on vLLM): what it
holds, what an instance loads from it instead of prefilling, and the ``@kvpool`` arms."""

import asyncio
import json

import pytest

from test_sim import _cost, _requests, _trace
from test_sim_seer_support import _chunked
from verl_ext.cli import main as cli_main
from verl_ext.sim.clock import run_virtual
from verl_ext.perf.cost import preset_derivation
from verl_ext.sim.instance import SimInstance
from verl_ext.sim.kv_pool import KVPool, kv_bytes_per_token
from verl_ext.sim.runner import SimConfig, make_kv_pool, split_kv_pool
from verl_ext.sim.source import TraceSource


def test_pool_holds_the_longest_context_of_a_key_and_evicts_the_oldest():
    p = KVPool(1e-6, capacity_tokens=100)
    p.save("a", 40)
    p.save("a", 30)  # a shorter save (it never happens along one request) does not shrink it
    assert p.held("a") == 40 and p.saved_tokens == 40
    p.save("b", 50)
    p.save("c", 20)  # 110 > 100: "a", the oldest, goes
    assert (p.held("a"), p.held("b"), p.held("c")) == (0, 50, 20) and p.evicted_tokens == 40 and p.held_tokens == 70
    assert p.load(10) == pytest.approx(1e-5) and p.loaded_tokens == 10
    p.drop("b")
    assert p.held("b") == 0 and p.held_tokens == 20
    for bad in (dict(load_token_s=-1.0), dict(load_token_s=float("inf")), dict(load_token_s=1e-6, capacity_tokens=0)):
        with pytest.raises(ValueError):
            KVPool(**bad)


def test_kv_bytes_per_token_of_a_gpu_preset():
    der = preset_derivation("h100-7b")  # Qwen2.5-7B: 28 layers, 4 KV heads of 128, BF16, TP1
    assert kv_bytes_per_token(der) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token({**der, "tp": 4}) == 2 * 28 * 4 * 128 * 2 / 4
    assert preset_derivation("cpu-smollm2") is None
    with pytest.raises(ValueError, match="derivation"):
        kv_bytes_per_token({})
    pool = make_kv_pool(SimConfig(preset="h100-7b", kv_pool_gbps=50.0))
    assert pool.load_token_s == pytest.approx(57344 / 50e9)
    with pytest.raises(ValueError, match="'cpu-smollm2' has none"):
        make_kv_pool(SimConfig(preset="cpu-smollm2"))
    assert split_kv_pool("seer[context=false]@kvpool") == ("seer[context=false]", True)
    assert split_kv_pool("baseline+spec") == ("baseline+spec", False)


def test_continuation_on_another_instance_loads_its_context_from_the_pool():
    tr = _trace(groups=1, samples=2, lo=250, hi=300, seed=2)
    src = TraceSource(tr)
    first, rest = _chunked(tr, 0, 100)
    ctx = len(rest.prompt_ids)
    hit = (ctx - 1) // 16 * 16  # whole blocks; the last token is always computed
    load_token_s = 3e-6

    def run(where: str, pool):
        a, b = SimInstance("a", _cost(), src, kv_pool=pool), SimInstance("b", _cost(), src, kv_pool=pool)

        async def main():
            one = await a.generate(first)
            second = a if where == "same" else b
            t1, before = asyncio.get_running_loop().time(), second.prefill_tokens
            two = await second.generate(rest)
            assert list(one.token_ids) + list(two.token_ids) == tr.response(0).tolist()
            return second.prefill_tokens - before, asyncio.get_running_loop().time() - t1, second

        return run_virtual(main())

    same, t_same, _ = run("same", None)
    cold, t_cold, _ = run("other", None)
    pool = KVPool(load_token_s)
    warm, t_warm, b = run("other", pool)
    assert same == ctx - hit and cold == ctx  # the prefix cache helps only where the context is
    assert warm == ctx - hit and pool.loaded_tokens == b.pool_loaded_tokens == hit > 0
    # the same steps as on the prefix holder, plus the load in the admitting step
    assert t_warm == pytest.approx(t_same + hit * load_token_s) and t_warm < t_cold
    assert pool.saved_tokens == ctx and pool.held(("p0", 0)) == 0  # finished with EOS: released
    assert pool.held_tokens == 0


def test_a_preempted_request_loads_what_was_computed_instead_of_recomputing():
    tr = _trace(groups=1, samples=3, lo=250, hi=300, seed=4)
    src = TraceSource(tr)
    reqs = _requests(tr)
    need = max(len(r.prompt_ids) + len(tr.response(i)) for i, r in enumerate(reqs))
    cost = _cost(cap=need + 320)  # all three start; the cache fills while they decode

    def run(pool):
        inst = SimInstance("a", cost, src, kv_pool=pool)

        async def main():
            outs = await asyncio.gather(*(inst.generate(r) for r in reqs))
            return [list(o.token_ids) for o in outs], asyncio.get_running_loop().time()

        outs, t = run_virtual(main())
        return outs, t, inst

    outs, t_plain, plain = run(None)
    pool = KVPool(1e-6)
    outs_pool, t_pool, pooled = run(pool)
    assert outs == outs_pool == [tr.response(i).tolist() for i in range(len(reqs))]
    assert plain.preemptions == pooled.preemptions > 0
    prompts = sum(len(r.prompt_ids) for r in reqs)
    recomputed = plain.prefill_tokens - prompts
    assert recomputed > 0
    assert pooled.pool_loaded_tokens > 0 and pooled.prefill_tokens - prompts < recomputed / 4
    assert pooled.prefill_tokens + pooled.pool_loaded_tokens == plain.prefill_tokens
    assert t_pool < t_plain
    assert pool.held_tokens == 0  # every request finished with EOS


def test_ab_sim_kvpool_arms(tmp_path, capsys):
    out = tmp_path / "ab"
    # one h100-7b instance, 4.2M response tokens against 0.94M of KV: baseline preempts
    rc = cli_main(["sim", "--prompts", "32", "--samples", "16", "--mean-len", "8192", "--max-len", "32768",
                   "--instances", "1", "--no-progress", "--kv-pool-gbps", "10", "--out", str(out),
                   "--strategies", "baseline,baseline@kvpool"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())["strategies"]
    plain, pooled = s["baseline"], s["baseline@kvpool"]
    assert "kv_pool_loaded_tokens" not in plain and pooled["kv_pool_load_token_s"] == pytest.approx(57344 / 10e9)
    assert plain["preemptions"] > 0 and pooled["kv_pool_loaded_tokens"] > 0
    assert pooled["prefill_tokens"] < plain["prefill_tokens"] / 4 and pooled["wall_s"] < plain["wall_s"]
    assert pooled["output_tokens"] == plain["output_tokens"]
    capsys.readouterr()
    assert cli_main(["sim", "--pipeline", "sync", "--strategies", "baseline@kvpool", "--out",
                     str(tmp_path / "p")]) == 2
    assert "@kvpool arms run in single-rollout simulations" in capsys.readouterr().err
    assert cli_main(["ab", "--kv-pool-gbps", "10", "--out", str(tmp_path / "r")]) == 2
    assert "--kv-pool-gbps needs --sim" in capsys.readouterr().err
    assert cli_main(["sim", "--kv-pool-gbps", "0", "--out", str(tmp_path / "z")]) == 2
    assert "--kv-pool-gbps must be" in capsys.readouterr().err
