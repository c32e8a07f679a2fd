"""verl_ext's manager behind veRL's real `generate_sequences` (V0 DataProto path), over fake
rollout servers, following veRL's `*_on_cpu.py` pattern: real Ray (local), veRL's real config,
agent-loop workers, single-turn agent loop, `GlobalRequestLoadBalancer` and `LLMServerClient`;
only the GPU inference servers are replaced by Ray actors with deterministic outputs.
"""

import asyncio
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from _util import compose_verl  # noqa: E402


@ray.remote(num_cpus=0)
class FakeServer:
    """`vLLMHttpServer.generate`'s signature; returns `prompt[-1] + k` tokens, k = 1 + sum(prompt) % 5."""

    def __init__(self, name, delay=0.0):
        self.name = name
        self.delay = delay  # seconds per generate call
        self.calls = 0
        self.sampling = []  # the sampling params of every request
        self.rpcs = []  # collective_rpc calls
        self.engine_rpcs = []  # collective_rpc calls through the engine client (``__ray_call__``)

        class EngineClient:
            """The vLLM engine client of veRL's ``vLLMHttpServer`` (``server.engine``), as far as verl_ext's
            drafter RPC needs it: ``collective_rpc`` answers, and the output handler's loop. Its drafter
            holds a real ``DraftIndex``: group deltas imported into it answer per blob, as a worker's."""

            def __init__(self, server):
                from verl_ext.spec._suffix import DraftIndex

                self.server, self.index, self.loop = server, DraftIndex(32, 0, 1), None
                self.output_handler = self

            def get_loop(self):
                return self.loop

            async def collective_rpc(self, method, args=()):
                from verl_ext.spec.dgds import import_deltas

                self.server.engine_rpcs.append((method, args))
                return [import_deltas(self.index, args[1]) if args[0] == "import_groups" else None]

        self.engine = EngineClient(self)  # defined here: Ray cannot import this test module

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority=0, kv_transfer_params=None):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        self.engine.loop = asyncio.get_running_loop()
        self.sampling.append((list(prompt_ids), dict(sampling_params)))
        if self.delay:
            await asyncio.sleep(self.delay)
        k = 1 + sum(prompt_ids) % 5
        tokens = [(prompt_ids[-1] + i) % 1000 + 1 for i in range(k)][: sampling_params.get("max_tokens", k)]
        return TokenOutput(token_ids=tokens, log_probs=[-0.5] * len(tokens),
                           stop_reason="completed", extra_fields={"server": self.name})

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # vLLMHttpServer's signature
        self.rpcs.append((method, args))

    def reset(self):
        """As new (the next test's): ``_servers`` shares a pair between the module's tests."""
        self.__init__(self.name, self.delay)

    def num_calls(self):
        return self.calls

    def seen(self):
        return self.sampling, self.rpcs

    def engine_calls(self):
        return self.engine_rpcs


