"""What the command line shows on a terminal: the progress line, tables that fit, each result.

Design
------
Two consoles: `out` (stdout, results) and `err` (stderr, progress and notes), so that stdout
can be piped. Off a terminal, `out` is 140 columns wide and `err` keeps a message on one line
(logs, pipes); on one, both follow the terminal. Every function here looks the two consoles
up when it runs, so a test can swap `render.err` for a console of its own.

- `progress(label)`: the progress line on stderr (only on a terminal), counting rows per
  pass over the log with rate, elapsed time and time left; yields the library's progress
  callback `update(done, total)`.
- `fit(table)`: column widths that fit the terminal without breaking a number or a rule
  parameter (rich alone squeezes columns below their longest word and cuts with an
  ellipsis). A sweep that cannot fit as one table is folded into one table per rule setting
  (`print_sweep`), drift's masked fractions into as many settings per table as fit.
- One `print_*` per command result (`print_rules`, `print_inspect`, `print_check`,
  `print_sweep`, `print_paths`, `print_choose`, `print_compare`, `print_drift`,
  `print_demo`, `print_convert`), plus `say`, `note`, `warn` and `error` for single lines.

Text from the library is printed without rich markup (`add_row` escapes every cell; lines go
out with markup=False): `[torch]` in an install hint is not a style tag. Nothing here reads a
log or computes a number: the commands (commands.py) hand over what the library returned
(ingest's Summary, engine's sweep table and paths, analysis's CheckResult, ChooseResult,
CompareResult and DriftResult); --json prints the same objects' `to_dict()`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console(width=None if sys.stdout.isatty() else 140)
# On a terminal, notes wrap between words; elsewhere (logs, pipes) a message stays one line.
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


# ----------------------------------------------------------------------------- lines


def say(text: str, to_err: bool = False) -> None:
    """One line of plain text (no markup, no highlighting) on stdout, or stderr."""
    (err if to_err else out).print(text, highlight=False, markup=False)


def note(text: str) -> None:
    """A dim `note: ...` on stderr."""
    err.print(f"[dim]note: {escape(text)}[/]", highlight=False)


def warn(text: str) -> None:
    """A yellow `warning: ...` on stderr."""
    err.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)


def error(text: str) -> None:
    """A red `error: ...` on stderr: how a library error reaches the user."""
    err.print(f"[bold red]error:[/] {escape(text)}", highlight=False)


def print_json(doc: dict) -> None:
    """A JSON document on stdout (schema_version added, null for every undefined number)."""
    from ..output import to_json

    print(to_json(doc))


# ----------------------------------------------------------------------------- progress


def progress_columns(unit: str):
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
def progress(label: str, unit: str = "rows"):
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
    with Progress(*progress_columns(unit), console=err, transient=True, expand=True) as bar:
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


# ----------------------------------------------------------------------------- tables


def add_row(t: Table, *cells: str) -> None:
    """Add a row of plain text (brackets in rule settings are not rich markup)."""
    t.add_row(*[escape(c) for c in cells])


def fit(t: Table, width: int | None = None) -> bool:
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


def show(t: Table, to_err: bool = False) -> None:
    """Fit `t` to stdout's width and print it on stdout (or stderr)."""
    fit(t)
    (err if to_err else out).print(t)


def fmt_num(x, digits: int = 4) -> str:
    """A number as a table shows it: ints with thousands separators, floats to `digits`
    significant digits (3 beyond 1e4 or below 1e-3), '-' for None."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.3g}"
    return f"{x:.{digits}g}"


def pct(x) -> str:
    """A fraction as a percentage to 3 significant digits, '-' for None."""
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    return f"{100 * x:.3g}%"


def rule_label(rule: str, setting: str | None) -> str:
    """'dppo-kl' + 'high=0.05,clamp=20' -> 'dppo-kl [high=0.05, clamp=20]': a narrow column
    wraps between the fixed parameters, never inside one (no two settings read the same)."""
    return rule + (f" [{setting.replace(',', ', ')}]" if setting else "")


def given_label(spec: str, exclude: str | None = None) -> str:
    """A rule SPEC as a table's first column names it: the name as the user gave it, preset
    included ('token-mis@verl'), and in brackets the fixed parameters that differ from that
    preset's (all of them without a preset); `exclude`: the swept or chosen parameter.
    'token-mis@verl:low=0.5,high=5' -> 'token-mis@verl'; 'icepop@verl:low=0.3,high=5' with
    exclude 'high' -> 'icepop@verl [low=0.3]'; 'icepop:low=0.2,high=5' -> 'icepop [low=0.2,
    high=5]'."""
    from ..rules.spec import given_label as label

    return label(spec, exclude, fmt_num)


