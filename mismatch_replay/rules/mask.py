"""One token rule's decision on arrays: which tokens a rule at one setting masks.

Design
------
The engine never forms a per-token mask: it bins each rule's score against a threshold grid
and adds counts (DESIGN.md). A training loop that applies a rule in its loss (the simulator's
`--loss SPEC`) needs the mask itself. `token_mask` takes the same score and threshold the
engine's one-setting job takes (`engine.single_job`: the first threshold parameter whose value
is not 0; a two-sided band's score already sends the other side to +inf), so the tokens it
masks are the tokens a replay of that setting counts. Token rules only: a sequence rule needs
its sequences' statistics, and m2po a whole step.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from .base import Rule, TokenBatch


def token_mask(
    rule: Rule,
    trainer_logprob: np.ndarray,
    inference_logprob: np.ndarray,
    advantage: np.ndarray | None = None,
) -> np.ndarray:
    """Boolean (n,) array: True where `rule` (a token rule at one setting) masks the token.
    A weight rule (tis, cispo) masks nothing; it is refused, as are sequence and step rules."""
    if rule.level != "token" or rule.kind != "mask":
        raise UsageError(
            f"{rule.spec()}: a loss mask needs a token masking rule (ipo, icepop, kpop, "
            f"dppo-tv, ...); {rule.name} is a {rule.level} {rule.kind} rule."
        )
    names = [p.name for p in rule.params if p.threshold]
    rule.require(*names)
    active = [n for n in names if getattr(rule, n) not in (0, 0.0)]
    param = (active or names)[0]
    if "advantage" in rule.needs and advantage is None:
        raise UsageError(f"{rule.spec()} needs the advantages.")
    b = TokenBatch(
        np.asarray(trainer_logprob, dtype=np.float64),
        np.asarray(inference_logprob, dtype=np.float64),
        None if advantage is None else np.asarray(advantage, dtype=np.float64),
    )
    score = np.asarray(rule.score(b, param), dtype=np.float64)
    thr = rule.threshold(param, float(getattr(rule, param)))
    return score >= thr if rule.inclusive else score > thr


__all__ = ["token_mask"]
