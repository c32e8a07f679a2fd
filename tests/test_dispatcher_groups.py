"""Which GRPO group and sample a veRL ``generate`` call belongs to (``StrategyDispatcher``): veRL's
agent loops pass prompt tokens and a request id; verl_ext's agent-loop workers add the prompt's
uid (``verl_ext.rollout.trajectory``)."""

import asyncio

import pytest

from _util import VerlServer
from verl_ext.config.settings import VerlExtSettings

pytest.importorskip("verl")


def _server():
    return VerlServer(lambda prompt_ids, sampling_params: [5, 6])


def test_a_multi_turn_trajectory_keeps_its_first_turns_group_and_sample():
    """veRL's tool agent loop sends every turn under the trajectory's request id, each turn's
    prompt extending the last: group drafts, history and length estimates follow it."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher, prompt_group_id

    server = _server()
    d = StrategyDispatcher(VerlExtSettings(strategy="baseline"), {"s0": server}, max_tokens_default=8, drafting=True)

    async def run():
        first = [await d.generate(f"t{j}", [1, 2, 3], {"max_tokens": 8}) for j in range(2)]
        later = await d.generate("t1", [1, 2, 3, 5, 6, 40, 41], {"max_tokens": 8})  # t1's second turn
        other = await d.generate("t2", [1, 2, 3, 5, 6, 40, 41], {"max_tokens": 8})  # a new trajectory
        return first, later, other

    asyncio.run(run())
    groups = [p["extra_args"]["verl_ext"]["group_id"] for p in server.generate.params]
    assert groups[:3] == [prompt_group_id([1, 2, 3])] * 3
    assert groups[3] == prompt_group_id([1, 2, 3, 5, 6, 40, 41])
    counters = asyncio.run(d.metrics())
    assert counters["verl_ext/later_turns"] == 1 and counters["verl_ext/requests"] == 4
    assert d._identify("t9", [1, 2, 3]).sample_index == 2  # t1's later turn took no new sample index


def test_one_prompt_in_two_groups_makes_two_groups_that_share_its_history_key():
    """A prompt twice in a batch (or in overlapping async steps) comes with two uids: two GRPO
    groups, each with its own sample indices and group trees, one prompt key for their history.
    Without a uid (another agent-loop worker) the prompt tokens alone make the group."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher, prompt_group_id

    server = _server()
    d = StrategyDispatcher(VerlExtSettings(strategy="baseline"), {"s0": server}, max_tokens_default=8, drafting=True)

    async def run():
        for uid in ("u1", "u2"):
            for j in range(2):
                await d.generate(f"{uid}-{j}", [1, 2, 3], {"max_tokens": 8}, verl_ext_uid=uid)
        await d.generate("plain", [1, 2, 3], {"max_tokens": 8})

    asyncio.run(run())
    idents = [p["extra_args"]["verl_ext"] for p in server.generate.params]
    key = prompt_group_id([1, 2, 3])
    assert [i["group_id"] for i in idents] == [f"{key}:u1"] * 2 + [f"{key}:u2"] * 2 + [key]
    assert {i["prompt_key"] for i in idents} == {key}  # the drafter's history tree, rhyme's lengths
    assert [d._identify(f"x{u}", [1, 2, 3], u).sample_index for u in ("u1", "u2")] == [2, 2]
    # the uid travels in the agent loop's task context, from verl_ext's workers to the client
    from verl_ext.rollout.trajectory import TRAJECTORY_UID, trajectory

    async def seen():
        return TRAJECTORY_UID.get()

    async def in_trajectory():
        with trajectory(7):
            return await asyncio.ensure_future(seen())  # a task the agent loop starts sees it

    assert asyncio.run(in_trajectory()) == "7" and TRAJECTORY_UID.get() is None


