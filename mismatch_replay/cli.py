"""The `mismatch-replay` command line: parse, call one library function, format.

Design
------
No computation lives here. Each command turns its options into library arguments, calls one
function (`engine.sweep`, `summary.inspect_log`, ...) and formats the result: a rich table on
stdout by default, machine-readable output with `--json` or `-o FILE`. Progress bars and
notes go to stderr so that stdout can be piped. Library errors (`ReplayError`) become one
readable line on stderr and exit code 1 (bad data) or 2 (bad usage); no traceback.
Heavy modules are imported inside the commands so that `--help` starts fast.

On a terminal (tests/test_pty.py runs every command in one, 80 and 120 columns): the progress
line (`_progress`) counts rows per pass over the log with rate, elapsed time and time left;
tables get column widths that fit the terminal without breaking a number or a rule parameter
(`_fit`; rich alone squeezes columns below their longest word and cuts with an ellipsis), and a
sweep that cannot fit as one table is folded into one table per rule setting. Text from the
library is printed without rich markup (`[torch]` in an install hint is not a style tag).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from inspect import cleandoc
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import ReplayError, UsageError


class _PlainFlags:
    """Flags render as plain flags in --help: `--json`, not `--json <bool>` (typer 0.29 shows
    a flag's type unless it has a metavar; an empty metavar shows nothing)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_PlainFlags, typer.core.TyperCommand):
    pass


class _Group(_PlainFlags, typer.core.TyperGroup):
    pass


app = typer.Typer(
    name="mismatch-replay",
    cls=_Group,
    help=(
        "Replay logged trainer/inference token probabilities through every masking rule "
        "(IPO, IcePop, KPop, DPPO, TIS, sequence rules, ...) across threshold sweeps. "
        "Results go to stdout, progress and notes to stderr."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
out = Console(width=None if sys.stdout.isatty() else 140)
# On a terminal, notes wrap between words; elsewhere (logs, pipes) a message stays one line.
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def _reflow(doc: str) -> str:
    """A docstring's paragraphs as single lines. In rich markup mode typer keeps a
    docstring's line breaks, so text wrapped at 100 columns in the source would break
    mid-sentence at any other width; rich rewraps single-line paragraphs to the terminal."""
    paragraphs = cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def command(fn: Callable) -> Callable:
    """Register a command: its docstring (reflowed) is its --help; flags print plainly."""
    return app.command(cls=_Command, help=_reflow(fn.__doc__ or ""))(fn)


# ----------------------------------------------------------------------------- shared options

Sources = Annotated[
    list[str],
    typer.Argument(
        metavar="SOURCES",
        help="Token logs: Parquet or JSONL files, captured step=N/ trees, prime-rl "
        "token_exports or traces, NeMo-RL train_data_step<N>.jsonl, slime .pt dumps, SkyRL "
        ".pkl dumps; directories (searched recursively) or globs.",
    ),
]
MapOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--map",
        metavar="CANONICAL=THEIRS",
        help="Read a canonical column from another name (repeatable), e.g. --map advantage=adv.",
    ),
]
ProbsOpt = Annotated[
    bool, typer.Option("--probs", help="The mapped columns hold probabilities, not log-probs.")
]
DropOpt = Annotated[
    bool,
    typer.Option(
        "--drop-invalid",
        help="Drop rows with NaN, inf, log-probs > 0, ... and report how many (default: error).",
    ),
]
BatchOpt = Annotated[
    int,
    typer.Option(
        "--batch-rows", min=1, metavar="N", help="Rows per streamed batch (bounds memory)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        metavar="FORMAT",
        help="The log's format: auto (default: detected from the paths), parquet, jsonl, "
        "prime-rl (token export), prime-rl-traces, nemo-rl, slime or skyrl.",
    ),
]
PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        metavar="float64|float32",
        help="Replay the rule decisions in float64 (default) or in the float32 arithmetic the "
        "frameworks run on the GPU (its NaNs and roundings included; metrics stay float64).",
    ),
]
IoTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--io-timeout",
        min=0,
        metavar="SECONDS",
        help="Object stores (s3://, gs:// ...): seconds to wait for a connection or an answer "
        "before failing (0: no limit).",
    ),
]
FromConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--from-config",
        metavar="FILE",
        help="Take the rules and their thresholds from the trainer's own config (repeatable; "
        "later files win): prime-rl TOML, verl / AReaL / NeMo-RL / SkyRL YAML or Hydra "
        "overrides, TRL GRPOConfig YAML or flags, slime / OpenRLHF launch scripts.",
    ),
]
FrameworkOpt = Annotated[
    str | None,
    typer.Option(
        "--framework",
        metavar="NAME",
        help="The --from-config file's framework (default: detected from its keys): "
        "prime-rl, verl, areal, trl, nemo-rl, slime, skyrl, openrlhf.",
    ),
]


def _config_rules(paths: list[Path] | None, framework: str | None, rules: list[str] | None):
    """--from-config: (the TrainerConfig or None, --rule SPECs + the config's SPECs); the
    config's notes go to stderr."""
    if not paths:
        if framework:
            from .errors import UsageError

            raise UsageError("--framework names the --from-config file's framework; give one.")
        return None, rules
    from .integrations.config_in import read_config

    cfg = read_config(paths, framework, require=True)
    err.print(f"[dim]{cfg.framework} config: {escape(', '.join(cfg.specs()))}[/]", highlight=False)
    for n in cfg.all_notes():
        err.print(f"[dim]  {escape(n)}[/]", highlight=False)
    return cfg, [*(rules or []), *cfg.specs()]


UnstableOpt = Annotated[
    bool,
    typer.Option(
        "--include-unstable",
        help="Also read steps not yet marked complete: prime-rl steps without STABLE, "
        "captured steps (TokenWriter) without _SUCCESS.",
    ),
]


