"""The commands: each parses its options, calls one library function and hands the result
to render.

Design
------
The commands that read a log, one function each, registered on `core.app` by
`@command` (simulate, demo and convert, which write one, are in logs.py). A command's
signature is its interface (flags, metavars, --help text, defaults); the shared options are
types from options.py, and the seven read options are one parameter, `read: Reads`. The body
runs under `core.run` (library errors -> one line and an exit code) and does three things:
check the combinations of options that typer cannot (a usage error before any pass over the
log), call the library (`engine.sweep`, `analysis.choose`, `viz.jobs.report`, ...) with a
progress callback from `render.progress`, and print the result with a `render.print_*`
function, or as JSON with `--json` (`render.print_json`), or into `-o FILE`. Library modules
are imported inside the bodies so that `--help` starts fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import __version__
from ..errors import UsageError
from . import render
from . import runs as cli_runs
from .core import command, command_line, run
from .options import (
    READ_DEFAULTS,
    ForceOpt,
    FrameworkOpt,
    FromConfigOpt,
    JsonOpt,
    OutDir,
    PrecisionOpt,
    Reads,
    ReadsCountingInvalid,
    RuleOpt,
    RunConfigOpt,
    RunFormatOpt,
    RunMapOpt,
    RunOpt,
    RunProbsOpt,
    RunRuleOpt,
    SettingOpt,
    Sources,
    SourcesOrRuns,
)


def _config_rules(paths: list[Path] | None, framework: str | None, rules: list[str] | None):
    """--from-config: (the TrainerConfig or None, --rule SPECs + the config's SPECs); the
    config's notes go to stderr."""
    if not paths:
        if framework:
            raise UsageError("--framework names the --from-config file's framework; give one.")
        return None, rules
    from ..integrations.config_in import read_config

    cfg = read_config(paths, framework, require=True)
    render.print_config(cfg)
    return cfg, [*(rules or []), *cfg.specs()]


@command
def rules(json_: JsonOpt = False) -> None:
    """The rule catalogue: parameters, defaults, presets, definitions and sources."""
    from ..rules import catalogue_records

    recs = catalogue_records()
    if json_:
        from ..rules.cost import DEFINITIONS

        render.print_json({"rules": recs, "mask_cost": DEFINITIONS})
        return
    render.print_rules(recs)


@command
def inspect(
    sources: Sources,
    read: ReadsCountingInvalid = READ_DEFAULTS,
    json_: JsonOpt = False,
) -> None:
    """What a log holds, and how far trainer and inference disagree on it.

    Columns found, rows, loss tokens, steps, sequences, invalid rows, and the
    trainer-inference mismatch (k1, k3 KL, |dp|) overall and per step.
    """

    def body():
        from ..analysis.inspect import inspect_log, prime_check

        with render.progress("inspect") as cb:
            opts = read.options()
            s = inspect_log(sources, opts, progress=cb)
        # a prime-rl log carries the run's own decisions: replay them (one more read)
        agree = prime_check(sources, opts) if s.format.startswith("prime-rl") else None
        if json_:
            d = s.to_dict()
            if agree is not None:
                d["prime_rl_check"] = agree.to_dict()
            render.print_json(d)
            return
        render.print_inspect(s, agree)

    run(body)


@command
def check(
    sources: Sources,
    max_: Annotated[
        list[str] | None,
        typer.Option(
            "--max",
            metavar="METRIC=V",
            help="A metric limit (repeatable): the metric must be at most V, e.g. "
            "--max kl_k3=0.01; the tool's names (inspect lists them) or a dashboard's, e.g. "
            "mismatch_kl/all/mean or rollout_corr/k3_kl (docs/commands/check.md).",
        ),
    ] = None,
    rule: Annotated[
        list[str] | None,
        typer.Option(
            "--rule",
            "-r",
            metavar="SPEC",
            help="A rule at one setting whose masked fraction is limited by the --max-masked "
            "given after it (repeatable), e.g. -r ipo:eps=0.3 --max-masked 0.01.",
        ),
    ] = None,
    max_masked: Annotated[
        list[float] | None,
        typer.Option(
            "--max-masked",
            metavar="F",
            help="The largest masked token fraction (0..1) allowed for each --rule, in order; "
            "one value for all of them, or one per --rule.",
        ),
    ] = None,
    per_step: Annotated[
        bool,
        typer.Option("--per-step", help="Every step must hold every limit (the worst decides)."),
    ] = False,
    read: Reads = READ_DEFAULTS,
    json_: JsonOpt = False,
) -> None:
    """A CI gate: exit 0 when every limit holds, 3 when one is exceeded.

    Replays the log once through the rules named with --rule and judges each limit on the
    whole log (or, with --per-step, on every step). Prints a verdict table (limit, value,
    worst step); --json adds `violations`. Exit codes: 0 pass, 3 a limit exceeded, 1 bad
    data, 2 bad usage.
    """

    def body():
        from ..analysis.check import check as run_check
        from ..analysis.check import masked_limit, metric_limit

        specs = rule or []
        fracs = max_masked or []
        if specs and len(fracs) not in (1, len(specs)):
            raise UsageError(
                f"--max-masked: give one value for all {len(specs)} --rule options or one "
                f"for each (got {len(fracs)})."
            )
        if fracs and not specs:
            raise UsageError("--max-masked limits the rule given with --rule: add -r SPEC.")
        if specs and not fracs:
            raise UsageError("--rule needs a limit: add --max-masked F (a fraction, 0..1).")
        limits = [metric_limit(m) for m in (max_ or [])]
        limits += [
            masked_limit(sp, fracs[i] if len(fracs) > 1 else fracs[0]) for i, sp in enumerate(specs)
        ]
        with render.progress("check") as cb:
            opts = read.options()
            res = run_check(sources, limits, per_step=per_step, options=opts, progress=cb)
        notes = _precision_notes(sources, specs, opts)
        if json_:
            render.print_json({**res.to_dict(), "precision_notes": notes})
        else:
            render.print_check(res, per_step)
        if not res.passed:
            render.print_check_failed(res)
            raise typer.Exit(3)

    run(body)


def _precision_notes(sources, settings, opts, precision=None) -> list[dict]:
    """The precision notes of the settings a command printed (engine.precision_notes_for:
    a framework preset whose float32 count differs from its exact one), each printed as a
    note on stderr; returned as dicts for --json."""
    from ..engine import precision_notes_for

    notes = precision_notes_for(sources, settings, opts, precision)
    for n in notes:
        render.note(n.line)
    return [n.to_dict() for n in notes]


@command
def sweep(
    ctx: typer.Context,
    sources: Sources,
    rule: Annotated[
        list[str] | None,
        typer.Option(
            "--rule",
            "-r",
            metavar="SPEC",
            help="Rule SPEC (repeatable). A bare name (ipo) sweeps the rule's threshold "
            "parameters over their default grids, as the sweep without --rule does; "
            "name:param=value,... (ipo:eps=0.3) or name@preset (icepop@verl) is one setting, "
            "one row. Default: every rule the log supports.",
        ),
    ] = None,
    sweep_: Annotated[
        list[str] | None,
        typer.Option(
            "--sweep",
            "-s",
            metavar="PARAM=GRID",
            help="Sweep a parameter: PARAM=GRID or RULE.PARAM=GRID; GRID is a,b,c or "
            "start:stop:num[:log] (repeatable).",
        ),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            metavar="step|env|q_bucket|length|lag|position",
            help="Group the counts: per step, per env, per q_bucket (the inference "
            "probability of each token, in 10 buckets; a sequence spans buckets, so there the "
            "sequence columns and the counts of sequence rules are empty), or per length (the "
            "sequence's loss tokens, in buckets [1,2), [2,4), [4,8) ...; one extra read of the "
            "log counts them), per lag (step - version: the policy lag, per token) or per "
            "position (the token's position, in buckets [1,2), [2,4) ...; per token too).",
        ),
    ] = None,
    match: Annotated[
        str | None,
        typer.Option(
            "--match",
            metavar="prime-rl",
            help="Reproduce a trainer's logging conventions: 'prime-rl' drops zero-advantage "
            "tokens and adds is_masked_mean (prime-rl's is_masked/mean).",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Write the full table: .csv, .parquet or .json.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing -o file.")] = False,
    all_rows: Annotated[
        bool, typer.Option("--all", help="Print every row (default: a preview of long sweeps).")
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also print, on stderr, the path each job ran on (fused or simple) and why.",
        ),
    ] = False,
    read: Reads = READ_DEFAULTS,
    json_: JsonOpt = False,
    from_config: FromConfigOpt = None,
    framework: FrameworkOpt = None,
    precision: PrecisionOpt = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="local|ray",
            help="local (this machine, every core) or ray (one task per file on a Ray "
            "cluster; needs the package's ray extra).",
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            metavar="ADDRESS",
            help="With --engine ray: the cluster to attach to (default: RAY_ADDRESS, else a "
            "local one).",
        ),
    ] = None,
) -> None:
    """What each rule masks at every value of its threshold, in one streaming pass.

    Prints, per rule and value, the tokens and sequences it masks (or, for weight rules,
    truncates) and the |p - q| mass it drops. Without --rule: every rule the log supports,
    each threshold parameter swept over its default grid (>= 100 values).
    """

    def body():
        from ..engine import parse_sweeps
        from ..engine import sweep as run_sweep
        from ..rules.spec import sweep_specs

        if output is not None:
            from ..output import check_target

            check_target(output, force)
        _, rules = _config_rules(from_config, framework, rule)
        opts = read.options()
        with render.progress("sweep") as cb:
            res = run_sweep(
                sources,
                rules=sweep_specs(rules) if rules else None,
                sweeps=parse_sweeps(sweep_ or []),
                by=by,
                options=opts,
                progress=cb,
                match=match,
                engine=engine,
                ray_address=ray_address,
                precision=precision,
            )
        render.print_drops(res.tally.report)
        for note in res.notes:
            render.note(note)
        for pn in res.precision_notes:
            render.note(pn.line)
        for w in res.warnings:
            render.warn(w)
        if verbose:
            render.print_paths(res.paths)
        meta = {"command": command_line(ctx), "version": __version__}
        if output is not None:
            from ..output import write_table

            write_table(res.table, output, force=force, meta=meta)
            render.say(f"wrote {res.table.height:,} rows to {output}", to_err=True)
            return
        if json_:
            notes = [pn.to_dict() for pn in res.precision_notes]
            render.print_json(
                {**meta, "paths": res.paths, "precision_notes": notes, "rows": res.table.to_dicts()}
            )
            return
        render.print_sweep(res.table, by, all_rows)

    run(body)