@ray.remote(num_cpus=0)
class MarkovServer:
    """A deterministic "model" whose next token depends only on the last one, so generating a
    response in pieces (chunks, or aborted and resumed attempts) gives the same tokens as in one
    go: next = (last * 7 + 3) % 997 + 1, ending after a token divisible by 5 (or at max_tokens).
    ``abort(n)``: the next ``n`` calls return the first half of their tokens, stop_reason
    "aborted", as veRL's servers do when a weight sync aborts the requests in flight."""

    def __init__(self, name, delay=0.02):
        self.name, self.delay, self.aborts, self.version = name, delay, 0, 1
        self.calls, self.bump_at, self.bump_to = 0, None, None

    def reset(self):
        """As new (the next test's): ``_servers`` shares a pair between the module's tests."""
        self.__init__(self.name, self.delay)

    def abort(self, n):
        self.aborts += n

    def bump(self, after_calls, version):
        """Weights move to ``version`` after the next ``after_calls`` calls (``global_steps``)."""
        self.bump_at, self.bump_to = self.calls + after_calls, version

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority=0, kwargs=None, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        if self.bump_at is not None and self.calls > self.bump_at:
            self.version = self.bump_to
        # decided when the call starts, as on veRL's servers, where a weight sync aborts what is in
        # flight before the weights change: a call runs under one version, and the first calls abort
        version, aborted = self.version, self.aborts > 0
        self.aborts -= aborted
        await asyncio.sleep(self.delay)
        tokens = []  # (inline: the test module is not importable in Ray workers)
        last, max_tokens = prompt_ids[-1], int(sampling_params.get("max_tokens", 16))
        while len(tokens) < max_tokens:
            last = (last * 7 + 3) % 997 + 1
            tokens.append(last)
            if last % 5 == 0:
                break
        stop = "completed"
        if aborted:
            tokens, stop = tokens[: len(tokens) // 2], "aborted"
        return TokenOutput(token_ids=tokens, log_probs=[-0.5] * len(tokens), stop_reason=stop,
                           extra_fields={"global_steps": version})

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return None


def _markov(prompt_ids, max_tokens=16):
    """``MarkovServer``'s response to ``prompt_ids`` in one go."""
    out, last = [], prompt_ids[-1]
    while len(out) < max_tokens:
        last = (last * 7 + 3) % 997 + 1
        out.append(last)
        if last % 5 == 0:
            break
    return out


def _batch(k):
    from verl import DataProto

    prompts = [f"What is {i} + {i}?" for i in range(k)]
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts], dtype=object),
            "uid": np.array([f"uid-{i}" for i in range(k)], dtype=object),
            "agent_name": np.array(["single_turn_agent"] * k, dtype=object),
            "data_source": np.array(["arith"] * k, dtype=object),
            "reward_model": np.array([{"ground_truth": "0"}] * k, dtype=object),
            "extra_info": np.array([{}] * k, dtype=object),
            "index": np.arange(k),
        }
    )


