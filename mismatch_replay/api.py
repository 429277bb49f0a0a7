"""The public functions: small, typed, documented calls over the engine and the analyses.

Design
------
`mismatch_replay.sweep`, `replay`, `choose`, `compare`, `drift`, `check`, `inspect`,
`convert` and `figure_data` are the functions below. Each takes the sources first (a path,
a glob, a directory, a URI, or a list of them), then keyword-only options, and returns a
dataclass result with `.table` (polars), `.to_dict()` and a notebook rendering
(`present.Presentable`). They check nothing themselves and add no arithmetic: each forwards
to the internal function the command line also calls (`engine.sweep`, `analysis.choose`,
...), whose extra keywords (the tail, the sequence lengths, the shape callback, ready-made
jobs, the bootstrap plumbing, the shared Tally of a report) stay internal.

The module is imported on first use of one of these names (`mismatch_replay.__getattr__`),
so `import mismatch_replay` stays a fraction of a millisecond; importing this module costs
what importing the engine costs (it imports the result types, so that
`typing.get_type_hints` resolves every annotation). `tests/test_public_api.py` walks
`mismatch_replay.__all__` and checks the signatures, the docstrings and docs/library.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from . import analysis
from . import engine as _engine
from .analysis.check import CheckResult, masked_limit, metric_limit
from .analysis.check import check as _check
from .analysis.choose import ChooseResult
from .analysis.compare import CompareResult
from .analysis.diagnose import DiagnoseResult
from .analysis.diagnose import diagnose as _diagnose
from .analysis.drift import MIN_RISE, DriftResult
from .analysis.figure_data import FigureData
from .analysis.inspect import Summary, inspect_log
from .analysis.runs import Run, RunsResult
from .analysis.runs import drift_runs as _drift_runs
from .analysis.summaries import frame
from .engine import SweepResult, Tally
from .errors import UsageError
from .ingest import ReadOptions
from .ingest.convert import ROW_GROUP_ROWS
from .ingest.convert import convert as _convert
from .present import Presentable, num
from .rules import Rule

Sources = str | Path | Sequence[str | Path]


def _paths(sources: Sources) -> list[str | Path]:
    """One source or several -> a list (a str is one path, not a sequence of letters)."""
    if isinstance(sources, str | Path):
        return [sources]
    return list(sources)


def sweep(
    sources: str | Path | Sequence[str | Path],
    *,
    rules: Sequence[str | Rule] | None = None,
    sweeps: Mapping[str, str | Sequence[float]] | None = None,
    by: str | None = None,
    match: str | None = None,
    precision: str | None = None,
    options: ReadOptions | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Every rule at every threshold in one streaming pass over the log: the sweep table.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them (Parquet token tables,
        prime-rl exports, NeMo-RL and slime dumps: docs/your-log.md).
    rules: rule SPECs (`"ipo"`, `"icepop@verl"`, `"ipo:eps=0.3"`) or `Rule` instances;
        None: every rule the log's columns support, each threshold over its default grid.
    sweeps: parameter -> grid (`"eps": "0.01:0.5:50"`, `"icepop.low": [0.2, 0.5]`): the
        values to sweep instead of a setting's one value.
    by: group the counts by "step", "env", "q_bucket" (the token's inference probability)
        or "length" (the sequence's loss tokens; one extra read).
    match: "prime-rl": drop zero-advantage tokens and add `is_masked_mean`, as prime-rl
        logs it (one extra read).
    precision: "float32": every rule decides in the frameworks' float32 arithmetic;
        None or "float64": exact float64.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`: column
        mapping, probabilities, drop invalid rows, batch size, format).
    engine: "local" (this machine, every core) or "ray" (one task a file on a Ray cluster).
    ray_address: with engine="ray", the cluster to attach to (None: `ray.init()` decides).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    SweepResult:
        table: the long sweep table, one row per rule setting x swept value (x group):
            rule, setting, param, value, tokens, masked_tokens, masked_fraction, the
            sequence, prompt-group and mass columns, spec; and what the mask costs (RULES.md,
            null where the log has no advantage / entropy column, and for m2po):
            masked_corrective (masked tokens with A * (p - q) < 0: their update pulls p back
            toward q), masked_divergent (A * (p - q) > 0), masked_neutral (A == 0 or p == q),
            masked_corrective_fraction = corrective / (corrective + divergent),
            masked_adv_mass (sum of |A| over the masked tokens) and
            masked_adv_mass_fraction (its share of sum |A| over the loss tokens: the
            gradient signal removed), entropy_mean (the group's loss tokens) and
            masked_entropy_mean (the masked ones'). Weight rules: over the tokens they
            truncate; sequence rules: over the tokens of the sequences they mask.
        metrics: the mismatch metrics (kl_k1, kl_k3, abs_dp_mean, ...), per group.
        tally: the Tally the table was read from (`replay`'s result).
        notes: what was skipped and why (a rule whose column the log lacks).
        warnings: the framework quirks a preset reproduces.
        paths: per job, {"rule", "param", "path": "fused" | "simple", "reason"}.
        precision_notes: where a float32 preset's count differs from its exact one.
    """
    return _engine.sweep(
        _paths(sources),
        rules=rules,
        sweeps=dict(sweeps) if sweeps is not None else None,
        by=by,
        match=match,
        precision=precision,
        options=options,
        engine=engine,
        ray_address=ray_address,
        progress=progress,
    )


