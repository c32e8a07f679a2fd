"""Trace recording inside veRL (verl_ext.rollout.trace_hook): settings validation, DataProto -> Trace,
the V0 recorder, the V1 collector and worker hook, and the V0 manager end to end over fake
servers (real Ray, veRL's real config, agent-loop workers and single-turn loop)."""

import logging
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl_ext.config.settings import TraceSettings, VerlExtSettings  # noqa: E402
from verl_ext.pipe.strategy import StrategyConfigError  # noqa: E402
from verl_ext.trace import read_trace  # noqa: E402
from verl_ext.rollout.trace_hook import (  # noqa: E402
    TRACE_KEY,
    StepTraceCollector,
    V0Recorder,
    request_info,
    step_path,
    trace_from_dataproto,
    v1_rows,
)


# -- settings ---------------------------------------------------------------------------------------
def test_trace_settings_default_off():
    s = VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline"}})
    assert s.trace == TraceSettings() and not s.trace.enabled and not s.trace.records(1)
    s = VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline", "trace": {"dir": None, "every": 3}}})
    assert not s.trace.enabled
    s = VerlExtSettings.from_custom({"verl_ext": {"trace": {"dir": "/tmp/t", "every": 3}}})
    assert s.trace.enabled and s.trace.dir == "/tmp/t"
    assert [n for n in range(10) if s.trace.records(n)] == [0, 3, 6, 9]
    assert VerlExtSettings.from_custom({"verl_ext": {"trace": {"dir": "d"}}}).trace.every == 1


@pytest.mark.parametrize(
    "trace, match",
    [
        ("somewhere", r"custom\.verl_ext\.trace must be a mapping"),
        ({"dir": "d", "evry": 2}, r"custom\.verl_ext\.trace: unknown key\(s\) \['evry'\]; valid keys: \['dir', 'every'\]"),
        ({"dir": "d", "every": 0}, r"custom\.verl_ext\.trace\.every must be an integer >= 1, got 0"),
        ({"dir": "d", "every": True}, r"trace\.every must be an integer >= 1, got True"),
        ({"dir": "d", "every": "2"}, r"trace\.every must be an integer >= 1, got '2'"),
        ({"dir": 5}, r"custom\.verl_ext\.trace\.dir must be a directory path or null, got 5"),
        ({"dir": "  "}, r"trace\.dir must be a directory path or null"),
    ],
)
def test_trace_settings_errors(trace, match):
    with pytest.raises(StrategyConfigError, match=match):
        VerlExtSettings.from_custom({"verl_ext": {"strategy": "baseline", "trace": trace}})


def test_trace_settings_from_hydra():
    from _util import compose_verl
    from omegaconf import OmegaConf

    cfg = compose_verl(["rollout@actor_rollout_ref.rollout=baseline",
                        "actor_rollout_ref.rollout.custom.verl_ext.trace.dir=/tmp/traces",
                        "actor_rollout_ref.rollout.custom.verl_ext.trace.every=2"])
    s = VerlExtSettings.from_custom(cfg.actor_rollout_ref.rollout.custom)
    assert s.trace == TraceSettings(dir="/tmp/traces", every=2)
    off = compose_verl(["rollout@actor_rollout_ref.rollout=baseline"])
    assert OmegaConf.to_container(off.actor_rollout_ref.rollout.custom.verl_ext.trace) == {"dir": None, "every": 1}
    assert not VerlExtSettings.from_custom(off.actor_rollout_ref.rollout.custom).trace.enabled


# -- request info -----------------------------------------------------------------------------------
class _Out:
    def __init__(self, tokens, stop_reason="completed"):
        self.token_ids, self.stop_reason, self.extra_fields = tokens, stop_reason, {}


