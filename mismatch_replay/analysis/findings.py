"""What this log says: the few sentences, with numbers, that open the report and end `demo`.

Design
------
`findings(data, decisions, ...)` turns the report's result objects into a `Findings`: a
short list (3 to 6) of `Finding`s, each ONE sentence and the numbers it quotes. It reads
result objects only, never rendered text:

* the mismatch level and its trend: the k3 token mean over the log (`FigureData.metrics`),
  and the plain k3 mean of the first and last steps (drift's `StepRow`s);
* what the headline presets mask: IPO at prime-rl's eps 0.3 and IcePop at prime-rl's
  [0.2, 5] (the settings table of the report, i.e. `FigureData.steps` summed over steps, else
  the Decision's `compare`, else an exact point of the sweep), and the log's own framework:
  the `--from-config` settings (what the run used), or the presets named after the framework
  its format tells (`Summary.format`: prime-rl, nemo-rl, skyrl, slime);
* the threshold `choose` picked for the target, with its bootstrap interval (`Choice`);
* the drift verdict: the drift steps against the baseline, and whether the headline rules'
  masked fractions followed (`DriftResult`, its `RuleVerdict`s);
* what a mask costs the gradient (`FigureData.mask_cost`, analysis/mask_cost.py): the share
  of the advantage mass IPO at prime-rl's eps removes, how many of its masked updates were
  corrective, against DPPO's (which masks divergent ones only), and their entropy.

Each finder is a function `(Context) -> Finding | None` (None: nothing to say, e.g. a
framework with no preset the log can count); `FINDERS` lists them in reading order. Later
findings slot in the same way: diagnose's result or the mask cost become a field of
`Context` (None where not computed) and a finder appended to `FINDERS`; the callers (the
report, the CLI) render whatever list comes back and need no change.

A `Number` is a value at full precision (what `to_dict()`, the JSON, carries), its name and
the text the sentence shows: 3 significant digits (`fmt`), percentages of tokens with 3
(`pct`), counts in full with thousands separators. `Finding` refuses a sentence with no
number, and one that does not show each of its numbers' texts: a template that drifts from
its numbers fails when it is built, in every test that builds one. The sentences are plain
text (the report escapes them; the terminal prints them without markup).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import polars as pl

from ..rules import REGISTRY, Rule, parse_rule
from .choose import Choice
from .decisions import Decisions
from .diagnose import DiagnoseResult
from .drift import DriftResult, RuleVerdict
from .figure_data import FigureData

HEADLINE = ("ipo@prime-rl", "icepop@prime-rl")  # the two presets every log is read at
MAX_CHOICES = 2  # choose's rows quoted: the first threshold of the first two rules
MAX_OWN = 3  # --from-config settings quoted
# a log format that tells its framework: format -> the framework's preset name
FORMAT_FRAMEWORK = {
    "prime-rl": "prime-rl",
    "prime-rl-traces": "prime-rl",
    "nemo-rl": "nemo-rl",
    "skyrl": "skyrl",
    "slime": "slime",
}


# ----------------------------------------------------------------------------- numbers


def fmt(v: float, digits: int = 3) -> str:
    """A value for reading: `digits` significant digits (0 as "0")."""
    if v == 0:
        return "0"
    return f"{v:.{digits}g}"


def pct(f: float) -> str:
    """A fraction of tokens as a percentage, 3 significant digits."""
    return "0%" if f == 0 else f"{100 * f:.3g}%"


def count(n: int) -> str:
    return f"{n:,}"


@dataclass(frozen=True)
class Number:
    """One number a sentence quotes: its name, its value (full precision) and its text."""

    name: str
    value: float | int
    text: str


@dataclass(frozen=True)
class Finding:
    """One sentence and the numbers it quotes (at least one, each shown in the sentence)."""

    key: str  # which finder: mismatch, headline, framework, choose, drift, ...
    sentence: str
    numbers: tuple[Number, ...]

    def __post_init__(self):
        if not self.numbers:
            raise ValueError(f"finding {self.key}: a sentence with no number: {self.sentence!r}")
        missing = [n.text for n in self.numbers if n.text not in self.sentence]
        if missing:
            raise ValueError(
                f"finding {self.key}: the sentence does not show {missing}: {self.sentence!r}"
            )

    def value(self, name: str) -> float | int:
        return next(n.value for n in self.numbers if n.name == name)

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "sentence": self.sentence,
            "numbers": {n.name: n.value for n in self.numbers},
        }


@dataclass
class Findings(Sequence):
    """The findings in reading order (a sequence of `Finding`)."""

    items: list[Finding] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.items)

    def get(self, key: str) -> Finding | None:
        return next((f for f in self.items if f.key == key), None)

    @property
    def sentences(self) -> list[str]:
        return [f.sentence for f in self.items]

    def to_dict(self) -> list[dict]:
        return [f.to_dict() for f in self.items]


class _Sentence:
    """A sentence assembled with its numbers: `num(...)` returns the text to place and
    records the number."""

    def __init__(self) -> None:
        self.numbers: list[Number] = []

    def num(self, name: str, value, text: str) -> str:
        self.numbers.append(Number(name, value, text))
        return text

    def g(self, name: str, value: float, digits: int = 3) -> str:
        return self.num(name, float(value), fmt(float(value), digits))

    def pct(self, name: str, value: float) -> str:
        return self.num(name, float(value), pct(float(value)))

    def count(self, name: str, value: int) -> str:
        return self.num(name, int(value), count(int(value)))

    def done(self, key: str, text: str) -> Finding:
        return Finding(key, text, tuple(self.numbers))


# ----------------------------------------------------------------------------- context


@dataclass
class Context:
    """What the finders read. `framework`: the log's framework and where that was learnt
    ("config" or "format"); `own_specs`: the --from-config settings."""

    data: FigureData
    decisions: Decisions
    framework: str | None = None
    framework_from: str | None = None
    own_specs: tuple[str, ...] = ()
    diagnosis: DiagnoseResult | None = None  # analysis.diagnose's findings, where computed
    # later: mask_cost: ... | None = None


@dataclass(frozen=True)
class Masked:
    """A setting's masked (weight rules: truncated) tokens over the whole log, exactly."""

    tokens: int
    hit: int
    kind: str  # "mask" or "weight"

    @property
    def fraction(self) -> float:
        return self.hit / self.tokens if self.tokens else math.nan