def test_the_dispatching_client_sends_the_trajectorys_uid():
    from verl_ext.rollout.manager import _DispatchingClient
    from verl_ext.rollout.trajectory import trajectory

    calls = []

    class Remote:
        async def _call(self, *args, **kwargs):
            calls.append(kwargs)

            class Out:
                extra_fields = {}

            return Out()

        def remote(self, *args, **kwargs):
            return self._call(*args, **kwargs)

    class Dispatcher:
        generate = Remote()

    client = _DispatchingClient.__new__(_DispatchingClient)
    client._dispatcher, client._dispatcher_failed = Dispatcher(), False

    async def run():
        with trajectory("uid-9"):
            await client.generate("r", prompt_ids=[1], sampling_params={})
        await client.generate("r2", prompt_ids=[1], sampling_params={})

    asyncio.run(run())
    assert [c["verl_ext_uid"] for c in calls] == ["uid-9", None]


def test_a_requests_drafting_keys_and_window_changes_reach_veRLs_server():
    """specactor's per-request window and scopes travel in ``extra_args["verl_ext"]`` (the drafter
    reads them), and ``set_spec_windows`` goes to the drafter over ``collective_rpc``."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.rollout.replica_instance import SAMPLING_KEY, ReplicaInstance

    server = _server()
    r = ReplicaInstance("s0", server, drafting=True)
    req = GenRequest("r1", "g", [1, 2], SamplingSpec(max_tokens=4),
                     extra={SAMPLING_KEY: {"max_tokens": 4}, "spec_window": 3, "spec_scopes": "request", "other": 1})
    asyncio.run(r.generate(req))
    assert server.generate.params[0]["extra_args"]["verl_ext"] == {
        "request_id": "r1", "group_id": "g", "prompt_key": "g", "spec_window": 3, "spec_scopes": "request"}
    assert asyncio.run(r.set_spec_windows({"r1": 1})) == 1
    assert server.rpcs == [("verl_ext_drafter", ("set_windows", {"r1": 1}))]
    assert asyncio.run(ReplicaInstance("s1", server).set_spec_windows({"r1": 1})) == 0  # no drafter there


def test_a_strategy_named_by_import_path_runs_in_the_dispatcher():
    from verl_ext.pipe.strategy import UnknownStrategyError, get_strategy_class
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    servers = {"s0": _server(), "s1": _server()}
    settings = VerlExtSettings.from_custom({"verl_ext": {"strategy": "_custom_strategy:LastInstance",
                                                         "options": {"tag": "y"}}})
    d = StrategyDispatcher(settings, servers, max_tokens_default=8)
    out = asyncio.run(d.generate("r", [1, 2], {"max_tokens": 8}))
    assert out.token_ids == [5, 6] and len(servers["s1"].generate.params) == 1 and not servers["s0"].generate.params
    assert asyncio.run(d.metrics())["verl_ext/LastInstance/sent"] == 1
    with pytest.raises(ValueError, match="unknown option"):
        VerlExtSettings.from_custom({"verl_ext": {"strategy": "_custom_strategy:LastInstance", "options": {"nope": 1}}})
    for path, message in (("_custom_strategy:Nope", "cannot import _custom_strategy:Nope"),
                          ("no_such_module:X", "cannot import no_such_module:X"),
                          ("_custom_strategy:NotAStrategy", "is not a concrete verl_ext Strategy subclass")):
        with pytest.raises(UnknownStrategyError, match=message):
            get_strategy_class(path)


def test_an_installed_packages_entry_point_names_a_strategy(tmp_path, monkeypatch):
    """A distribution on ``sys.path`` (its ``.dist-info``, as pip installs it) that declares a
    strategy in the ``verl_ext.strategies`` entry-point group."""
    from verl_ext.pipe import strategy as registry

    info = tmp_path / "my_strategies-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-strategies\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nlast_instance = _custom_strategy:LastInstance\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "last_instance" in registry.available_strategies()
    assert registry.get_strategy_class("last_instance").__name__ == "LastInstance"


def test_keyed_sampling_is_what_every_server_confirmed():
    """Issue 48/47: the driver's environment only predicts that servers key samples; before the
    first rollout every server is asked (``verl_ext_engine_info``). One that cannot confirm (the
    plugin did not take in its processes) turns keyed sampling off on all of them, with a
    metric, so that copies and chunks of sampled requests never rely on it."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    ready = {"keyed_sampling": {"ready": True, "active": False, "rule": "vllm-fused-op"}}

    async def run(servers):
        d = StrategyDispatcher(VerlExtSettings(strategy="seer"), servers, max_tokens_default=8, keyed_sampling=True)
        await d.begin_step(1)
        return d, await d.metrics()

    d, m = asyncio.run(run({"s0": VerlServer(lambda p, s: [5], ready), "s1": VerlServer(lambda p, s: [5], ready)}))
    assert d.pool.keyed_sampling and m["verl_ext/keyed_sampling/unconfirmed_servers"] == 0
    assert d.pool.instances["s0"].engine_info == ready
    d, m = asyncio.run(run({"s0": VerlServer(lambda p, s: [5], ready), "s1": VerlServer(lambda p, s: [5])}))
    assert not d.pool.keyed_sampling and not any(i.keyed_sampling for i in d.pool.instances.values())
    assert m["verl_ext/keyed_sampling/unconfirmed_servers"] == 1
    # and a sampled request is then neither keyed nor given a seed by the strategy
    out = asyncio.run(d.generate("r", [1, 2], {"max_tokens": 8, "temperature": 1.0}))
    assert out.token_ids == [5]
    sent = [p for srv in ("s0", "s1") for p in d.pool.instances[srv].handle.generate.params]
    assert "keyed_seed" not in ((sent[0].get("extra_args") or {}).get("verl_ext") or {})