@command
def choose(
    sources: Sources,
    target_fraction: Annotated[
        float | None,
        typer.Option(
            "--target-fraction",
            "-t",
            metavar="F",
            help="Find, per rule, the threshold that masks this fraction of loss tokens "
            "(e.g. 0.0025). Without it: the masked fraction at each --rule setting.",
        ),
    ] = None,
    rule: RuleOpt = None,
    bootstrap: Annotated[
        int,
        typer.Option(
            "--bootstrap",
            metavar="N",
            min=0,
            help="Bootstrap replicates for the interval (0: off).",
        ),
    ] = 200,
    bootstrap_unit: Annotated[
        str | None,
        typer.Option(
            "--bootstrap-unit",
            metavar="sequence|step",
            help="Resample 'sequence' (default when sample_id exists) or 'step'.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Bootstrap seed.")] = 0,
    of: Annotated[
        str,
        typer.Option(
            "--of",
            metavar="tokens|adv-mass",
            help="What --target-fraction is a share of: the loss tokens (default), or the "
            "advantage mass sum |A| the mask removes (masked_adv_mass_fraction).",
        ),
    ] = "tokens",
    from_config: FromConfigOpt = None,
    framework: FrameworkOpt = None,
    emit: Annotated[
        str | None,
        typer.Option(
            "--emit",
            metavar="FRAMEWORK[:SYNTAX]",
            help="Print, on stdout, the override that sets each chosen threshold in that "
            "framework's own syntax (prime-rl TOML; verl, NeMo-RL, SkyRL Hydra overrides; "
            "AReaL YAML; TRL, slime, OpenRLHF flags; SYNTAX: toml, yaml, hydra or cli). The "
            "table goes to stderr.",
        ),
    ] = None,
    read: Reads = READ_DEFAULTS,
    precision: PrecisionOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The threshold that masks a target fraction of tokens, per rule.

    With a 95% bootstrap interval: how much the answer would move on another log of the same
    run. Without --rule: every mask rule the log supports, each threshold parameter (two-sided
    bands: each side with the other at its default). The answer is exact on a grid refined
    until the fraction is within 1% of the target, or limited by ties in the data (said).

    --from-config reads the rules from the trainer's config (with --rule, only the --rule
    rules are chosen and the config is what the answer is written over); --emit writes the
    answer back in its syntax, only the keys of the rules chosen, each threshold with the
    fewest digits inside its interval: choose LOG --from-config rl.toml -t 0.0025 --emit
    prime-rl.
    """

    def body():
        from ..analysis import choose as run_choose

        if emit:
            from ..integrations.config_out import check_target

            check_target(emit)  # before any pass over the log
        cfg, rules = _config_rules(from_config, framework, rule)
        if cfg is not None and rule:  # the question is --rule's; the config is the base
            rules = list(rule)
        opts = read.options()
        with render.progress("choose") as cb:
            rows = run_choose(
                sources,
                target_fraction,
                rules or None,
                bootstrap=bootstrap,
                unit=bootstrap_unit,
                seed=seed,
                options=opts,
                progress=cb,
                precision=precision,
                of=of,
            )
        notes = _precision_notes(sources, [r.spec for r in rows], opts, precision)
        text = None
        if emit:
            from ..integrations.config_out import emit as emit_text

            text = emit_text(emit, rows, base=cfg)
        if json_:
            doc = {**rows.to_dict(), "precision_notes": notes}
            if cfg is not None:
                doc["config"] = cfg.to_dict()
            if text is not None:
                doc["emit"] = {"framework": emit, "text": text}
            render.print_json(doc)
            return
        # with --emit, stdout is the override and the table goes to stderr
        render.print_choose(rows, target_fraction, to_err=text is not None)
        if text is not None:
            print(text, end="")

    run(body)


@command
def compare(
    sources: Sources,
    rule: Annotated[
        list[str],
        typer.Option(
            "--rule", "-r", metavar="SPEC", help="Exactly two rule SPECs: --rule A --rule B."
        ),
    ],
    budget: Annotated[
        float | None,
        typer.Option(
            "--budget",
            metavar="F",
            help="First set each rule's primary parameter to mask this fraction "
            "(iso-budget: at equal cost, which tokens does each rule choose?).",
        ),
    ] = None,
    examples: Annotated[
        int,
        typer.Option(
            "--examples", metavar="K", min=0, help="Show the K most disputed tokens per side."
        ),
    ] = 0,
    read: Reads = READ_DEFAULTS,
    precision: PrecisionOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Two rules on the same tokens: which tokens each masks that the other keeps.

    Tokens masked by both, only A, only B, neither; their mean probabilities and |p - q|
    mass; where (inference-probability buckets) the two disagree.
    """

    def body():
        from ..analysis import compare as run_compare

        if len(rule) != 2:
            raise UsageError(f"compare needs exactly two --rule options, got {len(rule)}.")
        opts = read.options()
        with render.progress("compare") as cb:
            res = run_compare(
                sources, rule[0], rule[1], budget, examples, opts, cb, precision=precision
            )
        notes = _precision_notes(sources, [res.rule_a, res.rule_b], opts, precision)
        if json_:
            render.print_json({**res.to_dict(), "precision_notes": notes})
            return
        render.print_compare(res, budget)

    run(body)