def _options(
    map_: list[str] | None,
    probs: bool,
    drop: bool,
    batch_rows: int,
    fmt: str | None = None,
    include_unstable: bool = False,
    io_timeout: float = 30.0,
):
    from .io import ReadOptions, parse_mapping

    return ReadOptions(
        mapping=parse_mapping(map_ or []),
        probs=probs,
        drop_invalid=drop,
        batch_rows=batch_rows,
        format=fmt,
        include_unstable=include_unstable,
        io_timeout=io_timeout or None,
    )


def _progress_columns(unit: str):
    """Columns of the progress line: a spinner, the label, a bar (it pulses while the total
    is unknown), this pass's `done/total unit` (`done unit` when unknown), the rate and the
    time elapsed (both over every pass), and the time left in this pass when it is known."""
    import time

    from rich.progress import BarColumn, ProgressColumn, SpinnerColumn, TextColumn
    from rich.table import Column
    from rich.text import Text

    def clock(seconds: float) -> str:
        m, s = divmod(int(seconds), 60)
        return f"{m // 60}:{m % 60:02d}:{s:02d}"

    class Count(ProgressColumn):
        def render(self, task) -> Text:
            done = f"{task.completed:,.0f}"
            if task.total is None:
                return Text(f"{done} {unit}", style="progress.download")
            return Text(f"{done}/{task.total:,.0f} {unit}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            dt = time.monotonic() - task.fields["t0"]
            rate = task.fields["rows"] / dt if dt > 0 else 0
            return Text(f"{rate:,.0f} {unit}/s" if rate else "", style="progress.data.speed")

    class Elapsed(ProgressColumn):
        def render(self, task) -> Text:
            return Text(clock(time.monotonic() - task.fields["t0"]), style="progress.elapsed")

    class Left(ProgressColumn):
        def render(self, task) -> Text:
            left = task.time_remaining
            if task.total is None or task.finished or left is None:
                return Text("")
            return Text(f"eta {clock(left)}", style="progress.remaining")

    def whole() -> Column:  # a column that never wraps: the bar gives way instead
        return Column(no_wrap=True)

    return (
        SpinnerColumn(),
        TextColumn("[bold]{task.description}", table_column=whole()),
        BarColumn(bar_width=None),  # what the other columns leave
        Count(table_column=whole()),
        Rate(table_column=whole()),
        Elapsed(table_column=whole()),
        Left(table_column=whole()),
    )


@contextmanager
def _progress(label: str, unit: str = "rows"):
    """A progress line on stderr, only when stderr is a terminal; yields a callback
    `update(done, total)` (None otherwise), the library's progress protocol.

    A total <= 0 means unknown: the line shows a spinner, the count and the rate; with a
    total, a bar and the time left (totals are estimates from file sizes: a count beyond the
    estimate raises the total to it). Commands that read the log several times (report,
    demo, choose with a bootstrap, compare with --budget) count from 0 again for each pass:
    a count below the last one, or the same count again after a finished pass, starts the
    next pass, and the line says which; rate and elapsed time run over all passes. The line
    is drawn when the display starts and once more when it stops (so even a run shorter
    than one refresh shows its final count), then cleared."""
    import time

    from rich.progress import Progress

    if not err.is_terminal:
        yield None
        return
    with Progress(*_progress_columns(unit), console=err, transient=True, expand=True) as bar:
        task = bar.add_task(label, total=None, rows=0, t0=time.monotonic())
        last = {"pass": 1, "done": 0, "finished": False, "before": 0}

        def update(done: int, total: int | None) -> None:
            known = total if total is not None and total > 0 else None
            if known is not None and done > known:
                known = done
            if done < last["done"] or (done == last["done"] > 0 and last["finished"]):
                last["pass"] += 1
                last["before"] += last["done"]
                name = f"{label} (pass {last['pass']})"
                bar.reset(task, total=known, completed=done, description=name)
            bar.update(task, completed=done, total=known, rows=last["before"] + done)
            last["done"], last["finished"] = done, known is not None and done >= known

        yield update


def _run(fn: Callable[[], None]) -> None:
    """Run a command body; library errors become one line on stderr and an exit code.
    Warnings the library issues (mismatch_replay's own categories) print as they happen."""
    import warnings

    show = warnings.showwarning

    def _show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("mismatch_replay"):
            err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False)
        else:
            show(message, category, filename, lineno, file, line)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show
            warnings.filterwarnings("always", module=r"mismatch_replay\.")  # every call
            fn()
    except ReplayError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (output.terminate_as_interrupt)
        from .output import Terminated

        term = isinstance(exc, Terminated)
        err.print("terminated" if term else "interrupted", highlight=False)
        raise typer.Exit(143 if term else 130) from None


def _command(ctx: typer.Context) -> str:
    """The command line that reproduces this call, rebuilt from the parsed parameters."""
    import shlex

    words = ["mismatch-replay", ctx.info_name or ""]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is None or v == p.default or v == [] or (v is False and p.default is None):
            continue
        if getattr(p, "param_type_name", "") == "argument":
            words += [str(x) for x in (v if isinstance(v, list | tuple) else [v])]
        elif getattr(p, "is_flag", False):
            words.append(p.opts[0])
        else:
            for x in v if isinstance(v, list | tuple) else [v]:
                words += [p.opts[0], str(x)]
    return shlex.join(words)


def _report_drops(report) -> None:
    records = getattr(report, "dropped_records", 0)
    if report.dropped_rows or records:
        what = f"dropped {report.dropped_rows:,} invalid loss rows"
        if records:
            what += f" and skipped {records:,} unreadable records"
        err.print(f"[yellow]{what}[/] (--drop-invalid):", highlight=False)
        for (f, c), n in report.dropped.items():
            if not c.startswith("*"):
                err.print(f"  {f}: {c}: {n:,}", highlight=False, markup=False)


