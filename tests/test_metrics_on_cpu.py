import math

import pytest

from verl_ext.compare.metrics import REQUIRED_FIELDS, rollout_metrics
from verl_ext.pipe.pool import RequestRecord


def _rec(i, submit, finish, tokens, steps=None, inst="a"):
    return RequestRecord(f"r{i}", "g", inst, submit, finish, tokens, "stop", steps)


def test_metrics_definitions():
    # 10 requests, all submitted at t=0, finishing at 1..10 s with 10 tokens each
    recs = [_rec(i, 0.0, float(i + 1), 10, steps=5, inst="ab"[i % 2]) for i in range(10)]
    m = rollout_metrics(recs, [1.0] * 4 + [0.0] * 6)
    assert set(REQUIRED_FIELDS) <= set(m)
    assert m["wall_s"] == 10.0
    assert m["requests"] == 10 and m["output_tokens"] == 100
    assert m["throughput_tok_s"] == pytest.approx(10.0)
    assert m["tail_s"] == pytest.approx(1.0)  # 90% (9 requests) done at t=9
    assert m["latency_p50_s"] == pytest.approx(5.5)
    assert m["latency_max_s"] == 10.0
    assert m["tokens_per_step"] == pytest.approx(2.0)
    assert m["mean_reward"] == pytest.approx(0.4)
    assert m["per_instance"]["a"]["requests"] == 5


def test_chunks_of_one_request_merge():
    recs = [_rec(0, 1.0, 2.0, 4, 4), _rec(0, 2.5, 4.0, 6, 6), _rec(1, 1.0, 3.0, 3, 3)]
    m = rollout_metrics(recs, [1.0, 1.0])
    assert m["requests"] == 2 and m["output_tokens"] == 13
    assert m["wall_s"] == 3.0  # from first submit (1.0) to last finish (4.0)
    assert m["latency_max_s"] == 3.0


def test_latency_counts_from_the_rollouts_start():
    """A request held in a buffer before its first dispatch is charged for the wait."""
    recs = [_rec(0, 0.0, 2.0, 4), _rec(1, 0.0, 3.0, 4), _rec(2, 2.5, 4.0, 4)]
    m = rollout_metrics(recs, [0.0] * 3)
    assert m["latency_max_s"] == 4.0 and m["latency_p50_s"] == 3.0


def test_unknown_steps_give_none():
    m = rollout_metrics([_rec(0, 0.0, 1.0, 5)], [0.0])
    assert m["tokens_per_step"] is None
    assert not math.isnan(m["wall_s"])


def test_a_losing_copys_tokens_are_engine_work_not_output():
    """Best-of-N: request r0's original ran 6 tokens before it was aborted; its copy, started from
    its first 4 tokens, delivered the rest (6 more): the response has 10 tokens, the engines made 12."""
    recs = [RequestRecord("r0", "g", "a", 0.0, 3.0, 6, "abort", 6), RequestRecord("r0", "g", "b", 1.0, 2.5, 6, "stop", 3)]
    m = rollout_metrics(recs, [1.0], delivered_tokens=10)
    assert m["output_tokens"] == 10 and m["throughput_tok_s"] == pytest.approx(10 / 3.0)
    assert m["tokens_per_step"] == pytest.approx(12 / 9)  # what the engines did per request step
    assert m["per_instance"]["a"]["output_tokens"] == 6 and m["per_instance"]["b"]["output_tokens"] == 6
    assert rollout_metrics(recs, [1.0])["output_tokens"] == 12  # records only: the engines' tokens