def test_a_best_of_n_copy_that_wins_hands_veRL_the_whole_response():
    """Issue 48, item 1: a copy resumes after the prefix the original had generated; its own
    ``TokenOutput`` holds only its part. What veRL gets must be the whole response, with a
    log-prob per token (the prefix's from the original, the rest from the copy), and a response
    whose log-probs are not all known is refused rather than handed over truncated."""
    from verl.workers.rollout.replica import TokenOutput

    from verl_ext.engine.instance import Completion
    from verl_ext.rollout.dispatcher import merged_token_output
    from verl_ext.rollout.replica_instance import TOKEN_OUTPUT_KEY

    copy_out = TokenOutput(token_ids=[7, 8, 2], log_probs=[-0.7, -0.8, -0.2], stop_reason="completed",
                           extra_fields={"global_steps": 3})
    spliced = Completion("r", [5, 6, 7, 8, 2], "stop", logprobs=[-0.5, -0.6, -0.7, -0.8, -0.2],
                         extra={TOKEN_OUTPUT_KEY: copy_out, "bon_method": "ngram"})
    out = merged_token_output(spliced)
    assert out.token_ids == [5, 6, 7, 8, 2] and out.log_probs == [-0.5, -0.6, -0.7, -0.8, -0.2]
    assert out.extra_fields["global_steps"] == 3 and out.stop_reason == "completed"
    whole = Completion("r", [7, 8, 2], "stop", logprobs=[-0.7, -0.8, -0.2], extra={TOKEN_OUTPUT_KEY: copy_out})
    assert merged_token_output(whole) is copy_out  # a response made in one call goes through as veRL sent it
    missing = Completion("r", [5, 6, 7, 8, 2], "stop", logprobs=None, extra={TOKEN_OUTPUT_KEY: copy_out})
    with pytest.raises(RuntimeError, match="log-probs of 5 response tokens are not all known"):
        merged_token_output(missing)