def _add_row(t: Table, *cells: str) -> None:
    """Add a row of plain text (brackets in rule settings are not rich markup)."""
    t.add_row(*[escape(c) for c in cells])


def _fit(t: Table, width: int | None = None) -> bool:
    """Fix the column widths of `t` so that it fits `width` (default: stdout's) without
    breaking a word: each column gets at least its longest word (a number, a rule parameter,
    a header word), and the rest of the width goes to the columns that would wrap, those
    that lack least first (so that as few columns as possible wrap). False, widths untouched,
    when even the longest words do not fit: the caller folds the table (fewer columns per
    table) or lets rich wrap. (rich alone shrinks columns below their longest word and cuts
    numbers with an ellipsis.)"""
    from rich.measure import Measurement

    width = out.width if width is None else width
    opts = out.options.update_width(10_000)
    lo, hi = [], []
    for c in t.columns:
        ms = [Measurement.get(out, opts, x) for x in [c.header, *c.cells]]
        lo.append(max(m.minimum for m in ms))
        hi.append(max(m.maximum for m in ms))
    _, right, _, left = t.padding
    n = len(t.columns)
    extra = (left + right) * n + (n - 1 if t.box else 0)
    extra += 2 if t.box and t.show_edge else 0
    extra -= 0 if t.pad_edge else left + right
    room = width - extra
    if sum(hi) <= room:
        return True
    if sum(lo) > room:
        return False
    spare, need, give = room - sum(lo), [h - m for h, m in zip(hi, lo, strict=True)], [0] * n
    for i in sorted(range(n), key=lambda i: need[i]):  # unwrap the most columns
        give[i] = min(need[i], spare)
        spare -= give[i]
    for c, m, g in zip(t.columns, lo, give, strict=True):
        c.width = m + g
    return True


def _fmt_num(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.3g}"
    return f"{x:.{digits}g}"


def _pct(x) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    return f"{100 * x:.3g}%"


# ----------------------------------------------------------------------------- commands


@command
def rules(json_: JsonOpt = False) -> None:
    """The rule catalogue: parameters, defaults, presets, definitions and sources."""
    from .rules import catalogue_records

    recs = catalogue_records()
    if json_:
        from .output import to_json

        print(to_json({"rules": recs}))
        return
    t = Table(title="mismatch-replay rule catalogue", show_lines=True)
    for c in ("rule", "parameters (default)", "presets", "masked when / source"):
        t.add_column(c, overflow="fold")
    for r in recs:
        params = "\n".join(
            p["name"] + (" (no default)" if p["default"] is None else f"={_fmt_num(p['default'])}")
            for p in r["params"]
        )
        presets = "\n".join(
            f"@{k}: " + ", ".join(f"{a}={_fmt_num(b)}" for a, b in v.items())
            for k, v in r["presets"].items()
        )
        needs = f"\nneeds: {', '.join(r['needs'])}" if r["needs"] else ""
        _add_row(
            t,
            f"{r['name']}\n{r['level']} {r['kind']}",
            params,
            presets or "-",
            f"{r['definition']}\n{r['source']}{needs}",
        )
    _fit(t)
    out.print(t)


