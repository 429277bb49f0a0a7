"""`drift --run NAME=SOURCES ...`: the arms of an ablation side by side, one verdict a run.

Design
------
A paired ablation (the same recipe, only `[trainer.loss]` changing) is judged on the arms
together: their mismatch, what each arm's own rule masked, entropy and reward, step by step.
Users hold one token log per arm. A `Run` is one arm: a name, its SOURCES, its own read
options and its own rule(s) (the SPECs its trainer config gives, `--run-config NAME=FILE`,
or `--run-rule NAME=SPEC`). `drift_runs` replays each run once, exactly as `drift` replays
one log (the same robust per-step Tally and `drift_from`), with the run's own rules plus the
shared `rules` (`-r`, applied to every run) as its jobs; so a run's rows are the rows `drift`
gives for that log and those rules, and reading two runs costs the two reads, nothing more
(benchmarks/runs_bench.py). Per step it adds the trainer entropy's token mean (the Tally's
metrics, where the log has `entropy`) and the mean reward: an observer of the same read
keeps one (step, sample_id, reward) per sequence (memory bounded by the sequences, as
DuplicateCheck) and averages over sequences; without sample ids, over tokens.

The verdict of a run (`RunVerdict`):
- drift: its steps flagged as drift (a `factor` x rise of the trimmed k3 over its own
  baseline, `min_run` steps in a row) and `departs_at`, the first of them;
- `late_early_k3`: the token mean of k3 over its last baseline-many steps over that of its
  first (the seed's "more than 20x"; `late_early_k3_trimmed` the same with the per-step
  1%-trimmed means, medians over the steps);
- per own rule, drift's verdict; `collapse`: an own rule stayed flat while the mismatch
  rose (drift's "collapse signature"), None where the run names no rule of its own.

`RunsResult.table` is one row per run and step (long: the figure's input, viz.runs),
`.verdicts` one row per run, `to_dict()` what `drift --run ... --json` prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..errors import UsageError
from ..present import Presentable, num
from ..rules import Rule, parse_rule
from .drift import MIN_RISE, DriftResult, drift_from, drift_rules

COLLAPSE = "flat while the mismatch rose (the collapse signature)"


@dataclass(frozen=True)
class Run:
    """One arm: `name`, its `sources`, how to read them, and its own rule SPECs."""

    name: str
    sources: tuple[str | Path, ...]
    options: ingest.ReadOptions | None = None
    rules: tuple[str, ...] = ()  # the run's own rule(s): its trainer config's SPECs
    config: tuple[Path, ...] = ()  # where they came from (informative)


def parse_runs(
    runs: Sequence[str],
    configs: Sequence[str] = (),
    run_rules: Sequence[str] = (),
    options: ingest.ReadOptions | None = None,
    framework: str | None = None,
) -> list[Run]:
    """The command line's `--run NAME=SOURCES` (repeat a NAME to give it more sources),
    `--run-config NAME=FILE` and `--run-rule NAME=SPEC` -> Runs, in the order first named.
    Every run reads with `options`. A usage error names the flag and the value."""

    examples = {"SOURCES": "logs/icepop", "FILE": "configs/icepop.toml", "SPEC": "icepop@prime-rl"}

    def split(flag: str, item: str, what: str) -> tuple[str, str]:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise UsageError(
                f"{flag} {item!r}: give NAME={what}, e.g. {flag} icepop={examples[what]}."
            )
        if any(c in name for c in " ,:@/\\"):
            raise UsageError(
                f"{flag} {item!r}: the run name {name!r} may not hold spaces or , : @ / \\ "
                "(it names the run in the tables and the figure)."
            )
        return name, value

    sources: dict[str, list[str]] = {}
    for item in runs:
        name, value = split("--run", item, "SOURCES")
        sources.setdefault(name, []).append(value)
    cfgs: dict[str, list[Path]] = {}
    for item in configs:
        name, value = split("--run-config", item, "FILE")
        cfgs.setdefault(name, []).append(Path(value))
    specs: dict[str, list[str]] = {}
    for item in run_rules:
        name, value = split("--run-rule", item, "SPEC")
        parse_rule(value)  # a bad SPEC: a usage error now, before any read
        specs.setdefault(name, []).append(value)
    for flag, named in (("--run-config", cfgs), ("--run-rule", specs)):
        unknown = [n for n in named if n not in sources]
        if unknown:
            raise UsageError(
                f"{flag} {unknown[0]}=...: no --run names {unknown[0]!r} (runs: "
                f"{', '.join(sources) or 'none'}); give --run {unknown[0]}=SOURCES."
            )
    if len(sources) < 1:
        raise UsageError("give at least one --run NAME=SOURCES.")
    out = []
    for name, src in sources.items():
        own: list[str] = []
        if name in cfgs:
            from ..integrations.config_in import read_config

            own += read_config(cfgs[name], framework, require=True).specs()
        own += specs.get(name, [])
        out.append(Run(name, tuple(src), options, tuple(own), tuple(cfgs.get(name, ()))))
    return out


@dataclass
class RunVerdict:
    """One run's answer: did it drift, from which step, by how much; did its rule follow?"""

    run: str
    steps: int
    drift_steps: list[int]
    departs_at: int | None  # the first drift step (None: no drift)
    baseline_k3: float  # token mean of k3 over the first (baseline-many) steps
    late_k3: float  # ... over the last as many steps
    late_early_k3: float  # late_k3 / baseline_k3
    late_early_k3_trimmed: float  # the same with per-step trimmed means (medians)
    own_rules: list[str]
    collapse: bool | None  # an own rule flat while the mismatch rose; None: no own rule
    rule_verdicts: dict[str, str] = field(default_factory=dict)  # SPEC -> drift's verdict

    @property
    def drifted(self) -> bool:
        return bool(self.drift_steps)

    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "steps": self.steps,
            "drift": self.drifted,
            "drift_steps": self.drift_steps,
            "departs_at": self.departs_at,
            "baseline_k3": self.baseline_k3,
            "late_k3": self.late_k3,
            "late_early_k3": self.late_early_k3,
            "late_early_k3_trimmed": self.late_early_k3_trimmed,
            "own_rules": self.own_rules,
            "collapse": self.collapse,
            "rule_verdicts": self.rule_verdicts,
        }


