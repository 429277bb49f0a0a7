"""TRL: `vllm_importance_sampling_*` and `off_policy_mask_threshold` (GRPOConfig).

Design
------
`TRL` reads the vLLM importance-sampling correction (`vllm_importance_sampling_mode`: token
or sequence, truncate or mask, between `clip_min` and `clip_max`; the deprecated `cap`
is read as `clip_max`, as TRL does) and the off-policy sequence mask (opsm, its delta),
from a YAML config or `--flag` arguments. Slots: one "is" correction, and "opsm". Mapped
from the commit in `checked`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework, low_bound


class TRL(Framework):
    name = "trl"
    title = "TRL"
    hint = "TRL: vllm_importance_sampling_*, off_policy_mask_threshold (GRPOConfig)"
    checked = (
        Checked(
            "huggingface/trl",
            "f2cd57710ae345ea6428ae95363267fcf38a3dc8",
            "2026-07-24",
            ("trl/trainer/grpo_config.py", "trl/trainer/grpo_trainer.py"),
            "GRPOConfig fields; the field default mode is sequence_mask (its docstring says "
            "token_truncate: the code wins)",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli", "yaml")
    KEYS = (
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_cap",
    )
    families = {
        "vllm_importance_sampling_": KEYS,
        "off_policy_mask": ("off_policy_mask_threshold",),
    }
    extra_keys = ("use_vllm",)
    flag_arity = {"off_policy_mask_threshold": 1}
    MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    slots = dict.fromkeys(("token-mis", "icepop", "seq-mis", "tis", "cispo", "seq-tis"), "is") | {
        "opsm": "opsm"
    }

    def owns_flag(self, key):
        return key == "use_vllm" or super().owns_flag(key)

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        p = "vllm_importance_sampling_"
        if self.flag(s, p + "correction", True):
            mode = self.choice(s, p + "mode", "sequence_mask", self.MODES)
            hi = self.num(s, p + "clip_max", 3.0, none=True, positive=True)
            cap = self.num(s, p + "cap", None, none=True, positive=True)
            hi_key = p + "clip_max"
            if cap is not None:
                hi, hi_key = cap, p + "cap"
                notes.append(f"{p}cap is deprecated; TRL copies it into {p}clip_max.")
            lo = self.num(s, p + "clip_min", None, none=True)
            at = s.origin(p + "mode")
            if hi is None:
                raise UsageError(
                    f"{at}: {p}clip_max is null (no upper bound): no catalogue rule replays a "
                    "band open above; set clip_max."
                )
            if lo is not None and lo > hi:
                raise UsageError(f"{at}: {p}clip_min ({lo:g}) > clip_max ({hi:g}).")
            band = {"low": p + "clip_min", "high": hi_key}
            if mode == "token_mask":
                rule = self.make("token-mis", low=low_bound(lo), high=hi)
            elif mode == "sequence_mask":
                rule = self.make("seq-mis", low=low_bound(lo), high=hi)
            elif mode == "token_truncate":
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
                band = {"cap": hi_key} if not lo else band
            else:
                if lo:
                    raise UsageError(
                        f"{at}: sequence_truncate with clip_min {lo:g}: no catalogue rule "
                        "clips a sequence weight from below; replay seq-tis with --rule."
                    )
                rule, band = self.make("seq-tis", cap=hi), {"cap": hi_key}
            rules.append(ConfigRule(rule, band, f"{p}mode={mode}"))
            if not self.flag(s, "use_vllm", False):
                notes.append(
                    "TRL computes the vLLM importance-sampling correction only with use_vllm: true."
                )
        delta = self.num(s, "off_policy_mask_threshold", None, none=True, positive=True)
        if delta is not None:
            rules.append(
                ConfigRule(
                    self.make("opsm", delta=delta),
                    {"delta": "off_policy_mask_threshold"},
                    "off_policy_mask_threshold",
                )
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        p = "vllm_importance_sampling_"
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "opsm":
                pairs.append(("off_policy_mask_threshold", r.delta))
                continue
            if r.name in ("token-mis", "icepop"):
                mode, lo, hi = "token_mask", r.low, r.high
            elif r.name == "seq-mis":
                mode, lo, hi = "sequence_mask", r.low, r.high
            elif r.name == "tis":
                mode, lo, hi = "token_truncate", 0.0, r.cap
            elif r.name == "cispo":
                mode, lo, hi = "token_truncate", r.low, r.high
            elif r.name == "seq-tis":
                mode, lo, hi = "sequence_truncate", 0.0, r.cap
            else:
                raise self.cannot(r)
            pairs += [
                (p + "correction", True),
                (p + "mode", mode),
                (p + "clip_min", float(lo)),
                (p + "clip_max", hi),
            ]
        return pairs, []