def test_request_info_finish_reason():
    assert request_info(_Out([1, 2]), {"max_tokens": 2}, None, 1.0, 2.0) == {"finish_reason": "length", "submit_t": 1.0, "finish_t": 2.0}
    assert request_info(_Out([1]), {"max_tokens": 2}, None, 1, 2)["finish_reason"] == "stop"
    assert request_info(_Out([1, 2, 3]), {}, 3, 1, 2)["finish_reason"] == "length"  # rollout response_length
    assert request_info(_Out([1, 2, 3]), {}, None, 1, 2)["finish_reason"] == "stop"
    assert request_info(_Out([1], "aborted"), {"max_tokens": 1}, None, 1, 2)["finish_reason"] == "abort"
    # an EOS (stop id) that fills the budget is a stop, not a cut-off (veRL says "completed" for both)
    assert request_info(_Out([1, 2]), {"max_tokens": 2}, None, 1, 2, stop_ids=[2])["finish_reason"] == "stop"
    assert request_info(_Out([1, 2]), {"max_tokens": 2, "ignore_eos": True}, None, 1, 2, stop_ids=[2])["finish_reason"] == "length"


# -- DataProto -> Trace -------------------------------------------------------------------------------
PAD = 0


def hand_built_dataproto(with_uid=True, with_scores=True, with_info=True):
    """4 rows (2 prompts x 2 samples), prompts left-padded to 5, responses right-padded to 4."""
    from verl import DataProto

    prompts = [[11, 12, 13], [11, 12, 13], [21, 22, 23, 24, 25], [21, 22, 23, 24, 25]]
    responses = [[31, 32], [41, 42, 43, 44], [51], []]
    P, R = 5, 4
    p = torch.full((4, P), PAD)
    r = torch.full((4, R), PAD)
    attn = torch.zeros((4, P + R), dtype=torch.int64)
    for i, (pi, ri) in enumerate(zip(prompts, responses)):
        p[i, P - len(pi):] = torch.tensor(pi)
        attn[i, P - len(pi):P] = 1
        if ri:
            r[i, : len(ri)] = torch.tensor(ri)
            attn[i, P:P + len(ri)] = 1
    tensors = {"prompts": p, "responses": r, "attention_mask": attn, "response_mask": attn[:, P:].clone(),
               "input_ids": torch.cat([p, r], dim=1)}
    if with_scores:
        scores = torch.zeros((4, R))
        for i, ri in enumerate(responses):
            scores[i, max(len(ri) - 1, 0)] = [1.0, 0.0, 0.5, 0.0][i]
        tensors["rm_scores"] = scores
    non_tensors = {"__num_turns__": np.array([2, 2, 2, 2], dtype=np.int32)}
    if with_uid:
        non_tensors["uid"] = np.array(["u0", "u0", "u1", "u1"], dtype=object)
    if with_info:
        info = np.empty(4, dtype=object)
        info[:] = [{"finish_reason": "stop", "submit_t": 100.0, "finish_t": 101.0},
                   {"finish_reason": "length", "submit_t": 100.5, "finish_t": 103.0},
                   None,
                   {"finish_reason": "abort", "submit_t": 101.0, "finish_t": 101.5}]
        non_tensors[TRACE_KEY] = info
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={}), prompts, responses


def test_trace_from_dataproto():
    out, prompts, responses = hand_built_dataproto()
    t = trace_from_dataproto(out, step=7, meta={"source": "verl"})
    t.validate()
    assert len(t) == 4 and t.epoch.tolist() == [7] * 4 and t.step.tolist() == [7] * 4
    assert [t.prompt(i).tolist() for i in range(4)] == prompts
    assert [t.response(i).tolist() for i in range(4)] == responses
    assert t.prompt_uid.tolist() == ["u0", "u0", "u1", "u1"] and t.sample_index.tolist() == [0, 1, 0, 1]
    assert t.reward.tolist() == [1.0, 0.0, 0.5, 0.0]
    # info where present; row 2 has none: inferred (1 token < response_length 4 -> stop)
    assert t.finish_reason.tolist() == ["stop", "length", "stop", "abort"]
    assert t.submit_s[[0, 1, 3]].tolist() == [0.0, 0.5, 1.0] and t.finish_s[[0, 1, 3]].tolist() == [1.0, 3.0, 1.5]
    assert math.isnan(t.submit_s[2]) and t.instance.tolist() == [None] * 4
    assert t.meta == {"source": "verl"} and t.token_times is None
    assert TRACE_KEY in out.non_tensor_batch  # the converter does not modify its input