def test_specactors_splice_keeps_the_prefix_and_its_log_probs():
    """The strategy side of the same path: the winner's completion is prefix + copy, with the
    original's log-probs for the prefix (``SpecActorStrategy._splice``), whatever TokenOutput
    rides along in ``extra``."""
    from verl_ext.engine.instance import Completion, GenRequest, SamplingSpec
    from verl_ext.pipe.specactor.strategy import _Live, _Run
    from verl_ext.pipe.strategy import make_strategy

    strategy = make_strategy("specactor", {"profile": "cpu-smollm2-avx2"})
    live = _Live(GenRequest("r", "g", [1, 2], SamplingSpec(max_tokens=8)))
    run = _Run(instance=VerlServer(lambda p, s: []), method="ngram", original=False, prefix=[5, 6], steps0=2)
    run.instance.name = "s1"
    copy = Completion("r", [7, 8, 2], "stop", logprobs=[-0.7, -0.8, -0.2], num_steps=2, extra={"x": 1})
    original = Completion("r", [5, 6, 9], "abort", logprobs=[-0.5, -0.6, -0.9])
    got = strategy._splice(live, run, copy, original)
    assert got.token_ids == [5, 6, 7, 8, 2] and got.logprobs == [-0.5, -0.6, -0.7, -0.8, -0.2]
    assert got.num_steps == 4 and got.extra["x"] == 1 and got.extra["bon_method"] == "ngram"


@pytest.mark.parametrize("same_tokens", [True, False])
def test_a_move_whose_abort_came_with_the_last_token_reaches_veRL_finished(same_tokens):
    """Issue 48, item 2: ``rlhfspec`` aborts a sample to move it; when the abort arrives with the
    response's last token, the strategy finishes the sample (``length``) but the engine's own
    ``TokenOutput`` says ``stop_reason="aborted"``. veRL's async client resends an aborted
    response, so what veRL gets must say it completed, whether the sample was made in one call
    (the abort hit its first part) or in parts."""
    from verl.workers.rollout.replica import TokenOutput

    from verl_ext.engine.instance import Completion
    from verl_ext.rollout.dispatcher import merged_token_output
    from verl_ext.rollout.replica_instance import TOKEN_OUTPUT_KEY

    last = [7, 8] if same_tokens else [8]
    aborted = TokenOutput(token_ids=last, log_probs=[-0.1] * len(last), stop_reason="aborted")
    done = Completion("r", [7, 8], "length", logprobs=[-0.1, -0.1], extra={TOKEN_OUTPUT_KEY: aborted})
    out = merged_token_output(done)
    assert out.stop_reason == "completed" and out.token_ids == [7, 8]
    assert aborted.stop_reason == "aborted"  # the engine's own output is left as it was
    really = Completion("r", [7], "abort", logprobs=[-0.1], extra={TOKEN_OUTPUT_KEY: aborted.model_copy(
        update={"token_ids": [7], "log_probs": [-0.1]})})
    assert merged_token_output(really).stop_reason == "aborted"  # an abort that stands is passed on