@dataclass
class RunResult:
    """One run's drift (`drift`'s result on its log) and its per-step extras."""

    run: Run
    drift: DriftResult
    entropy: dict[int, float]  # step -> token mean of the trainer entropy (logged steps)
    reward: dict[int, float]  # step -> mean reward (over sequences, else tokens)
    reward_over: str | None  # "sequences", "tokens" or None (no reward column)
    verdict: RunVerdict


@dataclass
class RunsResult(Presentable):
    """Several runs side by side: `runs` (RunResult each), the shared `rules`."""

    runs: list[RunResult]
    rules: list[str]  # the SPECs applied to every run (-r)
    factor: float
    min_run: int

    @property
    def names(self) -> list[str]:
        return [r.run.name for r in self.runs]

    def __getitem__(self, name: str) -> RunResult:
        for r in self.runs:
            if r.run.name == name:
                return r
        raise KeyError(name)

    @property
    def table(self) -> pl.DataFrame:
        """One row per run and step: k3 (mean, trimmed), entropy, reward, the masked
        fraction under the run's own rule (`own_rule`, `masked_own`; a run's second own rule
        in `own_rule_2`, `masked_own_2`, and so on, as many as the run with most has), under
        each shared rule, the flags."""
        rows = []
        owns = {rr.run.name: own_labels(rr.run.rules) for rr in self.runs}
        most = max((len(v) for v in owns.values()), default=0)
        extra = [f"_{k}" for k in range(2, most + 1)]
        for rr in self.runs:
            labels = owns[rr.run.name]
            own_label = labels[0] if labels else None
            for s in rr.drift.steps:
                row = {
                    "run": rr.run.name,
                    "step": s.step,
                    "tokens": s.tokens,
                    "kl_k3": s.kl_k3,
                    "kl_k3_trimmed": s.kl_k3_trimmed,
                    "entropy_mean": rr.entropy.get(s.step),
                    "reward_mean": rr.reward.get(s.step),
                    "own_rule": own_label,
                    "masked_own": s.masked.get(own_label) if own_label else None,
                }
                for k, suffix in enumerate(extra, start=1):
                    lab = labels[k] if k < len(labels) else None
                    row[f"own_rule{suffix}"] = lab
                    row[f"masked_own{suffix}"] = s.masked.get(lab) if lab else None
                for spec in self.rules:
                    row[f"masked:{spec}"] = s.masked.get(spec)
                row["drift"] = s.drift
                row["spike"] = s.spike
                rows.append(row)
        extra_schema: dict[str, pl.DataType] = {}
        for x in extra:
            extra_schema |= {f"own_rule{x}": pl.String, f"masked_own{x}": pl.Float64}
        schema = {
            "run": pl.String,
            "step": pl.Int64,
            "tokens": pl.Int64,
            "kl_k3": pl.Float64,
            "kl_k3_trimmed": pl.Float64,
            "entropy_mean": pl.Float64,
            "reward_mean": pl.Float64,
            "own_rule": pl.String,
            "masked_own": pl.Float64,
            **extra_schema,
            **{f"masked:{spec}": pl.Float64 for spec in self.rules},
            "drift": pl.Boolean,
            "spike": pl.Boolean,
        }
        return (
            pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)
        )

    @property
    def verdicts(self) -> pl.DataFrame:
        return pl.DataFrame(
            [
                {k: v for k, v in r.verdict.to_dict().items() if k != "rule_verdicts"}
                | {"own_rules": ", ".join(r.verdict.own_rules)}
                | {"drift_steps": len(r.verdict.drift_steps)}
                for r in self.runs
            ]
        )

    def to_dict(self) -> dict:
        return {
            "runs": [
                {
                    "run": rr.run.name,
                    "sources": [str(s) for s in rr.run.sources],
                    "own_rules": list(rr.run.rules),
                    "config": [str(p) for p in rr.run.config],
                    "reward_over": rr.reward_over,
                    "verdict": rr.verdict.to_dict(),
                    "drift": rr.drift.to_dict(),
                    "entropy": {str(k): v for k, v in rr.entropy.items()},
                    "reward": {str(k): v for k, v in rr.reward.items()},
                }
                for rr in self.runs
            ],
            "rules": self.rules,
            "factor": self.factor,
            "min_run": self.min_run,
        }

    def summary_lines(self) -> list[str]:
        out = [f"RunsResult: {len(self.runs)} runs ({', '.join(self.names)}), factor "
               f"{num(self.factor)}, min run {self.min_run}"]  # fmt: skip
        for rr in self.runs:
            v = rr.verdict
            where = f"departs at step {v.departs_at}" if v.departs_at is not None else "no drift"
            own = ""
            for spec in v.own_rules:
                label = parse_rule(spec).spec()
                own += f"; {label}: {v.rule_verdicts.get(label, 'n/a')}"
            out.append(
                f"  {v.run}: k3 x{num(v.late_early_k3, 3)} late/early "
                f"({num(v.baseline_k3, 3)} -> {num(v.late_k3, 3)}), {where}{own}"
            )
        return out