@command
def drift(
    sources: SourcesOrRuns = None,
    rule: RuleOpt = None,
    factor: Annotated[
        float,
        typer.Option(
            "--factor",
            metavar="X",
            help="A step departs when its trimmed-mean k3 exceeds the baseline by this factor.",
        ),
    ] = 3.0,
    baseline_steps: Annotated[
        int | None,
        typer.Option(
            "--baseline-steps",
            metavar="N",
            min=1,
            help="Early steps forming the baseline (default: the first 20%, at least 3).",
        ),
    ] = None,
    min_run: Annotated[
        int,
        typer.Option(
            "--min-run", metavar="N", min=1, help="Consecutive departing steps that make drift."
        ),
    ] = 3,
    min_rise: Annotated[
        float,
        typer.Option(
            "--min-rise",
            metavar="F",
            min=0.0,
            max=1.0,
            help="A rule rose only if its masked fraction over the drift steps rose by at least "
            "this fraction of tokens (default 0.0005 = 0.05 percentage points); a smaller rise "
            "is flat, whatever its ratio.",
        ),
    ] = 5e-4,
    read: Reads = READ_DEFAULTS,
    json_: JsonOpt = False,
    run_: RunOpt = None,
    run_config: RunConfigOpt = None,
    run_rule: RunRuleOpt = None,
    run_map: RunMapOpt = None,
    run_format: RunFormatOpt = None,
    run_probs: RunProbsOpt = None,
) -> None:
    """Per-step mismatch and masked fractions; flags the steps where the run drifted.

    Per step: k1, k3, robust k3, |dp| and each rule's masked fraction. Flags sustained drift
    from an early-step baseline, reports lone heavy-tail steps as spikes (with the tokens
    that caused them), and says whether each rule's masked fraction followed the mismatch.

    With --run NAME=SOURCES (repeated): the arms of an ablation side by side, each against
    its own baseline: k3, entropy, reward and the masked fraction under the run's own rule
    (--run-config NAME=FILE or --run-rule NAME=SPEC) and under each -r rule, and a verdict
    a run (drift, the step it departs at, late / early k3, the collapse signature).
    """

    def body():
        from ..analysis import drift as run_drift

        opts = read.options()
        runs = cli_runs.runs_of(
            sources, run_, run_config, run_rule, "drift", opts, run_map, run_format, run_probs
        )
        if runs is not None:
            kw = {"factor": factor, "baseline_steps": baseline_steps, "min_run": min_run}
            cli_runs.drift(runs, opts, rule, json_, min_rise=min_rise, **kw)
            return
        with render.progress("drift") as cb:
            res = run_drift(
                sources, rule or None, factor, baseline_steps, min_run, opts, cb, min_rise
            )
        # its per-step masked fractions: a preset's float32 count beside its exact one
        notes = _precision_notes(sources, [v.rule for v in res.rules], opts)
        if json_:
            render.print_json({**res.to_dict(), "precision_notes": notes})
            return
        render.print_drift(res)

    run(body)