def _summed(table: pl.DataFrame | None, spec: str) -> Masked | None:
    """A per-group sweep table (by step, by length bucket) summed over its groups for one
    setting: counts add over groups."""
    if table is None or table.height == 0 or "spec" not in table.columns:
        return None
    t = table.filter(pl.col("spec") == spec)
    if t.height == 0:
        return None
    kind = t["kind"][0]
    hit = "truncated_tokens" if kind == "weight" else "masked_tokens"
    return Masked(int(t["tokens"].sum()), int(t[hit].sum()), kind)


def _on_sweep(table: pl.DataFrame, rule: Rule) -> Masked | None:
    """The setting as a point of the full sweep, where one of its grid values is the
    setting's value (to 1e-12, relative)."""
    if table.height == 0 or not _complete(rule):
        return None
    for p in (q.name for q in rule.params if q.threshold):
        v = float(getattr(rule, p))
        rows = table.filter(
            pl.col("rule") == rule.name,
            pl.col("setting") == rule.setting(p),
            pl.col("param") == p,
        )
        for r in rows.iter_rows(named=True):
            if math.isclose(r["value"], v, rel_tol=1e-12, abs_tol=0.0):
                kind = r["kind"]
                hit = r["truncated_tokens" if kind == "weight" else "masked_tokens"]
                return Masked(int(r["tokens"]), int(hit), kind)
    return None


def masked(ctx: Context, rule: Rule) -> Masked | None:
    """What `rule` masks over the whole log, from the first result that holds it exactly:
    the chosen settings per step, the Decision's compare, the by-length table, the sweep."""
    spec = rule.spec()
    got = _summed(ctx.data.steps, spec)
    if got is not None:
        return got
    c = getattr(ctx.decisions, "compare", None)  # None: the rules given have no pair
    for side, n in ((c.rule_a, c.masked_a), (c.rule_b, c.masked_b)) if c is not None else ():
        if side == spec:
            return Masked(int(c.tokens), int(n), "mask")
    got = _summed(ctx.data.by_length, spec)
    if got is not None:
        return got
    got = _preset_point(ctx.data, rule)
    if got is not None:
        return got
    return _on_sweep(ctx.data.sweep, rule)


