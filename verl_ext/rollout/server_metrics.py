"""What a veRL vLLM server's own Prometheus endpoint says about its drafts and its load.

veRL's ``vLLMHttpServer`` serves vLLM's OpenAI app, and with it vLLM's ``/metrics`` (recorded
unless the rollout sets ``disable_log_stats=true``, veRL's default; verl_ext's strategies that
read them turn it off in their rollout configs). :func:`scrape` reads one server's
speculative-decoding counters with ``prometheus_client``'s parser; :class:`SpecCounters` turns
cumulative counters of several servers into per-step deltas for veRL's tracking;
:func:`parse_load` reads the load a strategy schedules by (``ReplicaInstance.telemetry``).
"""

from __future__ import annotations

import logging
import urllib.request
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

#: vLLM counter family -> our name (vLLM 0.24-0.33, ``vllm/v1/spec_decode/metrics.py``)
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def parse(text: str) -> dict[str, float]:
    """The speculative-decoding counters in a Prometheus text page, summed over their labels
    (engines of one server); counters the page lacks are absent."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = SPEC_COUNTERS.get(family.name)
        if name is None:
            continue
        out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


#: vLLM family -> (our name, how to read it) for a server's load (vLLM 0.24-0.33,
#: ``vllm/v1/metrics/loggers.py``): gauges and counters summed over the server's engines; the
#: histogram's sample count (one observation per engine step)
LOAD_METRICS = {
    "vllm:num_requests_running": ("running", ""),
    "vllm:num_requests_waiting": ("waiting", ""),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", ""),
    "vllm:generation_tokens": ("generated_tokens", "_total"),
    "vllm:iteration_tokens_total": ("steps", "_count"),
}


def parse_load(text: str) -> dict[str, float]:
    """A server's load and capacity from its Prometheus page: ``running``, ``waiting``,
    ``kv_cache_usage`` (fraction; the mean over its engines), ``generated_tokens``, ``steps``
    (engine iterations), ``kv_capacity_tokens`` (``cache_config_info``: blocks x block size) and
    the drafting counters of :func:`parse`; what the page lacks is absent."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[family.name]] = sum(x.value for x in family.samples if x.name.endswith("_total"))
        elif family.name in LOAD_METRICS:
            name, suffix = LOAD_METRICS[family.name]
            values = [x.value for x in family.samples if x.name == family.name + suffix]
            if values:
                out[name] = sum(values) / len(values) if name == "kv_cache_usage" else sum(values)
        elif family.name == "vllm:cache_config_info":
            caps = [int(x.labels["num_gpu_blocks"]) * int(x.labels["block_size"]) for x in family.samples
                    if str(x.labels.get("num_gpu_blocks", "")).isdigit() and str(x.labels.get("block_size", "")).isdigit()]
            if caps:
                out["kv_capacity_tokens"] = float(sum(caps))
    return out


def fetch(address: str, timeout_s: float = 2.0) -> str:
    """``http://<address>/metrics``; raises on any HTTP or network error."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def scrape(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """``parse`` of ``http://<address>/metrics``; raises on any HTTP or network error."""
    return parse(fetch(address, timeout_s))


class SpecCounters:
    """Per-step drafting figures of a set of servers from their cumulative counters.

    ``step(readings)`` takes one reading per server (None where a scrape failed) and returns what
    the servers drafted and accepted since the previous call, as veRL metrics:
    ``verl_ext/spec/{drafts,draft_tokens,accepted_tokens}`` and ``verl_ext/spec/acceptance``
    (accepted / drafted tokens). A server first seen in this call counts from zero, so the first
    step includes everything since the server started (its warm-up drafts nothing)."""

    def __init__(self):
        self._last: dict[str, dict[str, float]] = {}

    def step(self, readings: dict[str, Optional[dict[str, float]]]) -> dict[str, float]:
        totals = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
        seen = False
        for server, reading in readings.items():
            if not reading:
                continue
            seen = True
            last = self._last.get(server, {})
            for key in totals:
                now = float(reading.get(key, 0.0))
                before = last.get(key, 0.0)
                totals[key] += now - before if now >= before else now  # a restarted server counts anew
            self._last[server] = dict(reading)
        if not seen:
            return {}
        out = {f"verl_ext/spec/{k}": v for k, v in totals.items()}
        out["verl_ext/spec/acceptance"] = totals["accepted_tokens"] / totals["draft_tokens"] if totals["draft_tokens"] else 0.0
        return out


def read_all(addresses: Iterable[str], timeout_s: float = 2.0) -> dict[str, Optional[dict[str, float]]]:
    """``scrape`` of each address; None (and one warning per call) where a server does not answer."""
    out: dict[str, Optional[dict[str, float]]] = {}
    for address in addresses:
        try:
            out[address] = scrape(address, timeout_s)
        except Exception as exc:
            logger.warning("verl_ext: no draft counters from server %s (%s: %s)", address, type(exc).__name__, exc)
            out[address] = None
    return out
