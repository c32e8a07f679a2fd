"""The arm mini-language of ``verl-ext ab``/``sim``: ``name[key=value,...]`` sets strategy
options, ``+spec[:scopes]`` turns on drafting; ``--strategies`` lists arms separated by the
commas outside ``[...]``."""

from __future__ import annotations

from typing import Optional, Sequence

from verl_ext.pipe.defer import require_carrier
from verl_ext.pipe.strategy import make_strategy


def validate_strategies(strategies: Sequence[str]) -> None:
    """The ``--strategies`` list of an A/B run (real or simulated): non-empty, no repeats."""
    if not strategies:
        raise ValueError("--strategies is empty")
    if len(set(strategies)) != len(strategies):
        raise ValueError(f"--strategies lists a strategy twice: {list(strategies)}")


SPEC_SUFFIX = "+spec"
def split_arms(text: str) -> list[str]:
    """Split a ``--strategies`` value on the commas outside ``[...]`` option lists."""
    arms, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in --strategies {text!r}")
        if ch == "," and depth == 0:
            arms.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in --strategies {text!r}")
    arms.append("".join(cur).strip())
    return [a for a in arms if a]


def _option_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_options_label(name: str) -> tuple[str, dict, str]:
    """``"seer[context=false,spec_k=4]+spec"`` -> (``"seer"``, options, ``"+spec"``)."""
    if "[" not in name:
        return name, {}, ""
    base, _, rest = name.partition("[")
    body, sep, tail = rest.partition("]")
    if not sep:
        raise ValueError(f"bad arm '{name}': options go in [key=value,...]")
    options = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad arm '{name}': option '{item}' is not key=value")
        options[key.strip()] = _option_value(value)
    return base.strip(), options, tail


def parse_arm(name: str, spec_k: int = 8, allow_history: bool = False):
    """``"baseline"`` -> (``"baseline"``, None); ``"baseline+spec"`` -> request-scope drafting;
    ``"baseline+spec:group"`` / ``":request+group"`` choose the scopes. Raises ``ValueError``.
    The history scope needs an earlier epoch: only simulated runs over a trace have one."""
    base, sep, rest = name.partition(SPEC_SUFFIX)
    if not sep:
        return name, None
    if rest and not rest.startswith(":"):
        raise ValueError(f"bad arm '{name}': write <strategy>+spec or <strategy>+spec:<scopes>")
    from verl_ext.spec.options import SpecOptions, scope_mask
    from verl_ext.spec import SCOPE_HISTORY

    scopes = rest[1:] or "request"
    if scope_mask(scopes) & SCOPE_HISTORY and not allow_history:
        raise ValueError(
            f"arm '{name}': the history scope drafts from an earlier epoch's responses; run 2+ epochs "
            "(`verl-ext ab --epochs 2`, or `--sim` over a trace with 2+ epochs), or use request and/or group"
        )
    return base, SpecOptions(scopes=scopes, k=spec_k)


#: what a caller of ``make_arm`` is by default, for the error refusing inter-step migration
SINGLE_ROLLOUT = "a single rollout (`verl-ext ab` without `--pipeline`, `verl-ext record`)"


def make_arm(label: str, spec_k: int = 8, allow_history: bool = False, cost=None,
             carrier: Optional[str] = SINGLE_ROLLOUT):
    """(strategy, SpecOptions or None) for one ``--strategies`` entry: ``name[key=value,...]``
    sets strategy options, ``+spec[:scopes]`` turns on drafting explicitly; otherwise the
    strategy's own ``engine_spec`` (e.g. ``seer``'s grouped drafting) decides. ``carrier``: None
    when the caller carries deferred samples to the next step (off-policy pipelines), else what
    the caller is, for the error refusing a strategy that defers (``verl_ext.pipe.defer``)."""
    strategy, spec = check_arm(label, spec_k, allow_history, carrier)
    if spec is None:
        spec = strategy.engine_spec(cost)
    return strategy, spec


def check_arm(label: str, spec_k: int = 8, allow_history: bool = False,
              carrier: Optional[str] = SINGLE_ROLLOUT):
    """``make_arm`` without the engines: (strategy, the ``+spec`` arm's SpecOptions or None). A
    bad name, option or scope raises here, before anything loads an engine's cost model."""
    base, options, tail = parse_options_label(label)
    name, spec = parse_arm(base + tail, spec_k, allow_history)
    strategy = make_strategy(name, options)  # unknown name or option -> clear error
    require_carrier(strategy, carrier is None, carrier)
    return strategy, spec
