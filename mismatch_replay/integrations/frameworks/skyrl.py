"""SkyRL: `trainer.algorithm.off_policy_correction.*` (and the deprecated `use_tis` keys).

Design
------
`SkyRL` reads the off-policy correction block: the TIS ratio type with its clip (tis or
seq-tis), the sequence mask (geometric: geo-mis, product: seq-mis, with its bounds), the
outlier-token veto and the token mask (token-mis); the deprecated
`trainer.algorithm.use_tis` / `tis_imp_ratio_cap` are migrated as SkyRL does. Slots: the
weight, the sequence mask, the veto, the token mask. Mapped from the commit in `checked`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework


class SkyRL(Framework):
    name = "skyrl"
    title = "SkyRL"
    hint = "SkyRL: trainer.algorithm.off_policy_correction.*"
    checked = (
        Checked(
            "NovaSky-AI/SkyRL",
            "a9564572eb8e91076be43c1bd5e4615e3de17265",
            "2026-08-21",
            (
                "skyrl/train/config/config.py",
                "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py",
                "skyrl/train/utils/utils.py",
            ),
            "OffPolicyCorrectionConfig; the deprecated trainer.algorithm.use_tis is migrated",
        ),
    )
    SECTION = "trainer.algorithm.off_policy_correction"
    strict = {
        SECTION: (
            "tis_ratio_type",
            "token_tis_ratio_clip_high",
            "sequence_tis_ratio_clip_high",
            "sequence_mask_metric",
            "geo_mask_high",
            "geo_mask_low",
            "product_mask_high",
            "product_mask_low",
            "outlier_token_is_threshold_low",
            "outlier_token_is_threshold_high",
            "token_mask_is_threshold_low",
            "token_mask_is_threshold_high",
        )
    }
    extra_keys = ("trainer.algorithm.use_tis", "trainer.algorithm.tis_imp_ratio_cap")
    slots = {
        "tis": "tis",
        "seq-tis": "tis",
        "geo-mis": "seqmask",
        "seq-mis": "seqmask",
        "veto": "veto",
        "token-mis": "tokenmask",
        "icepop": "tokenmask",
    }

    def read(self, s):
        self.check(s)
        k = self.SECTION + "."
        rules: list[ConfigRule] = []
        notes: list[str] = []
        ttype = self.choice(s, k + "tis_ratio_type", None, (None, "token", "sequence"))
        cap_key = k + ("token" if ttype == "token" else "sequence") + "_tis_ratio_clip_high"
        cap = None
        if self.flag(s, "trainer.algorithm.use_tis", False):
            cap_key = "trainer.algorithm.tis_imp_ratio_cap"
            ttype, cap = "token", self.num(s, cap_key, -1.0, positive=True)
            notes.append(
                "trainer.algorithm.use_tis is deprecated: SkyRL turns it into "
                "tis_ratio_type=token with token_tis_ratio_clip_high = tis_imp_ratio_cap."
            )
        if ttype == "token":
            cap = cap if cap is not None else self.num(s, cap_key, 2.0, positive=True)
            rules.append(
                ConfigRule(self.make("tis", cap=cap), {"cap": cap_key}, "tis_ratio_type=token")
            )
        elif ttype == "sequence":
            cap = self.num(s, cap_key, 5.0, positive=True)
            rules.append(
                ConfigRule(
                    self.make("seq-tis", cap=cap), {"cap": cap_key}, "tis_ratio_type=sequence"
                )
            )
        metric = self.choice(s, k + "sequence_mask_metric", None, (None, "geometric", "product"))
        if metric is not None:
            pre, name, dlo, dhi = (
                ("geo", "geo-mis", 0.99, 1.01)
                if metric == "geometric"
                else ("product", "seq-mis", 0.5, 2.0)
            )
            lo = self.num(s, f"{k}{pre}_mask_low", dlo)
            hi = self.num(s, f"{k}{pre}_mask_high", dhi, positive=True)
            rules.append(
                ConfigRule(
                    self.make(name, low=lo, high=hi),
                    {"low": f"{k}{pre}_mask_low", "high": f"{k}{pre}_mask_high"},
                    f"sequence_mask_metric={metric}",
                )
            )
        v = self.num(s, k + "outlier_token_is_threshold_low", None, none=True, positive=True)
        if v is not None:
            rules.append(
                ConfigRule(
                    self.make("veto", v=v),
                    {"v": k + "outlier_token_is_threshold_low"},
                    "outlier_token_is_threshold_low",
                )
            )
        if self.num(s, k + "outlier_token_is_threshold_high", None, none=True) is not None:
            raise UsageError(
                f"{s.origin(k + 'outlier_token_is_threshold_high')}: "
                f"{k}outlier_token_is_threshold_high (mask a sequence when any token's ratio is "
                "above it) has no rule in the catalogue yet; replay veto or seq-max-k2 with --rule."
            )
        tlo = self.num(s, k + "token_mask_is_threshold_low", None, none=True)
        thi = self.num(s, k + "token_mask_is_threshold_high", None, none=True)
        if tlo is not None and thi is not None:
            rules.append(
                ConfigRule(
                    self.make("token-mis", low=tlo, high=thi),
                    {
                        "low": k + "token_mask_is_threshold_low",
                        "high": k + "token_mask_is_threshold_high",
                    },
                    "token_mask_is_threshold_*",
                )
            )
        elif tlo is not None or thi is not None:
            notes.append(
                "SkyRL applies token_mask_is_threshold_low/high only when both are set: "
                "the one given is ignored."
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "tis":
                pairs += [(k + "tis_ratio_type", "token"), (k + "token_tis_ratio_clip_high", r.cap)]
            elif r.name == "seq-tis":
                pairs += [
                    (k + "tis_ratio_type", "sequence"),
                    (k + "sequence_tis_ratio_clip_high", r.cap),
                ]
            elif r.name in ("geo-mis", "seq-mis"):
                metric, pre = (
                    ("geometric", "geo") if r.name == "geo-mis" else ("product", "product")
                )
                pairs += [
                    (k + "sequence_mask_metric", metric),
                    (f"{k}{pre}_mask_low", r.low),
                    (f"{k}{pre}_mask_high", r.high),
                ]
            elif r.name == "veto":
                pairs.append((k + "outlier_token_is_threshold_low", r.v))
            elif r.name in ("token-mis", "icepop"):
                pairs += [
                    (k + "token_mask_is_threshold_low", r.low),
                    (k + "token_mask_is_threshold_high", r.high),
                ]
            else:
                raise self.cannot(r)
        return pairs, []