def _preset_point(data: FigureData, rule: Rule) -> Masked | None:
    """The setting among the report's exact one-value rows (`FigureData.presets`: spec ->
    fraction of the whole log; every catalogue preset in its stable, float64 form), under
    its own spec or that stable form's."""
    fractions = getattr(data, "presets", None) or {}
    cls = REGISTRY.get(rule.name)
    keys = [rule.spec()]
    if cls is not None and _complete(rule):
        values = {p.name: getattr(rule, p.name) for p in rule.params}
        with contextlib.suppress(Exception):  # a setting the stable form cannot hold
            keys.append(cls(**values).spec())
    for key in keys:
        f = fractions.get(key)
        if f is not None and data.tokens:
            return Masked(int(data.tokens), round(f * data.tokens), cls.kind if cls else "mask")
    return None


def _complete(rule: Rule) -> bool:
    """Every threshold parameter set (a preset may leave one to the user: token-k2@verl)."""
    return all(getattr(rule, p.name) is not None for p in rule.params if p.threshold)


def label(name: str) -> str:
    cls = REGISTRY.get(name)
    return cls.label if cls is not None else name


def _setting_text(s: _Sentence, rule: Rule, tag: str) -> str:
    """`eps 0.3`, `[0.2, 5]` (a low/high band), `phi 0.1`: the rule's threshold values."""
    names = [p.name for p in rule.params if p.threshold]
    if names == ["low", "high"] and _complete(rule):
        lo = s.g(f"{tag}.low", rule.low)
        hi = s.g(f"{tag}.high", rule.high)
        return f"[{lo}, {hi}]"
    return ", ".join(  # a preset may leave a value to the user (token-k2@verl): unset
        f"{n} unset" if getattr(rule, n) is None else f"{n} {s.g(f'{tag}.{n}', getattr(rule, n))}"
        for n in names
    )


def _verb(m: Masked) -> str:
    return "truncates" if m.kind == "weight" else "masks"


# ----------------------------------------------------------------------------- finders


def mismatch_level(ctx: Context) -> Finding | None:
    """The k3 token mean over the log; its first and last steps (drift's step rows)."""
    k3 = ctx.data.metrics.get("kl_k3")
    if k3 is None or not math.isfinite(k3):
        return None
    s = _Sentence()
    head = (
        f"Mismatch: k3, the token mean of KL(inference ‖ trainer), is {s.g('kl_k3', k3)} "
        f"over {s.count('tokens', ctx.data.tokens)} loss tokens"
    )
    d = ctx.decisions.drift
    if d is None or len(d.steps) < 2:
        steps = ctx.data.step_metrics.height
        return s.done("mismatch", f"{head} in {s.count('steps', steps)} step(s).")
    first, last = d.steps[0], d.steps[-1]
    a = s.g("kl_k3_first", first.kl_k3)
    sa = s.num("step_first", first.step, str(first.step))
    b = s.g("kl_k3_last", last.kl_k3)
    sb = s.num("step_last", last.step, str(last.step))
    # 0 at the first step: it rose if it is not 0 at the last
    zero = math.inf if last.kl_k3 > 0 else 1.0
    ratio = last.kl_k3 / first.kl_k3 if first.kl_k3 > 0 else zero
    if ratio >= 2 and math.isfinite(ratio):
        trend = f"it rose from {a} at step {sa} to {b} at step {sb} ({s.g('ratio', ratio)}×)"
    elif ratio >= 2:
        trend = f"it rose from {a} at step {sa} to {b} at step {sb}"
    elif ratio <= 0.5:
        trend = f"it fell from {a} at step {sa} to {b} at step {sb}"
    else:
        trend = f"it was {a} at step {sa} and {b} at step {sb}, about level"
    return s.done("mismatch", f"{head}; {trend}.")


def headline_masks(ctx: Context) -> Finding | None:
    """IPO at prime-rl's eps 0.3 and IcePop at prime-rl's [0.2, 5], over the whole log."""
    s = _Sentence()
    parts = []
    for i, spec in enumerate(HEADLINE):
        rule = parse_rule(spec)
        if not all(c in _columns(ctx) for c in rule.needs):
            continue
        m = masked(ctx, rule)
        if m is None:
            continue
        tag = rule.name
        setting = _setting_text(s, rule, tag)
        f = s.pct(f"{tag}.fraction", m.fraction)
        n = s.count(f"{tag}.tokens", m.hit)
        tokens = " of the tokens" if i == 0 else ""
        parts.append(f"{label(rule.name)} at prime-rl's {setting} {_verb(m)} {f}{tokens} ({n})")
    if not parts:
        return None
    own = " (this log's framework)" if ctx.framework == "prime-rl" else ""
    return s.done("headline", f"At the headline presets{own}, {' and '.join(parts)}.")