@command
def diagnose(
    sources: Sources,
    rule: RuleOpt = None,
    read: ReadsCountingInvalid = READ_DEFAULTS,
    json_: JsonOpt = False,
    from_config: FromConfigOpt = None,
    framework: FrameworkOpt = None,
) -> None:
    """Why is this run mismatched? One finding a row: found, clear or can't tell.

    Truncated sampling (top-p/top-k), temperature, staleness against the engine, position
    effects, placeholder log-probs, the noise floor (the -r / --from-config settings below it
    mask rounding noise) and alignment, from one streamed read. Exits 0 (check is the gate).
    """

    def body():
        from ..analysis.diagnose import diagnose as run_diagnose

        _, rules = _config_rules(from_config, framework, rule)
        with render.progress("diagnose") as cb:
            res = run_diagnose(sources, rules or (), read.options(), cb)
        render.print_json(res.to_dict()) if json_ else render.print_diagnose(res)

    run(body)


@command
def plot(
    sources: SourcesOrRuns = None,
    output: OutDir = Path("mismatch-replay-plots"),
    rule: SettingOpt = None,
    image_format: Annotated[
        str,
        typer.Option("--image-format", metavar="png|svg|pdf", help="The figures' file format."),
    ] = "png",
    target_fraction: Annotated[
        float | None,
        typer.Option(
            "--target-fraction",
            "-t",
            metavar="F",
            help="Reference line on the masked-fraction plot.",
        ),
    ] = None,
    force: ForceOpt = False,
    read: Reads = READ_DEFAULTS,
    log_format: Annotated[str | None, typer.Option("--log-format", hidden=True)] = None,
    run_: RunOpt = None,
    run_config: RunConfigOpt = None,
    run_rule: RunRuleOpt = None,
    run_map: RunMapOpt = None,
    run_format: RunFormatOpt = None,
    run_probs: RunProbsOpt = None,
) -> None:
    """The figures of a log, as PNG, SVG or PDF files.

    scatter (q vs p with the IPO band and the IcePop cone), masked_fraction (every rule
    against its threshold), steps (k3 and masked fractions per step), where_masked (masked
    fraction per inference-probability bucket), when the log has sequence ids,
    masked_by_length (product vs geometric sequence rules per sequence-length bucket) and,
    when it has advantages, masked_direction (what each setting's mask costs the gradient:
    corrective / divergent / neutral masked updates, the |A| mass removed, their entropy).
    """

    def body():
        import dataclasses

        from ..viz.jobs import plot as run_plot

        fmt = read.format
        if fmt in ("png", "svg", "pdf"):  # plot --format used to be the image format
            raise UsageError(
                f"--format {fmt}: --format is the log's format, as in every command; "
                f"the image format is --image-format {fmt}."
            )
        # --log-format: the old name of --format here
        opts = dataclasses.replace(read, format=fmt or log_format).options()
        runs = cli_runs.runs_of(
            sources, run_, run_config, run_rule, "plot", opts, run_map, run_format, run_probs
        )
        if runs is not None:  # runs.png: the runs side by side (drift --run's figure)
            cli_runs.plot(runs, opts, rule, output, image_format, force)
            return
        with render.progress("plot") as cb:
            paths = run_plot(
                sources, output, rule or None, image_format, target_fraction, force, opts, cb
            )
        for name, p in paths.items():
            render.say(f"{name:16s} {p}")
        # the figures' settings (-r, or the default ones): a preset's float32 count beside
        # its exact one, on stderr after the file list
        from ..analysis.figure_data import default_settings
        from ..ingest import plan_sources

        plan = plan_sources(sources, opts)
        _precision_notes(plan, rule or default_settings(plan.columns), opts)

    run(body)


