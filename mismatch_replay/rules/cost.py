"""What a mask costs the policy gradient: the definitions `rules --json` carries (RULES.md).

For a loss token with advantage A and dp = p - q (trainer minus inference probability), the
policy-gradient step raises log p when A > 0 and lowers it when A < 0. The sweep's columns
(engine/readout.py) classify each masked token by the direction of the update it loses.
`DIRECTION` says, per rule, which directions its mask (or clip) can remove: by construction
DPPO and PPO-clip only divergent ones.
"""

from __future__ import annotations

DEFINITIONS = {
    "corrective": "A * (p - q) < 0: the update moves p back toward q",
    "divergent": "A * (p - q) > 0: the update moves p further from q",
    "neutral": "A == 0 or p == q: no update, or no mismatch to move",
    "sign": "sign(p - q) = sign(log p - log q), so the class is exact, with no exp",
    "columns": {
        "masked_corrective": "masked tokens that are corrective",
        "masked_divergent": "masked tokens that are divergent",
        "masked_neutral": "masked tokens that are neutral",
        "masked_corrective_fraction": "masked_corrective / (masked_corrective + masked_divergent)",
        "masked_adv_mass": "sum of |A| over the masked tokens (a masked A == 0 token costs "
        "nothing)",
        "masked_adv_mass_fraction": "masked_adv_mass / sum of |A| over the loss tokens: the "
        "share of the gradient signal the rule removes",
        "entropy_mean": "mean trainer entropy of the loss tokens (finite values)",
        "masked_entropy_mean": "mean trainer entropy of the masked tokens: whether a rule "
        "masks the high-entropy forking tokens disproportionately",
    },
    "scope": "Weight rules: over the tokens they truncate. Sequence rules: over the tokens "
    "of the sequences they mask. Null without an advantage column (entropy: without an "
    "entropy column), and for m2po.",
}

# which update directions a rule's mask (or clip) can remove
_DIVERGENT = "divergent only (by construction)"
DIRECTION = {
    "dppo-tv": _DIVERGENT,
    "dppo-kl": _DIVERGENT,
    "ppo-clip": _DIVERGENT,
    "gspo": "divergent only, on the sequence's geometric-mean ratio",
    "dual-clip": "divergent, and corrective ones at the c bound (A < 0, r > c)",
    "opsm": "sequences with A < 0 whose trainer lags the sampler: mostly divergent",
}
EITHER = "corrective and divergent alike (the test ignores the advantage)"


def direction_of(name: str) -> str:
    """The directions rule `name` can mask (DIRECTION, else EITHER)."""
    return DIRECTION.get(name, EITHER)
