"""verl_ext's Hydra options compose with veRL's real `ppo_trainer` config, in both forms, and
convert to veRL's `RolloutConfig`; unknown strategies fail with the available ones listed."""

import subprocess
import sys

import pytest

from _util import compose_verl

from verl_ext.config import VerlExtSettings, option_names
from verl_ext.config.settings import HistorySettings
from verl_ext.pipe import available_strategies, make_strategy
from verl_ext.spec import SCOPE_HISTORY

STRATEGIES = option_names()


def test_every_option_is_a_registered_strategy():
    assert "baseline" in STRATEGIES
    assert set(STRATEGIES) <= set(available_strategies())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_form_composes_and_converts(strategy):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    cfg = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm"])
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.agent.agent_loop_manager_class == "verl_ext.rollout.manager.VerlExtAgentLoopManager"
    assert rollout.custom.verl_ext.strategy == strategy
    # veRL's own defaults are still there (inherited from rollout/rollout.yaml)
    assert rollout.mode == "async" and "engine_kwargs" in rollout
    converted = omega_conf_to_dataclass(rollout)
    assert isinstance(converted, RolloutConfig)
    assert converted.agent.agent_loop_manager_class.endswith("VerlExtAgentLoopManager")
    assert VerlExtSettings.from_custom(converted.custom).strategy == strategy


def test_knobs_override_without_plus():
    cfg = compose_verl(["rollout@actor_rollout_ref.rollout=baseline", "actor_rollout_ref.rollout.custom.verl_ext.seed=7"])
    assert VerlExtSettings.from_custom(cfg.actor_rollout_ref.rollout.custom).seed == 7
    for strategy in ("baseline", "seer", "rhyme", "rlhfspec", "specactor", "multiscope"):  # each YAML has it, off
        cfg = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}"])
        assert VerlExtSettings.from_custom(cfg.actor_rollout_ref.rollout.custom).sample_seed is None
    cfg = compose_verl(["rollout@actor_rollout_ref.rollout=seer", "actor_rollout_ref.rollout.custom.verl_ext.sample_seed=3"])
    assert VerlExtSettings.from_custom(cfg.actor_rollout_ref.rollout.custom).sample_seed == 3


def test_default_config_untouched():
    cfg = compose_verl([])
    rollout = cfg.actor_rollout_ref.rollout
    assert "custom" not in rollout or not rollout.custom
    assert rollout.agent.get("agent_loop_manager_class") is None


@pytest.mark.parametrize(
    "custom,match",
    [
        ({"verl_ext": {"strategy": "nope"}}, "available: .*baseline"),
        ({"verl_ext": {"strategy": "baseline", "chunk": 1}}, "unknown key"),
        ({"verl_ext": {"strategy": "baseline", "options": {"x": 1}}}, "unknown option"),
        ({"verl_ext": {"strategy": "baseline", "seed": "one"}}, "seed must be an integer"),
        ({"verl_ext": {"strategy": "baseline", "sample_seed": 1.5}}, "sample_seed must be an integer or null"),
        ({"verl_ext": "baseline"}, "must be a mapping"),
        ({"verl_ext": {"strategy": "rhyme", "history": {"workers": 2}}}, "history: unknown key"),
        ({"verl_ext": {"strategy": "rhyme", "history": {"shards": 0}}}, "shards must be an integer >= 1"),
        ({"verl_ext": {"strategy": "rhyme", "history": {"timeout_s": 0}}}, "timeout_s must be a number > 0"),
        ({"verl_ext": {"strategy": "rhyme", "history": {"checkpoint_dir": " "}}}, "checkpoint_dir must be"),
        ({}, "missing"),
    ],
)
def test_malformed_settings(custom, match):
    with pytest.raises(ValueError, match=match):
        VerlExtSettings.from_custom(custom)


