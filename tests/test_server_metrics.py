"""verl_ext.rollout.server_metrics: vLLM's speculative-decoding counters from a server's
Prometheus page, and per-step deltas over several servers. The page is written by
prometheus_client itself, as vLLM's server writes it (the real servers' pages are read in
test_verl_e2e_on_cpu.py)."""

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