@pytest.mark.parametrize("setting", [{"min_p": 0.1}, {"logit_bias": {"5": 2.0}}])
def test_a_setting_that_drafting_engines_cannot_serve_is_refused_clearly(setting):
    """Issue 48, item 3: vLLM 0.32 serves no min-p or logit-bias request on an engine with
    speculative decoding (its verification would skip them at draft positions; the engine test
    ``test_drafting_engines_refuse_min_p_and_logit_bias`` shows the refusal). Where the servers
    run verl_ext's drafter, such a request is refused before anything is generated, naming the
    setting and how to run without the drafter; without one it is served as veRL sends it."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    def run(drafting):
        server = VerlServer(lambda p, s: [5, 6])
        d = StrategyDispatcher(VerlExtSettings(strategy="seer"), {"s0": server}, max_tokens_default=8, drafting=drafting)
        out = asyncio.run(d.generate("r", [1, 2], {"max_tokens": 8, "temperature": 1.0, **setting}))
        return out, server

    with pytest.raises(ValueError, match=rf"sets {next(iter(setting))}=.*speculative_config") as err:
        run(True)
    assert "verl_ext" in str(err.value)
    out, server = run(False)
    assert out.token_ids == [5, 6] and server.generate.params[0][next(iter(setting))] == next(iter(setting.values()))


def test_a_request_that_comes_keyed_keeps_its_key_through_every_strategy():
    """An agent loop may key its own sampled requests (``extra_args["verl_ext"]["keyed_seed"]``,
    as the conformance suite's does for veRL's own manager and verl_ext's alike). The key reaches
    the engine unchanged whether or not the strategy keys samples itself. Where a server did not
    confirm keyed sampling the strategy does not rely on it (no copies, no parts of sampled
    requests) and the caller's ``extra_args`` go through as it sent them."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    ready = {"keyed_sampling": {"ready": True, "active": False, "rule": "vllm-fused-op"}}
    params = {"max_tokens": 8, "temperature": 0.7, "extra_args": {"verl_ext": {"keyed_seed": 4242}}}

    def sent(strategy, info):
        server = VerlServer(lambda p, s: [5], info)
        d = StrategyDispatcher(VerlExtSettings(strategy=strategy), {"s0": server}, max_tokens_default=8,
                               keyed_sampling=True)
        asyncio.run(d.generate("r", [1, 2], dict(params)))
        return ((server.generate.params[0].get("extra_args") or {}).get("verl_ext") or {}).get("keyed_seed")

    assert sent("baseline", ready) == 4242 and sent("seer", ready) == 4242 and sent("rhyme", ready) == 4242
    assert sent("seer", None) == 4242  # the caller's own extra_args, untouched


def test_a_sample_seed_gives_every_strategy_the_same_keys_in_any_arrival_order(caplog):
    """``custom.verl_ext.sample_seed``: each sampled request is keyed by the seed, the step, the
    prompt and its ordinal among that prompt's samples in the step, so that two runs (any
    strategies, requests arriving in any order) send the same keys: the same samples. Greedy
    requests get none, each step gets new ones, and where the servers cannot key the requests
    sample unkeyed, said once and counted."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    ready = {"keyed_sampling": {"ready": True, "active": False, "rule": "vllm-fused-op"}}
    a, b = [1, 2, 3], [4, 5]

    def keys(strategy, order, info=ready, temperature=0.7, seed=5):
        server = VerlServer(lambda p, s: [7], info)
        d = StrategyDispatcher(VerlExtSettings(strategy=strategy, sample_seed=seed), {"s0": server},
                               max_tokens_default=8, keyed_sampling=True)

        async def run():
            out = {}
            for step in (1, 2):
                await d.begin_step(step)
                for i, (uid, prompt) in enumerate(order):
                    await d.generate(f"{step}-{i}", prompt, {"max_tokens": 8, "temperature": temperature},
                                     verl_ext_uid=f"{uid}-{step}")
                out[step] = [((p.get("extra_args") or {}).get("verl_ext") or {}).get("keyed_seed")
                             for p in server.generate.params[-len(order):]]
            return out, await d.metrics()

        return asyncio.run(run())

    # two groups of prompt a (one prompt twice in the batch) and one of b, two samples each
    order = [("u1", a), ("u2", a), ("u3", b), ("u1", a), ("u3", b), ("u2", a)]
    got, m = keys("baseline", order)
    prompts = [p for _, p in order]

    def by_prompt(step_keys, prompts):
        return {tuple(p): sorted(k for k, q in zip(step_keys, prompts) if q == p) for p in (a, b)}

    assert all(isinstance(k, int) for k in got[1] + got[2]) and len(set(got[1] + got[2])) == 12
    assert m["verl_ext/sample_seed/unkeyed_requests"] == 0
    for strategy in ("baseline", "seer", "rhyme"):
        other, _ = keys(strategy, order[::-1])
        for step in (1, 2):
            assert by_prompt(other[step], prompts[::-1]) == by_prompt(got[step], prompts), (strategy, step)
    assert by_prompt(keys("baseline", order, seed=6)[0][1], prompts) != by_prompt(got[1], prompts)
    assert keys("baseline", order, temperature=0.0)[0][1] == [None] * 6  # greedy: nothing to key
    unseeded, m = keys("seer", order, info=None)  # a server without verl_ext's plugin
    assert unseeded[1] == [None] * 6 and m["verl_ext/sample_seed/unkeyed_requests"] == 12
    assert "sample_seed is set but the rollout servers do not key" in caplog.text