def test_rhyme_knobs_reach_the_engines_drafter(tmp_path):
    """rollout=rhyme: the strategy's drafting knobs flow into veRL's engine_kwargs, which the vLLM
    drafter accepts; the history workers' checkpoints default under veRL's checkpoint dir."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.config.check import runs_verl_ext_drafter
    from verl_ext.spec.options import SpecOptions

    opts = "actor_rollout_ref.rollout.custom.verl_ext.options"
    cfg = compose_verl(["rollout@actor_rollout_ref.rollout=rhyme", "actor_rollout_ref.rollout.name=vllm",
                        f"{opts}.spec_k=16", f"{opts}.min_match=2", f"{opts}.profile=h100-7b",
                        f"trainer.default_local_dir={tmp_path}"])
    assert runs_verl_ext_drafter(cfg.actor_rollout_ref.rollout)
    vllm = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).engine_kwargs["vllm"]
    assert vllm["speculative_config"]["num_speculative_tokens"] == 16
    spec = SpecOptions.from_dict({**vllm["additional_config"]["verl_ext_spec"], "k": 16})  # what the drafter does
    assert spec.mask == SCOPE_HISTORY and spec.aimd and spec.min_match == 2 and spec.max_match == 7
    assert spec.batch_cutoffs  # computed from the profile
    settings = VerlExtSettings.from_custom(cfg.actor_rollout_ref.rollout.custom)
    assert settings.history.resolve_dir(cfg.trainer.default_local_dir) == str(tmp_path / "verl_ext_history")
    assert HistorySettings(checkpoint_dir=None).resolve_dir(str(tmp_path)) is None
    # baseline starts no drafter; seer does
    assert not runs_verl_ext_drafter(compose_verl(["rollout@actor_rollout_ref.rollout=baseline",
                                                   "actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.rollout)
    assert runs_verl_ext_drafter(compose_verl(["rollout@actor_rollout_ref.rollout=seer",
                                               "actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.rollout)


def test_seers_draft_profile_reaches_the_engines_adaptive_budget():
    """rollout=seer: ``options.draft_profile`` gives the engines' drafter its knee (the adaptive
    draft budget), as ``engine_spec`` gives the A/B runner's engines; without one, none."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.perf.cost import load_cost_model
    from verl_ext.spec.options import SpecOptions

    def spec(*overrides):
        cfg = compose_verl(["rollout@actor_rollout_ref.rollout=seer", "actor_rollout_ref.rollout.name=vllm", *overrides])
        vllm = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).engine_kwargs["vllm"]
        return SpecOptions.from_dict({**vllm["additional_config"]["verl_ext_spec"], "k": 8})

    knee = load_cost_model("cpu-smollm2-avx2").draft_thresholds()["knee_tokens"]
    assert spec(f"{OPTS}.draft_profile=cpu-smollm2-avx2").knee_tokens == knee > 0
    assert spec().knee_tokens == 0
    strategy = make_strategy("seer", {"draft_profile": "cpu-smollm2-avx2"})
    assert strategy.engine_spec(None).knee_tokens == knee  # the A/B runner's engines: the same knee


def _main_ppo(*args):
    return subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args, "--cfg", "job"],
        capture_output=True, text=True, timeout=300,
    )