class _Rewards:
    """Observer of a replay's batches: one reward per (step, sample_id), or token sums."""

    def __init__(self) -> None:
        self.parts: list[pl.DataFrame] = []
        self.by_token = False

    def __call__(self, df: pl.DataFrame) -> None:
        if "reward" not in df.columns:
            return
        if "sample_id" in df.columns:
            # a sequence's rows are mostly adjacent: keep the first row of each run of one
            # (step, sample_id) here (a vectorised compare), deduplicate across runs at the end
            key = [pl.col("step"), pl.col("sample_id")]
            new = pl.any_horizontal([(k != k.shift()).fill_null(True) for k in key])
            part = df.select("step", "sample_id", "reward").filter(new)
        else:
            self.by_token = True
            part = df.group_by("step").agg(
                pl.col("reward").sum().alias("sum"), pl.col("reward").count().alias("n")
            )
        self.parts.append(part)

    def per_step(self) -> tuple[dict[int, float], str | None]:
        if not self.parts:
            return {}, None
        df = pl.concat(self.parts)
        if self.by_token:
            g = df.group_by("step").agg(pl.col("sum").sum(), pl.col("n").sum())
            return {s: t / n for s, t, n in g.iter_rows() if n}, "tokens"
        df = df.unique(["step", "sample_id"], keep="first")
        g = df.group_by("step").agg(pl.col("reward").mean())
        return {s: r for s, r in g.iter_rows() if r is not None}, "sequences"


