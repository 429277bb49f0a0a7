"""`drift / plot / report --run NAME=SOURCES ...`: the arms of an ablation on the command line.

Design
------
`runs_of` checks --run / --run-config / --run-rule against SOURCES (one or the other, a usage
error before any read) and builds the `analysis.runs.Run`s; `drift` runs `drift_runs` and
prints. The runs share the step axis, so the tables are wide: one row a step, a column
group a run (k3 trimmed, the masked fraction under the run's own rule, and a D where the
step is in the run's drift), as many runs per table as fit the width (`render.fit`); then,
where logged, entropy and reward the same way; then one table a shared `-r` rule; then the
verdicts and "What these runs say" (the findings, on stderr like every command's answer in
words). Library modules are imported inside the functions, so that --help starts fast.
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..errors import UsageError
from . import render
from .render import add_row, err, fit, fmt_num, given_spec, out, pct, say, show, spec_header


def runs_of(sources, run, run_config, run_rule, command: str):
    """None (one log: SOURCES) or the runs of --run / --run-config / --run-rule."""
    if not run:
        if run_config or run_rule:
            flag = "--run-config" if run_config else "--run-rule"
            raise UsageError(f"{flag} names a run's own rule; give the runs with --run too.")
        if not sources:
            raise UsageError(
                f"{command} needs SOURCES, or the runs of an ablation as --run NAME=SOURCES."
            )
        return None
    if sources:
        raise UsageError(
            f"{command}: give SOURCES or --run NAME=SOURCES, not both (with --run, SOURCES "
            f"would be one more run: --run NAME={sources[0]})."
        )
    from ..analysis.runs import parse_runs

    return parse_runs(run, run_config or (), run_rule or ())


def compute(runs, opts, rules, **kw):
    """`drift_runs` on the runs, each read with `opts`, with a progress bar."""
    import dataclasses

    from ..analysis.runs import drift_runs

    runs = [dataclasses.replace(r, options=opts) for r in runs]
    with render.progress("drift") as cb:
        return drift_runs(runs, rules or None, progress=cb, **kw)


def plot(runs, opts, rules, output, image_format: str, force: bool) -> None:
    """plot --run: runs.<format> in the output folder."""
    from ..viz.runs import write_runs

    res = compute(runs, opts, rules)
    say(f"{'runs':16s} {write_runs(res, output, image_format, force)}")


def report(runs, opts, rules, output, command: str, force: bool, one_log: bool) -> None:
    """report --run: index.html (findings, runs.png, verdicts, the per-step table).
    `one_log`: --from-config, --wandb or --tensorboard was given (refused: one log each)."""
    from ..analysis.runs import runs_findings
    from ..viz.runs import write_runs_report

    if one_log:
        raise UsageError(
            "report --run: give each run's config as --run-config NAME=FILE; "
            "--from-config, --wandb and --tensorboard take one log."
        )

    res = compute(runs, opts, rules)
    found = runs_findings(res)
    paths = write_runs_report(res, found, output, command, force)
    say(f"report: {paths['index.html']}")
    print_runs_findings(found)


def drift(runs, opts, rules, json_: bool, **kw) -> None:
    """drift --run: the tables and verdicts (or --json, findings included)."""
    from ..analysis.runs import runs_findings

    res = compute(runs, opts, rules, **kw)
    found = runs_findings(res)
    if json_:
        render.print_json({**res.to_dict(), "findings": found.to_dict()})
        return
    print_runs(res, found)


def _groups(res, make) -> None:
    """Print `make(runs)` tables, as many runs per table as fit."""
    runs = res.runs
    size = len(runs)
    while size > 1 and not fit(make(runs[:size])):
        size -= 1
    for i in range(0, len(runs), size):
        show(make(runs[i : i + size]))


def _steps(res) -> list[int]:
    return sorted({s.step for rr in res.runs for s in rr.drift.steps})


def _by_step(rr) -> dict:
    return {s.step: s for s in rr.drift.steps}


def _mismatch_table(res, runs, extras: bool = False) -> Table:
    """k3 trimmed and the own rule's masked fraction a run; `extras`: entropy and reward
    beside them (where logged), when the width allows one table."""
    title = "k3 (1%-trimmed mean) and masked fraction per step; D: drift"
    t = Table(title=title + ("; entropy, reward: means" if extras else ""), show_edge=False)
    t.add_column("step", justify="right")
    for rr in runs:
        own = rr.run.rules[0] if rr.run.rules else None
        t.add_column(escape(f"{rr.run.name}\nk3"), justify="right")
        head = f"{rr.run.name}\nmasked\n{spec_header(given_spec(own))}" if own else "-"
        t.add_column(escape(head), justify="right")
        if extras and rr.entropy:
            t.add_column(escape(f"{rr.run.name}\nentropy"), justify="right")
        if extras and rr.reward:
            t.add_column(escape(f"{rr.run.name}\nreward"), justify="right")
    for step in _steps(res):
        cells = [str(step)]
        for rr in runs:
            s = _by_step(rr).get(step)
            own = rr.verdict.own_rules[0] if rr.verdict.own_rules else None
            if s is None:
                cells += ["", ""]
            else:
                cells.append(fmt_num(s.kl_k3_trimmed, 3) + (" D" if s.drift else "  "))
                cells.append(pct(s.masked.get(own)) if own else "-")
            if extras and rr.entropy:
                cells.append(fmt_num(rr.entropy.get(step), 3))
            if extras and rr.reward:
                cells.append(fmt_num(rr.reward.get(step), 3))
        add_row(t, *cells)
    return t


def _extras_table(res, runs) -> Table:
    t = Table(title="entropy and reward per step (means)", show_edge=False)
    t.add_column("step", justify="right")
    for rr in runs:
        if rr.entropy:
            t.add_column(escape(f"{rr.run.name}\nentropy"), justify="right")
        if rr.reward:
            t.add_column(escape(f"{rr.run.name}\nreward"), justify="right")
    for step in _steps(res):
        cells = [str(step)]
        for rr in runs:
            if rr.entropy:
                cells.append(fmt_num(rr.entropy.get(step), 3))
            if rr.reward:
                cells.append(fmt_num(rr.reward.get(step), 3))
        add_row(t, *cells)
    return t


def _shared_table(res, spec: str, runs) -> Table:
    t = Table(title=f"masked fraction per step under {given_spec(spec)}", show_edge=False)
    t.add_column("step", justify="right")
    for rr in runs:
        t.add_column(escape(rr.run.name), justify="right")
    for step in _steps(res):
        cells = [str(step)]
        for rr in runs:
            s = _by_step(rr).get(step)
            cells.append(pct(s.masked.get(spec)) if s is not None else "")
        add_row(t, *cells)
    return t


SHORT = {  # drift's verdicts, as the verdict table's narrow column says them
    "rose with the mismatch": "rose",
    "flat while the mismatch rose (the collapse signature)": "flat: collapse signature",
}


def _verdict_table(res) -> Table:
    t = Table(title="verdict per run", show_edge=False)
    for c in ("run", "drift", "departs at", "late/early k3", "own rule", "its verdict"):
        left = c in ("run", "own rule", "its verdict")
        t.add_column(escape(c), justify="left" if left else "right")
    for rr in res.runs:
        v = rr.verdict
        own = v.own_rules[0] if v.own_rules else None
        add_row(
            t,
            v.run,
            f"{len(v.drift_steps)} steps" if v.drifted else "no",
            "-" if v.departs_at is None else str(v.departs_at),
            f"x{fmt_num(v.late_early_k3, 3)}",
            given_spec(own) if own else "-",
            SHORT.get(v.rule_verdicts.get(own, "-"), v.rule_verdicts.get(own, "-")) if own else "-",
        )
    return t


def print_runs(res, findings=()) -> None:
    """The runs' tables on stdout, their findings on stderr."""
    logged = any(rr.entropy or rr.reward for rr in res.runs)
    if logged and fit(_mismatch_table(res, res.runs, extras=True)):
        show(_mismatch_table(res, res.runs, extras=True))  # one table when it fits
    else:
        _groups(res, lambda runs: _mismatch_table(res, runs))
        if logged:
            _groups(res, lambda runs: _extras_table(res, runs))
    for spec in res.rules:
        _groups(res, lambda runs, spec=spec: _shared_table(res, spec, runs))
    show(_verdict_table(res))
    for rr in res.runs:
        for spec, verdict in rr.verdict.rule_verdicts.items():
            if spec in res.rules:
                say(f"  {rr.run.name}, {given_spec(spec)}: {verdict}")
    print_runs_findings(findings)


def print_runs_findings(findings) -> None:
    """ "What these runs say" on stderr, wrapped between words on a terminal."""
    if not len(findings):
        return
    import textwrap

    err.print()
    err.print("[bold]What these runs say[/]", highlight=False)
    for f in findings:
        text = f"- {f.sentence}"
        if err.is_terminal:
            text = textwrap.fill(
                text,
                width=max(err.width - 1, 20),
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        err.print(text, highlight=False, markup=False, soft_wrap=True)


__all__ = ["out", "print_runs"]
