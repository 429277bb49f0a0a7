"""slime: `--use-tis`, `--tis-clip`, `--tis-clip-low`, `--use-opsm`, `--opsm-delta` flags.

Design
------
`Slime` reads its launcher's argparse flags (a shell script or a command line): TIS with
its clip (CISPO with a low clip; IcePop through slime's own `icepop_function` given as the
custom TIS function) and OPSM's sequence mask with its delta. Slots: one "tis", and
"opsm". Mapped from the commit in `checked`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework


class Slime(Framework):
    name = "slime"
    title = "slime"
    hint = "slime: --use-tis, --tis-clip, --tis-clip-low, --use-opsm, --opsm-delta"
    checked = (
        Checked(
            "THUDM/slime",
            "624b824a898ab0ec1fcb4d373004c7f3852bf515",
            "2026-08-21",
            (
                "slime/utils/arguments.py",
                "slime/backends/megatron_utils/loss.py",
                "slime/utils/ppo_utils.py",
            ),
            "vanilla_tis_function, icepop_function, compute_opsm_mask",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli",)
    ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
    flag_arity = {
        "use_tis": 0,
        "tis_clip": 1,
        "tis_clip_low": 1,
        "custom_tis_function_path": 1,
        "use_opsm": 0,
        "opsm_delta": 1,
        "get_mismatch_metrics": 0,
        "use_rollout_logprobs": 0,
    }
    families = {
        "tis_": ("tis_clip", "tis_clip_low"),
        "use_tis": ("use_tis",),
        "custom_tis_": ("custom_tis_function_path",),
        "opsm_": ("opsm_delta",),
        "use_opsm": ("use_opsm",),
    }
    slots = dict.fromkeys(("tis", "cispo", "icepop", "token-mis"), "tis") | {"opsm": "opsm"}

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        use = self.flag(s, "use_tis", False)
        metrics = self.flag(s, "get_mismatch_metrics", False)
        path = self.raw(s, "custom_tis_function_path", None)
        if use or metrics:
            at = s.origin("use_tis" if use else "get_mismatch_metrics")
            hi = self.num(s, "tis_clip", 2.0, positive=True)
            lo = self.num(s, "tis_clip_low", 0.0)
            band = {"low": "tis_clip_low", "high": "tis_clip"}
            if path is None and not use:
                raise UsageError(
                    f"{at}: --get-mismatch-metrics needs "
                    "--custom-tis-function-path (slime asserts it)."
                )
            if path is None:
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
                band = {"cap": "tis_clip"} if not lo else band
                origin = "--use-tis (vanilla_tis_function)"
            elif path == self.ICEPOP:
                rule, origin = self.make("icepop", low=lo, high=hi), "icepop_function"
            else:
                raise UsageError(
                    f"{at}: --custom-tis-function-path {path}: a custom TIS function is your "
                    f"own code; replay it with --rule SPEC (slime's own {self.ICEPOP} is read)."
                )
            rules.append(ConfigRule(rule, band, origin))
            if self.flag(s, "use_rollout_logprobs", False):
                notes.append("slime: --use-rollout-logprobs and --use-tis cannot be set together.")
        if self.flag(s, "use_opsm", False):
            delta = self.num(s, "opsm_delta", 1e-4, positive=True)
            rules.append(
                ConfigRule(self.make("opsm", delta=delta), {"delta": "opsm_delta"}, "--use-opsm")
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "opsm":
                pairs += [("use_opsm", True), ("opsm_delta", r.delta)]
            elif r.name == "tis":
                pairs += [("use_tis", True), ("tis_clip", r.cap), ("tis_clip_low", 0.0)]
            elif r.name == "cispo":
                pairs += [("use_tis", True), ("tis_clip", r.high), ("tis_clip_low", r.low)]
            elif r.name in ("icepop", "token-mis"):
                pairs += [
                    ("use_tis", True),
                    ("custom_tis_function_path", self.ICEPOP),
                    ("tis_clip", r.high),
                    ("tis_clip_low", r.low),
                ]
            else:
                raise self.cannot(r)
        return pairs, []

    def flag_text(self, key):
        return "--" + key.replace("_", "-")
