"""The m2po rule: a per-step second-moment budget on l^2.

M2PO masks, within one training step, the tokens of largest l^2 until the mean l^2 of
the rest is below tau. Its `score()` is each token's l^2; what makes it a step rule
(`level = "step"`, `inclusive = True`: the token of rank m is masked iff the mean of the
ranked tokens from m on is >= tau) is resolved by the engine, which sorts each step's
l^2 and reads the suffix means. The AReaL preset keeps the last-ranked token
(`keep_last`). The catalogue lists it right after token-k3, among the rules on the
log-probs alone (`register(after=TokenK3.name)`).
"""

from __future__ import annotations

from .base import AREAL_ACTOR, Param, Rule, as_f64, register
from .token import TokenK3


@register(after=TokenK3.name)
class M2PO(Rule):
    name = "m2po"
    label = "M2PO"
    color = "#CC6677"  # Tol rose
    panel = "kl"
    title = "M2PO second-moment budget"
    source = "arXiv 2510.01161"
    definition = "per step: mask the largest l^2 until the mean l^2 of the rest is < tau"
    level = "step"
    inclusive = True  # the token of rank m is masked iff mean(rest from m on) >= tau
    params = (Param("tau", "budget on the mean of l^2 per step", "0.0001:1:121:log"),)
    presets = {"paper": {"tau": 0.04}, "areal": {"tau": 0.04}}
    preset_notes = {
        "areal": "AReaL's _apply_m2po_masking: when no tail brings the mean under tau, all "
        "but one token (the smallest l^2) are masked, where the bare rule masks all; AReaL "
        "ranks each micro-batch, the replay each step",
    }
    preset_arith = {"areal": "areal"}
    preset_sources = {"areal": f"{AREAL_ACTOR} _get_m2po_loss_mask"}
    tau: float | None = 0.04

    @property
    def keep_last(self) -> bool:
        """AReaL never masks a step's last-ranked token (smallest l^2)."""
        return self.arith == "areal"

    def score(self, b, param):
        b = self.at_precision(b)
        return as_f64(b.l * b.l)  # the engine turns per-step sorted l^2 into suffix means