def replay(
    sources: str | Path | Sequence[str | Path],
    *,
    rules: Sequence[str | Rule] | None = None,
    sweeps: Mapping[str, str | Sequence[float]] | None = None,
    by: str | None = None,
    match: str | None = None,
    precision: str | None = None,
    options: ReadOptions | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Tally:
    """Stream the log once into a Tally: additive counts that shards add up exactly.

    `replay(a) + replay(b)` is the Tally of both logs (counts, histograms and metric sums
    add); `.result()` reads the sweep table out of it, as `sweep` does.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    rules: rule SPECs or `Rule` instances (None: every rule the log supports).
    sweeps: parameter -> grid, as in `sweep`.
    by: group the counts by "step", "env", "q_bucket" or "length".
    match: "prime-rl": prime-rl's logging conventions (see `sweep`).
    precision: "float32" or "float64" (None): the arithmetic of the rule decisions.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    engine: "local" or "ray".
    ray_address: with engine="ray", the cluster to attach to.
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    Tally (the engine's additive state; its fields are internal), read through:
        table: the sweep table (`result().table`).
        result(): the `SweepResult` (table, metrics, paths).
        metrics: the metric sums; `metrics.table(by, groups)` is the metrics table.
        groups: the group keys, in the order of the counts.
        report: what was read: rows, loss_rows, dropped (per file and column), warnings.
        hist_lin: the (200, 200) scatter histogram on probability axes ([q bin, p bin]).
        hist_log: the same on log10-probability axes.
        notes: what was skipped and why.
    """
    return _engine.replay(
        _paths(sources),
        rules=rules,
        sweeps=dict(sweeps) if sweeps is not None else None,
        by=by,
        match=match,
        precision=precision,
        options=options,
        engine=engine,
        ray_address=ray_address,
        progress=progress,
    )


def choose(
    sources: str | Path | Sequence[str | Path],
    target_fraction: float | None = None,
    *,
    rules: Sequence[str | Rule] | None = None,
    bootstrap: int = 200,
    unit: str | None = None,
    seed: int = 0,
    tol: float = 0.01,
    max_passes: int = 8,
    curve: bool = False,
    precision: str | None = None,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    of: str = "tokens",
) -> ChooseResult:
    """The threshold of each rule that masks `target_fraction` of the tokens (or, with
    `of="adv-mass"`, removes that share of the advantage mass sum |A|), with a 95%
    bootstrap interval; without a target, the masked fraction at each given setting.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    target_fraction: the fraction of loss tokens to mask, in (0, 1); None: give `rules`
        at one setting each, and get each one's masked fraction and its interval.
    rules: rule SPECs or `Rule` instances; None (with a target): every masking rule the log
        supports, each of its threshold parameters.
    bootstrap: Poisson-bootstrap replicates for the interval (0: none).
    unit: what the bootstrap resamples, "sequence" (default where the log has sample_id)
        or "step".
    seed: the bootstrap's seed.
    tol: refine until the masked fraction is within this relative distance of the target.
    max_passes: at most this many passes over the log.
    curve: also give each choice the exact masked fraction at the grid values around it.
    precision: "float32" or "float64" (None): the arithmetic of the rule decisions.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.
    of: "tokens" (the target is a fraction of the loss tokens) or "adv-mass" (of sum |A|
        over them: the gradient signal the mask removes; needs an advantage column; no m2po).

    Returns
    -------
    ChooseResult, a sequence of `Choice` (rule, setting, param, value, masked_fraction,
    ci_low, ci_high, status, spec, ...; `of`, and with of="adv-mass" the
    masked_adv_mass_fraction at the value):
        target_fraction: the target aimed at (None: fractions at the given settings).
        rows: the choices, one per rule and threshold parameter, in rule order.
    """
    return analysis.choose(
        _paths(sources),
        target_fraction,
        rules=rules,
        bootstrap=bootstrap,
        unit=unit,
        seed=seed,
        tol=tol,
        max_passes=max_passes,
        curve=curve,
        precision=precision,
        options=options,
        progress=progress,
        of=of,
    )


def compare(
    sources: str | Path | Sequence[str | Path],
    rule_a: str | Rule,
    rule_b: str | Rule,
    *,
    budget: float | None = None,
    examples: int = 0,
    precision: str | None = None,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CompareResult:
    """Two rules on the same tokens: the 2 x 2 table of what each masks, where they
    disagree, and how much probability the disputed tokens moved.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    rule_a: the first rule (a SPEC or a `Rule`).
    rule_b: the second rule.
    budget: set both rules' primary threshold to mask this fraction of tokens first
        (an equal budget); None: compare them as given.
    examples: keep this many of the most disputed tokens of each side.
    precision: "float32" or "float64" (None): the arithmetic of the rule decisions.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    CompareResult:
        rule_a: rule a's SPEC as set (at the budget: the value found).
        rule_b: rule b's SPEC as set.
        budget: the budget, or None.
        settings: with a budget, "a" and "b" -> `BudgetSetting` (param, value, fraction).
        tokens: the loss tokens compared.
        cells: "both", "only_a", "only_b", "neither" -> `Cell` (tokens, fraction, mean_q,
            mean_p, mass).
        masked_a: tokens rule a masks.
        masked_b: tokens rule b masks.
        jaccard: both / (masked by either); None when neither masks a token.
        where: per inference-probability bucket, the cells' tokens (`BucketRow`).
        examples: the most disputed tokens, side a then side b.
    """
    return analysis.compare(
        _paths(sources),
        rule_a,
        rule_b,
        budget=budget,
        examples=examples,
        precision=precision,
        options=options,
        progress=progress,
    )


def drift(
    sources: str | Path | Sequence[str | Path],
    *,
    rules: Sequence[str | Rule] | None = None,
    factor: float = 3.0,
    baseline_steps: int | None = None,
    min_run: int = 3,
    min_rise: float = MIN_RISE,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DriftResult:
    """Per-step mismatch and masked fractions: sustained departures flagged as drift, lone
    heavy-tail steps as spikes, and whether each rule's masked fraction followed.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them (with several steps).
    rules: the settings to follow (SPECs or `Rule`s); None: the report's IPO and IcePop.
    factor: a step is elevated when its trimmed-mean k3 exceeds factor x the baseline's.
    baseline_steps: the first steps that set the baseline (None: 20%, at least 3).
    min_run: consecutive elevated steps that make a drift (fewer: spikes).
    min_rise: a rule "rose" only if its masked fraction rose by at least this much.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    DriftResult:
        factor: as given.
        min_run: as given.
        baseline_steps: the steps of the baseline.
        baseline: its trimmed-mean and mean k3 (medians over those steps).
        statistic: what departs, in words.
        flagged_steps: the drift steps.
        spikes: the lone elevated steps, each with its top-k3 tokens (`spike_steps`: steps).
        rules: a `RuleVerdict` per setting (baseline and drift fractions, verdict).
        steps: a `StepRow` per step (tokens, kl_k1, kl_k3, its median and trimmed mean,
            abs_dp_mean, each setting's masked fraction, flags).
        min_rise: as given.
    """
    return analysis.drift(
        _paths(sources),
        rules=rules,
        factor=factor,
        baseline_steps=baseline_steps,
        min_run=min_run,
        min_rise=min_rise,
        options=options,
        progress=progress,
    )


def drift_runs(
    runs: Mapping[str, str | Path | Sequence[str | Path]],
    *,
    own_rules: Mapping[str, Sequence[str]] | None = None,
    configs: Mapping[str, str | Path | Sequence[str | Path]] | None = None,
    rules: Sequence[str | Rule] | None = None,
    factor: float = 3.0,
    baseline_steps: int | None = None,
    min_run: int = 3,
    min_rise: float = MIN_RISE,
    options: ReadOptions | Mapping[str, ReadOptions] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunsResult:
    """The arms of an ablation side by side (`drift --run NAME=SOURCES ...`): each run's
    drift against its own baseline, its per-step entropy and reward, and a verdict a run.

    Parameters
    ----------
    runs: run name -> its sources (a log file, directory, glob or URI, or a list of them),
        in the order the tables and the figure show them.
    own_rules: run name -> the SPECs of its own rule (what its trainer masked with).
    configs: run name -> its trainer config file(s), read as `--from-config` reads them: their
        rules are the run's own too.
    rules: SPECs (or `Rule`s) applied to every run. None, with a run that has no rule of its
        own: drift's default IPO and IcePop settings.
    factor: a step departs when its trimmed-mean k3 exceeds factor x its run's baseline.
    baseline_steps: the first steps that set each run's baseline (None: 20%, at least 3).
    min_run: consecutive departing steps that make a drift.
    min_rise: a rule "rose" only if its masked fraction rose by at least this much.
    options: how to read the sources: one `ReadOptions` for every run, or run name -> its own.
    progress: called as `progress(rows_read, rows_total)` over all the runs.

    Returns
    -------
    RunsResult:
        runs: a `RunResult` a run: `run`, `drift` (its `DriftResult`), `entropy` and `reward`
            (step -> mean), `reward_over` ("sequences", "tokens" or None) and `verdict` (a
            `RunVerdict`: drift_steps, departs_at, baseline_k3, late_k3, late_early_k3,
            late_early_k3_trimmed, own_rules, collapse, rule_verdicts).
        rules: the SPECs applied to every run.
        factor: as given.
        min_run: as given.
    `.table` is one row per run and step, `.verdicts` one row per run.
    """
    from .analysis.runs import parse_runs

    own_rules, configs = dict(own_rules or {}), dict(configs or {})
    per_run = options if isinstance(options, Mapping) else {}
    unknown = sorted((set(own_rules) | set(configs) | set(per_run)) - set(runs))
    if unknown:
        raise UsageError(f"{unknown[0]!r} is not one of the runs ({', '.join(runs)}).")
    built: list[Run] = []
    for name, src in runs.items():
        files = configs.get(name)
        cfg = [] if files is None else [f"{name}={f}" for f in _paths(files)]
        (run,) = parse_runs(
            [f"{name}={p}" for p in _paths(src)],
            cfg,
            [f"{name}={r}" for r in own_rules.get(name, ())],
        )
        read = per_run.get(name) if isinstance(options, Mapping) else options
        built.append(Run(run.name, tuple(_paths(src)), read, run.rules, run.config))
    return _drift_runs(
        built,
        rules,
        factor=factor,
        baseline_steps=baseline_steps,
        min_run=min_run,
        min_rise=min_rise,
        progress=progress,
    )


def diagnose(
    sources: str | Path | Sequence[str | Path],
    *,
    settings: Sequence[str | Rule] = (),
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiagnoseResult:
    """Why is this run mismatched? Seven findings from one streamed read of the log:
    truncated sampling, temperature, staleness against the engine, position effects,
    placeholder log-probs, the noise floor and alignment (docs/commands/diagnose.md gives
    each signature). Invalid rows are counted, not refused.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    settings: rule settings (SPECs or `Rule`s) the noise-floor finding judges: one whose
        per-token threshold lies below the floor's 90th percentile masks rounding noise.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`; a
        `mapping={"kept_mass": COLUMN}` replays lq + log(kept_mass)).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    DiagnoseResult:
        files: the files read.
        tokens: the loss tokens diagnosed.
        findings: a `Diagnosis` per finding (key, verdict "found" / "clear" / "can't
            tell", evidence, action, numbers, rows); `.get(key)`, `.found`, `.table`.
    """
    return _diagnose(_paths(sources), settings=settings, options=options, progress=progress)


def check(
    sources: str | Path | Sequence[str | Path],
    *,
    max_metric: Mapping[str, float] | None = None,
    max_masked: Mapping[str, float] | None = None,
    per_step: bool = False,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CheckResult:
    """A CI gate: replay once and judge each limit; `result.passed` is the verdict.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    max_metric: metric -> its largest allowed value (`{"kl_k3": 0.01}`); the tool's metric
        names or a dashboard's (`"mismatch_kl/all/mean"`, `"rollout_corr/k3_kl"`).
    max_masked: rule SPEC at one setting -> the largest fraction of tokens it may mask
        (`{"ipo:eps=0.3": 0.01}`).
    per_step: every step must hold every limit (the worst step decides).
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    CheckResult (`passed`: every limit holds; `violations`: the verdicts that fail):
        verdicts: a `Verdict` per limit (limit, value, worst_step, worst_value, ok).
        per_step: as given.
        tokens: the loss tokens judged.
        steps: with per_step, the steps judged.
        notes: what was skipped and why.
    """
    limits = [metric_limit(f"{k}={v}") for k, v in (max_metric or {}).items()]
    limits += [masked_limit(spec, v) for spec, v in (max_masked or {}).items()]
    if not limits:
        raise UsageError("check: give max_metric={'kl_k3': 0.01} or max_masked={SPEC: F}.")
    return _check(_paths(sources), limits, per_step=per_step, options=options, progress=progress)


def inspect(
    sources: str | Path | Sequence[str | Path],
    *,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Summary:
    """What a log holds, without failing on what is wrong with it (invalid rows counted).

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`); invalid rows
        are always counted, not raised.
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    Summary:
        files: the files read.
        format: parquet, prime-rl, nemo-rl, slime or jsonl.
        source: canonical column -> the log's column.
        layout: "token rows" or "sequence rows (list columns)".
        probs: the columns read as probabilities.
        rows: rows read.
        loss_tokens: loss tokens.
        steps: steps.
        sequences: sequences (None without sample_id).
        invalid: "file: column" -> invalid rows.
        invalid_rows: rows with an invalid value.
        metrics: the mismatch metrics of the whole log.
        per_step: the counts and metrics per step (the `.table`).
        warnings: what looked wrong (repeated rows, misaligned columns, ...).
        alignment: the lag check's verdict and evidence.
    """
    return inspect_log(_paths(sources), options, progress=progress)


@dataclass
class ConvertResult(Presentable):
    """What `convert` wrote; `.table`: one row, these fields."""

    output: str
    format: str
    files: int
    partition_by: str | None
    columns: list[str]
    rows_read: int
    tokens: int
    steps: int
    row_groups: int | None
    bytes: int
    seconds: float
    tokens_per_s: float | None
    dropped_rows: int
    dropped_records: int
    dropped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """What `convert --json` prints."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @property
    def table(self) -> pl.DataFrame:
        d = self.to_dict()
        d["columns"] = ", ".join(self.columns)
        d["dropped"] = sum(self.dropped.values())
        d["warnings"] = len(self.warnings)
        return frame([d])

    def summary_lines(self) -> list[str]:
        out = [
            f"ConvertResult: {self.tokens:,} tokens, {self.steps:,} steps -> {self.output} "
            f"({self.bytes:,} bytes, {num(self.seconds, 3)} s)",
            f"  from {self.files:,} {self.format} files, {self.rows_read:,} rows read",
            f"  columns: {', '.join(self.columns)}",
        ]
        if self.dropped_rows or self.dropped_records:
            out.append(f"  dropped: {self.dropped_rows:,} rows, {self.dropped_records:,} records")
        return out + [f"warning: {w}" for w in self.warnings]


def convert(
    sources: str | Path | Sequence[str | Path],
    out: str | Path,
    *,
    partition_by: str | None = None,
    force: bool = False,
    row_group_rows: int = ROW_GROUP_ROWS,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Any supported log -> the canonical token table as zstd Parquet, written atomically.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    out: the Parquet file to write (a directory with partition_by="step").
    partition_by: "step": a hive layout `out/step=N/part-0.parquet`; None: one file.
    force: replace an existing `out`.
    row_group_rows: rows per Parquet row group.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    ConvertResult:
        output: the path written.
        format: the sources' format.
        files: source files read.
        partition_by: as given.
        columns: the canonical columns written.
        rows_read: rows read.
        tokens: loss tokens written.
        steps: steps written.
        row_groups: row groups of the file (None when partitioned).
        bytes: bytes written.
        seconds: the conversion's wall time.
        tokens_per_s: tokens / seconds.
        dropped_rows: invalid rows dropped (with `options.drop_invalid`).
        dropped_records: whole records dropped.
        dropped: "file: column" -> rows dropped.
        warnings: what looked wrong in the sources.
    """
    s = _convert(
        _paths(sources),
        out,
        options,
        partition_by=partition_by,
        force=force,
        progress=progress,
        row_group_rows=row_group_rows,
    )
    return ConvertResult(**s)


def figure_data(
    sources: str | Path | Sequence[str | Path],
    *,
    settings: Sequence[str | Rule] | None = None,
    sweeps: Mapping[str, str | Sequence[float]] | None = None,
    precision: str | None = None,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FigureData:
    """The data behind the figures (`mismatch_replay.viz`: scatter_panels, masked_fraction,
    steps, where_masked, masked_by_length, masked_direction), in four replays; no raw token
    kept.

    Parameters
    ----------
    sources: a log file, directory, glob or URI, or a list of them.
    settings: the rule settings drawn per step and per bucket (SPECs or `Rule`s); None:
        the two IPO defaults, the two IcePop bands, KPop and DPPO-TV the log supports.
        They also decide the sweep, as `sweep -r` reads them: a bare name ("ipo") over its
        threshold parameters' default grids, a setting ("ipo:eps=0.3", a preset, a Rule)
        one row; None: every rule the log supports. masked_fraction.png draws a setting
        on its curves (`curves`).
    sweeps: parameter -> grid for the sweep, as in `sweep`.
    precision: "float32" or "float64" (None): the arithmetic of the rule decisions.
    options: how to read the sources (`mismatch_replay.ingest.ReadOptions`).
    progress: called as `progress(rows_read, rows_total)` after each batch.

    Returns
    -------
    FigureData:
        hist_lin: (200, 200) token counts, [q bin, p bin], probability axes.
        hist_log: the same on log10-probability axes.
        edges_lin: (201,) probability bin edges.
        edges_log10: (201,) log10-probability bin edges.
        sweep: the sweep of the settings given (see `settings`), else every supported rule
            over its default grid (the `.table`).
        settings: the settings drawn.
        steps: the settings' sweep table by step.
        step_metrics: the mismatch metrics by step.
        buckets: the settings' sweep table by inference-probability bucket.
        metrics: the whole log's mismatch metrics.
        tokens: loss tokens.
        sources: the files read.
        notes: what was not drawn and why.
        by_length: the sequence rules' table by sequence length (None without sample_id).
        given: whether `settings` are the ones given (else the defaults).
        presets: SPEC -> exact masked fraction at each catalogue preset (the report's).
        mask_cost: what each setting's mask costs (the chosen settings and the presets
            ipo@prime-rl, ipo@prime-rl-legacy, icepop@prime-rl, dppo-tv@prime-rl,
            kpop@prime-rl: their sweep rows' masked_corrective, ..., masked_entropy_mean),
            masked_direction.png's data; None without an advantage column.
        curves: masked_fraction.png's own table where settings are given (None: the
            figure draws `sweep`): each given setting's threshold curves over the default
            grid with its other parameters at its values, its value a grid point (columns
            `given`: the line is a setting's; `mark`: the settings' labels at that row);
            counted in the same read as the sweep.
    """
    return analysis.figure_data(
        _paths(sources),
        settings=settings,
        sweeps=dict(sweeps) if sweeps is not None else None,
        options=options,
        progress=progress,
        precision=precision,
    )


__all__ = [
    "ConvertResult",
    "check",
    "choose",
    "compare",
    "convert",
    "diagnose",
    "drift",
    "drift_runs",
    "figure_data",
    "inspect",
    "replay",
    "sweep",
]
