"""Chunking never changes what veRL's server samples: a continuation's ``min_tokens`` counts the
tokens so far, and requests whose penalties a continuation would restart (presence, frequency)
are generated in one piece. veRL's ``vLLMHttpServer.generate`` is stood in for by a recorder
(``_util.VerlServer``)."""

import asyncio

import pytest

from _util import VerlServer
from verl_ext.config.settings import VerlExtSettings

pytest.importorskip("verl")


def _continuing(prompt_ids, sampling_params):
    """``max_tokens`` tokens 10, 11, ... continuing the response so far (the prompt is 3 tokens)."""
    done = len(prompt_ids) - 3
    return [10 + done + i for i in range(int(sampling_params["max_tokens"]))]


def _seer(params):
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    server = VerlServer(_continuing)
    dispatcher = StrategyDispatcher(VerlExtSettings(strategy="seer", options={"chunk_size": 4, "speculative": False}),
                                    {"s0": server}, max_tokens_default=14, stop_ids=[2])
    out = asyncio.run(dispatcher.generate("r0", [1, 1, 1], {"max_tokens": 14, "temperature": 1.0, **params}))
    assert out.token_ids == list(range(10, 24))  # the whole response either way
    return server.generate.params


def test_min_tokens_counts_the_tokens_of_earlier_chunks():
    sent = _seer({"min_tokens": 10})
    assert [p["max_tokens"] for p in sent] == [4, 4, 4, 2]
    assert [p["min_tokens"] for p in sent] == [4, 4, 2, 0]  # 10 in all, none past the budget


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_requests_with_penalties_a_continuation_would_restart_are_generated_whole(penalty):
    sent = _seer({penalty: 0.5, "repetition_penalty": 1.1})
    assert len(sent) == 1 and sent[0]["max_tokens"] == 14 and sent[0][penalty] == 0.5


@pytest.mark.parametrize("params", [{"stop": ["\n\n"]}, {"bad_words": ["foo bar"]},
                                    {"structured_outputs": {"json": {"type": "object"}}}])
def test_requests_a_continuation_could_not_keep_exact_are_generated_whole(params):
    """Issue 48, item 4: vLLM matches stop strings and bad words within one call's output, and
    restarts a structured output's grammar at each call: a chunk boundary would miss a stop string
    that spans it, or label a chunk that ends on one at its budget as cut off."""
    sent = _seer(params)
    assert len(sent) == 1 and sent[0]["max_tokens"] == 14


def test_unknown_eos_ids_generate_whole_with_a_metric(caplog):
    """Issue 48, item 5: where the model's EOS ids could not be read (``model_stop_ids`` empty:
    an hdfs:// path, a hub id offline), a part that ends on EOS exactly at its budget would be taken
    as cut off and continued after EOS; requests are generated whole instead, with a warning and
    ``verl_ext/whole/unknown_EOS_ids``. A request that ignores EOS keeps chunking."""
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    server = VerlServer(_continuing)
    d = StrategyDispatcher(VerlExtSettings(strategy="seer", options={"chunk_size": 4, "speculative": False}),
                           {"s0": server}, max_tokens_default=14, stop_ids=[])

    async def run():  # one event loop, as in the dispatcher's actor
        out = await d.generate("r0", [1, 1, 1], {"max_tokens": 14, "temperature": 1.0})
        ignoring = await d.generate("r1", [1, 1, 1], {"max_tokens": 14, "temperature": 1.0, "ignore_eos": True})
        return out, ignoring, await d.metrics()

    out, ignoring, metrics = asyncio.run(run())
    assert out.token_ids == ignoring.token_ids == list(range(10, 24))
    assert [p["max_tokens"] for p in server.generate.params] == [14, 4, 4, 4, 2]
    assert metrics["verl_ext/whole/unknown_EOS_ids"] == 1
    assert "requests with unknown EOS ids are generated in one piece" in caplog.text


def test_repetition_penalty_alone_keeps_chunking():
    """vLLM applies it over prompt and output tokens, so a continuation's prompt carries it."""
    sent = _seer({"repetition_penalty": 1.1})
    assert [p["max_tokens"] for p in sent] == [4, 4, 4, 2] and all(p["repetition_penalty"] == 1.1 for p in sent)
