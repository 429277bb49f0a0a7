"""prime-rl: the `[trainer.loss]` table (or `[loss]` in a trainer TOML), one loss a config.

Design
------
`PrimeRL` reads the loss `type` (default, ipo, kpop, custom) and the keys that type may hold
(`TYPES`): the default loss's DPPO mask (`dppo_mask_low` / `dppo_mask_high`) and IcePop band
(`icepop_ratio_low` / `_high`), `ipo_threshold`, `kpop_threshold` (KPop with prime-rl's
probability clamp, KPOP_CLAMP = 1e-6). Every rule it can express (ipo, dppo-tv, kpop,
icepop, token-mis) is in the one "loss" slot; `write` gives that table's keys for one rule,
emitted as TOML or command-line flags. Mapped from the commits in `checked`.
"""

from __future__ import annotations

import math
from typing import ClassVar

from ...errors import UsageError
from ...rules import REGISTRY
from ..settings import ConfigRule, TrainerConfig
from .base import Checked, Framework


class PrimeRL(Framework):
    name = "prime-rl"
    title = "prime-rl"
    hint = "prime-rl: [trainer.loss] (or [loss] in a trainer TOML)"
    checked = (
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "559b44772e471d1538537b8805cc77f3824a5e64",
            "2026-08-21",
            (
                "packages/prime-rl-configs/src/prime_rl/configs/trainer.py",
                "src/prime_rl/trainer/rl/loss.py",
            ),
            "main: DefaultLossConfig (DPPO), IPOLossConfig",
        ),
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "489621ac422b13124533e35b7d4fb1d4d973c47d",
            "2026-08-16",
            (
                "packages/prime-rl-configs/src/prime_rl/configs/trainer.py",
                "src/prime_rl/trainer/rl/loss.py",
            ),
            "branch feat/kpop-loss: KPopLossConfig (clamp 1e-6 in kpop_loss_fn)",
        ),
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "db604193b42c14232fd0bb13b74a3e67a72b6f81",
            "2026-05-02",
            ("src/prime_rl/configs/trainer.py", "src/prime_rl/trainer/rl/loss.py"),
            "unmerged commit: the IcePop default loss (icepop_ratio_low / icepop_ratio_high)",
        ),
    )
    token_style = "flags"
    syntaxes = ("toml", "cli")
    TYPES: ClassVar[dict[str, tuple[str, ...]]] = {
        "default": (
            "type",
            "dppo_mask_low",
            "dppo_mask_high",
            "icepop_ratio_low",
            "icepop_ratio_high",
            "adv_tau",
            "kl_tau",
        ),
        "ipo": ("type", "ipo_threshold", "adv_tau", "kl_tau"),
        "kpop": ("type", "kpop_threshold", "adv_tau", "kl_tau"),
        "custom": ("type", "import_path", "kwargs"),
    }
    strict = {"trainer.loss": tuple(dict.fromkeys(k for v in TYPES.values() for k in v))}
    slots = dict.fromkeys(("ipo", "dppo-tv", "kpop", "icepop", "token-mis"), "loss")
    KPOP_CLAMP = 1e-6  # prime-rl's kpop_loss_fn clamps probabilities to [1e-6, 1 - 1e-6]

    @staticmethod
    def section(keys) -> str:
        keys = list(keys)
        if any(k == "trainer.loss" or k.startswith("trainer.loss.") for k in keys):
            return "trainer.loss"
        if any(k.startswith("loss.") for k in keys):
            return "loss"
        return "trainer.loss"

    def detect(self, keys):
        bare = {k.lstrip("-") for k in keys}
        return any(k.startswith("trainer.loss.") for k in bare) or (
            "loss.type" in bare and not any(k.startswith("loss_fn") for k in bare)
        )

    def owns_flag(self, key):
        return key.startswith(("trainer.loss.", "loss."))

    def read(self, s):
        sec = self.section(s)
        vals = s.under(sec)
        kind = self.choice(s, f"{sec}.type", "default", tuple(self.TYPES))
        known = self.TYPES[kind]
        for rel in vals:
            if rel.split(".")[0] not in known:
                self.reject_unknown(s, f"{sec}.{rel}", f"{sec}.", known, f"[{sec}] type = '{kind}'")
        notes: list[str] = []
        k = f"{sec}."
        if kind == "custom":
            raise UsageError(
                f"{s.origin(k + 'type')}: [{sec}] type = 'custom' ({vals.get('import_path')}): "
                "a custom loss is your own code; replay it with --rule SPEC instead."
            )
        if kind == "ipo":
            if f"{k}ipo_threshold" in s:
                eps = self.num(s, f"{k}ipo_threshold", None, positive=True)
            else:
                eps = REGISTRY["ipo"].presets["prime-rl"]["eps"]
                notes.append(
                    f"{k}ipo_threshold not set: using prime-rl's default as the catalogue has "
                    f"it (ipo@prime-rl, eps={eps:g}); prime-rl's code had 0.1 at 559b447 "
                    "(2026-08-21). Set it in the config to be sure."
                )
            rule = ConfigRule(self.make("ipo", eps=eps), {"eps": f"{k}ipo_threshold"}, "type=ipo")
        elif kind == "kpop":
            phi = self.num(s, f"{k}kpop_threshold", 0.1, positive=True)
            rule = ConfigRule(
                self.make("kpop", phi=phi, clamp=self.KPOP_CLAMP),
                {"phi": f"{k}kpop_threshold"},
                "type=kpop",
                ["prime-rl's kpop_loss_fn clamps probabilities to [1e-6, 1 - 1e-6] (clamp=1e-06)."],
            )
        elif any(f"{k}icepop_ratio_{side}" in s for side in ("low", "high")):
            if any(f"{k}dppo_mask_{side}" in s for side in ("low", "high")):
                raise UsageError(
                    f"{s.origin(k + 'icepop_ratio_low')}: [{sec}] sets both icepop_ratio_* and "
                    "dppo_mask_*: one prime-rl version has one or the other as its default loss. "
                    "Keep the keys of the version you run."
                )
            low = self.num(s, f"{k}icepop_ratio_low", 0.2)
            high = self.num(s, f"{k}icepop_ratio_high", 5.0, positive=True)
            rule = ConfigRule(
                self.make("icepop", low=low, high=high),
                {"low": f"{k}icepop_ratio_low", "high": f"{k}icepop_ratio_high"},
                "type=default (IcePop)",
                [
                    "icepop_ratio_* are the IcePop default loss of prime-rl commit db60419 (not on "
                    "main at 559b447, where the default loss is DPPO)."
                ],
            )
        else:
            low = self.num(s, f"{k}dppo_mask_low", 0.2)
            high = self.num(s, f"{k}dppo_mask_high", 0.2)
            rule = ConfigRule(
                self.make("dppo-tv", low=low, high=high),
                {"low": f"{k}dppo_mask_low", "high": f"{k}dppo_mask_high"},
                "type=default (DPPO)",
                [
                    "prime-rl's default loss masks by the advantage sign (A == 0 on the low side): "
                    "the log needs an advantage column."
                ],
            )
        mine = {key: v for key, v in s.items() if key == sec or key.startswith(k)}
        return TrainerConfig(self.name, [], [rule], mine, notes)

    def write(self, rules, base):
        if len(rules) != 1:
            raise UsageError(
                f"prime-rl's [trainer.loss] selects one loss; got {len(rules)} rules "
                f"({', '.join(r.spec() for r in rules)})."
            )
        r = rules[0]
        sec = self.section(base)
        notes = []
        if r.name == "ipo":
            pairs = [("type", "ipo"), ("ipo_threshold", r.eps)]
        elif r.name == "dppo-tv":
            pairs = [("type", "default"), ("dppo_mask_low", r.low), ("dppo_mask_high", r.high)]
        elif r.name == "kpop":
            if not math.isclose(r.clamp, self.KPOP_CLAMP, rel_tol=1e-9):
                raise UsageError(
                    f"prime-rl's KPop clamps probabilities at 1e-06; {r.spec()} uses "
                    f"clamp={r.clamp:g}, which no prime-rl key sets."
                )
            pairs = [("type", "kpop"), ("kpop_threshold", r.phi)]
        elif r.name in ("icepop", "token-mis"):
            pairs = [
                ("type", "default"),
                ("icepop_ratio_low", r.low),
                ("icepop_ratio_high", r.high),
            ]
            notes.append(
                "icepop_ratio_* exist only in prime-rl versions whose default loss is "
                "IcePop (commit db60419); on main (559b447) the default loss is DPPO."
            )
        else:
            raise self.cannot(r)
        return [(f"{sec}.{k}", v) for k, v in pairs], notes

    def flag_text(self, key):
        return "--" + key.replace("_", "-")