def test_trace_from_dataproto_without_extras():
    from verl import DataProto

    out, _, _ = hand_built_dataproto(with_uid=False, with_scores=False, with_info=False)
    t = trace_from_dataproto(out, step=1)
    assert t.prompt_uid.tolist() == ["row-0", "row-1", "row-2", "row-3"] and t.sample_index.tolist() == [0] * 4
    assert np.isnan(t.reward).all() and np.isnan(t.submit_s).all()
    assert t.finish_reason.tolist() == ["stop", "length", "stop", "stop"]  # 4 tokens fill response_length
    # uid from the input batch when the output has none (streaming reward drops the inputs)
    inputs = DataProto.from_dict(non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    t = trace_from_dataproto(out, step=1, prompts=inputs)
    assert t.prompt_uid.tolist() == ["a", "a", "b", "b"] and t.sample_index.tolist() == [0, 1, 0, 1]


def test_v0_recorder(tmp_path, caplog):
    rec = V0Recorder(str(tmp_path), every=2, meta={"source": "verl", "flavour": "v0"})
    out, _, responses = hand_built_dataproto()
    inputs = out.select(non_tensor_batch_keys=["uid"])
    inputs.meta_info = {"global_steps": 4}
    assert rec.record(inputs, out) == str(step_path(tmp_path, 4))
    assert TRACE_KEY not in out.non_tensor_batch  # training data is left as veRL made it
    t = read_trace(tmp_path / "step_4.parquet")
    assert [t.response(i).tolist() for i in range(4)] == responses
    assert t.meta["step"] == 4 and t.meta["flavour"] == "v0" and "created" in t.meta
    # every=2: step 3 is skipped; validation is skipped; the column is removed anyway
    for meta_info in ({"global_steps": 3}, {"global_steps": 6, "validate": True}):
        out, _, _ = hand_built_dataproto()
        inputs.meta_info = meta_info
        assert rec.record(inputs, out) is None and TRACE_KEY not in out.non_tensor_batch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4.parquet"]
    # a write failure is logged, never raised
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = V0Recorder(str(blocker / "sub"), every=1, meta={})
    out, _, _ = hand_built_dataproto()
    inputs.meta_info = {"global_steps": 1}
    with caplog.at_level(logging.ERROR):
        assert bad.record(inputs, out) is None
    assert "could not record the rollout trace" in caplog.text and TRACE_KEY not in out.non_tensor_batch


# -- V1: collector and worker hook ------------------------------------------------------------------------
def v1_row(uid, s, step, submit=None):
    return {"epoch": step, "step": step, "prompt_uid": uid, "sample_index": s, "prompt_ids": [1, 2],
            "response_ids": [3] * (s + 1), "reward": 1.0, "finish_reason": "stop", "instance": None,
            "submit_t": submit, "finish_t": None if submit is None else submit + 1}


def test_step_trace_collector(tmp_path):
    c = StepTraceCollector(str(tmp_path), meta={"source": "verl", "flavour": "v1"})
    c.expect(1, ["b", "a"])
    c.add(1, "a", [v1_row("a", 1, 1, 10.0), v1_row("a", 0, 1, 11.0)])
    assert c.done(1, "a") is None  # "b" still running
    c.add(1, "b", [v1_row("b", 0, 1, 12.0)])
    path = c.done(1, "b")
    assert path == str(step_path(tmp_path, 1))
    t = read_trace(path)
    assert t.prompt_uid.tolist() == ["b", "a", "a"] and t.sample_index.tolist() == [0, 0, 1]  # registration order
    assert t.submit_s.tolist() == [2.0, 1.0, 0.0] and t.finish_s.tolist() == [3.0, 2.0, 1.0]
    assert "incomplete" not in t.meta and t.meta["step"] == 1
    # a refill for step 1 rewrites the file with all rows
    c.expect(1, ["c"])
    c.add(1, "c", [v1_row("c", 0, 1)])
    c.done(1, "c")
    assert read_trace(path).prompt_uid.tolist() == ["b", "a", "a", "c"]
    # step 2 is still waiting for "e" when step 3 is registered: written partially, then completed
    c.expect(2, ["d", "e"])
    c.add(2, "d", [v1_row("d", 0, 2)])
    c.done(2, "d")
    assert not step_path(tmp_path, 2).exists()
    c.expect(3, ["f"])
    assert read_trace(step_path(tmp_path, 2)).meta["incomplete"] == 1
    c.add(2, "e", [v1_row("e", 0, 2)])
    c.done(2, "e")
    t2 = read_trace(step_path(tmp_path, 2))
    assert t2.prompt_uid.tolist() == ["d", "e"] and "incomplete" not in t2.meta
    # a re-issued prompt replaces its earlier rows
    c.add(3, "f", [v1_row("f", 0, 3)])
    c.expect(3, ["f"])
    c.add(3, "f", [v1_row("f", 1, 3)])
    c.done(3, "f")
    assert read_trace(step_path(tmp_path, 3)).sample_index.tolist() == [1]


def test_v1_rows():
    class O:
        def __init__(self, p, r, score):
            self.prompt_ids, self.response_ids, self.reward_score = p, r, score

    rows = v1_rows([O([1], [2, 3], 0.5), O([1], [2, 3, 4, 5], None)],
                   [{"finish_reason": "abort", "submit_t": 5.0, "finish_t": 6.0}, None],
                   {"uid": "u", "session_id": 3, "global_steps": 9}, response_length=4)
    assert [r["finish_reason"] for r in rows] == ["abort", "length"]
    assert rows[0]["reward"] == 0.5 and rows[1]["reward"] is None and rows[0]["sample_index"] == 3
    assert rows[0]["step"] == rows[0]["epoch"] == 9 and rows[0]["submit_t"] == 5.0 and math.isnan(rows[1]["submit_t"])


def test_v1_worker_hook(monkeypatch):
    """The V1 worker removes the info from the output before veRL stores it, feeds the history
    workers (through the dispatcher), and reports trace rows then `done`."""
    import asyncio

    pytest.importorskip("transfer_queue")
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from verl_ext.rollout.dispatcher import prompt_group_id
    from verl_ext.rollout.workers_v1 import TracingAgentLoopWorkerTQ

    base = AgentLoopWorkerTQ.__ray_actor_class__
    assert issubclass(TracingAgentLoopWorkerTQ, base)
    seen = {}

    async def fake_postprocess(self, output, validate, **kwargs):
        seen["extra"] = dict(output.extra_fields)
        output.reward_score = 1.0  # veRL's streaming reward sets it in place

    async def fake_run_prompt(self, prompt, sampling_params, trajectory, trace=False):
        seen["ran"] = prompt["uid"]

    monkeypatch.setattr(base, "_agent_loop_postprocess", fake_postprocess)
    monkeypatch.setattr(base, "_run_prompt", fake_run_prompt)

    calls = []

    class Remote:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append((self.name, *args))

    class Collector:
        add, done = Remote("add"), Remote("done")

    class Dispatcher:
        ingest = Remote("ingest")

    class Client:
        verl_ext_trace = (Collector(), TraceSettings(dir="/x", every=1), 8)
        verl_ext_history = Dispatcher()

    worker = object.__new__(TracingAgentLoopWorkerTQ)
    worker.llm_client = Client()
    out = AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1], metrics=AgentLoopMetrics(),
                          extra_fields={TRACE_KEY: {"finish_reason": "stop", "submit_t": 1.0, "finish_t": 2.0}, "k": 1})
    asyncio.run(worker._agent_loop_postprocess(out, False, uid="u1", session_id=2, global_steps=5))
    assert seen["extra"] == {"k": 1}  # TransferQueue never sees the trace info
    asyncio.run(worker._run_prompt({"uid": "u1", "global_steps": 5}, {}, {"validate": False, "step": 5}))
    assert [c[0] for c in calls] == ["ingest", "add", "done"]
    # the history feed: (prompt key, sample, response, reward after veRL's post-processing)
    _, step, items = calls.pop(0)
    (key, sample, response, reward), = items
    assert (step, key, sample, response.tolist(), reward) == (5, prompt_group_id([1, 2]), 2, [3, 4], 1.0)
    _, step, uid, rows = calls[0]
    assert (step, uid) == (5, "u1") and rows[0]["reward"] == 1.0 and rows[0]["sample_index"] == 2
    assert rows[0]["response_ids"] == [3, 4] and rows[0]["finish_reason"] == "stop"
    assert calls[1] == ("done", 5, "u1")
    # validation rollouts are not reported
    calls.clear()
    asyncio.run(worker._agent_loop_postprocess(out, True, uid="u1", session_id=0, global_steps=5))
    asyncio.run(worker._run_prompt({"uid": "u1", "global_steps": 5}, {}, {"validate": True, "step": 5}))
    assert calls == []