def own_labels(specs: Sequence[str]) -> list[str]:
    """A run's own rule SPECs as the result names them (`Rule.spec()`), each once, in order."""
    return list(dict.fromkeys(parse_rule(s).spec() for s in specs))


def _weighted_k3(rows) -> float:
    tok = sum(r.tokens for r in rows)
    return sum(r.kl_k3 * r.tokens for r in rows) / tok if tok else math.nan


def verdict_of(name: str, d: DriftResult, own: Sequence[str]) -> RunVerdict:
    """A run's verdict from its drift result and its own rule SPECs."""
    n = len(d.baseline_steps)
    early, late = d.steps[:n], d.steps[-n:]
    b, lt = _weighted_k3(early), _weighted_k3(late)
    bt = float(np.median([r.kl_k3_trimmed for r in early]))
    lt_t = float(np.median([r.kl_k3_trimmed for r in late]))
    labels = own_labels(own)
    verdicts = {v.rule: v.verdict for v in d.rules}
    collapse = any(verdicts.get(lab) == COLLAPSE for lab in labels) if labels else None
    return RunVerdict(
        run=name,
        steps=len(d.steps),
        drift_steps=list(d.flagged_steps),
        departs_at=d.flagged_steps[0] if d.flagged_steps else None,
        baseline_k3=b,
        late_k3=lt,
        late_early_k3=lt / b if b > 0 else math.inf,
        late_early_k3_trimmed=lt_t / bt if bt > 0 else math.inf,
        own_rules=labels,
        collapse=collapse,
        rule_verdicts=verdicts,
    )


def drift_runs(
    runs: Sequence[Run],
    rules: Sequence[str | Rule] | None = None,
    *,
    factor: float = 3.0,
    baseline_steps: int | None = None,
    min_run: int = 3,
    min_rise: float = MIN_RISE,
    progress: Callable[[int, int], None] | None = None,
) -> RunsResult:
    """Each run's drift under its own rules and the shared `rules`, its per-step entropy
    and reward, and its verdict. With no shared rules and a run without a rule of its own,
    every run also gets drift's default settings (IPO, IcePop), so that each has one."""
    if not runs:
        raise UsageError("give at least one run.")
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"run {dup[0]!r} is named twice; give each run its own name.")
    plans = [ingest.plan_sources(r.sources, r.options) for r in runs]
    shared = [parse_rule(r) if isinstance(r, str) else r for r in rules or ()]
    if not shared and any(not r.rules for r in runs):
        shared = drift_rules(plans[0].columns)
    labels = [r.spec() for r in shared]
    total = sum(sum(p.rows) for p in plans)
    done = 0
    out = []
    for run, plan in zip(runs, plans, strict=True):
        chosen: list[Rule] = []
        for r in [*(parse_rule(s) for s in run.rules), *shared]:
            if r.spec() not in {c.spec() for c in chosen}:
                chosen.append(r)
        jobs = [engine.single_job(r) for r in chosen]
        rewards = _Rewards()

        def cb(i, n, base=done):
            if progress is not None:
                progress(base + i, total)

        (tally,) = engine.replay_together(
            plan,
            [{"jobs": jobs, "by": "step", "robust": True}],
            progress=cb,
            final=True,
            observers=[rewards],
            columns=["reward"],
        )
        done += sum(plan.rows)
        d = drift_from(plan, tally, range(len(jobs)), factor, baseline_steps, min_run, min_rise)
        m = tally.metrics.values()
        ent = {}
        if "entropy" in plan.columns and "entropy_mean" in m:
            for gi, step in enumerate(tally.groups):
                v = float(m["entropy_mean"][gi])
                if math.isfinite(v):
                    ent[int(step)] = v
        reward, over = rewards.per_step()
        out.append(RunResult(run, d, ent, reward, over, verdict_of(run.name, d, run.rules)))
    return RunsResult(out, labels, factor, min_run)


