"""verl_ext.rollout.server_metrics: vLLM's speculative-decoding counters from a server's
Prometheus page, and per-step deltas over several servers. The page is written by
prometheus_client itself, as vLLM's server writes it (the real servers' pages are read in
test_verl_e2e_on_cpu.py)."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from verl_ext.rollout.server_metrics import SpecCounters, parse


def page(drafts, draft_tokens, accepted, engines=("0",)):
    reg = CollectorRegistry()
    labels = ["engine", "model_name"]
    counters = {
        "vllm:spec_decode_num_drafts": drafts,
        "vllm:spec_decode_num_draft_tokens": draft_tokens,
        "vllm:spec_decode_num_accepted_tokens": accepted,
    }
    for name, value in counters.items():
        c = Counter(name, name, labels, registry=reg)
        for e in engines:
            c.labels(engine=e, model_name="m").inc(value)
    Gauge("vllm:num_requests_running", "running", labels, registry=reg).labels(engine="0", model_name="m").set(3)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per position", [*labels, "position"], registry=reg)
    per_pos.labels(engine="0", model_name="m", position="0").inc(accepted)
    return generate_latest(reg).decode()


def test_parse_sums_each_counter_over_the_servers_engines():
    assert parse(page(5, 20, 12)) == {"drafts": 5.0, "draft_tokens": 20.0, "accepted_tokens": 12.0}
    assert parse(page(5, 20, 12, engines=("0", "1"))) == {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 24.0}
    assert parse(page(0, 0, 0).replace("spec_decode", "other")) == {}


def test_spec_counters_report_each_steps_drafts_over_all_servers():
    c = SpecCounters()
    first = c.step({"a": parse(page(2, 10, 5)), "b": parse(page(1, 4, 4))})
    assert first == {"verl_ext/spec/drafts": 3.0, "verl_ext/spec/draft_tokens": 14.0,
                     "verl_ext/spec/accepted_tokens": 9.0, "verl_ext/spec/acceptance": 9 / 14}
    # the next step counts only what came after; a server that did not answer adds nothing
    second = c.step({"a": parse(page(3, 16, 8)), "b": None})
    assert second["verl_ext/spec/draft_tokens"] == 6.0 and second["verl_ext/spec/accepted_tokens"] == 3.0
    # a restarted server's counters start again from zero
    third = c.step({"a": parse(page(1, 2, 2)), "b": parse(page(1, 4, 4))})
    assert third["verl_ext/spec/draft_tokens"] == 2.0 and third["verl_ext/spec/acceptance"] == 1.0
    # no server answered: nothing to report (no zeros that would read as "nothing drafted")
    assert c.step({"a": None}) == {}


def load_page(engines=("0", "1")):
    """vLLM's load families as its PrometheusStatLogger declares them (0.32): gauges, counters,
    the per-step histogram and the cache config info gauge."""
    from prometheus_client import Histogram

    reg = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "running", labels, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=reg)
    usage = Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=reg)
    gen = Counter("vllm:generation_tokens", "generated", labels, registry=reg)
    steps = Histogram("vllm:iteration_tokens_total", "tokens per engine step", labels, buckets=(1, 8, 64), registry=reg)
    info = Gauge("vllm:cache_config_info", "cache config", ["engine", "num_gpu_blocks", "block_size"], registry=reg)
    for k, e in enumerate(engines):
        running.labels(engine=e, model_name="m").set(3 + k)
        waiting.labels(engine=e, model_name="m").set(1)
        usage.labels(engine=e, model_name="m").set(0.2 + 0.2 * k)
        gen.labels(engine=e, model_name="m").inc(100)
        for tokens in (12, 4, 4):
            steps.labels(engine=e, model_name="m").observe(tokens)
        info.labels(engine=e, num_gpu_blocks="182", block_size="128").set(1)
    return generate_latest(reg).decode()


def test_parse_load_reads_a_servers_load_and_capacity():
    from verl_ext.rollout.server_metrics import parse_load

    got = parse_load(load_page())
    assert got == {"running": 7.0, "waiting": 2.0, "kv_cache_usage": pytest.approx(0.3), "generated_tokens": 200.0,
                   "steps": 6.0, "kv_capacity_tokens": 2 * 182 * 128.0}  # sums over engines; usage: their mean
    assert parse_load(page(5, 20, 12)) == {"running": 3.0, "drafts": 5.0, "draft_tokens": 20.0, "accepted_tokens": 12.0}
    assert parse_load("") == {}


def test_a_replicas_telemetry_splits_what_it_sent_by_the_servers_reading():
    from verl_ext.rollout.replica_instance import ReplicaInstance
    from verl_ext.rollout.server_metrics import parse_load

    r = ReplicaInstance("10.0.0.1:8000", handle=None, max_running=64)
    r._inflight = 10
    t = r.telemetry()  # no reading: in-flight requests only
    assert (t.running, t.waiting, t.kv_capacity_tokens, t.steps) == (10, None, None, 0)
    r._load, r._load_at = parse_load(load_page(engines=("0",))), 123.0
    t = r.telemetry()
    assert (t.running, t.waiting, t.kv_cache_usage, t.kv_capacity_tokens, t.steps, t.max_running, t.timestamp) == \
        (3, 7, 0.2, 182 * 128, 3, 64, 123.0)