@command
def report(
    ctx: typer.Context,
    sources: SourcesOrRuns = None,
    output: OutDir = Path("mismatch-replay-report"),
    rule: SettingOpt = None,
    target_fraction: Annotated[
        float,
        typer.Option(
            "--target-fraction",
            "-t",
            metavar="F",
            help="The masked fraction the Decision section chooses thresholds for.",
        ),
    ] = 0.0025,
    bootstrap: Annotated[
        int,
        typer.Option("--bootstrap", min=0, metavar="N", help="Bootstrap replicates (0: off)."),
    ] = 200,
    force: ForceOpt = False,
    from_config: FromConfigOpt = None,
    framework: FrameworkOpt = None,
    wandb: Annotated[
        str | None,
        typer.Option(
            "--wandb",
            metavar="ENTITY/PROJECT[/RUN_ID]",
            help="Also log the report to Weights & Biases: into the training run RUN_ID "
            "(resumed) or a new run; the figures, the sweep and choose tables, the page, and "
            "the per-step series under mismatch_replay/* against their own step. "
            "W&B's own settings apply (WANDB_MODE, WANDB_DIR, WANDB_NAME, ...): "
            "WANDB_MODE=offline writes a local run for `wandb sync` into $WANDB_DIR/wandb/, or "
            "DIR/wandb/ when WANDB_DIR is unset. Needs the \\[wandb] extra.",
        ),
    ] = None,
    wandb_artifact: Annotated[
        bool,
        typer.Option(
            "--wandb-artifact",
            help="With --wandb: also convert the log to the canonical Parquet table "
            "(DIR/tokens.parquet) and log it as a dataset artifact.",
        ),
    ] = False,
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            "--tensorboard",
            metavar="LOGDIR",
            help="Also write TensorBoard event files into LOGDIR: the per-step series as "
            "scalars at their steps, the figures as images, the chosen thresholds as text. "
            "Needs the \\[tensorboard] extra (tensorboardX).",
        ),
    ] = None,
    read: Reads = READ_DEFAULTS,
    precision: PrecisionOpt = None,
    precision_threshold: Annotated[
        float,
        typer.Option(
            "--precision-threshold",
            metavar="F",
            help="With --precision float32: a line in the report for every setting whose "
            "float32 and float64 masked fractions differ by more than F.",
        ),
    ] = 0.001,
    run_: RunOpt = None,
    run_config: RunConfigOpt = None,
    run_rule: RunRuleOpt = None,
    run_map: RunMapOpt = None,
    run_format: RunFormatOpt = None,
    run_probs: RunProbsOpt = None,
) -> None:
    """Everything on one self-contained HTML page (index.html, figures embedded).

    The figures, the sweep table, the log summary, the preset defaults, a Decision section
    (choose, compare, drift), the exact command and the tool version. --wandb and
    --tensorboard log the same into the tools the training run already uses.
    """

    def body():
        from ..viz.jobs import report as run_report

        per_run = (run_map, run_format, run_probs)  # each run's own read options
        runs = cli_runs.runs_of(
            sources, run_, run_config, run_rule, "report", read.options(), *per_run
        )
        if runs is not None:  # the runs side by side: findings, runs.png, verdicts
            one_log = bool(from_config or wandb or tensorboard is not None)
            cli_runs.report(runs, read.options(), rule, output, command_line(ctx), force, one_log)
            return
        if wandb_artifact and not wandb:
            raise UsageError("--wandb-artifact logs to the --wandb run; give --wandb too.")
        if wandb:
            from ..integrations.wandb_log import check as check_wandb

            check_wandb(wandb)  # before any pass over the log
        if tensorboard is not None:
            from ..integrations.tensorboard_log import check as check_tb

            check_tb()
        cfg, settings = _config_rules(from_config, framework, rule)
        opts = read.options()
        command = command_line(ctx)
        keep: dict = {}
        with render.progress("report") as cb:
            path = run_report(
                sources,
                output,
                command,
                settings or None,
                target_fraction,
                bootstrap,
                force,
                opts,
                cb,
                precision=precision,
                precision_threshold=precision_threshold,
                keep=keep,
                config=(cfg.framework, cfg.specs()) if cfg is not None else None,
            )
        render.say(f"report: {path}")
        render.print_findings(keep.get("findings", ()))
        if not (wandb or tensorboard is not None):
            return
        from ..integrations.outputs import collect

        logged = collect(output, keep.get("data"), keep.get("decisions"), command=command)
        if wandb:
            from ..integrations.wandb_log import log_to_wandb

            parquet = None
            if wandb_artifact:
                from ..ingest.convert import convert as run_convert

                parquet = Path(output) / "tokens.parquet"
                with render.progress("convert") as cb:
                    run_convert(sources, parquet, opts, force=force, progress=cb)
            info = log_to_wandb(wandb, logged, artifact=parquet, default_dir=output)
            render.say(
                f"wandb: {info['entity']}/{info['project']}/{info['id']} ({info['mode']}; "
                f"{len(info['keys'])} keys; {info['dir']})"
            )
        if tensorboard is not None:
            from ..integrations.tensorboard_log import log_to_tensorboard

            info = log_to_tensorboard(tensorboard, logged)
            render.say(f"tensorboard: {info['event_file']}")

    run(body)