@command
def inspect(
    sources: Sources,
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    json_: JsonOpt = False,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
) -> None:
    """What a log holds, and how far trainer and inference disagree on it.

    Columns found, rows, loss tokens, steps, sequences, invalid rows, and the
    trainer-inference mismatch (k1, k3 KL, |dp|) overall and per step.
    """

    def body():
        from .adapters import prime_check
        from .summary import inspect_log

        with _progress("inspect") as cb:
            opts = _options(map_, probs, True, batch_rows, fmt, include_unstable, io_timeout)
            s = inspect_log(sources, opts, progress=cb)
        # a prime-rl log carries the run's own decisions: replay them (one more read)
        agree = prime_check(sources, opts) if s.format.startswith("prime-rl") else None
        if json_:
            from .output import to_json

            d = s.to_dict()
            if agree is not None:
                d["prime_rl_check"] = agree.to_dict()
            print(to_json(d))
            return
        t = Table(title="log", show_header=False)
        t.add_column("what", style="bold")
        t.add_column("value", overflow="fold")
        _add_row(t, "files", "\n".join(s.files) if len(s.files) <= 5 else f"{len(s.files)} files")
        _add_row(t, "format", s.format)
        _add_row(t, "layout", s.layout)
        _add_row(
            t,
            "columns",
            ", ".join(f"{c} <- {src}" if c != src else c for c, src in s.source.items()),
        )
        if s.probs:
            _add_row(t, "probabilities", ", ".join(s.probs) + " (converted to log-probs)")
        _add_row(t, "rows", f"{s.rows:,}")
        _add_row(t, "loss tokens", f"{s.loss_tokens:,}")
        _add_row(t, "steps", f"{s.steps:,}")
        _add_row(t, "sequences", "-" if s.sequences is None else f"{s.sequences:,}")
        inv = "none" if not s.invalid else "\n".join(f"{k}: {v:,}" for k, v in s.invalid.items())
        _add_row(t, "invalid rows", inv)
        _add_row(t, "alignment", s.alignment)
        if agree is not None:
            _add_row(t, "prime-rl check", agree.line())
        _fit(t)
        out.print(t)
        from .metrics import NAMES

        m = Table(title="mismatch (loss tokens)")
        m.add_column("metric")
        m.add_column("value", justify="right")
        m.add_column("framework name", style="dim")
        for k, v in s.metrics.items():
            _add_row(m, k, _fmt_num(v), NAMES.get(k, ("", ""))[0])
        _fit(m)
        out.print(m)
        if s.steps > 1:
            st = Table(title="per step")
            cols = ("step", "tokens", "kl_k1", "kl_k3", "kl_k3_max", "abs_dp_mean")
            for c in cols:
                st.add_column(c, justify="right")
            for row in s.per_step.iter_rows(named=True):
                _add_row(st, *[_fmt_num(row[c]) for c in cols])
            _fit(st)
            out.print(st)

    _run(body)


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
            "mismatch_kl/all/mean or rollout_corr/k3_kl (README: A CI gate on mismatch).",
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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    json_: JsonOpt = False,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
) -> None:
    """A CI gate: exit 0 when every limit holds, 3 when one is exceeded.

    Replays the log once through the rules named with --rule and judges each limit on the
    whole log (or, with --per-step, on every step). Prints a verdict table (limit, value,
    worst step); --json adds `violations`. Exit codes: 0 pass, 3 a limit exceeded, 1 bad
    data, 2 bad usage.
    """
    from .check import masked_limit, metric_limit

    def body():
        from .check import check as run_check

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
        with _progress("check") as cb:
            opts = _options(map_, probs, drop, batch_rows, fmt, include_unstable, io_timeout)
            res = run_check(sources, limits, per_step=per_step, options=opts, progress=cb)
        if json_:
            from .output import to_json

            def row(v):
                return {
                    "limit": v.limit.label,
                    "kind": v.limit.kind,
                    "metric": v.limit.name if v.limit.kind == "metric" else None,
                    "rule": v.limit.name if v.limit.kind == "masked" else None,
                    "max": v.limit.limit,
                    "value": v.value,
                    "worst_step": v.worst_step,
                    "worst_value": v.worst_value,
                    "ok": v.ok,
                }

            print(
                to_json(
                    {
                        "passed": res.passed,
                        "per_step": res.per_step,
                        "tokens": res.tokens,
                        "steps": res.steps,
                        "verdicts": [row(v) for v in res.verdicts],
                        "violations": [row(v) for v in res.violations],
                    }
                )
            )
        else:
            scope = f"every one of {res.steps:,} steps" if per_step else "the whole log"
            t = Table(title=f"check: {res.tokens:,} loss tokens, limits on {scope}")
            for c, j in (("limit", "left"), ("max", "right"), ("value", "right")):
                t.add_column(c, justify=j)
            if per_step:
                t.add_column("worst step", justify="right")
                t.add_column("worst value", justify="right")
            t.add_column("verdict")
            for v in res.verdicts:
                cells = [v.limit.label, _fmt_num(v.limit.limit), _fmt_num(v.value)]
                if per_step:
                    cells += [_fmt_num(v.worst_step), _fmt_num(v.worst_value)]
                t.add_row(*[escape(c) for c in cells], "ok" if v.ok else "[bold red]EXCEEDED[/]")
            _fit(t)
            out.print(t)
        if not res.passed:
            n = len(res.violations)
            err.print(
                f"check failed: {n} of {len(res.verdicts)} limit(s) exceeded", highlight=False
            )
            raise typer.Exit(3)

    _run(body)


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
            help="Rule SPEC (repeatable): name[:param=value,...] or name@preset, "
            "e.g. ipo:eps=0.3, icepop@verl. Default: every rule the log supports.",
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
            metavar="step|env|q_bucket|length",
            help="Group the counts: per step, per env, per q_bucket (the inference "
            "probability of each token, in 10 buckets; a sequence spans buckets, so there the "
            "sequence columns and the counts of sequence rules are empty), or per length (the "
            "sequence's loss tokens, in buckets [1,2), [2,4), [4,8) ...; one extra read of the "
            "log counts them).",
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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    json_: JsonOpt = False,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    from_config: FromConfigOpt = None,
    framework: FrameworkOpt = None,
    precision: PrecisionOpt = "float64",
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
        from .engine import parse_sweeps
        from .engine import sweep as run_sweep

        if output is not None:
            from .output import check_target

            check_target(output, force)
        _, rules = _config_rules(from_config, framework, rule)
        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        with _progress("sweep") as cb:
            res = run_sweep(
                sources,
                rules=rules or None,
                sweeps=parse_sweeps(sweep_ or []),
                by=by,
                options=opts,
                progress=cb,
                match=match,
                engine=engine,
                ray_address=ray_address,
                precision=precision,
            )
        _report_drops(res.tally.report)
        for note in res.notes:
            err.print(f"[dim]note: {escape(note)}[/]", highlight=False)
        for w in res.warnings:
            err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
        meta = {"command": _command(ctx), "version": __version__}
        if output is not None:
            from .output import write_table

            write_table(res.table, output, force=force, meta=meta)
            err.print(f"wrote {res.table.height:,} rows to {output}", highlight=False, markup=False)
            return
        if json_:
            from .output import to_json

            print(to_json({**meta, "rows": res.table.to_dicts()}))
            return
        _print_sweep(res.table, by, all_rows)

    _run(body)


def _rule_label(rule: str, setting: str | None) -> str:
    """'dppo-kl' + 'high=0.05,clamp=20' -> 'dppo-kl [high=0.05, clamp=20]': a narrow column
    wraps between the fixed parameters, never inside one (no two settings read the same)."""
    return rule + (f" [{setting.replace(',', ', ')}]" if setting else "")


def _spec_header(spec: str) -> str:
    """A rule SPEC as a column header, one part per line: 'icepop:low=0.2,high=5' ->
    'icepop\nlow=0.2\nhigh=5', so a header is as narrow as its longest part and never cut."""
    name, _, params = spec.partition(":")
    return "\n".join([name, *params.split(",")]) if params else name


def _group_cell(by: str, v) -> str:
    from .tables import group_label

    return group_label(by, v)