def given_spec(spec: str) -> str:
    """`given_label` as a SPEC: 'icepop@verl:low=0.5,high=5' -> 'icepop@verl',
    'icepop@verl:low=0.3,high=5' -> 'icepop@verl:low=0.3'."""
    head, _, rest = given_label(spec).partition(" [")
    return head + (":" + rest[:-1].replace(", ", ",") if rest else "")


def budget_side(param: str) -> str:
    """Which side of a rule a parameter bounds, in words: 'high' -> 'its upper bound'."""
    if param in ("high", "hi", "cap", "eps_high", "tau", "phi", "delta", "c") or param.endswith(
        "high"
    ):
        return "its upper bound"
    if param == "low" or param.endswith("low") or param == "v":
        return "its lower bound"
    if param == "eps":
        return "its band half-width"
    return "its threshold"


def spec_header(spec: str) -> str:
    """A rule SPEC as a column header, one part per line: 'icepop:low=0.2,high=5' ->
    'icepop\nlow=0.2\nhigh=5', so a header is as narrow as its longest part and never cut."""
    name, _, params = spec.partition(":")
    return "\n".join([name, *params.split(",")]) if params else name


# ----------------------------------------------------------------------------- notes


def print_config(cfg) -> None:
    """--from-config: the trainer config's rules and the reader's notes, on stderr."""
    err.print(f"[dim]{cfg.framework} config: {escape(', '.join(cfg.specs()))}[/]", highlight=False)
    for n in cfg.all_notes():
        err.print(f"[dim]  {escape(n)}[/]", highlight=False)


def print_drops(report) -> None:
    """--drop-invalid: how many loss rows were dropped (and records skipped), per file and
    column, on stderr; nothing when none were."""
    records = getattr(report, "dropped_records", 0)
    if report.dropped_rows or records:
        what = f"dropped {report.dropped_rows:,} invalid loss rows"
        if records:
            what += f" and skipped {records:,} unreadable records"
        err.print(f"[yellow]{what}[/] (--drop-invalid):", highlight=False)
        for (f, c), n in report.dropped.items():
            if not c.startswith("*"):
                err.print(f"  {f}: {c}: {n:,}", highlight=False, markup=False)


# ----------------------------------------------------------------------------- results


def print_rules(recs: list[dict]) -> None:
    """The rule catalogue: one row per rule (parameters, presets, definition, source)."""
    t = Table(title="mismatch-replay rule catalogue", show_lines=True)
    for c in ("rule", "parameters (default)", "presets", "masked when / source"):
        t.add_column(c, overflow="fold")
    for r in recs:
        params = "\n".join(
            p["name"] + (" (no default)" if p["default"] is None else f"={fmt_num(p['default'])}")
            for p in r["params"]
        )
        presets = "\n".join(
            f"@{k}: " + ", ".join(f"{a}={fmt_num(b)}" for a, b in v.items())
            for k, v in r["presets"].items()
        )
        needs = f"\nneeds: {', '.join(r['needs'])}" if r["needs"] else ""
        add_row(
            t,
            f"{r['name']}\n{r['level']} {r['kind']}",
            params,
            presets or "-",
            f"{r['definition']}\n{r['source']}{needs}",
        )
    show(t)


