"""Why a veRL rollout server's response ended: ``stop``, ``length`` or ``abort``.

veRL 0.9.1's ``vLLMHttpServer.generate`` maps vLLM's ``stop`` and ``length`` both to
``stop_reason="completed"`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``);
``SGLangHttpServer`` passes SGLang's ``stop``/``length``/``abort`` through. A response that filled
``max_tokens`` therefore ended on a stop token or on the budget, and only its last token tells
which. That matters for chunked generation (``verl_ext.pipe.chunks``): a chunk whose stop token is
its last one has ended, and generating more after it would change the response.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from verl_ext.engine.instance import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

logger = logging.getLogger(__name__)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def model_stop_ids(model_path: str, trust_remote_code: bool = False) -> frozenset[int]:
    """The token ids a server stops on unless ``ignore_eos``: the tokenizer's EOS and the
    generation config's ``eos_token_id`` (vLLM adds those to a request's stop ids). Empty, with a
    warning, when neither can be read."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        ids |= _ids(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except Exception:  # no generation_config.json: the tokenizer's EOS alone
        pass
    try:
        from transformers import AutoTokenizer

        ids |= _ids(AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id)
    except Exception as exc:
        logger.debug("verl_ext: no tokenizer at %s (%s)", model_path, exc)
    if not ids:
        logger.warning("verl_ext: no EOS token id found for %s; a response that fills a chunk exactly is taken "
                       "as cut off there", model_path)
    return frozenset(ids)


def finish_reason(token_ids: Iterable[int], stop_reason: Optional[str], sampling_params: dict,
                  max_tokens: Optional[int], stop_ids: Iterable[int] = ()) -> str:
    """``stop``, ``length`` or ``abort`` for a server's ``TokenOutput``.

    ``max_tokens``: the request's budget (its sampling ``max_tokens``, else the rollout's
    ``response_length``). ``stop_ids``: the model's EOS ids (``model_stop_ids``), which end a
    response unless ``sampling_params["ignore_eos"]``; the request's own ``stop_token_ids`` end it
    either way."""
    if stop_reason in ("aborted", "abort"):
        return FINISH_ABORT
    if stop_reason in (FINISH_STOP, FINISH_LENGTH):  # SGLang says which
        return stop_reason
    tokens = list(token_ids)
    if max_tokens is None or len(tokens) < int(max_tokens):
        return FINISH_STOP
    stops = _ids(sampling_params.get("stop_token_ids"))
    if not sampling_params.get("ignore_eos"):
        stops |= set(stop_ids)
    return FINISH_STOP if tokens and tokens[-1] in stops else FINISH_LENGTH
