"""AReaL: `actor.rejection_sampling` (one block a config) and M2PO's `actor.m2_threshold`.

Design
------
`AReaL` reads the rejection-sampling block (`level` token or sequence, `action` mask or
clamp, `metric` ratio or a KL estimator, `agg`, `upper`, `lower`) into one catalogue rule
with AReaL's own arithmetic: its `kl_k1` bounds apply to log r (replayed as the ratio band
exp(lower) .. exp(upper)); its `kl_k3`, which is q/p - 1 - log(q/p), has no catalogue rule
and is refused. `m2_threshold` is m2po's tau. Slots: "rejection" and "m2po". Mapped from
the commit in `checked`.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework, low_bound


class AReaL(Framework):
    name = "areal"
    title = "AReaL"
    hint = "AReaL: actor.rejection_sampling.*, actor.m2_threshold"
    checked = (
        Checked(
            "inclusionAI/AReaL",
            "4aef98d8d818af55b43621aaadba047ae10f4e77",
            "2026-05-21",
            (
                "areal/api/cli_args.py",
                "areal/utils/functional/functional.py",
                "areal/utils/data.py",
                "areal/trainer/ppo/actor.py",
            ),
            "RejectionSamplingConfig, apply_rejection_sampling, KLEstimator, M2PO",
        ),
    )
    syntaxes = ("yaml", "hydra")
    SECTION = "actor.rejection_sampling"
    strict = {SECTION: ("level", "action", "metric", "agg", "upper", "lower")}
    extra_keys = ("actor.m2_threshold", "actor.use_decoupled_loss")
    slots = {"m2po": "m2po"} | dict.fromkeys(
        ("icepop", "token-mis", "tis", "cispo", "geo-mis", "seq-mis", "token-k2", "seq-max-k2"),
        "rejection",
    )

    def detect(self, keys):
        bare = {k.lstrip("-") for k in keys}
        return any(k == self.SECTION or k.startswith(self.SECTION + ".") for k in bare) or (
            "actor.m2_threshold" in bare
        )

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        k = self.SECTION + "."
        present = s.has(self.SECTION) and s.get(self.SECTION, {}) is not None
        if present:
            rules.append(self._read_rs(s, k))
            if not self.flag(s, "actor.use_decoupled_loss", False):
                notes.append(
                    "AReaL applies actor.rejection_sampling only with actor.use_decoupled_loss: "
                    "true (its default is false)."
                )
        tau = self.num(s, "actor.m2_threshold", None, none=True, positive=True)
        if tau is not None:
            rules.append(
                ConfigRule(
                    self.make("m2po", tau=tau), {"tau": "actor.m2_threshold"}, "m2_threshold"
                )
            )
        return self.result(s, rules, notes)

    def _read_rs(self, s, k) -> ConfigRule:
        level = self.choice(s, k + "level", "token", ("token", "sequence"))
        action = self.choice(s, k + "action", "mask", ("mask", "clamp"))
        metric = self.choice(s, k + "metric", "ratio", ("ratio", "kl_k1", "kl_k2", "kl_k3"))
        agg = self.choice(s, k + "agg", "mean", ("sum", "mean", "max"))
        upper = self.num(s, k + "upper", 5.0)
        lower = self.num(s, k + "lower", None, none=True)
        at = s.origin(k + "upper")
        if lower is not None and lower > upper:
            raise UsageError(f"{at}: {k}lower ({lower:g}) > upper ({upper:g}); AReaL rejects it.")
        if metric == "ratio" and upper <= 1.0:
            raise UsageError(f"{at}: {k}upper = {upper:g}: AReaL needs upper > 1 for 'ratio'.")
        if metric == "ratio" and lower is not None and lower <= 0:
            raise UsageError(f"{at}: {k}lower = {lower:g}: AReaL needs lower > 0 for 'ratio'.")
        if metric in ("kl_k2", "kl_k3") and upper <= 0:
            raise UsageError(f"{at}: {k}upper = {upper:g}: AReaL needs upper > 0 for {metric}.")
        if action == "clamp" and metric != "ratio":
            raise UsageError(f"{at}: {k}action = clamp: AReaL clamps only metric 'ratio'.")
        origin = f"rejection_sampling level={level} action={action} metric={metric}" + (
            f" agg={agg}" if level == "sequence" else ""
        )
        band = {"low": k + "lower", "high": k + "upper"}
        notes: list[str] = []
        rule = None
        if metric == "kl_k3":
            raise UsageError(
                f"{at}: {k}metric = kl_k3: AReaL's k3 is q/p - 1 - log(q/p) (KLEstimator with "
                "the ratio inverted), not the catalogue's token-k3 (r - 1 - log r); no rule "
                "replays it yet. Use metric ratio or kl_k2, or replay token-k3 with --rule."
            )
        if metric == "kl_k1":  # bounds on log r: the ratio band exp(lower) .. exp(upper)
            lo = 0.0 if lower is None else math.exp(lower)
            hi = math.exp(upper)
            notes.append(
                f"AReaL's kl_k1 bounds log r: replayed as the ratio band [{lo:g}, {hi:g}]."
            )
            metric, lower, upper = "ratio", lo, hi
        if metric == "ratio":
            if level == "token" and action == "mask":
                rule = self.make("icepop", low=low_bound(lower), high=upper)
            elif level == "token":
                rule = (
                    self.make("tis", cap=upper)
                    if not lower
                    else self.make("cispo", low=lower, high=upper)
                )
                band = {"cap": k + "upper"} if not lower else band
            elif action == "mask" and agg in ("mean", "sum"):
                rule = self.make(
                    "geo-mis" if agg == "mean" else "seq-mis", low=low_bound(lower), high=upper
                )
        elif metric == "kl_k2" and action == "mask" and lower is None:
            if level == "token":
                rule = self.make("token-k2", hi=upper)
            elif agg == "max":
                rule = self.make("seq-max-k2", hi=upper)
            band = {"hi": k + "upper"}
        if rule is None:
            raise UsageError(
                f"{at}: AReaL's {origin} has no rule in the catalogue yet (replayable: token "
                "ratio mask/clamp, sequence ratio mask with agg mean or sum, kl_k1 at the same "
                "levels, kl_k2 token mask or sequence max)."
            )
        notes.append(
            "AReaL compares the proximal (recomputed) and behaviour (inference) "
            "log-probs in float32; map the recomputed column as trainer_logprob."
        )
        return ConfigRule(rule, band, origin, notes)

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "m2po":
                pairs.append(("actor.m2_threshold", r.tau))
                continue
            if r.name in ("icepop", "token-mis"):
                vals = ("token", "mask", "ratio", "mean", r.high, r.low or None)
            elif r.name == "tis":
                vals = ("token", "clamp", "ratio", "mean", r.cap, None)
            elif r.name == "cispo":
                vals = ("token", "clamp", "ratio", "mean", r.high, r.low or None)
            elif r.name in ("geo-mis", "seq-mis"):
                agg = "mean" if r.name == "geo-mis" else "sum"
                vals = ("sequence", "mask", "ratio", agg, r.high, r.low or None)
            elif r.name == "token-k2":
                vals = ("token", "mask", "kl_k2", "mean", r.hi, None)
            elif r.name == "seq-max-k2":
                vals = ("sequence", "mask", "kl_k2", "max", r.hi, None)
            else:
                raise self.cannot(r)
            if vals[2] == "ratio" and vals[4] <= 1.0:
                raise UsageError(
                    f"AReaL needs upper > 1 for metric 'ratio'; {r.spec()} has {vals[4]:g}."
                )
            names = ("level", "action", "metric", "agg", "upper", "lower")
            pairs += [(k + n, v) for n, v in zip(names, vals, strict=True)]
        return pairs, []
