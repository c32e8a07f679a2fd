"""Drafting options shared by the vLLM proposer, ``verl-ext ab`` and the benchmarks."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from verl_ext.spec._suffix import SCOPE_GLOBAL, SCOPE_GROUP, SCOPE_HISTORY, SCOPE_REQUEST

SCOPES = {"request": SCOPE_REQUEST, "group": SCOPE_GROUP, "history": SCOPE_HISTORY, "global": SCOPE_GLOBAL}
#: a scope bit -> its name (the drafter's per-scope counts)
SCOPE_NAMES = {bit: name for name, bit in SCOPES.items()}
# vLLM's rejection sampler asserts max_spec_len <= 128 (MAX_SPEC_LEN)
MAX_K = 128


#: ``GenRequest.extra`` keys the engine's drafter reads per request (``request_drafting``, and
#: ``verl_ext.spec.reference`` for reference drafts); drivers forward them to the engine
REQUEST_DRAFT_KEYS = ("spec_scopes", "spec_window", "spec_reference", "spec_accept", "spec_seed",
                      "spec_seq_offset")
#: ``GenRequest.extra`` key of a chunk of a response (``verl_ext.pipe.chunks``): the response's
#: tokens before it. The engine writes the chunk's tokens into one group sequence per response,
#: named by the request id, from there on, so that a grouped draft server's copy of the response
#: merges into it rather than doubling it
SEQ_OFFSET_KEY = "spec_seq_offset"


def request_drafting(ident, mask: int) -> tuple[int, Optional[int]]:
    """One request's drafting from its per-request keys (``GenRequest.extra``, or the vLLM
    request's ``extra_args["verl_ext"]``): ``spec_scopes`` narrows the engine's scope ``mask``,
    ``spec_window`` caps its drafts (0: none). Returns (scopes mask, window or None). A bad value
    must not break an engine: it means no drafts for that request."""
    window = None
    if ident.get("spec_scopes"):
        try:
            mask &= scope_mask(ident["spec_scopes"])
        except ValueError:
            mask = 0
    if ident.get("spec_window") is not None:
        try:
            window = max(0, int(ident["spec_window"]))
        except (TypeError, ValueError):
            window = 0
    return mask, window


def scope_mask(scopes: str) -> int:
    """``"request+group"`` -> bit mask. Raises ``ValueError`` naming the valid scopes."""
    names = [s.strip() for s in str(scopes).replace(",", "+").split("+") if s.strip()]
    if not names:
        raise ValueError(f"no drafting scope given; choose from {sorted(SCOPES)} joined by '+'")
    mask = 0
    for name in names:
        if name not in SCOPES:
            raise ValueError(f"unknown drafting scope '{name}'; valid: {sorted(SCOPES)} (join with '+')")
        mask |= SCOPES[name]
    return mask


@dataclass(frozen=True)
class SpecOptions:
    """Model-free (suffix-tree) drafting inside the engine.

    ``k`` is the most tokens drafted per request per step; drafts are shorter when the tree has
    no confident continuation. ``max_depth`` bounds the indexed suffix length (and the per-token
    append cost); ``min_match``/``max_match`` bound the context suffix that must match;
    ``min_prob`` stops a draft once its cumulative empirical probability drops below it;
    ``max_bytes`` caps the index memory per engine (least recently used trees are evicted).
    The ``global`` scope drafts from the engine's recent responses to every prompt (Arctic's
    global tree): each finished response goes in, and ``global_tokens`` bounds it (two
    generations of at most about that many tokens each; ``DraftIndex.set_global_tokens``).
    With ``scope_weights`` each scope's draft is weighed by how that scope's drafts fared for
    the prompt so far (tokens the response went on to contain per expected token,
    ``ScopeStats`` in ``draft_index.h``); off, the draft with the highest expected accepted
    length wins.

    Adaptive draft length (Seer, ``verl_ext.spec.adaptive``): with ``adaptive`` on, a step of
    ``B`` requests drafts at most ``knee_tokens - B`` tokens in total (``knee_tokens``: from the
    profiled cost model, ``CostModel.draft_thresholds``; 0 = no batch threshold), shared out with
    weight ``1 + sibling_boost * (finished fraction of the request's group)``, at most ``k`` each.
    ``knee_profile``: a cost-model preset name or profile JSON path to take ``knee_tokens`` from
    when it is 0 (how engines started from a YAML config, e.g. veRL's, get Seer's profile).

    AIMD draft window (RhymeRL section 5.4, ``verl_ext.spec.aimd``): with ``aimd`` on, each
    request drafts at most its window, which starts at ``aimd_start``, grows by ``aimd_step`` after
    a fully accepted draft (up to ``k``) and resets to ``aimd_start`` on any rejection.
    ``batch_cutoffs``: HistoSpec's ``((context, acceptance rate, max batch), ...)`` table
    (``CostModel.spec_batch_cutoffs``, ``verl_ext.spec.cutoff``); an engine whose batch exceeds the
    cut-off for its batch's mean context and its measured acceptance rate does not draft that
    step. Empty: no cut-off. ``cutoff_profile``: a cost-model preset name or profile JSON path
    (``verl-ext fit grid``) to compute that table from (``CostModel.spec_batch_cutoffs`` at a
    draft of ``aimd_start`` tokens) when ``batch_cutoffs`` is empty; "" = none.

    Workload-aware selection (RLHFSpec section 5, ``verl_ext.spec.select``): with ``select`` on,
    each step drafts candidates of up to ``k`` tokens per request and keeps the draft tokens that
    maximise predicted tokens per second (Equation 2): ``F`` from ``acceptance`` (an offline fit's
    table, or the path of its JSON; () = ``F(s) = s``), updated online, and step times from ``select_profile`` (a
    cost-model preset, a ``verl-ext fit grid`` JSON path, or an inline JSON object; the simulator
    uses its instances' own model when empty). ``select_patience``: consecutive falls of the
    objective that end the search (0 = exhaustive).

    ``group_source``: where group trees come from. ``"local"``: each engine builds them from the
    requests it runs itself. ``"remote"``: from the grouped draft server (``verl_ext.spec.dgds``),
    which aggregates the group's responses from every engine; the engine's own requests then do
    not write to the local group trees (the server's copy already has their tokens).
    """

    scopes: str = "request"
    k: int = 8
    max_depth: int = 32
    min_match: int = 1
    max_match: int = 16
    min_prob: float = 0.3
    max_bytes: int = 2 << 30
    global_tokens: int = 1 << 20
    scope_weights: bool = False
    adaptive: bool = False
    knee_tokens: int = 0
    knee_profile: str = ""
    sibling_boost: float = 1.0
    group_source: str = "local"
    aimd: bool = False
    aimd_start: int = 2
    aimd_step: int = 2
    batch_cutoffs: tuple = ()
    cutoff_profile: str = ""
    select: bool = False
    select_profile: str = ""
    acceptance: tuple = ()
    select_patience: int = 4

    def __post_init__(self):
        scope_mask(self.scopes)
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"spec k must be in [1, {MAX_K}], got {self.k}")
        if not 2 <= self.max_depth <= 255:
            raise ValueError(f"spec max_depth must be in [2, 255], got {self.max_depth}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"spec needs 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"spec min_prob must be in [0, 1], got {self.min_prob}")
        if self.knee_tokens < 0:
            raise ValueError(f"spec knee_tokens must be >= 0 (0 = no batch threshold), got {self.knee_tokens}")
        if self.sibling_boost < 0:
            raise ValueError(f"spec sibling_boost must be >= 0, got {self.sibling_boost}")
        if self.group_source not in ("local", "remote"):
            raise ValueError(f"spec group_source must be 'local' or 'remote', got {self.group_source!r}")
        if self.max_bytes < 0:
            raise ValueError(f"spec max_bytes must be >= 0 (0 = no cap), got {self.max_bytes}")
        if self.global_tokens < 1:
            raise ValueError(f"spec global_tokens must be >= 1, got {self.global_tokens}")
        # the window start only matters with AIMD windows or a cut-off derived for it
        if (self.aimd or self.cutoff_profile) and not 1 <= self.aimd_start <= self.k:
            raise ValueError(f"spec aimd_start must be in [1, k={self.k}], got {self.aimd_start}")
        if self.aimd_step < 0:
            raise ValueError(f"spec aimd_step must be >= 0, got {self.aimd_step}")
        if self.select_patience < 0:
            raise ValueError(f"spec select_patience must be >= 0 (0 = exhaustive), got {self.select_patience}")
        acc = self.acceptance
        if isinstance(acc, str):  # a `verl-ext fit acceptance` JSON (veRL's engine_kwargs)
            acc = load_acceptance(acc) if acc.strip() else ()
        try:
            rows = [tuple(float(x) for x in r) for r in acc] if acc and not isinstance(acc[0], (int, float)) \
                else ([tuple(float(x) for x in acc)] if acc else [])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"spec acceptance must be probabilities (one row, or a row per depth bucket), got {self.acceptance!r}") from exc
        if rows and (len(rows[0]) < 2 or any(len(r) != len(rows[0]) for r in rows)
                     or not all(0.0 <= x <= 1.0 for r in rows for x in r)):
            raise ValueError(f"spec acceptance needs rows of >= 2 probabilities in [0, 1], got {self.acceptance!r}")
        acc = tuple(rows) if len(rows) > 1 else (rows[0] if rows else ())
        object.__setattr__(self, "acceptance", acc)
        if self.select_profile:
            load_select_cost(self.select_profile)  # fail early on a bad profile
        from verl_ext.spec.cutoff import check_cutoffs

        cutoffs = self.batch_cutoffs
        if self.cutoff_profile and not cutoffs:
            from verl_ext.perf.cost import load_cost_model

            try:
                cutoffs = load_cost_model(self.cutoff_profile).spec_batch_cutoffs(self.aimd_start)
            except (OSError, ValueError) as exc:
                raise ValueError(f"spec cutoff_profile: {exc}") from exc
        object.__setattr__(self, "batch_cutoffs", check_cutoffs(cutoffs))
        if self.knee_profile and not self.knee_tokens:
            from verl_ext.perf.cost import load_cost_model

            try:
                knee = int(load_cost_model(self.knee_profile).draft_thresholds()["knee_tokens"])
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"spec knee_profile: {exc}") from exc
            object.__setattr__(self, "knee_tokens", max(0, knee))

    def batch_cutoff(self):
        """A fresh ``BatchCutoff`` for these options, or None without a table."""
        if not self.batch_cutoffs:
            return None
        from verl_ext.spec.cutoff import BatchCutoff

        return BatchCutoff(self.batch_cutoffs)

    def draft_selector(self, cost=None):
        """A fresh ``DraftSelector`` (``verl_ext.spec.select``), or None without ``select``.
        ``cost``: the instance's cost model, used when ``select_profile`` is empty."""
        if not self.select:
            return None
        from verl_ext.spec.select import AcceptanceModel, DraftSelector

        if self.select_profile:
            cost = load_select_cost(self.select_profile)
        if cost is None:
            raise ValueError("spec select needs step times: set select_profile (a cost-model preset, a "
                             "`verl-ext fit grid` JSON, or an inline JSON object)")
        return DraftSelector(cost, AcceptanceModel(prior=self.acceptance or None), self.select_patience)

    def aimd_windows(self):
        """A fresh ``AimdWindows`` for these options, or None without ``aimd``."""
        if not self.aimd:
            return None
        from verl_ext.spec.aimd import AimdWindows

        return AimdWindows(self.aimd_start, self.aimd_step, self.k)

    @property
    def mask(self) -> int:
        return scope_mask(self.scopes)

    def without(self, scope: str) -> Optional[SpecOptions]:
        """These options without drafting from ``scope``, or None where no scope is left."""
        rest = self.mask & ~SCOPES[scope]
        if not rest:
            return None
        return dataclasses.replace(self, scopes="+".join(n for bit, n in sorted(SCOPE_NAMES.items()) if rest & bit))

    def new_index(self, max_bytes: Optional[int] = None, k: Optional[int] = None):
        """The engine's ``DraftIndex`` for these options (the global tree on when its scope is)."""
        from verl_ext.spec._suffix import DraftIndex

        index = DraftIndex(self.max_depth, self.max_bytes if max_bytes is None else max_bytes,
                           max(1, self.k if k is None else k))
        if self.mask & SCOPE_GLOBAL:
            index.set_global_tokens(self.global_tokens)
        return index

    @classmethod
    def from_dict(cls, d: dict) -> "SpecOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown spec option(s) {unknown}; valid: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def engine_args(self) -> dict:
        """vLLM engine arguments that turn this drafter on."""
        return {
            "speculative_config": {
                "method": "custom_class",
                "model": "verl_ext.vllm.proposer.SuffixProposer",
                "num_speculative_tokens": self.k,
            },
            "additional_config": {"verl_ext_spec": self.to_dict()},
        }


def load_acceptance(path: str) -> tuple:
    """F's table from a ``verl-ext fit acceptance`` JSON."""
    from verl_ext.spec.select import AcceptanceModel

    try:
        return tuple(tuple(r) for r in AcceptanceModel.from_file(path).prior.tolist())
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec acceptance: {path}: {exc}") from exc


def load_select_cost(profile: str):
    """The ``CostModel`` of ``select_profile``: a preset name, a JSON path, or an inline JSON object."""
    from verl_ext.perf.cost import CostModel, load_cost_model

    try:
        if profile.lstrip().startswith("{"):
            return CostModel.from_dict(json.loads(profile), "select_profile")
        return load_cost_model(profile)
    except (OSError, ValueError) as exc:  # PresetError and JSONDecodeError are ValueErrors
        raise ValueError(f"spec select_profile: {exc}") from exc