def _sweep_table(
    title: str, part, kind: str, by, seqs: bool, prime: bool, job: bool, groups: bool = False
) -> Table:
    """One table of sweep rows. job=False: every rule, one row per rule x value (x group);
    job=True: the rows of one rule setting and swept parameter (the value column is headed
    by the parameter's name; the rule is in the title)."""
    t = Table(title=escape(title), show_edge=False)
    param = part["param"][0]
    cols = [param] if job else ["rule [fixed]", "param", "value"]
    cols += [by, "tokens"] if by else []
    if kind == "mask":
        cols += ["masked", "masked n"] + (["seqs masked"] if seqs else []) + ["|dp| masked"]
        cols += ["groups all masked"] if groups else []
        cols += ["is_masked/ mean"] if prime else []
    else:
        cols += ["truncated", "truncated n", "w mean", "w max", "ESS"]
    for c in cols:
        left = c in ("rule [fixed]", "param")
        t.add_column(escape(c), justify="left" if left else "right", overflow="fold")
    prev = prev_value = None
    for r in part.iter_rows(named=True):
        label = _rule_label(r["rule"], r["setting"])
        value = _fmt_num(r["value"])
        if job:  # grouped rows of one value: the value once
            row = [value if value != prev_value else ""]
        else:
            row = [label if label != prev else "", r["param"], value]
        prev, prev_value = label, value
        if by:
            row += [_group_cell(by, r[by]), _fmt_num(r["tokens"])]
        if kind == "mask":
            row += [_pct(r["masked_fraction"]), _fmt_num(r["masked_tokens"])]
            if seqs:
                row.append(_pct(r["masked_sequence_fraction"]))
            row.append(_pct(r["masked_mass_fraction"]))
            if groups:
                row.append(_pct(r["fully_masked_group_fraction"]))
            if prime:
                row.append(_pct(r["is_masked_mean"]))
        else:
            row += [
                _pct(r["truncated_fraction"]),
                _fmt_num(r["truncated_tokens"]),
                _fmt_num(r["weight_mean"]),
                _fmt_num(r["weight_max"]),
                _pct(r["weight_ess"]),
            ]
        _add_row(t, *row)
    return t


def _print_sweep(df, by: str | None, all_rows: bool) -> None:
    """The sweep as tables: one per kind (mask, weight) with a row per rule x value (x
    group); where that does not fit the terminal without breaking a number or a rule
    parameter, folded into one table per rule setting."""
    import polars as pl

    from .tables import TOKEN_GROUPS, loss_tokens, preview, prompt_groups

    shown = df if all_rows else preview(df)
    seqs = df["sequences"].null_count() < df.height
    prime = df["is_masked_mean"].null_count() < df.height
    total = loss_tokens(df, by)
    of = "" if total is None else f", of {total:,} loss tokens"
    of += f"; tokens: per {by}" if by else ""
    n_groups = prompt_groups(df, by)
    groups = n_groups is not None
    if groups:  # the log has a group_id: GRPO groups whose every sample a rule masks
        of += f"; {n_groups:,} prompt groups (step, group_id)"
    for kind in ("mask", "weight"):
        part = shown.filter(pl.col("kind") == kind)
        if part.height == 0:
            continue
        verb = "masked" if kind == "mask" else "truncated"
        t = _sweep_table(
            f"{verb} by each {kind} rule{of}", part, kind, by, seqs, prime, False, groups
        )
        if _fit(t):
            out.print(t)
            continue
        for _, job in part.group_by(["rule", "setting", "param"], maintain_order=True):
            label = _rule_label(job["rule"][0], job["setting"][0])
            title = f"{verb} by {label}, {job['param'][0]} swept{of}"
            t = _sweep_table(title, job, kind, by, seqs, prime, True, groups)
            _fit(t)
            out.print(t)
    if by in TOKEN_GROUPS:
        err.print(
            f"[dim]note: --by {by} groups tokens, and a sequence spans groups: the sequence "
            "columns are empty, and so are the counts of sequence rules (they mask whole "
            "sequences).[/]",
            highlight=False,
        )
    if shown.height < df.height:
        err.print(
            f"[dim]showing {shown.height:,} of {df.height:,} rows; --all prints every row, "
            "-o FILE.csv|.parquet|.json writes them.[/]",
            highlight=False,
        )


RuleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rule", "-r", metavar="SPEC", help="Rule SPEC (repeatable), e.g. ipo, icepop@prime-rl."
    ),
]


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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    precision: PrecisionOpt = "float64",
    json_: JsonOpt = False,
) -> None:
    """The threshold that masks a target fraction of tokens, per rule.

    With a 95% bootstrap interval: how much the answer would move on another log of the same
    run. Without --rule: every mask rule the log supports, each threshold parameter (two-sided
    bands: each side with the other at its default). The answer is exact on a grid refined
    until the fraction is within 1% of the target, or limited by ties in the data (said).

    --from-config reads the rules from the trainer's config; --emit writes the answer back
    in its syntax: choose LOG --from-config rl.toml -t 0.0025 --emit prime-rl.
    """

    def body():
        from .analysis import choose as run_choose

        if emit:
            from .integrations.config_out import check_target

            check_target(emit)  # before any pass over the log
        cfg, rules = _config_rules(from_config, framework, rule)
        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        with _progress("choose") as cb:
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
            )
        text = None
        if emit:
            from .integrations.config_out import emit as emit_text

            text = emit_text(emit, rows, base=cfg)
        if json_:
            from .output import to_json

            doc = {"target_fraction": target_fraction, "rows": rows}
            if cfg is not None:
                doc["config"] = cfg.to_dict()
            if text is not None:
                doc["emit"] = {"framework": emit, "text": text}
            print(to_json(doc))
            return
        title = (
            f"threshold masking {_pct(target_fraction)} of tokens"
            if target_fraction is not None
            else "masked fraction at each setting"
        )
        t = Table(title=title, show_edge=False)
        for c in ("rule [fixed]", "param", "value", "95% interval", "masked", "status"):
            left = c in ("rule [fixed]", "param")
            t.add_column(escape(c), justify="left" if left else "right", overflow="fold")
        notes: list[str] = []
        for r in rows:
            label = _rule_label(r["rule"], r["setting"])
            show = _pct if target_fraction is None else _fmt_num
            ci = "-" if r["ci_low"] is None else f"{show(r['ci_low'])} .. {show(r['ci_high'])}"
            status = r["status"] + (f" [{len(notes) + 1}]" if r["note"] else "")
            if r["note"]:
                notes.append(r["note"])
            _add_row(
                t, label, r["param"], _fmt_num(r["value"]), ci, _pct(r["masked_fraction"]), status
            )
        con = err if text is not None else out  # with --emit, stdout is the override
        _fit(t)
        con.print(t)
        for i, n in enumerate(notes, 1):
            con.print(f"[{i}] {n}", highlight=False, markup=False)
        if text is not None:
            print(text, end="")

    _run(body)


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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    precision: PrecisionOpt = "float64",
    json_: JsonOpt = False,
) -> None:
    """Two rules on the same tokens: which tokens each masks that the other keeps.

    Tokens masked by both, only A, only B, neither; their mean probabilities and |p - q|
    mass; where (inference-probability buckets) the two disagree.
    """

    def body():
        from .analysis import compare as run_compare
        from .errors import UsageError

        if len(rule) != 2:
            raise UsageError(f"compare needs exactly two --rule options, got {len(rule)}.")
        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        with _progress("compare") as cb:
            res = run_compare(
                sources, rule[0], rule[1], budget, examples, opts, cb, precision=precision
            )
        if json_:
            from .output import to_json

            print(to_json(res))
            return
        a, b = res["rule_a"], res["rule_b"]
        if res["settings"]:
            for k, v in res["settings"].items():
                err.print(
                    f"budget {_pct(budget)}: rule {k.upper()} set to {v['param']}="
                    f"{_fmt_num(v['value'])} (masks {_pct(v['masked_fraction'])}, {v['status']})",
                    highlight=False,
                )
        t = Table(title=f"A = {a}   B = {b}   ({res['tokens']:,} loss tokens)", show_edge=False)
        for c in ("", "tokens", "fraction", "mean q (infer)", "mean p (train)", "|dp| mass"):
            t.add_column(c, justify="left" if not c else "right")
        names = {
            "both": "masked by both",
            "only_a": "only A",
            "only_b": "only B",
            "neither": "neither",
        }
        for k, label in names.items():
            c = res["cells"][k]
            _add_row(
                t,
                label,
                f"{c['tokens']:,}",
                _pct(c["fraction"]),
                _fmt_num(c["mean_q"]),
                _fmt_num(c["mean_p"]),
                _fmt_num(c["mass"]),
            )
        _fit(t)
        out.print(t)
        out.print(f"Jaccard overlap of the masked sets: {_fmt_num(res['jaccard'])}")
        w = Table(title="where they disagree (inference probability q)", show_edge=False)
        for c in ("q bucket", "tokens", "both", "only A", "only B"):
            w.add_column(c, justify="right")
        for r in res["where"]:
            _add_row(
                w,
                r["q_bucket"],
                f"{r['tokens']:,}",
                f"{r['both']:,}",
                f"{r['only_a']:,}",
                f"{r['only_b']:,}",
            )
        _fit(w)
        out.print(w)
        if res["examples"]:
            e = Table(title="most disputed tokens (largest |log p - log q|)", show_edge=False)
            cols = [
                c
                for c in ("masked_by", "step", "sample_id", "position", "q", "p", "abs_dp")
                if c in res["examples"][0]
            ]
            for c in cols:
                e.add_column(c.replace("abs_dp", "|dp|"), justify="right")
            for x in res["examples"]:
                _add_row(e, *[x[c].upper() if c == "masked_by" else _fmt_num(x[c]) for c in cols])
            _fit(e)
            out.print(e)

    _run(body)


@command
def drift(
    sources: Sources,
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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    json_: JsonOpt = False,
) -> None:
    """Per-step mismatch and masked fractions; flags the steps where the run drifted.

    Per step: k1, k3, robust k3, |dp| and each rule's masked fraction. Flags sustained drift
    from an early-step baseline, reports lone heavy-tail steps as spikes (with the tokens
    that caused them), and says whether each rule's masked fraction followed the mismatch.
    """

    def body():
        from .analysis import drift as run_drift

        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        with _progress("drift") as cb:
            res = run_drift(sources, rule or None, factor, baseline_steps, min_run, opts, cb)
        if json_:
            from .output import to_json

            print(to_json(res))
            return
        _print_drift(res)
        out.print(
            f"drift: {_steps(res['flagged_steps'])}; spikes: {_steps(res['spike_steps'])}",
            highlight=False,
        )
        for v in res["rules"]:
            ratio = f" (masked fraction x{v['ratio']:.3g})" if v.get("ratio") else ""
            out.print(f"  {v['rule']}: {v['verdict']}{ratio}", highlight=False, markup=False)
        for s in res["spikes"]:
            toks = "; ".join(
                f"k3={x['k3']:.3g} q={x['q']:.3g} p={x['p']:.3g}"
                + (f" seq {x['sample_id']}" if "sample_id" in x else "")
                + (f" pos {x['position']}" if "position" in x else "")
                for x in s["tokens"][:3]
            )
            out.print(f"  spike at step {s['step']}: {toks}", highlight=False, markup=False)

    _run(body)