# -- V0 end to end: veRL's real manager machinery over fake servers ------------------------------------------
ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class FakeServer:
    """`vLLMHttpServer.generate`'s signature; `1 + sum(prompt) % 5` tokens, capped by max_tokens."""

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority=0, kv_transfer_params=None):
        from verl.workers.rollout.replica import TokenOutput

        k = 1 + sum(prompt_ids) % 5
        tokens = [(prompt_ids[-1] + i) % 1000 + 1 for i in range(k)][: sampling_params.get("max_tokens", 16)]
        return TokenOutput(token_ids=tokens, stop_reason="completed", extra_fields={})


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def test_v0_manager_records_traces(ray_local, model_dir, tmp_path):
    from _util import compose_verl
    from verl import DataProto
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    n = 2
    config = compose_verl(
        ["rollout@actor_rollout_ref.rollout=baseline", f"actor_rollout_ref.model.path={model_dir}",
         "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={n}",
         "actor_rollout_ref.rollout.agent.num_workers=2", "actor_rollout_ref.rollout.prompt_length=128",
         "actor_rollout_ref.rollout.response_length=3", "trainer.use_v1=false", "data.return_raw_chat=true",
         f"actor_rollout_ref.rollout.custom.verl_ext.trace.dir={tmp_path / 'traces'}"],
    )
    servers = {f"s{i}": FakeServer.remote() for i in range(2)}
    lb = get_router_handle(servers=servers, router_config_path=None, full_determinism=False)
    manager = VerlExtAgentLoopManager.create(config=config, llm_client=LLMServerClient(config, load_balancer_handle=lb))
    assert manager.verl_ext_trace_recorder is not None

    uids = np.array([f"uid-{i}" for i in range(3)], dtype=object)
    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array([[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3)], dtype=object),
            "uid": uids,
            "agent_name": np.array(["single_turn_agent"] * 3, dtype=object),
            "data_source": np.array(["arith"] * 3, dtype=object),
            "reward_model": np.array([{"ground_truth": "0"}] * 3, dtype=object),
            "extra_info": np.array([{}] * 3, dtype=object),
            "index": np.arange(3),
        }
    )
    gen = batch.repeat(repeat_times=n, interleave=True)
    gen.meta_info["global_steps"] = 3
    out = manager.generate_sequences(gen)
    assert TRACE_KEY not in out.non_tensor_batch  # training data unchanged

    t = read_trace(tmp_path / "traces" / "step_3.parquet")
    assert len(t) == 3 * n and t.meta["source"] == "verl" and t.meta["flavour"] == "v0" and t.meta["n"] == n
    assert t.prompt_uid.tolist() == [u for u in uids for _ in range(n)] and t.sample_index.tolist() == [0, 1] * 3
    attn = out.batch["attention_mask"].bool()
    width = out.batch["prompts"].shape[1]
    for i in range(len(t)):
        assert t.prompt(i).tolist() == out.batch["prompts"][i][attn[i, :width]].tolist()
        assert t.response(i).tolist() == out.batch["responses"][i][attn[i, width:]].tolist()
        k = 1 + sum(t.prompt(i).tolist()) % 5
        assert t.finish_reason[i] == ("length" if k >= 3 else "stop")  # response_length=3
    assert np.isfinite(t.submit_s).all() and (t.finish_s >= t.submit_s).all() and t.submit_s.min() == 0.0