class _Words:
    """A sentence and the numbers it quotes (findings.Finding checks each is shown)."""

    def __init__(self) -> None:
        self.numbers: list = []

    def num(self, name: str, value, text: str) -> str:
        from .findings import Number

        self.numbers.append(Number(name, value, text))
        return text

    def g(self, name: str, value: float) -> str:
        from .findings import fmt

        return self.num(name, float(value), fmt(float(value)))

    def pct(self, name: str, value: float) -> str:
        from .findings import pct as fpct

        return self.num(name, float(value), fpct(float(value)))


def _rule_words(w: _Words, tag: str, d: DriftResult, spec: str) -> str:
    from .findings import label

    v = next((x for x in d.rules if x.rule == spec), None)
    name = f"its own rule {label(parse_rule(spec).name)} ({spec})"
    if v is None:
        return ""
    a = w.pct(f"{tag}.baseline_fraction", v.baseline_fraction)
    if v.drift_fraction is None:
        return f"; {name} masks {a}"
    b = w.pct(f"{tag}.drift_fraction", v.drift_fraction)
    if v.verdict == COLLAPSE:
        return f"; {name} stayed flat ({a} → {b} masked): the collapse signature"
    if v.verdict.startswith("rose"):
        return f"; {name} rose with it ({a} → {b} masked)"
    return f"; {name} stayed flat ({a} → {b} masked)"


def runs_findings(res: RunsResult):
    """The sentences of "What these runs say": one a run (its drift, the step it departs
    at, late / early k3, its own rule's verdict), then which run's k3 rose most and, where
    logged, each run's mean reward over its last steps."""
    from .findings import Finding, Findings

    out = []
    for i, rr in enumerate(res.runs):
        v, d, w = rr.verdict, rr.drift, _Words()
        n = w.num(f"run{i}.window", len(d.baseline_steps), f"{len(d.baseline_steps):,}")
        ratio = w.g(f"run{i}.late_early_k3", v.late_early_k3)
        k0, k1 = w.g(f"run{i}.baseline_k3", v.baseline_k3), w.g(f"run{i}.late_k3", v.late_k3)
        text = f"{v.run}: k3 ×{ratio} from its first {n} steps to its last {n} ({k0} → {k1})"
        if v.departs_at is not None:
            at = w.num(f"run{i}.departs_at", v.departs_at, f"step {v.departs_at}")
            f = w.g(f"run{i}.factor", d.factor)
            text += f"; it departs from its own baseline at {at} (trimmed k3 above {f}×)"
        else:
            text += "; no drift from its own baseline"
        for j, spec in enumerate(v.own_rules):
            text += _rule_words(w, f"run{i}.own{j}", d, spec)
        out.append(Finding(f"run:{v.run}", text + ".", tuple(w.numbers)))
    if len(res.runs) > 1:
        w = _Words()
        order = sorted(res.runs, key=lambda r: -r.verdict.late_early_k3)
        top, rest = order[0], order[1:]
        others = ", ".join(
            f"×{w.g(f'{r.run.name}.late_early_k3', r.verdict.late_early_k3)} in {r.run.name}"
            for r in rest
        )
        text = (
            f"Of the {w.num('runs', len(res.runs), str(len(res.runs)))} runs, k3 rose most in "
            f"{top.run.name} (×{w.g(f'{top.run.name}.late_early_k3', top.verdict.late_early_k3)}"
            f", against {others})"
        )
        rewarded = [r for r in res.runs if r.reward]
        if rewarded:
            parts = []
            for r in rewarded:
                last = [r.reward[s.step] for s in r.drift.steps[-len(r.drift.baseline_steps) :]
                        if s.step in r.reward]  # fmt: skip
                if last:
                    m = w.g(f"{r.run.name}.late_reward", float(np.mean(last)))
                    parts.append(f"{r.run.name} {m}")
            if parts:
                text += "; mean reward over the last steps: " + ", ".join(parts)
        out.append(Finding("runs", text + ".", tuple(w.numbers)))
    return Findings(out)


__all__ = [
    "COLLAPSE",
    "Run",
    "RunResult",
    "RunVerdict",
    "RunsResult",
    "drift_runs",
    "parse_runs",
    "runs_findings",
]
