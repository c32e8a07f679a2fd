"""The conformance suite's agent loop (:mod:`verl_ext.verl_runs.conformance`): veRL's own
``SingleTurnAgentLoop``, with a cell's sampling settings added to what veRL sends.

Users set sampling parameters beyond veRL's five (temperature, top-p, top-k, repetition penalty,
log-probs) in an agent loop of their own; this one does the same, from two fields of the batch:
``conformance_params`` (JSON: the cell's settings, e.g. ``{"stop_token_ids": [30], "min_p":
0.1}``) and ``conformance_seed`` (each sample's key: a sampled request is keyed,
``extra_args["verl_ext"]["keyed_seed"]``, so that veRL's own manager and verl_ext's draw the
same sample; ``verl_ext.engine.keyed_sampling``). Registered through veRL's
``agent_loop_config_path`` (``AGENT_LOOP_YAML``) as ``AGENT_NAME``.

``TOOL_AGENT_NAME`` is veRL's own ``ToolAgentLoop`` under the same rule, for multi-turn cells: a
small model emits no tool-call syntax, so its tool parser (``TOOL_FORMAT``) reads every assistant
turn as one call of the suite's tool (``verl_ext.verl_runs.conformance_tools``) with that turn's text;
the tool answers, and the next assistant turn follows, up to ``multi_turn.max_assistant_turns``.
"""

from __future__ import annotations

import json
from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

from verl_ext.engine.instance import KEYED_SEED

AGENT_NAME = "verl_ext_conformance"
TOOL_AGENT_NAME = "verl_ext_conformance_tool"
TOOL_FORMAT = "verl_ext_every_turn"
AGENT_LOOP_YAML = (f"- name: {AGENT_NAME}\n  _target_: verl_ext.verl_runs.conformance_loop.ConformanceAgentLoop\n"
                   f"- name: {TOOL_AGENT_NAME}\n  _target_: verl_ext.verl_runs.conformance_loop.ConformanceToolAgentLoop\n")


def cell_sampling(sampling_params: dict[str, Any], cell_params: str, seed) -> dict[str, Any]:
    """veRL's sampling parameters with a cell's settings over them, keyed where it samples."""
    params = {**sampling_params, **json.loads(cell_params or "{}")}
    if params.get("logit_bias"):  # JSON keys are strings; vLLM's SamplingParams takes token ids
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
    if seed is not None and float(params.get("temperature", 1.0)) > 0:
        params["extra_args"] = {**(params.get("extra_args") or {}), "verl_ext": {KEYED_SEED: int(seed)}}
    return params


class _CellSampling:
    """An agent loop's ``run`` with the row's cell settings over veRL's sampling parameters."""

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        params = cell_sampling(sampling_params, kwargs.get("conformance_params"), kwargs.get("conformance_seed"))
        return await super().run(params, **kwargs)


class ConformanceAgentLoop(_CellSampling, SingleTurnAgentLoop):
    pass


class ConformanceToolAgentLoop(_CellSampling, ToolAgentLoop):
    pass


@ToolParser.register(TOOL_FORMAT)
class EveryTurnToolParser(ToolParser):
    """Every assistant turn is one call of the suite's tool with the turn's text."""

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name="verl_ext_echo", arguments=json.dumps({"text": text}))]