def _steps(steps: list) -> str:
    if not steps:
        return "none"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def _print_drift(res: dict) -> None:
    """Two tables, so that both fit 80 columns: the per-step mismatch, then the masked
    fraction of each rule setting per step (headed by the setting, one parameter a line;
    as many settings per table as fit)."""
    base = res["baseline_steps"]
    flags = ["DRIFT" if r["drift"] else ("spike" if r["spike"] else "") for r in res["steps"]]
    t = Table(
        title=f"mismatch per step (baseline: steps {base[0]}..{base[-1]}, "
        f"factor {res['factor']:g} on k3 trimmed)",
        show_edge=False,
    )
    for c in ("step", "tokens", "k1", "k3 mean", "k3 trimmed", "k3 median", "|dp| mean", "flag"):
        t.add_column(escape(c), justify="right", overflow="fold")
    for r, flag in zip(res["steps"], flags, strict=True):
        _add_row(
            t,
            str(r["step"]),
            f"{r['tokens']:,}",
            _fmt_num(r["kl_k1"]),
            _fmt_num(r["kl_k3"]),
            _fmt_num(r["kl_k3_trimmed"]),
            _fmt_num(r["kl_k3_median"]),
            _fmt_num(r["abs_dp_mean"]),
            flag,
        )
    _fit(t)
    out.print(t)
    labels = [k for k in res["steps"][0] if k.startswith("masked:")]

    def masked(cols: list[str]) -> Table:
        m = Table(title="masked fraction per step", show_edge=False)
        for c in ["step", *[_spec_header(x.removeprefix("masked:")) for x in cols], "flag"]:
            m.add_column(escape(c), justify="right", overflow="fold")
        for r, flag in zip(res["steps"], flags, strict=True):
            _add_row(m, str(r["step"]), *[_pct(r[x]) for x in cols], flag)
        return m

    size = len(labels)
    while size > 1 and not _fit(masked(labels[:size])):
        size -= 1
    for i in range(0, len(labels), size):
        m = masked(labels[i : i + size])
        _fit(m)
        out.print(m)


OutDir = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        metavar="DIR",
        show_default=False,
        help="Directory to write into; by default a new folder in the current directory, "
        "named after the command.",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Overwrite files that already exist in the directory.")
]
SettingOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rule",
        "-r",
        metavar="SPEC",
        help="Settings to draw (repeatable SPEC). Default: IPO 0.3 and 0.1, IcePop [0.2, 5] "
        "and [0.5, 5], KPop 0.1, DPPO-TV 0.2 (when the log has advantages).",
    ),
]


@command
def plot(
    sources: Sources,
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
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    log_format: Annotated[str | None, typer.Option("--log-format", hidden=True)] = None,
) -> None:
    """The four figures of a log, as PNG, SVG or PDF files.

    scatter (q vs p with the IPO band and the IcePop cone), masked_fraction (every rule
    against its threshold), steps (k3 and masked fractions per step) and where_masked (masked
    fraction per inference-probability bucket).
    """

    def body():
        from .errors import UsageError
        from .pipeline import plot as run_plot

        if fmt in ("png", "svg", "pdf"):  # plot --format used to be the image format
            raise UsageError(
                f"--format {fmt}: --format is the log's format, as in every command; "
                f"the image format is --image-format {fmt}."
            )
        log = fmt or log_format  # --log-format: the old name of --format here
        opts = _options(map_, probs, drop_invalid, batch_rows, log, include_unstable, io_timeout)
        with _progress("plot") as cb:
            paths = run_plot(
                sources, output, rule or None, image_format, target_fraction, force, opts, cb
            )
        for name, p in paths.items():
            out.print(f"{name:16s} {p}", highlight=False, markup=False)

    _run(body)


@command
def report(
    ctx: typer.Context,
    sources: Sources,
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
            "WANDB_MODE=offline writes a local run (DIR/wandb/) for `wandb sync`. Needs the "
            "[wandb] extra.",
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
            "Needs the [tensorboard] extra (tensorboardX).",
        ),
    ] = None,
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
    precision: PrecisionOpt = "float64",
    precision_threshold: Annotated[
        float,
        typer.Option(
            "--precision-threshold",
            metavar="F",
            help="With --precision float32: a line in the report for every setting whose "
            "float32 and float64 masked fractions differ by more than F.",
        ),
    ] = 0.001,
) -> None:
    """Everything on one self-contained HTML page (index.html, figures embedded).

    The figures, the sweep table, the log summary, the preset defaults, a Decision section
    (choose, compare, drift), the exact command and the tool version. --wandb and
    --tensorboard log the same into the tools the training run already uses.
    """

    def body():
        from .pipeline import report as run_report

        if wandb_artifact and not wandb:
            raise UsageError("--wandb-artifact logs to the --wandb run; give --wandb too.")
        if wandb:
            from .integrations.wandb_log import check as check_wandb

            check_wandb(wandb)  # before any pass over the log
        if tensorboard is not None:
            from .integrations.tensorboard_log import check as check_tb

            check_tb()
        _, settings = _config_rules(from_config, framework, rule)
        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        command = _command(ctx)
        keep: dict = {}
        with _progress("report") as cb:
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
            )
        out.print(f"report: {path}", highlight=False, markup=False)
        if not (wandb or tensorboard is not None):
            return
        from .integrations.outputs import collect

        logged = collect(output, keep.get("data"), keep.get("decisions"), command=command)
        if wandb:
            from .integrations.wandb_log import log_to_wandb

            parquet = None
            if wandb_artifact:
                from .convert import convert as run_convert

                parquet = Path(output) / "tokens.parquet"
                with _progress("convert") as cb:
                    run_convert(sources, parquet, opts, force=force, progress=cb)
            info = log_to_wandb(wandb, logged, artifact=parquet, dir=output)
            out.print(
                f"wandb: {info['entity']}/{info['project']}/{info['id']} ({info['mode']}; "
                f"{len(info['keys'])} keys; {info['dir']})",
                highlight=False,
                markup=False,
            )
        if tensorboard is not None:
            from .integrations.tensorboard_log import log_to_tensorboard

            info = log_to_tensorboard(tensorboard, logged)
            out.print(f"tensorboard: {info['event_file']}", highlight=False, markup=False)

    _run(body)