def test_v1_manager_registers_prompts_with_the_collector(ray_local, model_dir, tmp_path):
    """V1 without TransferQueue: build the manager (no workers), then play the workers' part."""
    pytest.importorskip("transfer_queue")
    from _util import compose_verl
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from verl_ext.rollout.manager import VerlExtAgentLoopManager, _v1_cls
    from verl_ext.rollout.workers_v1 import TracingAgentLoopWorkerTQ

    config = compose_verl(
        ["rollout@actor_rollout_ref.rollout=baseline", f"actor_rollout_ref.model.path={model_dir}",
         "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2",
         f"actor_rollout_ref.rollout.custom.verl_ext.trace.dir={tmp_path}",
         "actor_rollout_ref.rollout.custom.verl_ext.trace.every=2",
         "transfer_queue.enable=true"],  # as veRL's V1 main_ppo sets it before building the manager
    )
    assert VerlExtAgentLoopManager.manager_cls(config) is _v1_cls()
    lb = get_router_handle(servers={"s0": FakeServer.remote()}, router_config_path=None, full_determinism=False)
    manager = _v1_cls()(config, LLMServerClient(config, load_balancer_handle=lb))  # __init__ only: no workers
    assert manager.agent_loop_workers_class.__ray_actor_class__ is TracingAgentLoopWorkerTQ
    collector = manager.verl_ext_trace_collector
    client_collector, settings, response_length = manager.llm_client.verl_ext_trace
    assert settings.every == 2 and response_length == config.actor_rollout_ref.rollout.response_length

    def batch(step, uids, validate=False):
        td = TensorDict({"x": torch.zeros(len(uids), 1)}, batch_size=len(uids))
        td["uid"] = NonTensorStack.from_list(uids)
        tu.assign_non_tensor_data(td, "global_steps", step)
        if validate:
            tu.assign_non_tensor_data(td, "validate", True)
        return td

    manager._verl_ext_expect(batch(3, ["x"]))  # every=2: not recorded
    manager._verl_ext_expect(batch(4, ["a", "b"], validate=True))  # validation: not recorded
    manager._verl_ext_expect(batch(4, ["a", "b"]))
    row = {"epoch": 4, "step": 4, "prompt_ids": [1], "response_ids": [2], "finish_reason": "stop", "submit_t": 1.0,
           "finish_t": 2.0}
    ray.get(collector.add.remote(4, "b", [{**row, "prompt_uid": "b", "sample_index": 0}]))
    ray.get(collector.done.remote(4, "b"))
    ray.get(collector.add.remote(4, "a", [{**row, "prompt_uid": "a", "sample_index": 0}]))
    assert ray.get(collector.done.remote(4, "a")) == str(step_path(tmp_path, 4))
    t = read_trace(step_path(tmp_path, 4))
    assert t.prompt_uid.tolist() == ["a", "b"] and t.meta["flavour"] == "v1" and t.meta["source"] == "verl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4.parquet"]
