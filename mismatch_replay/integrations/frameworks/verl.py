"""verl: `algorithm.rollout_correction.*`, an IS weight and any number of rejection options.

Design
------
`Verl` reads `rollout_is` (token or sequence: tis or seq-tis, truncated at
`rollout_is_threshold`) and `rollout_rs`, a comma-separated list of rejection options with
their thresholds in `rollout_rs_threshold`: the `*_k1` options (`K1`: token-mis, seq-mis,
geo-mis, with verl's own arithmetic for token-mis) and the upper-bounded k2 / k3 options
(`UPPER`); the others of `RS_OPTIONS` (`seq_sum_k2`, ...) have no catalogue rule and are
refused. A "lo_hi" threshold of a `*_k1` option keeps 1/hi <= r <= 1/lo; `write` produces
it back with `reciprocal_text`, exact to the last bit. Slots: one "is", and one per
rejection option. Mapped from the commit in `checked`.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import UsageError
from ..settings import ConfigRule
from .base import Checked, Framework, float_text, reciprocal_text


class Verl(Framework):
    name = "verl"
    title = "verl"
    hint = "verl: algorithm.rollout_correction.*"
    checked = (
        Checked(
            "volcengine/verl",
            "b178a3cd56f58b2d502255daba591e92833930a7",
            "2026-01-29",
            (
                "verl/trainer/config/algorithm.py",
                "verl/trainer/config/algorithm/rollout_correction.yaml",
                "verl/trainer/ppo/rollout_corr_helper.py",
            ),
            "RolloutCorrectionConfig; the YAML defaults (rollout_is: null) apply",
        ),
    )
    SECTION = "algorithm.rollout_correction"
    strict = {
        SECTION: (
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
            "bypass_mode",
            "loss_type",
        )
    }
    K1 = {"token_k1": "token-mis", "seq_sum_k1": "seq-mis", "seq_mean_k1": "geo-mis"}
    UPPER = {
        "token_k2": "token-k2",
        "token_k3": "token-k3",
        "seq_mean_k3": "seq-mean-k3",
        "seq_max_k2": "seq-max-k2",
    }
    RS_OPTIONS = (
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    )
    IS = {"token": "tis", "sequence": "seq-tis"}
    arith = {"token-mis": "verl-k1"}
    slots = {"tis": "is", "seq-tis": "is", "icepop": "token-mis"} | {
        r: r for r in (*K1.values(), *UPPER.values())
    }

    def read(self, s):
        self.check(s)
        k = self.SECTION + "."
        rules: list[ConfigRule] = []
        level = self.choice(s, k + "rollout_is", None, (None, "token", "sequence"))
        if level is not None:
            cap = self.num(s, k + "rollout_is_threshold", 2.0, positive=True)
            rules.append(
                ConfigRule(
                    self.make(self.IS[level], cap=cap),
                    {"cap": k + "rollout_is_threshold"},
                    f"rollout_is={level}",
                )
            )
        rs = self.raw(s, k + "rollout_rs", None)
        if isinstance(rs, str) and rs.strip().lower() in ("null", "none", ""):
            rs = None
        if rs is not None:
            rules += self._read_rs(s, k, str(rs))
        return self.result(s, rules, [])

    def _read_rs(self, s, k, rs: str) -> list[ConfigRule]:
        opts = list(dict.fromkeys(o.strip() for o in rs.split(",") if o.strip()))
        for o in opts:
            if o not in self.RS_OPTIONS:
                raise UsageError(
                    f"{s.origin(k + 'rollout_rs')}: {k}rollout_rs: '{o}' is not a verl rejection "
                    f"option ({', '.join(self.RS_OPTIONS)})."
                )
        spec = self.raw(s, k + "rollout_rs_threshold", None)
        if spec is None:
            raise UsageError(
                f"{s.origin(k + 'rollout_rs')}: {k}rollout_rs is set and rollout_rs_threshold "
                "is not; verl requires one threshold per option."
            )
        specs = (
            [str(spec)]
            if isinstance(spec, int | float)
            else [p.strip() for p in str(spec).split(",") if p.strip()]
        )
        if len(specs) == 1:
            specs = specs * len(opts)
        if len(specs) != len(opts):
            raise UsageError(
                f"{s.origin(k + 'rollout_rs_threshold')}: {k}rollout_rs_threshold has "
                f"{len(specs)} thresholds for {len(opts)} options; give one, or one per option."
            )
        out = []
        for opt, t in zip(opts, specs, strict=True):
            where = f"{s.origin(k + 'rollout_rs_threshold')}: {k}rollout_rs_threshold '{t}'"
            if opt in self.K1:
                try:
                    lo, hi = (float(x) for x in t.split("_", 1)) if "_" in t else (None, float(t))
                    if lo is None:
                        lo = 1.0 / hi
                except (ValueError, ZeroDivisionError):
                    raise UsageError(f"{where}: not a number or 'lower_upper' pair.") from None
                if lo <= 0 or hi <= 0:
                    raise UsageError(f"{where}: verl needs positive bounds.")
                rule = self.make(self.K1[opt], low=1.0 / hi, high=1.0 / lo)
                notes = []
                if "_" in t and not math.isclose(lo * hi, 1.0, rel_tol=1e-12):
                    notes.append(
                        f"verl's {opt} with '{t}' keeps 1/{hi:g} <= r <= 1/{lo:g} (it bounds "
                        f"-log r by [log {lo:g}, log {hi:g}], rollout_corr_helper.py): replayed "
                        f"as {rule.spec()}, as verl computes it."
                    )
                keys = {"low": k + "rollout_rs_threshold", "high": k + "rollout_rs_threshold"}
            elif opt in self.UPPER:
                try:
                    hi = float(t)
                except ValueError:
                    raise UsageError(f"{where}: {opt} takes one upper bound.") from None
                if hi <= 0:
                    raise UsageError(f"{where}: verl needs a positive upper bound.")
                rule = self.make(self.UPPER[opt], hi=hi)
                notes = ["verl clamps log r to ±20 before k2 / k3 (SAFETY_BOUND)."]
                keys = {"hi": k + "rollout_rs_threshold"}
            else:
                raise UsageError(
                    f"{s.origin(k + 'rollout_rs')}: verl's rejection option '{opt}' has no rule "
                    "in the catalogue yet (replayable: "
                    f"{', '.join([*self.K1, *self.UPPER])}); replay a neighbour with --rule."
                )
            out.append(ConfigRule(rule, keys, f"rollout_rs={opt}", notes))
        return out

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        weights = [r for r in rules if r.name in self.IS.values()]
        if len(weights) > 1:
            raise UsageError("verl applies one IS weight (rollout_is); got " + str(len(weights)))
        for r in weights:
            level = "token" if r.name == "tis" else "sequence"
            pairs += [(k + "rollout_is", level), (k + "rollout_is_threshold", r.cap)]
        opts, specs = [], []
        inv = {v: o for o, v in self.K1.items()} | {"icepop": "token_k1"}
        inv_up = {v: o for o, v in self.UPPER.items()}
        for r in rules:
            if r in weights:
                continue
            if r.name in inv:
                if not r.low or r.low <= 0:
                    raise UsageError(
                        f"verl's {inv[r.name]} needs both ratio bounds; {r.spec()} has no lower "
                        "bound (low=0)."
                    )
                opts.append(inv[r.name])
                specs.append(f"{reciprocal_text(r.high)}_{reciprocal_text(r.low)}")
            elif r.name in inv_up:
                opts.append(inv_up[r.name])
                specs.append(float_text(r.hi))
            else:
                raise self.cannot(r)
        notes = []
        if opts:
            pairs += [
                (k + "rollout_rs", ",".join(opts)),
                (k + "rollout_rs_threshold", ",".join(specs)),
            ]
            if any(o.endswith("k1") for o in opts):
                notes.append(
                    "verl's *_k1 'lower_upper' keeps 1/upper <= r <= 1/lower: the "
                    "pair written is (1/high, 1/low) of the rule."
                )
        return pairs, notes
