"""Why a veRL server's response ended (``verl_ext.rollout.finish``), and what chunked generation
does with it: veRL's vLLM server reports both "stop" and "length" as "completed", so a response
whose EOS is the last token of a chunk must be read as stopped, not cut off."""

import asyncio

import pytest

from verl_ext.config.settings import VerlExtSettings
from verl_ext.rollout.finish import finish_reason, model_stop_ids

EOS = 2


@pytest.mark.parametrize("tokens,stop_reason,params,max_tokens,want", [
    ([5, 6], "completed", {}, 4, "stop"),  # fewer tokens than allowed: a stop
    ([5, 6, 7, 8], "completed", {}, 4, "length"),
    ([5, 6, 7, EOS], "completed", {}, 4, "stop"),  # the EOS filled the budget
    ([5, 6, 7, EOS], "completed", {"ignore_eos": True}, 4, "length"),
    ([5, 6, 7, 9], "completed", {"ignore_eos": True, "stop_token_ids": [9]}, 4, "stop"),
    ([5, 6, 7, EOS], "completed", {}, None, "stop"),
    ([5], "aborted", {}, 4, "abort"),
    ([5, 6, 7, 8], "stop", {}, 4, "stop"),  # SGLang's servers say which
    ([5, 6], "length", {}, 4, "length"),
])
def test_finish_reason_of_a_veRL_server_response(tokens, stop_reason, params, max_tokens, want):
    assert finish_reason(tokens, stop_reason, params, max_tokens, stop_ids=[EOS]) == want


def test_the_models_stop_ids_are_its_tokenizers_and_generation_configs_eos(model_dir):
    from transformers import AutoTokenizer, GenerationConfig

    ids = model_stop_ids(str(model_dir))
    assert AutoTokenizer.from_pretrained(model_dir).eos_token_id in ids
    gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert set([gen] if isinstance(gen, int) else gen) <= ids
    assert model_stop_ids("/nonexistent/model") == frozenset()


def _answering(answer: int):
    """A model that answers 10, 11, 12, ... and then EOS after ``answer`` tokens."""

    def tokens(prompt_ids, sampling_params):
        done = len(prompt_ids) - 3  # tokens of the response already in the prompt (a continuation)
        return ([10 + i for i in range(done, answer)] + [EOS])[: sampling_params["max_tokens"]]

    return tokens


@pytest.mark.parametrize("answer", [3, 7])  # the EOS is the 4th token: the first chunk's last; the 8th: the second's
def test_a_chunk_that_ends_on_eos_ends_the_request(answer):
    """seer generates in chunks of 4 tokens; a response whose EOS is a chunk's last token is
    complete: no further chunk is requested, and the response is plain decoding's."""
    pytest.importorskip("verl")
    from _util import VerlServer
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    settings = VerlExtSettings(strategy="seer", options={"chunk_size": 4, "speculative": False})
    server = VerlServer(_answering(answer))
    dispatcher = StrategyDispatcher(settings, {"s0": server}, max_tokens_default=32, stop_ids=[EOS])
    out = asyncio.run(dispatcher.generate("r0", [1, 1, 1], {"max_tokens": 32, "temperature": 0.0}))
    assert out.token_ids == [10 + i for i in range(answer)] + [EOS]
    assert [p["max_tokens"] for p in server.generate.params] == [4] * ((answer + 1) // 4)