def test_short_form_on_main_ppo():
    """The literal `python -m verl.trainer.main_ppo rollout=<strategy>` (rewritten by the verl plugin)."""
    r = _main_ppo("rollout=baseline", "actor_rollout_ref.rollout.custom.verl_ext.seed=3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "agent_loop_manager_class: verl_ext.rollout.manager.VerlExtAgentLoopManager" in r.stdout
    assert "strategy: baseline" in r.stdout and "seed: 3" in r.stdout


def test_short_form_unknown_strategy_lists_available():
    r = _main_ppo("rollout=nope")
    assert r.returncode != 0
    assert "unknown rollout strategy 'nope'; available: baseline" in r.stderr
    assert "Could not find 'rollout/nope'" in r.stderr


def _compose_with_drafter(strategy: str, spec_k: int):
    """``rollout=<strategy>`` with ``profile=h100-7b`` and ``spec_k``: (base overrides, the rollout
    config as a dataclass, the drafter's SpecOptions as the engine builds them)."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.spec import SpecOptions

    base = [f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm"]
    cfg = compose_verl(base + ["actor_rollout_ref.rollout.custom.verl_ext.options.profile=h100-7b",
                               f"actor_rollout_ref.rollout.custom.verl_ext.options.spec_k={spec_k}"])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    vllm = rollout.engine_kwargs["vllm"]
    assert vllm["speculative_config"]["num_speculative_tokens"] == spec_k
    spec = SpecOptions.from_dict({**vllm["additional_config"]["verl_ext_spec"], "k": spec_k})  # what the drafter does
    return base, cfg, rollout, spec


def test_rlhfspec_engines_get_the_selection_and_need_a_profile():
    from verl_ext.config.check import check_drafter_config

    base, cfg, rollout, spec = _compose_with_drafter("rlhfspec", 24)
    assert spec.select and spec.select_profile == "h100-7b" and spec.min_prob == 0.0 and spec.acceptance == ()
    assert spec.draft_selector() is not None
    settings = VerlExtSettings.from_custom(rollout.custom)
    check_drafter_config(settings, cfg.actor_rollout_ref.rollout)
    bare = compose_verl(base)
    with pytest.raises(ValueError, match="options.profile"):
        check_drafter_config(VerlExtSettings.from_custom(bare.actor_rollout_ref.rollout.custom), bare.actor_rollout_ref.rollout)


def test_specactor_composes_with_its_drafter_and_needs_a_ladder_or_profile():
    from verl_ext.pipe import make_strategy
    from verl_ext.pipe.strategy import StrategyConfigError

    base, cfg, rollout, spec = _compose_with_drafter("specactor", 12)
    assert spec.scopes == "request+group"
    settings = VerlExtSettings.from_custom(rollout.custom)
    assert settings.strategy == "specactor"
    st = make_strategy(settings.strategy, settings.options)
    assert st.ladder() is not None and st.options.spec_k == 12
    bare = compose_verl(base)
    st = make_strategy("specactor", VerlExtSettings.from_custom(bare.actor_rollout_ref.rollout.custom).options)
    with pytest.raises(StrategyConfigError, match="options.profile"):
        st.engine_spec()


OPTS = "actor_rollout_ref.rollout.custom.verl_ext.options"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_config_check_passes_each_strategys_own_config(strategy):
    from verl_ext.config.check import check_rollout

    overrides = [f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm"]
    if strategy in ("rlhfspec", "specactor"):
        overrides.append(f"{OPTS}.profile=cpu-smollm2-avx2")
    assert check_rollout(compose_verl(overrides).actor_rollout_ref.rollout).strategy == strategy
    assert check_rollout(compose_verl([]).actor_rollout_ref.rollout) is None  # verl_ext not selected


@pytest.mark.parametrize("strategy", ["seer", "rhyme", "rlhfspec", "specactor", "multiscope"])
def test_the_draft_length_is_set_once_in_the_strategys_options(strategy):
    """``options.spec_k`` is the engines' ``num_speculative_tokens`` too; an engine setting that
    disagrees with the strategy's options is refused, naming the setting."""
    from verl_ext.config.check import check_rollout

    base = [f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm",
            f"{OPTS}.profile=cpu-smollm2-avx2" if strategy in ("rlhfspec", "specactor") else f"{OPTS}.spec_k=8"]
    cfg = compose_verl(base + [f"{OPTS}.spec_k=12"]).actor_rollout_ref.rollout
    assert check_rollout(cfg).options["spec_k"] == 12
    assert cfg.engine_kwargs.vllm.speculative_config.num_speculative_tokens == 12
    assert cfg.engine_kwargs.vllm.additional_config.verl_ext_spec.get("k", 12) == 12
    apart = compose_verl(base + ["actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=4"])
    with pytest.raises(ValueError, match=r"disagree with what strategy '%s' asks of them .*k: engines 4" % strategy):
        check_rollout(apart.actor_rollout_ref.rollout)


@pytest.mark.parametrize(
    "strategy,overrides,match",
    [
        ("seer", [f"+{OPTS}.chunk_sise=8"], r"strategy 'seer': unknown option\(s\) \['chunk_sise'\]"),
        ("rlhfspec", [f"{OPTS}.profile=/nonexistent/profile.json"], "cost model file '/nonexistent/profile.json' does not exist"),
        ("rlhfspec", [], "needs step times"),
        ("rhyme", ["+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.verl_ext_spec.nope=1"],
         r"unknown spec option\(s\) \['nope'\]"),
        ("seer", ["+actor_rollout_ref.rollout.custom.verl_ext.chunk=1"], "unknown key"),
    ],
)
def test_config_check_refuses_what_the_rollouts_start_would_refuse(strategy, overrides, match):
    from verl_ext.config.check import check_rollout

    cfg = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm", *overrides])
    with pytest.raises(ValueError, match=match):
        check_rollout(cfg.actor_rollout_ref.rollout)


REPLAY = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"


@pytest.mark.parametrize(
    "strategy,overrides,parts",
    [
        ("seer", [], "options.chunk_size"),
        ("specactor", [f"{OPTS}.profile=cpu-smollm2-avx2"], "options.best_of_n"),
        ("rlhfspec", [f"{OPTS}.profile=cpu-smollm2-avx2"], "options.reallocation"),
        ("rhyme", [], "options.migration"),
    ],
)
def test_routing_replay_is_refused_with_a_strategy_that_makes_responses_in_parts(strategy, overrides, parts):
    """Issue 48, item 8: each engine call reports the routed experts of its own tokens, so a
    response made in parts cannot carry its routing; the config check refuses the pair before
    anything starts (the rollout used to fail only once a whole response had been generated),
    and accepts replay once the strategy makes every response in one call."""
    from verl_ext.config.check import check_rollout

    base = [f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm", *overrides]
    with pytest.raises(ValueError, match=rf"routing replay .* generates some in parts \({parts}"):
        check_rollout(compose_verl([*base, REPLAY]).actor_rollout_ref.rollout)
    off = {"options.chunk_size": "0"}.get(parts, "false")
    ok = [*base, REPLAY, f"{OPTS}.{parts.split('.')[1]}={off}"]
    if strategy == "rhyme":
        ok.append(f"+{OPTS}.inter_step=false")
    assert check_rollout(compose_verl(ok).actor_rollout_ref.rollout).strategy == strategy
    assert check_rollout(compose_verl(["rollout@actor_rollout_ref.rollout=baseline", REPLAY])
                         .actor_rollout_ref.rollout).strategy == "baseline"


@pytest.mark.parametrize(
    "args,line",
    [
        (["rollout=seer", f"+{OPTS}.chunk_sise=8"], "verl_ext: strategy 'seer': unknown option(s) ['chunk_sise']; valid options: ["),
        (["rollout=rlhfspec", f"{OPTS}.profile=/nonexistent/profile.json"],
         "verl_ext: strategy 'rlhfspec': profile: cost model file '/nonexistent/profile.json' does not exist; presets: "),
    ],
)
def test_main_ppo_ends_on_a_bad_setting_before_starting_anything(args, line, tmp_path):
    """The plugin's config check (a Hydra callback) runs before veRL's task function: one line on
    stderr, status 1, and no Ray, worker or server started."""
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, "trainer.device=cpu"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)  # (Hydra's outputs/ go there)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(line), r.stderr[-2000:]
    assert "ray init kwargs" not in r.stdout + r.stderr and "Started a local Ray instance" not in r.stdout + r.stderr


@pytest.mark.parametrize("strategy, option", [("seer", "draft_profile"), ("rhyme", "profile"), ("rlhfspec", "profile"),
                                              ("specactor", "profile"), ("multiscope", "draft_profile")])
def test_a_profile_option_drafts_the_same_through_hydra_as_in_verl_ext_ab(strategy, option):
    """Every strategy option that takes a profile: veRL's engines, started from the composed
    ``rollout=<strategy>`` config, draft with the options ``verl-ext ab`` starts its engines with
    (``Strategy.engine_spec``), as the config check compares them (``engine_spec_differences``):
    the engines resolve the knee's and cut-off's profiles themselves; ``seer``'s servers start
    with engine-local group trees (``group_source``), which the strategy switches where a draft
    server streams to them."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.config.check import engine_spec_differences
    from verl_ext.spec.options import SpecOptions

    cfg = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm",
                        f"{OPTS}.{option}=cpu-smollm2-avx2"])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    vllm = rollout.engine_kwargs["vllm"]
    k = vllm["speculative_config"]["num_speculative_tokens"]
    engines = SpecOptions.from_dict({**vllm["additional_config"]["verl_ext_spec"], "k": k})  # what veRL's engines run
    ab = make_strategy(strategy, VerlExtSettings.from_custom(rollout.custom).options).engine_spec()  # verl-ext ab's

    assert engine_spec_differences(ab, engines) == []
    if strategy == "specactor":  # its profile prices the draft ladder, strategy-side, from the same options
        # (the ladder also times the drafter on this machine, so two builds differ in those timings)
        hydra = make_strategy(strategy, VerlExtSettings.from_custom(rollout.custom).options)
        assert hydra.options == make_strategy(strategy, {option: "cpu-smollm2-avx2"}).options
        assert hydra.ladder() is not None
        return
    # and the profile changed what they draft with: without it, the engines' options differ
    bare = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}", "actor_rollout_ref.rollout.name=vllm"])
    bare_vllm = omega_conf_to_dataclass(bare.actor_rollout_ref.rollout).engine_kwargs["vllm"]
    bare_spec = SpecOptions.from_dict({**bare_vllm["additional_config"]["verl_ext_spec"], "k": k})
    assert engine_spec_differences(engines, bare_spec) != []


@pytest.mark.parametrize("overrides, warned", [
    ([f"{OPTS}.batch_cutoff=true"], "no cut-off table"),  # rlhfspec's engines keep cutoff_profile '' by default
    ([f"{OPTS}.batch_cutoff=true", "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.verl_ext_spec."
      "cutoff_profile=cpu-smollm2-avx2"], None),
    ([], None),
])
def test_a_cutoff_the_engines_would_not_run_is_warned(caplog, overrides, warned):
    """``options.batch_cutoff`` and the engines' ``cutoff_profile`` must agree: the config check
    warns where the strategy asks for the cut-off and the servers would start without a table."""
    import logging

    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.config.check import check_drafter_config

    cfg = compose_verl(["rollout@actor_rollout_ref.rollout=rlhfspec", "actor_rollout_ref.rollout.name=vllm",
                        f"{OPTS}.profile=cpu-smollm2-avx2", *overrides])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    with caplog.at_level(logging.WARNING, logger="verl_ext"):
        check_drafter_config(VerlExtSettings.from_custom(rollout.custom), rollout)
    if warned:
        assert warned in caplog.text
    else:
        assert "cut-off" not in caplog.text