def print_inspect(s, agree) -> None:
    """inspect: the log (files, format, columns, counts, alignment, the prime-rl check when
    `agree` is not None), its mismatch metrics, and the per-step metrics when it has steps."""
    t = Table(title="log", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")
    add_row(t, "files", "\n".join(s.files) if len(s.files) <= 5 else f"{len(s.files)} files")
    add_row(t, "format", s.format)
    add_row(t, "layout", s.layout)
    add_row(
        t,
        "columns",
        ", ".join(f"{c} <- {src}" if c != src else c for c, src in s.source.items()),
    )
    if s.probs:
        add_row(t, "probabilities", ", ".join(s.probs) + " (converted to log-probs)")
    add_row(t, "rows", f"{s.rows:,}")
    add_row(t, "loss tokens", f"{s.loss_tokens:,}")
    add_row(t, "steps", f"{s.steps:,}")
    add_row(t, "sequences", "-" if s.sequences is None else f"{s.sequences:,}")
    inv = "none" if not s.invalid else "\n".join(f"{k}: {v:,}" for k, v in s.invalid.items())
    add_row(t, "invalid rows", inv)
    add_row(t, "alignment", s.alignment)
    if agree is not None:
        add_row(t, "prime-rl check", agree.line())
    show(t)
    from ..metrics import NAMES

    m = Table(title="mismatch (loss tokens)")
    m.add_column("metric")
    m.add_column("value", justify="right")
    m.add_column("framework name", style="dim")
    for k, v in s.metrics.items():
        add_row(m, k, fmt_num(v), NAMES.get(k, ("", ""))[0])
    show(m)
    if s.steps > 1:
        st = Table(title="per step")
        cols = ("step", "tokens", "kl_k1", "kl_k3", "kl_k3_max", "abs_dp_mean")
        for c in cols:
            st.add_column(c, justify="right")
        for row in s.per_step.iter_rows(named=True):
            add_row(st, *[fmt_num(row[c]) for c in cols])
        show(st)


def print_check(res, per_step: bool) -> None:
    """check: one row per limit (max, value, the worst step with --per-step, the verdict)."""
    scope = f"every one of {res.steps:,} steps" if per_step else "the whole log"
    t = Table(title=f"check: {res.tokens:,} loss tokens, limits on {scope}")
    for c, j in (("limit", "left"), ("max", "right"), ("value", "right")):
        t.add_column(c, justify=j)
    if per_step:
        t.add_column("worst step", justify="right")
        t.add_column("worst value", justify="right")
        t.add_column("steps over", justify="right")
    t.add_column("verdict")
    for v in res.verdicts:
        cells = [v.limit.label, fmt_num(v.limit.limit), fmt_num(v.value)]
        if per_step:
            cells += [fmt_num(v.worst_step), fmt_num(v.worst_value), f"{len(v.violating):,}"]
        t.add_row(*[escape(c) for c in cells], "ok" if v.ok else "[bold red]EXCEEDED[/]")
    show(t)


def print_check_failed(res) -> None:
    """The line a failed check ends with, on stderr."""
    n = len(res.violations)
    err.print(f"check failed: {n} of {len(res.verdicts)} limit(s) exceeded", highlight=False)


def _cost_columns(part) -> list[tuple[str, str]]:
    """What the mask costs (issue 32), (column, header) where logged: the masked
    (truncated) tokens' corrective share of the corrective + divergent ones, the |A| mass
    removed, their mean entropy."""
    return [
        (k, h)
        for k, h in (
            ("masked_corrective_fraction", "corrective"),
            ("masked_adv_mass_fraction", "|A| masked"),
            ("masked_entropy_mean", "H masked"),
        )
        if k in part.columns and part[k].null_count() < part.height
    ]


def _sweep_table(
    title: str,
    part,
    kind: str,
    by,
    seqs: bool,
    prime: bool,
    job: bool,
    groups: bool = False,
    columns: str = "all",
) -> Table:
    """One table of sweep rows. job=False: every rule, one row per rule x value (x group);
    job=True: the rows of one rule setting and swept parameter (the value column is headed
    by the parameter's name; the rule is in the title). columns: 'all', 'counts'
    (all but the mask-cost ones) or 'cost' (the rows' keys and the mask-cost columns: a
    narrow terminal's second table)."""
    from ..engine.readout import group_label

    t = Table(title=escape(title), show_edge=False)
    param = part["param"][0]
    counts = columns != "cost"
    cols = [param] if job else ["rule [fixed]", "param", "value"]
    cols += ([by, "tokens"] if counts else [by]) if by else []
    if counts and kind == "mask":
        cols += ["masked", "masked n"] + (["seqs masked"] if seqs else []) + ["|dp| masked"]
        cols += ["groups all masked"] if groups else []
        cols += ["is_masked/ mean"] if prime else []
    elif counts:
        cols += ["truncated", "truncated n", "w mean", "w max", "ESS"]
    cost = _cost_columns(part) if columns != "counts" else []
    cols += [h for _, h in cost]
    for c in cols:
        left = c in ("rule [fixed]", "param")
        t.add_column(escape(c), justify="left" if left else "right", overflow="fold")
    prev = prev_value = None
    for r in part.iter_rows(named=True):
        label = (
            given_label(r["spec"], r["param"])
            if r.get("spec")
            else rule_label(r["rule"], r["setting"])
        )
        value = fmt_num(r["value"])
        if job:  # grouped rows of one value: the value once
            row = [value if value != prev_value else ""]
        else:
            row = [label if label != prev else "", r["param"], value]
        prev, prev_value = label, value
        if by:
            row += [group_label(by, r[by])] + ([fmt_num(r["tokens"])] if counts else [])
        if counts and kind == "mask":
            row += [pct(r["masked_fraction"]), fmt_num(r["masked_tokens"])]
            if seqs:
                row.append(pct(r["masked_sequence_fraction"]))
            row.append(pct(r["masked_mass_fraction"]))
            if groups:
                row.append(pct(r["fully_masked_group_fraction"]))
            if prime:
                row.append(pct(r["is_masked_mean"]))
        elif counts:
            row += [
                pct(r["truncated_fraction"]),
                fmt_num(r["truncated_tokens"]),
                fmt_num(r["weight_mean"]),
                fmt_num(r["weight_max"]),
                pct(r["weight_ess"]),
            ]
        row += [fmt_num(r[k]) if k == "masked_entropy_mean" else pct(r[k]) for k, _ in cost]
        add_row(t, *row)
    return t


def print_sweep(df, by: str | None, all_rows: bool) -> None:
    """The sweep as tables: one per kind (mask, weight) with a row per rule x value (x
    group); where that does not fit the terminal without breaking a number or a rule
    parameter, the mask-cost columns in a second table of the same rows; where even that
    does not fit, folded into one table per rule setting (split the same way if need be)."""
    import polars as pl

    from ..engine.readout import TOKEN_GROUPS, loss_tokens, preview, prompt_groups

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
        title = f"{verb} by each {kind} rule{of}"
        t = _sweep_table(title, part, kind, by, seqs, prime, False, groups)
        if fit(t):
            out.print(t)
            continue
        # too wide with the mask-cost columns: those in a second table of the same rows
        if _cost_columns(part):
            lean = _sweep_table(title, part, kind, by, seqs, prime, False, groups, "counts")
            title = f"what each {kind} rule's {verb} tokens cost"
            cost = _sweep_table(title, part, kind, by, seqs, prime, False, groups, "cost")
            if fit(lean) and fit(cost):
                out.print(lean)
                out.print(cost)
                continue
        # one table per rule setting and swept parameter (a job; its rows' specs differ in
        # the swept value only, so the label without that parameter names the job)
        labels = [given_label(s, p) for s, p in zip(part["spec"], part["param"], strict=True)]
        part = part.with_columns(pl.Series("_label", labels, dtype=pl.String))
        for (label, param), job in part.group_by(["_label", "param"], maintain_order=True):
            if by:  # a value's groups together, the values in their order: the value once
                vals = dict.fromkeys(job["value"].to_list())
                job = pl.concat([job.filter(pl.col("value") == v) for v in vals])
            title = f"{verb} by {label}, {param} swept{of}"
            t = _sweep_table(title, job, kind, by, seqs, prime, True, groups)
            if fit(t) or not _cost_columns(job):
                show(t)
                continue
            # still too wide: the counts, then what the mask costs, in a table each
            show(_sweep_table(title, job, kind, by, seqs, prime, True, groups, "counts"))
            title = f"what {label}'s {verb} tokens cost, {param} swept"
            show(_sweep_table(title, job, kind, by, seqs, prime, True, groups, "cost"))
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


def print_paths(paths: list[dict]) -> None:
    """sweep --verbose: the path each job ran on (fused or simple) and why, on stderr."""
    t = Table(title="path of each job", show_edge=False)
    for c in ("rule", "param", "path", "reason"):
        t.add_column(c, overflow="fold")
    for p in paths:
        add_row(t, p["rule"], p["param"] or "-", p["path"], p["reason"] or "-")
    fit(t, err.width)
    err.print(t)


def print_choose(rows, target_fraction: float | None, to_err: bool) -> None:
    """choose: one row per rule setting and parameter (the value, its interval, the masked
    fraction, the status) and the numbered notes; on stderr when stdout carries --emit."""
    mass = any(getattr(r, "of", "tokens") == "adv-mass" for r in rows)  # --of adv-mass
    title = (
        f"threshold masking {pct(target_fraction)} of tokens"
        if target_fraction is not None
        else "masked fraction at each setting"
    )
    if mass:
        title = f"threshold removing {pct(target_fraction)} of the advantage mass sum |A|"
    t = Table(title=title, show_edge=False)
    heads = ["rule [fixed]", "param", "value", "95% interval", "masked", "status"]
    if mass:
        heads[4:4] = ["|A| removed"]
    for c in heads:
        left = c in ("rule [fixed]", "param")
        t.add_column(escape(c), justify="left" if left else "right", overflow="fold")
    notes: list[str] = []
    for r in rows:
        label = given_label(r.spec, r.param)
        ci_fmt = pct if target_fraction is None else fmt_num
        ci = "-" if r.ci_low is None else f"{ci_fmt(r.ci_low)} .. {ci_fmt(r.ci_high)}"
        status = r.status + (f" [{len(notes) + 1}]" if r.note else "")
        if r.note:
            notes.append(r.note)
        shares = [pct(r.masked_adv_mass_fraction)] if mass else []
        add_row(t, label, r.param, fmt_num(r.value), ci, *shares, pct(r.masked_fraction), status)
    show(t, to_err)
    for i, n in enumerate(notes, 1):
        say(f"[{i}] {n}", to_err)


def print_compare(res, budget: float | None) -> None:
    """compare: the budget settings (stderr), the 2 x 2 table of masked tokens, the Jaccard
    overlap, where the two disagree, and the most disputed tokens when asked for."""
    a, b = res.rule_a, res.rule_b
    if res.settings:
        for k, v in res.settings.items():
            err.print(
                f"budget {pct(budget)}: rule {k.upper()} set to {v.param}="
                f"{fmt_num(v.value)} (masks {pct(v.masked_fraction)}, {v.status})",
                highlight=False,
            )
    sides = []
    for key, spec in (("a", a), ("b", b)):
        v = res.settings.get(key)
        if v is None:
            sides.append(f"{key.upper()} = {given_label(spec)}")
            continue
        head, _, vals = spec.partition(":")
        others = [kv for kv in vals.split(",") if kv and kv.partition("=")[0] != v.param]
        kept = ", ".join(
            f"{k}={fmt_num(float(x))}" for k, _, x in (o.partition("=") for o in others)
        )
        sides.append(
            f"{key.upper()} = {head} with {budget_side(v.param)} {v.param} moved to "
            f"{fmt_num(v.value)}" + (f" ({kept} kept)" if kept else "")
        )
    title = f"{'   '.join(sides)}   ({res.tokens:,} loss tokens)"
    title += f"; both at the {pct(budget)} budget" if res.settings else ""
    names = {"both": "masked by both", "only_a": "only A", "only_b": "only B", "neither": "neither"}
    counts = ["tokens", "fraction", "mean q (infer)", "mean p (train)", "|dp| mass"]
    # what each cell's tokens cost (issue 32), where the log has an advantage
    costs = ["corrective", "divergent", "|A| mass"]
    costs = costs if res.cells["neither"].corrective is not None else []

    def cells(title: str, heads: list[str]) -> Table:
        t = Table(title=escape(title), show_edge=False)
        for h in ["", *heads]:
            t.add_column(h, justify="left" if not h else "right")
        for k, label in names.items():
            c = res.cells[k]
            row = {
                "tokens": f"{c.tokens:,}",
                "fraction": pct(c.fraction),
                "mean q (infer)": fmt_num(c.mean_q),
                "mean p (train)": fmt_num(c.mean_p),
                "|dp| mass": fmt_num(c.mass),
            }
            if costs:
                row |= {
                    "corrective": f"{c.corrective:,}",
                    "divergent": f"{c.divergent:,}",
                    "|A| mass": fmt_num(c.adv_mass),
                }
            add_row(t, label, *[row[h] for h in heads])
        return t

    t = cells(title, counts + costs)
    if costs and not fit(t):  # too wide: what the cells cost in a table of their own
        show(cells(title, counts))
        show(cells("what each cell's tokens cost", costs))
    else:
        show(t)
    out.print(f"Jaccard overlap of the masked sets: {fmt_num(res.jaccard)}")
    w = Table(title="where they disagree (inference probability q)", show_edge=False)
    for c in ("q bucket", "tokens", "both", "only A", "only B"):
        w.add_column(c, justify="right")
    for r in res.where:
        add_row(
            w,
            r.q_bucket,
            f"{r.tokens:,}",
            f"{r.both:,}",
            f"{r.only_a:,}",
            f"{r.only_b:,}",
        )
    show(w)
    if res.examples:
        e = Table(title="most disputed tokens (largest |log p - log q|)", show_edge=False)
        cols = [
            c
            for c in ("masked_by", "step", "sample_id", "position", "q", "p", "abs_dp", "direction")
            if c in res.examples[0] and (c != "direction" or res.examples[0][c] is not None)
        ]
        for c in cols:
            # 'masked by', 'sample id': headers that wrap at 80 columns, not cut
            e.add_column(c.replace("abs_dp", "|dp|").replace("_", " "), justify="right")
        for x in res.examples:
            add_row(
                e,
                *[
                    x[c].upper()
                    if c == "masked_by"
                    else x[c]
                    if c == "direction"
                    else fmt_num(x[c])
                    for c in cols
                ],
            )
        show(e)


def _steps(steps: list) -> str:
    if not steps:
        return "none"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def print_drift(res) -> None:
    """drift: two tables, so that both fit 80 columns: the per-step mismatch, then the
    masked fraction of each rule setting per step (headed by the setting, one parameter a
    line; as many settings per table as fit); then the verdicts and the spikes' tokens."""
    base = res.baseline_steps
    flags = ["DRIFT" if r.drift else ("spike" if r.spike else "") for r in res.steps]
    t = Table(
        title=f"mismatch per step (baseline: steps {base[0]}..{base[-1]}, "
        f"factor {res.factor:g} on k3 trimmed)",
        show_edge=False,
    )
    for c in ("step", "tokens", "k1", "k3 mean", "k3 trimmed", "k3 median", "|dp| mean", "flag"):
        t.add_column(escape(c), justify="right", overflow="fold")
    for r, flag in zip(res.steps, flags, strict=True):
        add_row(
            t,
            str(r.step),
            f"{r.tokens:,}",
            fmt_num(r.kl_k1),
            fmt_num(r.kl_k3),
            fmt_num(r.kl_k3_trimmed),
            fmt_num(r.kl_k3_median),
            fmt_num(r.abs_dp_mean),
            flag,
        )
    show(t)
    labels = list(res.steps[0].masked)

    def masked(cols: list[str]) -> Table:
        m = Table(title="masked fraction per step", show_edge=False)
        for c in ["step", *[spec_header(given_spec(x)) for x in cols], "flag"]:
            m.add_column(escape(c), justify="right", overflow="fold")
        for r, flag in zip(res.steps, flags, strict=True):
            add_row(m, str(r.step), *[pct(r.masked[x]) for x in cols], flag)
        return m

    size = len(labels)
    while size > 1 and not fit(masked(labels[:size])):
        size -= 1
    for i in range(0, len(labels), size):
        show(masked(labels[i : i + size]))
    out.print(
        f"drift: {_steps(res.flagged_steps)}; spikes: {_steps(res.spike_steps)}",
        highlight=False,
    )
    for v in res.rules:
        ratio = f" (masked fraction x{v.ratio:.3g}" if v.ratio else ""
        if ratio and v.rise is not None:
            under = v.ratio >= 2 and v.verdict != "rose with the mismatch"
            ratio += f", {v.rise:+.2%} of tokens" + (
                f", under --min-rise {res.min_rise:.2%})" if under else ")"
            )
        elif ratio:
            ratio += ")"
        say(f"  {given_label(v.rule)}: {v.verdict}{ratio}")
    for s in res.spikes:
        toks = "; ".join(
            f"k3={x['k3']:.3g} q={x['q']:.3g} p={x['p']:.3g}"
            + (f" seq {x['sample_id']}" if "sample_id" in x else "")
            + (f" pos {x['position']}" if "position" in x else "")
            for x in s.tokens[:3]
        )
        say(f"  spike at step {s.step}: {toks}")


def print_diagnose(res) -> None:
    """diagnose: one finding a row (finding, verdict, evidence, what to do), then a line
    that counts what was found."""
    t = Table(
        title=f"diagnose: {res.tokens:,} loss tokens",
        show_edge=False,
        show_lines=True,
        expand=True,
    )
    t.add_column("finding", ratio=2, min_width=12, overflow="fold")
    t.add_column("verdict", no_wrap=True, min_width=10)
    t.add_column("evidence", ratio=6, overflow="fold")
    t.add_column("what to do", ratio=3, overflow="fold")
    style = {"found": "bold red", "clear": "green", "can't tell": "yellow"}
    for d in res.findings:
        t.add_row(
            escape(d.title),
            f"[{style[d.verdict]}]{escape(d.verdict)}[/]",
            escape(d.evidence),
            escape(d.action),
        )
    out.print(t)
    found = [d.title for d in res.found]
    say(f"found: {', '.join(found)}" if found else "nothing found", to_err=True)


def print_demo(output, paths: dict) -> None:
    """demo: the directory written, each file in it, and the page to open."""
    out.print(f"[bold]mismatch-replay demo[/] wrote {escape(str(output))}/:", highlight=False)
    for name, p in paths.items():
        say(f"  {name:16s} {p}")
    say(f"Open {paths['report']} in a browser.")


def print_findings(findings) -> None:
    """demo / report: "What this log says" on stderr (after the list of files on stdout),
    one sentence a paragraph, on a terminal wrapped between words with a hanging indent
    (never inside a number), elsewhere one line each; nothing when there is none.
    `findings`: an `analysis.Findings`."""
    if not len(findings):
        return
    import textwrap

    console = err
    console.print()
    console.print("[bold]What this log says[/]", highlight=False)
    for f in findings:
        text = f"- {f.sentence}"
        if console.is_terminal:  # logs, pipes: a sentence a line
            text = textwrap.fill(
                text,
                width=max(console.width - 1, 20),
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        console.print(text, highlight=False, markup=False, soft_wrap=True)


def print_convert(s: dict, json_: bool) -> None:
    """convert: the dropped rows (stderr), then the JSON summary, or one line on stderr."""
    if s["dropped_rows"] or s["dropped_records"]:
        err.print(
            f"[yellow]dropped {s['dropped_rows']:,} invalid loss rows and skipped "
            f"{s['dropped_records']:,} unreadable records[/] (--drop-invalid):",
            highlight=False,
        )
        for k, n in s["dropped"].items():
            err.print(f"  {k}: {n:,}", highlight=False, markup=False)
    if json_:
        print_json(s)
        return
    say(
        f"wrote {s['tokens']:,} loss tokens ({s['steps']:,} steps) from {s['files']:,} "
        f"{s['format']} file(s) to {s['output']}: {s['bytes'] / 1e6:.3g} MB zstd Parquet, "
        f"in {s['seconds']:.3g} s ({(s['tokens_per_s'] or 0):,.0f} tokens/s)",
        to_err=True,
    )
