"""OpenRLHF: `--algo.advantage.is_correction_*` flags.

Design
------
`OpenRLHF` reads the vLLM IS correction of its PolicyLoss (`enable`, `type` tis, icepop or
seq-mask-tis, and a two-number `threshold` LOW HIGH) into one rule. Slot: one "is".
Mapped from the commit in `checked`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework


class OpenRLHF(Framework):
    name = "openrlhf"
    title = "OpenRLHF"
    hint = "OpenRLHF: --algo.advantage.is_correction_*"
    checked = (
        Checked(
            "OpenRLHF/OpenRLHF",
            "3c3be6234e0cb353e76bb8019947db9dfe99fca7",
            "2026-08-13",
            ("openrlhf/cli/train_ppo_ray.py", "openrlhf/models/loss.py"),
            "vLLM IS correction of PolicyLoss (policy_loss_type ppo only)",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli",)
    P = "algo.advantage.is_correction_"
    families = {P: (P + "enable", P + "threshold", P + "type")}
    extra_keys = ("actor.policy_loss_type",)
    flag_arity = {P + "enable": 0, P + "threshold": 2, P + "type": 1, "actor.policy_loss_type": 1}
    slots = dict.fromkeys(("tis", "cispo", "icepop", "token-mis", "geo-mis"), "is")

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        p = self.P
        if self.flag(s, p + "enable", False):
            kind = self.choice(s, p + "type", "tis", ("tis", "icepop", "seq-mask-tis"))
            thr = self.raw(s, p + "threshold", [0.5, 5.0])
            at = s.origin(p + "threshold")
            if not isinstance(thr, list | tuple) or len(thr) != 2:
                raise UsageError(f"{at}: --{p}threshold takes two numbers, LOW HIGH.")
            try:
                lo, hi = (float(x) for x in thr)
            except (TypeError, ValueError):
                raise UsageError(f"{at}: --{p}threshold {thr}: not two numbers.") from None
            band = {"low": p + "threshold", "high": p + "threshold"}
            if kind == "tis":
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
            elif kind == "icepop":
                rule = self.make("icepop", low=lo, high=hi)
            else:
                rule = self.make("geo-mis", low=lo, high=hi)
            rules.append(ConfigRule(rule, band, f"is_correction_type={kind}"))
            if self.choice(s, "actor.policy_loss_type", "ppo", ("ppo", "gspo")) != "ppo":
                notes.append(
                    "OpenRLHF applies the vLLM IS correction only with "
                    "--actor.policy_loss_type ppo."
                )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        p = self.P
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "tis":
                kind, lo, hi = "tis", 0.0, r.cap
            elif r.name == "cispo":
                kind, lo, hi = "tis", r.low, r.high
            elif r.name in ("icepop", "token-mis"):
                kind, lo, hi = "icepop", r.low, r.high
            elif r.name == "geo-mis":
                kind, lo, hi = "seq-mask-tis", r.low, r.high
            else:
                raise self.cannot(r)
            pairs += [(p + "enable", True), (p + "type", kind), (p + "threshold", [lo, hi])]
        return pairs, []
