"""NeMo-RL: `loss_fn.truncated_importance_sampling_*` and `grpo.seq_logprob_error_threshold`.

Design
------
`NeMoRL` reads the truncated importance sampling of `ClippedPGLossConfig` (type tis, icepop
or seq-mask-tis, with its ratio and ratio_min; with `sequence_level_importance_ratios` the
ratios are sequence-level, and icepop becomes a product-ratio band) and GRPO's sequence
log-prob error filter (prob-error). Slots: one "tis", and "prob-error". Mapped from the
commit in `checked`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework


class NeMoRL(Framework):
    name = "nemo-rl"
    title = "NeMo-RL"
    hint = "NeMo-RL: loss_fn.truncated_importance_sampling_*, grpo.seq_logprob_error_threshold"
    checked = (
        Checked(
            "NVIDIA-NeMo/RL",
            "7ea279abfbeb698b092856d0dab61e7cf39bc909",
            "2026-08-22",
            (
                "nemo_rl/algorithms/loss/loss_functions.py",
                "nemo_rl/algorithms/grpo.py",
                "examples/configs/grpo_math_1B.yaml",
            ),
            "ClippedPGLossConfig (extra keys allowed: only the IS keys are checked), "
            "seq_logprob_error_threshold",
        ),
    )
    TIS = (
        "truncated_importance_sampling_type",
        "truncated_importance_sampling_ratio",
        "truncated_importance_sampling_ratio_min",
    )
    families = {
        "loss_fn.truncated_importance_sampling": tuple(f"loss_fn.{k}" for k in TIS),
        "loss_fn.use_importance_sampling": ("loss_fn.use_importance_sampling_correction",),
        "grpo.seq_logprob_error": ("grpo.seq_logprob_error_threshold",),
    }
    extra_keys = ("loss_fn.sequence_level_importance_ratios",)
    slots = dict.fromkeys(
        ("tis", "cispo", "seq-tis", "icepop", "token-mis", "seq-mis", "geo-mis"), "tis"
    ) | {"prob-error": "prob-error"}

    def detect(self, keys):
        return super().detect(keys) or any(k.lstrip("-").startswith("loss_fn.") for k in keys)

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        k = "loss_fn."
        ttype = self.choice(
            s,
            k + "truncated_importance_sampling_type",
            None,
            (None, "tis", "icepop", "seq-mask-tis"),
        )
        ratio = self.num(s, k + "truncated_importance_sampling_ratio", None, none=True)
        rmin = self.num(s, k + "truncated_importance_sampling_ratio_min", None, none=True)
        seq = self.flag(s, k + "sequence_level_importance_ratios", False)
        at = s.origin(k + "truncated_importance_sampling_type")
        if ttype is not None:
            if not self.flag(s, k + "use_importance_sampling_correction", False):
                raise UsageError(
                    f"{at}: {k}truncated_importance_sampling_type = {ttype} needs "
                    f"{k}use_importance_sampling_correction: true (NeMo-RL asserts it)."
                )
            if ratio is None:
                notes.append(
                    f"{k}truncated_importance_sampling_type = {ttype} is ignored: "
                    "NeMo-RL applies it only when truncated_importance_sampling_ratio "
                    "is set."
                )
            else:
                rules.append(self._read_tis(at, k, ttype, ratio, rmin, seq))
        elif ratio is not None:
            notes.append(
                f"{k}truncated_importance_sampling_ratio is set without a type: "
                "NeMo-RL applies no truncation."
            )
        tau = self.num(s, "grpo.seq_logprob_error_threshold", None, none=True, positive=True)
        if tau is not None:
            rules.append(
                ConfigRule(
                    self.make("prob-error", tau=tau),
                    {"tau": "grpo.seq_logprob_error_threshold"},
                    "seq_logprob_error_threshold",
                )
            )
        return self.result(s, rules, notes)

    def _read_tis(self, at, k, ttype, ratio, rmin, seq) -> ConfigRule:
        if ratio <= 0:
            raise UsageError(f"{at}: {k}truncated_importance_sampling_ratio must be positive.")
        if rmin is not None and rmin > ratio:
            raise UsageError(f"{at}: {k}truncated_importance_sampling_ratio_min > ratio.")
        if ttype in ("icepop", "seq-mask-tis") and rmin is None:
            raise UsageError(
                f"{at}: {k}truncated_importance_sampling_type = {ttype} needs "
                f"{k}truncated_importance_sampling_ratio_min (NeMo-RL asserts it)."
            )
        band = {"low": k + self.TIS[2], "high": k + self.TIS[1]}
        origin = f"truncated_importance_sampling_type={ttype}" + (
            " (sequence-level ratios)" if seq else ""
        )
        notes = []
        if ttype == "tis":
            if seq:
                if rmin:
                    raise UsageError(
                        f"{at}: tis on sequence-level ratios with ratio_min {rmin:g}: no "
                        "catalogue rule clips a sequence weight from below."
                    )
                return ConfigRule(self.make("seq-tis", cap=ratio), {"cap": k + self.TIS[1]}, origin)
            if not rmin:
                return ConfigRule(self.make("tis", cap=ratio), {"cap": k + self.TIS[1]}, origin)
            return ConfigRule(self.make("cispo", low=rmin, high=ratio), band, origin)
        if ttype == "icepop":
            if seq:
                notes.append(
                    "with sequence_level_importance_ratios, NeMo-RL's icepop bounds "
                    "the product ratio exp(S_i): replayed as seq-mis."
                )
                return ConfigRule(self.make("seq-mis", low=rmin, high=ratio), band, origin, notes)
            return ConfigRule(self.make("icepop", low=rmin, high=ratio), band, origin)
        if seq:
            raise UsageError(
                f"{at}: seq-mask-tis is incompatible with "
                f"{k}sequence_level_importance_ratios (NeMo-RL asserts it)."
            )
        return ConfigRule(self.make("geo-mis", low=rmin, high=ratio), band, origin)

    def write(self, rules, base):
        k = "loss_fn."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "prob-error":
                pairs.append(("grpo.seq_logprob_error_threshold", r.tau))
                continue
            if r.name == "tis":
                vals = ("tis", r.cap, None, False)
            elif r.name == "cispo":
                vals = ("tis", r.high, r.low, False)
            elif r.name == "seq-tis":
                vals = ("tis", r.cap, None, True)
            elif r.name in ("icepop", "token-mis"):
                vals = ("icepop", r.high, r.low, False)
            elif r.name == "seq-mis":
                vals = ("icepop", r.high, r.low, True)
            elif r.name == "geo-mis":
                vals = ("seq-mask-tis", r.high, r.low, False)
            else:
                raise self.cannot(r)
            pairs += [
                (k + "use_importance_sampling_correction", True),
                (k + self.TIS[0], vals[0]),
                (k + self.TIS[1], vals[1]),
                (k + self.TIS[2], vals[2]),
                (k + "sequence_level_importance_ratios", vals[3]),
            ]
        return pairs, []