def _columns(ctx: Context) -> set[str]:
    """The columns the log has, as far as the results tell (the rules they counted need)."""
    have = {"trainer_logprob", "inference_logprob"}
    for r in ctx.data.settings:
        have |= set(r.needs)
    for name in ctx.data.sweep["rule"].unique().to_list() if ctx.data.sweep.height else ():
        if name in REGISTRY:
            have |= set(REGISTRY[name].needs)
    return have


def framework_settings(ctx: Context) -> Finding | None:
    """The log's own framework: its --from-config settings, else the presets named after
    the framework its format tells (those the results can count exactly)."""
    if ctx.own_specs:
        rules = [parse_rule(x) for x in ctx.own_specs[:MAX_OWN]]
        where = f"the run's own settings ({ctx.framework} config)"
    elif ctx.framework and ctx.framework != "prime-rl":  # prime-rl's: the headline sentence
        rules = [
            parse_rule(f"{cls.name}@{ctx.framework}")
            for cls in REGISTRY.values()
            if ctx.framework in cls.presets
        ]
        rules = [r for r in rules if _complete(r)]
        where = f"{ctx.framework}'s presets (the log's format)"
    else:
        return None
    s = _Sentence()
    parts = []
    for i, rule in enumerate(rules):
        m = masked(ctx, rule) if len(parts) < MAX_OWN else None
        if m is None:
            continue
        setting = _setting_text(s, rule, f"own{i}")
        f = s.pct(f"own{i}.fraction", m.fraction)
        n = s.count(f"own{i}.tokens", m.hit)
        parts.append(f"{label(rule.name)} at {setting} {_verb(m)} {f} ({n})")
    if not parts:
        return None
    return s.done("framework", f"At {where}, {'; '.join(parts)}.")


def _maybe_g(text: str) -> str:
    """A parameter value from a setting string, at 3 significant digits where a number."""
    try:
        return fmt(float(text))
    except ValueError:
        return text


def _ci_digits(c: Choice) -> int:
    """Significant digits that tell the interval's two ends apart (3 at least)."""
    if c.ci_low is None or c.ci_high is None:
        return 3
    return next((d for d in range(3, 9) if fmt(c.ci_low, d) != fmt(c.ci_high, d)), 3)


def chosen_threshold(ctx: Context) -> Finding | None:
    """choose's answer for the target: the first threshold of the first rules, with the
    interval; a rule whose grid cannot reach the target says so."""
    dec = ctx.decisions
    seen: list[Choice] = []
    for c in dec.choose:
        if c.rule not in {x.rule for x in seen}:
            seen.append(c)
    seen = seen[:MAX_CHOICES]
    if not seen:
        return None
    s = _Sentence()
    parts = []
    for i, c in enumerate(seen):
        tag = f"choose{i}"
        name = label(c.rule)
        fixed = ""
        if c.setting:  # the other parameters, as the sweep table names them: k=v,k=v
            pairs = [kv.partition("=") for kv in c.setting.split(",") if kv]
            fixed = " with " + ", ".join(f"{k} {_maybe_g(v)}" for k, _, v in pairs)
        if c.status == "out of range":
            got = s.pct(f"{tag}.masked_fraction", c.masked_fraction)
            parts.append(f"{name} cannot reach it on its grid (nearest: {got} masked)")
            continue
        d = _ci_digits(c)
        verb = "truncates that share at" if c.kind == "weight" else "needs"
        text = f"{name} {verb} {c.param} {s.g(f'{tag}.value', c.value, d)}{fixed}"
        if c.ci_low is not None and c.ci_high is not None:
            lo = s.g(f"{tag}.ci_low", c.ci_low, d)
            hi = s.g(f"{tag}.ci_high", c.ci_high, d)
            text += f" (95% interval {lo}–{hi})"
        if c.status not in ("ok", "out of range"):
            text += f", {c.status}"
        parts.append(text)
    target = s.pct("target_fraction", dec.target_fraction)
    return s.done("choose", f"To mask the target {target} of the tokens, {'; '.join(parts)}.")