def _compose_one_step_off(overrides):
    """veRL's one-step-off-policy trainer config (``verl.experimental.one_step_off_policy``), whose
    search path ``file://verl/trainer/config`` is relative to the directory holding ``verl``."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    package = os.path.dirname(verl.__file__)
    cwd = os.getcwd()
    GlobalHydra.instance().clear()
    try:
        os.chdir(os.path.dirname(package))
        with initialize_config_dir(config_dir=os.path.join(package, "experimental/one_step_off_policy/config"),
                                   version_base=None):
            return compose(config_name="one_step_off_ppo_trainer", overrides=list(overrides))
    finally:
        os.chdir(cwd)


#: (server class, delay) -> two fake servers and veRL's load balancer over them, shared by the
#: module's tests (each of the three is a Ray actor whose process imports veRL: about 10 s of a
#: 2-core machine's time per test); ``ray_local`` clears it when its Ray stops
_SHARED: dict = {}


def _servers(cls, delay, fresh=False):
    """Two servers of ``cls`` (as new: ``reset``) and veRL's real load balancer over them; with
    ``fresh``, a pair of the test's own (where a previous manager's background calls, still
    arriving, would be counted)."""
    from verl.workers.rollout.router import get_router_handle

    key = (cls, delay)
    if not fresh and key in _SHARED:
        servers, lb = _SHARED[key]
        ray.get([s.reset.remote() for s in servers.values()])
        return servers, lb
    servers = {f"s{i}": cls.remote(f"s{i}", delay) for i in range(2)}
    pair = servers, get_router_handle(servers=servers, router_config_path=None, full_determinism=False)
    if not fresh:
        _SHARED[key] = pair
    return pair


def _v0_manager(strategy, model_dir, n, *overrides, delay=0.0, compose=compose_verl, server_cls=None,
                client_cls=None, workers=1, fresh=False):
    """verl_ext's V0 manager for ``rollout=<strategy>`` over two fake servers (veRL's real load
    balancer; the module's shared pair, ``_servers``), given veRL's ``client_cls`` (default
    ``LLMServerClient``), with ``workers`` agent-loop workers: one unless a test needs calls from
    several (each is a Ray actor that imports veRL and torch, most of a test's time on a 2-core
    machine)."""
    from verl.workers.rollout.llm_server import LLMServerClient

    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    config = compose(
        [f"rollout@actor_rollout_ref.rollout={strategy}", f"actor_rollout_ref.model.path={model_dir}",
         "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={n}",
         f"actor_rollout_ref.rollout.agent.num_workers={workers}", "actor_rollout_ref.rollout.prompt_length=128",
         "actor_rollout_ref.rollout.response_length=16",
         *(["trainer.use_v1=false"] if compose is compose_verl else []),
         "data.return_raw_chat=true", *overrides],
    )
    servers, lb = _servers(server_cls or FakeServer, delay, fresh)
    client = (client_cls or LLMServerClient)(config, load_balancer_handle=lb)
    return VerlExtAgentLoopManager.create(config=config, llm_client=client), servers


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    _SHARED.clear()
    ray.shutdown()


def test_manager_rhyme_feeds_history_and_serves_it_next_epoch(ray_local, model_dir, tmp_path):
    """rollout=rhyme on veRL's V0 path: step 1 (no history) feeds the history workers; step 2 (the
    same prompts, next epoch; histopipe=true: the synchronous trainer does not overlap steps) plans
    HistoPipe from their lengths and loads each server's drafter
    with the step-1 responses of the prompts it serves, keyed like the requests."""
    from verl_ext.rollout.dispatcher import prompt_group_id

    n = 3
    opts = "actor_rollout_ref.rollout.custom.verl_ext.options"
    # two agent-loop workers: the dispatcher takes each step's calls from both
    manager, servers = _v0_manager("rhyme", model_dir, n, f"trainer.default_local_dir={tmp_path}", f"{opts}.histopipe=true",
                                   workers=2, fresh=True)  # its own servers: it counts their drafter calls

    def run(step):
        gen = _batch(4).repeat(repeat_times=n, interleave=True)
        gen.meta_info["global_steps"] = step
        return manager.generate_sequences(gen)

    started = time.monotonic()
    out1 = run(1)
    m1 = out1.meta_info["timing"]
    assert m1["verl_ext/rhyme/histopipe_active"] == 0  # first epoch: no history
    seen = ray.get([s.seen.remote() for s in servers.values()])
    assert all(rpcs == [] for _, rpcs in seen)
    # every request names its group (prompt key and veRL's uid, from verl_ext's agent-loop
    # worker) and its history key (the prompt key) for the drafter
    groups = {}
    for prompts, params in (x for sampling, _ in seen for x in sampling):
        ident = dict(params["extra_args"]["verl_ext"])
        key = prompt_group_id(prompts)
        assert ident.pop("request_id") and ident["prompt_key"] == key and ident["group_id"].startswith(f"{key}:uid-")
        groups.setdefault(ident["group_id"], set()).add(key)
    assert len(groups) == 4 and all(len(keys) == 1 for keys in groups.values())
    responses = {}
    mask = out1.batch["response_mask"].bool()
    for row in range(len(out1)):
        p = out1.batch["prompts"][row][out1.batch["attention_mask"][row][: out1.batch["prompts"].shape[1]].bool()]
        responses.setdefault(prompt_group_id(p.tolist()), []).append(out1.batch["responses"][row][mask[row]].tolist())

    out2 = run(2)
    both_s = time.monotonic() - started
    m2 = out2.meta_info["timing"]
    assert m2["verl_ext/rhyme/histopipe_active"] == 1 and m2["verl_ext/rhyme/history_prompts"] == 4
    # HistoPipe placed every request in its ranking group's block, and its tier 2 floors t0 at the
    # trainer's time between the two rollouts, as the dispatcher saw it
    assert m2["verl_ext/mechanisms/histopipe_placements"] >= 4 * n
    assert "verl_ext/rhyme/t_train_s" not in m1 and 0 < m2["verl_ext/rhyme/t_train_s"] < both_s
    assert m2["verl_ext/history/failures"] == 0 and m2["verl_ext/history/ingested"] >= 4 * n
    # histories go out in the background (no request waits for them): wait for them to arrive
    deadline = time.monotonic() + 30
    while True:
        seen = ray.get([s.seen.remote() for s in servers.values()])
        if all(rpcs for _, rpcs in seen) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    loaded = {}
    for _, rpcs in seen:
        # one call per server and step, and one more per prompt that came after the plan was
        # made (a machine too busy for the plan window, PLAN_WINDOW_S)
        assert 1 <= len(rpcs) <= 1 + m2["verl_ext/rhyme/late_prompts"]
        for method, (op, items, stale) in rpcs:
            assert method == "verl_ext_drafter" and op == "set_histories" and stale == []
            for key, toks, weights in items:  # each response as int32 bytes
                got = sorted(np.frombuffer(t, dtype=np.int32).tolist() for t in toks)
                assert loaded.setdefault(key, got) == got
                assert weights == [pytest.approx(0.1)] * n  # unscored responses: the floor weight
    assert loaded == {k: sorted(v) for k, v in responses.items()}
    # step 1 was checkpointed when step 2 began
    ckpt = tmp_path / "verl_ext_history" / "history-0-of-1.vxh"
    for _ in range(100):
        if ckpt.exists():
            break
        time.sleep(0.1)
    assert ckpt.stat().st_size > 0


def test_the_last_steps_history_is_checkpointed_without_a_next_step(ray_local, model_dir, tmp_path):
    """veRL may save its checkpoint after a step and exit (``trainer.save_freq``); a run resumed
    from it must find that step's responses in the history checkpoint, although no next step
    starts (where the previous step is closed and checkpointed) in the run that rolled it out."""
    from verl_ext.history.worker import HistoryWorker
    from verl_ext.rollout.dispatcher import HISTORY_QUIET_S

    n = 2
    manager, _ = _v0_manager("rhyme", model_dir, n, f"trainer.default_local_dir={tmp_path}")
    gen = _batch(3).repeat(repeat_times=n, interleave=True)
    gen.meta_info["global_steps"] = 1
    manager.generate_sequences(gen)
    ckpt = tmp_path / "verl_ext_history" / "history-0-of-1.vxh"
    deadline = time.monotonic() + HISTORY_QUIET_S + 20
    while not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ckpt.exists(), "step 1's history was never checkpointed"
    # what a resumed run's history worker restores and serves to step 2
    worker = HistoryWorker(checkpoint_dir=str(tmp_path / "verl_ext_history"), nice=0)
    served = worker.serve(list(worker.store.prompts), step=2)
    assert len(served) == 3 and all(len(blobs) == n for blobs, _ in served.values())


def test_every_strategy_hears_each_step_and_its_batch(ray_local, model_dir):
    """The manager tells the dispatcher each training step and how many requests it brings, for
    every strategy (not only those with history): specactor then selects its method once per
    step, at the step's per-server batch (4 prompts x 3 over 2 servers: 6), as ``verl-ext ab``
    selects it, not once per run at ``options.batch`` (64)."""
    n = 3
    manager, _ = _v0_manager("specactor", model_dir, n,
                             "actor_rollout_ref.rollout.custom.verl_ext.options.profile=cpu-smollm2-avx2")
    selections = []
    for step in (1, 2):
        gen = _batch(4).repeat(repeat_times=n, interleave=True)
        gen.meta_info["global_steps"] = step
        m = manager.generate_sequences(gen).meta_info["timing"]
        assert m["verl_ext/specactor/selection_batch"] == 6
        selections.append(m["verl_ext/mechanisms/ladder_selections"])
    assert selections[1] == selections[0] + 1  # one more selection in step 2


def test_manager_seer_syncs_group_trees_across_servers(ray_local, model_dir):
    """rollout=seer with verl_ext's drafter on veRL's servers: the grouped draft server gets every
    chunk's tokens when the chunk returns and pushes each server the deltas of the groups it runs,
    through the server's engine client (collective_rpc returns nothing), which answers per blob;
    the servers, which do not stream, keep writing their own group trees as well. Outputs are those of the same rollout without the
    server."""
    from verl_ext.spec._suffix import DraftIndex
    from verl_ext.spec.dgds import import_deltas

    n, opts = 4, "actor_rollout_ref.rollout.custom.verl_ext.options"
    outs = {}
    for dgds in ("true", "false"):
        manager, servers = _v0_manager("seer", model_dir, n, f"{opts}.chunk_size=2", f"{opts}.dgds={dgds}",
                                       f"{opts}.dgds_sync_interval_s=0.01", delay=0.05, fresh=True)
        # the server starts beside the first step's first chunks; the second step runs with it up
        first = manager.generate_sequences(_batch(3).repeat(repeat_times=n, interleave=True))
        before = manager.verl_ext_metrics().get("verl_ext/seer/dgds_tokens", 0.0)
        out = manager.generate_sequences(_batch(3).repeat(repeat_times=n, interleave=True))
        outs[dgds] = (first, out)
        seen = ray.get([s.seen.remote() for s in servers.values()])
        ops = [[args for method, args in rpcs if method == "verl_ext_drafter"] for _, rpcs in seen]
        ops = [o + [args for method, args in engine_rpcs if method == "verl_ext_drafter"]
               for o, engine_rpcs in zip(ops, ray.get([s.engine_calls.remote() for s in servers.values()]))]
        if dgds == "false":
            assert not any(a[0] == "import_groups" for o in ops for a in o)
            continue
        time.sleep(0.5)  # the last appends are flushed on the next sync tick
        m = manager.verl_ext_metrics()
        assert m["verl_ext/seer/dgds_degraded"] == 0, {k: v for k, v in m.items() if "dgds" in k}
        assert out.meta_info["timing"]["verl_ext/seer/chunks"] > len(out)
        # the second step's chunks went to the server (less the last appends of each group, which
        # are dropped with the group's tree once all of it is done)
        assert 0 < m["verl_ext/seer/dgds_tokens"] - before <= float(out.batch["response_mask"].sum())
        assert m["verl_ext/seer/engine_local_trees"] == len(servers)
        for server_ops in ops:
            assert ("group_write", False) not in server_ops
            imports = [a for a in server_ops if a[0] == "import_groups"]
            assert imports and all(len(a) == 2 for a in imports)
            index = DraftIndex(32, 0, 1)  # the deltas are real group trees: replay them
            applied = [import_deltas(index, a[1]) for a in imports]
            assert min(x for a in applied for x in a) >= 0 and sum(x for a in applied for x in a) > 0
        assert m["verl_ext/seer/dgds_import_failures"] == 0 and m["verl_ext/seer/dgds_import_errors"] == 0
    for with_server, without in zip(outs["true"], outs["false"]):
        for key in ("responses", "response_mask"):
            assert with_server.batch[key].equal(without.batch[key])


def test_one_step_off_policy_trainer_gets_a_dataproto_and_numbers_generations_as_steps(ray_local, model_dir, tmp_path):
    """veRL's one-step-off-policy trainer builds the manager from a config with use_v1=true but no
    TransferQueue and unions what ``generate_sequences`` returns with its own batch
    (``OneStepOffRayTrainer._async_gen_next_batch``): the factory gives it the V0 manager. The
    trainer starts generation 2 before step 1 ends and passes ``global_steps`` 1 to both: the
    manager numbers generation 2 as step 2, so rollout=rhyme plans it from generation 1's history
    (here the same prompts: the dataset's next epoch), as in the synchronous trainer."""
    n = 2
    manager, servers = _v0_manager("rhyme", model_dir, n, f"trainer.default_local_dir={tmp_path}",
                                   compose=_compose_one_step_off)
    assert type(manager).__name__ == "VerlExtAgentLoopManagerV0"
    import torch
    from verl import DataProto

    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

    outs = []
    for global_steps in (1, 1, 2):  # what the trainer passes to generations 1, 2, 3
        # the trainer's batch (the dataloader's tensors besides these), split by veRL's own code
        batch = DataProto.from_dict(tensors={"row": torch.arange(4)}, non_tensors=dict(_batch(4).non_tensor_batch))
        gen = OneStepOffRayTrainer._get_gen_batch(None, batch).repeat(repeat_times=n, interleave=True)  # (no self)
        gen.meta_info["global_steps"] = global_steps
        out = manager.generate_sequences(gen)
        merged = batch.repeat(repeat_times=n, interleave=True).union(out)
        assert merged.batch["row"].tolist() == [i for i in range(4) for _ in range(n)]
        assert len(merged) == 4 * n and list(merged.non_tensor_batch["uid"]) == [f"uid-{i}" for i in range(4) for _ in range(n)]
        assert merged.batch["responses"].shape[0] == 4 * n
        outs.append(out.meta_info["timing"])
        if len(outs) == 1:  # (later generations plan from history)
            assert sum(ray.get([s.num_calls.remote() for s in servers.values()])) == 4 * n
    assert outs[0]["verl_ext/requests"] == 4 * n
    assert outs[0]["verl_ext/rhyme/histopipe_active"] == 0  # no history yet
    for m in outs[1:]:
        assert m["verl_ext/rhyme/histopipe_active"] == 1 and m["verl_ext/rhyme/history_prompts"] == 4
    assert manager._verl_ext_last_step == 3
    val = _batch(4).repeat(repeat_times=n, interleave=True)
    val.meta_info.update(global_steps=3, validate=True)  # validation does not count
    manager.generate_sequences(val)
    assert manager._verl_ext_last_step == 3


def test_manager_rejects_bad_settings(ray_local, model_dir):
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from verl_ext.pipe.strategy import StrategyConfigError
    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    config = compose_verl(
        ["rollout@actor_rollout_ref.rollout=baseline", f"actor_rollout_ref.model.path={model_dir}",
         "actor_rollout_ref.rollout.name=vllm", "trainer.use_v1=false",
         "+actor_rollout_ref.rollout.custom.verl_ext.options.chunk_size=8"],
    )
    lb = get_router_handle(servers={"s0": FakeServer.remote("s0")}, router_config_path=None, full_determinism=False)
    with pytest.raises(StrategyConfigError, match="unknown option"):
        VerlExtAgentLoopManager.create(config=config, llm_client=LLMServerClient(config, load_balancer_handle=lb))


def test_factory_picks_trainer_flavour():
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    base = "rollout@actor_rollout_ref.rollout=baseline"
    # main_ppo's V1 trainer (use_v1=true, the default) enables TransferQueue before building the manager
    v1 = VerlExtAgentLoopManager.manager_cls(compose_verl([base, "transfer_queue.enable=true"]))
    v0 = VerlExtAgentLoopManager.manager_cls(compose_verl([base, "trainer.use_v1=false"]))
    # the one-step-off-policy trainer: its config inherits use_v1=true, it wants a DataProto back
    off = VerlExtAgentLoopManager.manager_cls(_compose_one_step_off([base]))
    assert issubclass(v1, AgentLoopManagerTQ)
    for cls in (v0, off):
        assert issubclass(cls, AgentLoopManager) and not issubclass(cls, AgentLoopManagerTQ)


def test_async_trainer_modes_get_the_v1_manager_or_a_clear_error():
    """veRL's async trainers (colocate_async; separate_async with standalone servers only) get the
    V1 manager. separate_async with hybrid replicas adds and removes servers between steps, which
    the dispatcher (a fixed set of servers) cannot follow: refused with what to set."""
    from verl_ext.pipe.strategy import StrategyConfigError
    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    base = ["rollout@actor_rollout_ref.rollout=baseline", "transfer_queue.enable=true"]
    for extra in (["trainer.v1.trainer_mode=colocate_async"],
                  ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false"]):
        assert VerlExtAgentLoopManager.manager_cls(compose_verl(base + extra)).__name__ == "VerlExtAgentLoopManagerTQ"
    with pytest.raises(StrategyConfigError, match="actor_rollout_ref.hybrid_engine=false"):
        VerlExtAgentLoopManager.manager_cls(compose_verl(base + ["trainer.v1.trainer_mode=separate_async"]))


# (baseline's calls take the same path as rhyme's, without history)
@pytest.mark.parametrize("strategy,options", [("seer", ("chunk_size=3",)), ("rhyme", ())])
def test_async_trainers_aborted_requests_resume_through_the_strategy(ray_local, model_dir, tmp_path, strategy,
                                                                      options):
    """An async trainer's weight sync aborts the requests in flight (``stop_reason`` "aborted");
    veRL's ``FullyAsyncLLMServerClient`` loop resends each with its tokens so far. Given that
    client, the manager's workers resume through verl_ext's dispatcher: the responses are those of
    a rollout without aborts (no token dropped, duplicated or reordered, chunked or not), every
    resumed request keeps its group and sample index (no group grows past n), and the
    oldest weight version of a response's pieces is its ``min_global_steps``."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    n, opts = 3, [f"actor_rollout_ref.rollout.custom.verl_ext.options.{o}" for o in options]
    manager, servers = _v0_manager(strategy, model_dir, n, *opts, f"trainer.default_local_dir={tmp_path}",
                                   server_cls=MarkovServer, client_cls=FullyAsyncLLMServerClient)
    assert type(manager).__name__ == "VerlExtAgentLoopManagerV0"
    assert type(manager.llm_client).__name__ == "StrategyFullyAsyncLLMClient"  # what the workers get
    steps = iter(range(1, 10))

    def batch():  # a training batch of the next step (as veRL's trainers number them)
        b = _batch(4).repeat(repeat_times=n, interleave=True)
        b.meta_info["global_steps"] = next(steps)
        return b

    ray.get([s.abort.remote(4) for s in servers.values()])  # 8 aborted attempts, then none
    out = manager.generate_sequences(batch())
    prompt_ids, responses, mask = out.batch["prompts"], out.batch["responses"], out.batch["response_mask"]
    for row in range(4 * n):
        real_prompt = prompt_ids[row][out.batch["attention_mask"][row][: prompt_ids.shape[1]].bool()].tolist()
        assert responses[row][: int(mask[row].sum())].tolist() == _markov(real_prompt)
    timing = out.meta_info["timing"]
    assert timing["verl_ext/resumed"] == 8 and timing["verl_ext/requests"] >= 4 * n + 8
    sizes = ray.get(manager.verl_ext_dispatcher.__ray_call__.remote(lambda d: dict(d._group_sizes)))
    assert sorted(sizes.values()) == [n] * 4  # resumed requests are not new samples

    def versions(out):
        return [(int(lo), int(hi)) for lo, hi in zip(out.non_tensor_batch["min_global_steps"],
                                                     out.non_tensor_batch["max_global_steps"])]

    # a weight sync: the aborted attempts ran under version 1, everything after under 2
    ray.get([s.abort.remote(4) for s in servers.values()] + [s.bump.remote(4, 2) for s in servers.values()])
    out = manager.generate_sequences(batch())
    got = versions(out)
    assert (1, 2) in got and all(lo <= hi for lo, hi in got)
    if strategy == "rhyme":  # the second batch drafts and plans from the first one's history
        assert out.meta_info["timing"]["verl_ext/rhyme/histopipe_active"] == 1
    # weights move on with no abort after each server's share of the 12 first pieces: only a
    # request generated in pieces can span them
    ray.get([s.bump.remote(6, 3) for s in servers.values()])
    got = versions(manager.generate_sequences(batch()))
    assert all(lo <= hi for lo, hi in got)
    if strategy == "baseline":  # one piece per request
        assert all(lo == hi for lo, hi in got)
    elif strategy == "seer":  # 3-token chunks: the 12 first chunks go out together, the rest later
        assert any(lo < hi for lo, hi in got)


def test_async_trainers_carry_deferred_requests_into_the_next_step(ray_local, monkeypatch):
    """Inter-step migration inside veRL's async trainers (which take finished samples as they
    come): a request the strategy defers to the next training step is held by the dispatcher, its
    ``generate`` call waits, and the next ``begin_step`` resumes it where least loaded (prompt +
    tokens so far); its response is the one it would have had in one go. With no next step it
    resumes after ``DEFER_WAIT_S``. Only an async trainer's dispatcher wires the carrier into
    ``rollout=rhyme``; the others refuse ``inter_step`` (``VerlExtSettings.from_custom``). Also what
    the strategy sees of a resumed request: its group, its sample index, and its tokens so far
    (``PRIOR_TOKENS_KEY``, which ``seer``'s length estimates count)."""
    from verl_ext.config.settings import VerlExtSettings
    from verl_ext.engine.instance import PRIOR_TOKENS_KEY
    from verl_ext.pipe import defer
    from verl_ext.pipe.chunks import Chunked
    from verl_ext.rollout import dispatcher as dispatcher_mod
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    rhyme = {"verl_ext": {"strategy": "rhyme", "options": {"inter_step": True}}}
    servers = {f"s{i}": MarkovServer.remote(f"s{i}") for i in range(2)}
    for carries in (True, False):
        d = StrategyDispatcher(VerlExtSettings.from_custom(rhyme, async_trainer=True), servers, 16, carries=carries,
                               stop_ids=[0])
        assert (d.strategy._carry == d._carry) is carries

    from verl_ext.pipe.lifecycle import Lifecycle
    from verl_ext.pipe.strategy import Strategy

    class DeferAll(Strategy):
        """Defers every request after its first 2 tokens (what rhyme does to an outlier)."""
        defers_samples, carry = True, None

        def set_deferral(self, carry):
            self.carry = carry

        async def submit(self, request, pool):
            st = Chunked(request)
            c = await pool.run(pool.least_loaded(request.request_id), st.next_request(2))
            st.add(c)
            if not st.more(2, c):
                return st.result(c)
            self.carry(st)
            return defer.deferred_completion(st, c)

    prompts = [[1, 2, k] for k in range(3, 40)]
    long = [p for p in prompts if len(_markov(p)) > 2][:4]  # longer than the first piece: deferred

    async def main(wait_s):
        monkeypatch.setattr(dispatcher_mod, "DEFER_WAIT_S", wait_s)
        d = StrategyDispatcher(VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline"}}), servers, 16,
                               stop_ids=[0])  # the Markov servers' responses never hold token 0
        d.strategy = DeferAll()
        d.life = Lifecycle(d.strategy, carrier=d._carry)  # what the dispatcher gives a strategy that defers
        await d.begin_step(1)
        calls = [asyncio.ensure_future(d.generate(f"r{i}", p, {"max_tokens": 16})) for i, p in enumerate(long)]
        while len(d._parked) < len(long):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not any(c.done() for c in calls)  # held for the next step
        if wait_s > 10:
            await d.begin_step(2)
        outs = await asyncio.wait_for(asyncio.gather(*calls), 30)
        return outs, await d.metrics()

    for wait_s, late in ((1000.0, 0.0), (0.5, 4.0)):
        outs, m = asyncio.run(main(wait_s))
        assert [list(o.token_ids) for o in outs] == [_markov(p) for p in long]
        assert m["verl_ext/deferred"] == 4 and m["verl_ext/deferred_waited_out"] == late
        # the rollout's span, first call in to last response out, covers the wait for the next step
        assert m["verl_ext/rollout_s"] >= 0.2

    async def cancelled():  # a caller that gives up on a deferred request: it is never resumed
        d = StrategyDispatcher(VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline"}}), servers, 16,
                               stop_ids=[0])  # the Markov servers' responses never hold token 0
        d.strategy = DeferAll()
        d.life = Lifecycle(d.strategy, carrier=d._carry)
        call = asyncio.ensure_future(d.generate("r0", long[0], {"max_tokens": 16}))
        while not d._parked:
            await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.sleep(0.05)
        assert not d._parked and not d._waiting
        await d.begin_step(2)
        assert not d._carried

    asyncio.run(cancelled())

    class Capture:
        """Records what the strategy is given; generates like baseline."""
        defers_samples, seen = False, []

        def metrics(self):
            return {}

        async def submit(self, request, pool):
            self.seen.append((request.group_id, request.sample_index, request.extra.get(PRIOR_TOKENS_KEY)))
            return await pool.run(pool.least_loaded(request.request_id), request)

    async def resumed():  # an aborted request resent with its tokens so far, as veRL's async client does
        d = StrategyDispatcher(VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline"}}), servers, 16,
                               stop_ids=[0])  # the Markov servers' responses never hold token 0
        d.strategy = Capture()
        await d.generate("other", long[0], {"max_tokens": 16})  # sample 0 of the group
        ray.get([s.abort.remote(1) for s in servers.values()])
        first = await d.generate("r", long[0], {"max_tokens": 16})
        assert first.stop_reason == "aborted" and first.token_ids
        ray.get([s.abort.remote(-1) for s in servers.values()])  # the other server's abort is not used
        tokens = list(first.token_ids)
        second = await d.generate("r", long[0] + tokens, {"max_tokens": 16 - len(tokens)})
        assert tokens + list(second.token_ids) == _markov(long[0])
        return d.strategy.seen

    (g0, i0, p0), (g1, i1, p1), (g2, i2, p2) = asyncio.run(resumed())
    assert g0 == g1 == g2 and (i0, i1, i2) == (0, 1, 1) and (p0, p1) == (None, None) and p2 > 0