@command
def simulate(
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="FILE", help="Parquet file to write.")
    ],
    scenario: Annotated[
        str,
        typer.Option("--scenario", metavar="healthy|stale|drift", help="healthy, stale or drift."),
    ] = "drift",
    steps: Annotated[
        int | None, typer.Option("--steps", metavar="N", min=1, help="RL steps.")
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch", metavar="N", min=1, help="Sequences per step (a multiple of 8, the group)."
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", metavar="N", min=1, help="Response tokens per sequence."),
    ] = None,
    staleness: Annotated[
        int | None,
        typer.Option(
            "--staleness", metavar="N", min=0, help="Optimizer steps the trainer leads the sampler."
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="N", help="Same seed, same file, bit for bit.")
    ] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a token log whose mismatch comes from real numerics (needs torch).

    A small transformer sampled in bf16 by an 'inference engine' and rescored in fp32 by a
    'trainer' that runs ahead by --staleness optimizer steps, in an async policy-gradient
    loop.
    """

    def body():
        import dataclasses

        from .errors import UsageError

        try:
            from .simulate import SCENARIOS, SimConfig
            from .simulate import simulate as run_sim
        except ImportError as exc:
            raise UsageError(str(exc)) from None
        if scenario not in SCENARIOS:
            raise UsageError(f"--scenario {scenario}: use one of {', '.join(SCENARIOS)}.")
        given = {"steps": steps, "batch": batch, "seq_len": seq_len, "staleness": staleness}
        try:  # SimConfig checks its fields: a bad combination is a usage error, no traceback
            cfg = dataclasses.replace(
                SimConfig(scenario=scenario, seed=seed), **{k: v for k, v in given.items() if v}
            )
            if staleness == 0:
                cfg = dataclasses.replace(cfg, staleness=0)
            cfg.validate()
        except ValueError as exc:
            raise UsageError(f"simulate: {exc}.") from None
        if output.exists() and not force:  # checked again when the file is published
            raise UsageError(f"-o {output}: the file exists. Pass --force to overwrite it.")
        output.parent.mkdir(parents=True, exist_ok=True)
        with _progress("simulate", unit="steps") as cb:
            summary = run_sim(cfg, output, progress=cb, force=force)
        err.print(
            f"wrote {output}: {summary.get('tokens', 0):,} tokens, "
            f"{summary.get('tokens_per_second', 0):,.0f} tokens/s",
            highlight=False,
            markup=False,
        )

    _run(body)


@command
def demo(
    output: OutDir = Path("mismatch-replay-demo"),
    force: ForceOpt = False,
) -> None:
    """The whole tool on the bundled sample log, no arguments needed.

    The sample is a simulated run that drifts: inspect, sweep, the figures and the HTML
    report, written into ./mismatch-replay-demo/.
    """

    def body():
        from .pipeline import demo as run_demo

        with _progress("demo") as cb:
            paths = run_demo(output, force, cb)
        out.print(f"[bold]mismatch-replay demo[/] wrote {escape(str(output))}/:", highlight=False)
        for name, p in paths.items():
            out.print(f"  {name:16s} {p}", highlight=False, markup=False)
        out.print(f"Open {paths['report']} in a browser.", highlight=False, markup=False)

    _run(body)


@command
def convert(
    sources: Sources,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="The canonical table: FILE.parquet, or a directory with --partition-by step.",
        ),
    ],
    partition_by: Annotated[
        str | None,
        typer.Option(
            "--partition-by",
            metavar="step",
            help="Write a hive layout, one directory per step: DIR/step=N/.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    row_group_rows: Annotated[
        int,
        typer.Option("--row-group-rows", metavar="N", min=1, help="Rows per Parquet row group."),
    ] = 1_000_000,
    map_: MapOpt = None,
    probs: ProbsOpt = False,
    drop_invalid: DropOpt = False,
    batch_rows: BatchOpt = 1_000_000,
    json_: JsonOpt = False,
    fmt: FormatOpt = None,
    include_unstable: UnstableOpt = False,
    io_timeout: IoTimeoutOpt = 30.0,
) -> None:
    """Any supported log to the canonical token table: convert once, replay fast after.

    Reads prime-rl, NeMo-RL, slime, JSONL or Parquet logs; writes zstd Parquet, loss tokens
    only.

    Written to a temporary file and renamed at the end, so an interrupted run leaves nothing.
    """

    def body():
        from .convert import convert as run_convert

        opts = _options(map_, probs, drop_invalid, batch_rows, fmt, include_unstable, io_timeout)
        with _progress("convert") as cb:
            s = run_convert(
                sources,
                output,
                opts,
                partition_by=partition_by,
                force=force,
                progress=cb,
                row_group_rows=row_group_rows,
            )
        if s["dropped_rows"] or s["dropped_records"]:
            err.print(
                f"[yellow]dropped {s['dropped_rows']:,} invalid loss rows and skipped "
                f"{s['dropped_records']:,} unreadable records[/] (--drop-invalid):",
                highlight=False,
            )
            for k, n in s["dropped"].items():
                err.print(f"  {k}: {n:,}", highlight=False, markup=False)
        if json_:
            from .output import to_json

            print(to_json(s))
            return
        err.print(
            f"wrote {s['tokens']:,} loss tokens ({s['steps']:,} steps) from {s['files']:,} "
            f"{s['format']} file(s) to {s['output']}: {s['bytes'] / 1e6:.3g} MB zstd Parquet, "
            f"in {s['seconds']:.3g} s ({(s['tokens_per_s'] or 0):,.0f} tokens/s)",
            highlight=False,
            markup=False,
        )

    _run(body)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(f"mismatch-replay {__version__}")
        raise typer.Exit(0)


def main() -> None:
    from .output import exit_process, terminate_as_interrupt

    terminate_as_interrupt()  # SIGTERM unwinds like Ctrl-C: temporaries and m2po spills removed
    try:
        app(prog_name="mismatch-replay")  # also under `python -m mismatch_replay`
    except SystemExit as exc:
        exit_process(exc.code)  # os._exit where an object-store request is still stuck
    exit_process(0)


if __name__ == "__main__":  # pragma: no cover
    main()