def _verdict_text(s: _Sentence, v: RuleVerdict, i: int) -> str:
    rule = parse_rule(v.rule)
    name = f"{label(rule.name)} at {_setting_text(s, rule, f'drift{i}')}"
    a = s.pct(f"drift{i}.baseline_fraction", v.baseline_fraction)
    if v.drift_fraction is None:
        return f"{name} masks {a}"
    b = s.pct(f"drift{i}.drift_fraction", v.drift_fraction)
    if v.verdict.startswith("rose"):
        return f"{name} rose with it ({a} → {b} masked)"
    if v.verdict.startswith("flat while"):  # drift's "(the collapse signature)"
        return f"{name} stayed flat ({a} → {b}): the collapse signature"
    return f"{name} stayed flat ({a} → {b})"


def _headline_verdicts(d: DriftResult) -> list[RuleVerdict]:
    want = [parse_rule(x).spec() for x in HEADLINE]
    got = [v for spec in want for v in d.rules if v.rule == spec]
    return got or d.rules[:2]


def drift_verdict(ctx: Context) -> Finding | None:
    """Did the run drift (drift's steps against its baseline), and did the masks follow?"""
    d = ctx.decisions.drift
    s = _Sentence()
    if d is None:
        steps = s.count("steps", ctx.data.step_metrics.height)
        return s.done("drift", f"Drift not computed: the log has {steps} step(s).")
    base = s.g("baseline_k3_trimmed", d.baseline.kl_k3_trimmed)
    b0 = s.num("baseline_first", d.baseline_steps[0], str(d.baseline_steps[0]))
    b1 = s.num("baseline_last", d.baseline_steps[-1], str(d.baseline_steps[-1]))
    factor = s.g("factor", d.factor)
    if not d.flagged_steps:
        run = s.count("min_run", d.min_run)
        text = (
            f"No drift: no {run} steps in a row had a trimmed k3 above {factor}× the baseline "
            f"{base} (steps {b0}–{b1})"
        )
        if d.spikes:
            n = s.count("spikes", len(d.spikes))
            where = ", ".join(map(str, d.spike_steps))
            text += f"; {n} lone spike{'s' if len(d.spikes) > 1 else ''} (step {where})"
        return s.done("drift", text + ".")
    n = s.count("drift_steps", len(d.flagged_steps))
    f0 = s.num("drift_first", d.flagged_steps[0], str(d.flagged_steps[0]))
    f1 = s.num("drift_last", d.flagged_steps[-1], str(d.flagged_steps[-1]))
    text = (
        f"The run drifted: {n} steps from step {f0} to step {f1} had a trimmed k3 above "
        f"{factor}× the baseline {base} (steps {b0}–{b1})"
    )
    verdicts = [_verdict_text(s, v, i) for i, v in enumerate(_headline_verdicts(d))]
    if verdicts:
        text += "; " + " and ".join(verdicts)
    return s.done("drift", text + ".")


def _cause(s: _Sentence, d) -> str:
    """A found diagnosis in a few words with its headline number."""
    n = d.numbers
    k = d.key
    if k == "truncation":
        return f"truncated sampling (mean p/q {s.g('truncation.mean_ratio', n['mean_ratio'], 4)})"
    if k == "temperature":
        return (
            f"a temperature mismatch (T ratio {s.g('temperature.ratio', n['temperature_ratio'])})"
        )
    if k == "position" and n.get("changepoint_ratio", 0) >= 3:
        at = s.num("position.at", n["changepoint_position"], str(n["changepoint_position"]))
        return f"a jump at position {at} ({s.g('position.ratio', n['changepoint_ratio'])}×)"
    if k == "position":
        return f"an off first token ({s.g('position.first', n['first_token_ratio'])}×)"
    if k == "placeholders":
        tot = sum(v for key, v in n.items() if key.startswith(("zero_", "sentinel_", "invalid_"))
                  and key.count("_") == 1)  # fmt: skip
        tot += sum(
            v for key, v in n.items() if key.startswith("value_") and key.endswith("_tokens")
        )
        return f"placeholder log-probs ({s.count('placeholders.tokens', tot)} tokens)"
    if k == "noise_floor":
        b = s.count("noise_floor.settings", n["below_floor"])
        return f"{b} setting(s) below the noise floor's p90 {s.g('noise_floor.p90', n['p90'])}"
    if k == "alignment":
        shift = n["shift"]
        return f"a shifted column ({s.num('alignment.shift', shift, f'{shift:+d}')})"
    return d.title.lower()


def diagnosed(ctx: Context) -> Finding | None:
    """diagnose's verdicts: the causes found, with their numbers, or that none was."""
    d = ctx.diagnosis
    if d is None:
        return None
    s = _Sentence()
    total = s.count("diagnose.findings", len(d.findings))
    found = d.found
    if not found:
        unsure = [x.title.lower() for x in d.findings if x.verdict == "can't tell"]
        tail = f" ({', '.join(unsure)}: can't tell)" if unsure else ""
        return s.done("diagnose", f"Diagnose found none of its {total} causes{tail}.")
    causes = [_cause(s, x) for x in found]
    n = s.count("diagnose.found", len(found))
    return s.done("diagnose", f"Diagnose found {n} of {total} causes: {'; '.join(causes)}.")


def _cost_row(table: pl.DataFrame, spec: str) -> dict | None:
    """The mask-cost row of a preset (its spec starts with `name@preset:`), None without."""
    rows = table.filter(pl.col("spec").str.starts_with(spec + ":")).to_dicts()
    return rows[0] if rows and rows[0]["masked_adv_mass_fraction"] is not None else None


def mask_cost(ctx: Context) -> Finding | None:
    """What IPO at prime-rl's default costs the gradient: the share of sum |A| it removes
    and the corrective share of its masked updates, beside DPPO-TV at prime-rl's (divergent
    only, by construction), and the masked tokens' entropy against the log's."""
    table = getattr(ctx.data, "mask_cost", None)
    if table is None or table.height == 0:
        return None
    s = _Sentence()
    ipo = _cost_row(table, "ipo@prime-rl")
    if ipo is None:
        return None
    rule = parse_rule("ipo@prime-rl")
    setting = _setting_text(s, rule, "ipo")
    mass = s.pct("ipo.adv_mass_fraction", ipo["masked_adv_mass_fraction"])
    text = f"IPO at prime-rl's {setting} removes {mass} of the advantage mass sum |A|"
    if ipo["masked_corrective_fraction"] is not None:
        corr = s.pct("ipo.corrective_fraction", ipo["masked_corrective_fraction"])
        text += (
            f"; of its masked tokens whose update has a direction, {corr} were corrective "
            "(pulling p back toward q)"
        )
        dppo = _cost_row(table, "dppo-tv@prime-rl")
        if dppo is not None:
            dset = _setting_text(s, parse_rule("dppo-tv@prime-rl"), "dppo-tv")
            dm = s.pct("dppo-tv.adv_mass_fraction", dppo["masked_adv_mass_fraction"])
            text += (
                f", while DPPO-TV at prime-rl's {dset} removes {dm} and masks divergent ones only"
            )
    if ipo["masked_entropy_mean"] is not None and ipo["entropy_mean"] is not None:
        me = s.g("ipo.masked_entropy_mean", ipo["masked_entropy_mean"])
        le = s.g("entropy_mean", ipo["entropy_mean"])
        text += f"; its masked tokens' mean entropy is {me} against {le} over every token"
    return s.done("mask_cost", text + ".")


FINDERS: tuple[Callable[[Context], Finding | None], ...] = (
    mismatch_level,
    diagnosed,
    headline_masks,
    framework_settings,
    chosen_threshold,
    drift_verdict,
    mask_cost,
)


def framework_of(
    log_format: str | None, config_framework: str | None = None
) -> tuple[str | None, str | None]:
    """(framework, where it was learnt): the --from-config file's, else the log format's."""
    if config_framework:
        return config_framework, "config"
    fw = FORMAT_FRAMEWORK.get(log_format or "")
    return (fw, "format") if fw else (None, None)


def findings(
    data: FigureData,
    decisions: Decisions,
    *,
    log_format: str | None = None,
    config_framework: str | None = None,
    own_specs: Sequence[str] = (),
    diagnosis: DiagnoseResult | None = None,
) -> Findings:
    """The sentences of "What this log says", from the report's results (`report_data`):
    `log_format` (`Summary.format`) and `config_framework` / `own_specs` (--from-config)
    tell the log's framework; `diagnosis` (analysis.diagnose) adds its verdicts."""
    fw, where = framework_of(log_format, config_framework)
    ctx = Context(data, decisions, fw, where, tuple(own_specs), diagnosis)
    out = [f for f in (finder(ctx) for finder in FINDERS) if f is not None]
    return Findings(out)


__all__ = [
    "FINDERS",
    "Context",
    "Finding",
    "Findings",
    "Number",
    "findings",
    "framework_of",
    "masked",
]
