"""`drift / plot / report --run NAME=SOURCES ...`: the arms of an ablation on the command line.

Design
------
`runs_of` checks --run / --run-config / --run-rule against SOURCES (one or the other, a usage
error before any read) and builds the `analysis.runs.Run`s, each with its read options (the
shared ones under its own --run-map / --run-format / --run-probs, `with_read_options`);
`drift` runs `drift_runs` and prints. The runs share the step axis, so the tables are wide:
one row a step, a column group a run (k3 trimmed, and a D where the step is in the run's
drift; the masked fraction under each of the run's own rules, one column a rule), as many
runs per table as fit the width (`render.fit`); then, where logged, entropy and reward the
same way; then one table a shared `-r` rule; then the verdicts (one row per own rule of a
run) and "What these runs say" (the findings, on stderr like every command's answer in
words). Library modules are imported inside the functions, so that --help starts fast.
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..errors import UsageError
from . import render
from .render import add_row, err, fit, fmt_num, given_spec, out, pct, say, show, spec_header


def runs_of(
    sources,
    run,
    run_config,
    run_rule,
    command: str,
    opts=None,
    run_map=None,
    run_format=None,
    run_probs=None,
):
    """None (one log: SOURCES) or the runs of --run / --run-config / --run-rule, each with
    its read options: the shared `opts` under its own --run-map / --run-format / --run-probs."""
    per_run = {"--run-map": run_map, "--run-format": run_format, "--run-probs": run_probs}
    if not run:
        given = [f for f, v in {"--run-config": run_config, "--run-rule": run_rule}.items() if v]
        if given:
            raise UsageError(f"{given[0]} names a run's own rule; give the runs with --run too.")
        given = [f for f, v in per_run.items() if v]
        if given:
            raise UsageError(
                f"{given[0]} gives a run's own read options; give the runs with --run too "
                f"(for SOURCES alone: {given[0].replace('--run-', '--')})."
            )
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

    runs = parse_runs(run, run_config or (), run_rule or ())
    return with_read_options(runs, opts, run_map or (), run_format or (), run_probs or ())


def with_read_options(runs, opts, run_map=(), run_format=(), run_probs=()):
    """Each run with the shared ReadOptions `opts` (None: the defaults) and its own
    --run-map NAME:CANONICAL=THEIRS (added to the shared mapping, the run's wins),
    --run-format NAME=FORMAT (in place of the shared one) and --run-probs NAME.
    A usage error names the flag, the value and the runs."""
    import dataclasses

    from ..ingest import FORMATS, ReadOptions

    opts = opts if opts is not None else ReadOptions()
    names = [r.name for r in runs]

    def known(flag: str, item: str, name: str) -> str:
        if name not in names:
            raise UsageError(
                f"{flag} {item!r}: no --run names {name!r} (runs: {', '.join(names)}); "
                f"give --run {name}=SOURCES."
            )
        return name

    maps: dict[str, dict[str, str]] = {}
    for item in run_map:
        name, sep, pair = item.partition(":")
        canon, eq, theirs = pair.partition("=")
        if not sep or not name.strip() or not eq or not canon.strip() or not theirs.strip():
            raise UsageError(
                f"--run-map {item!r}: give NAME:CANONICAL=THEIRS, the run and its --map, e.g. "
                "--run-map icepop:trainer_logprob=lp_train."
            )
        name = known("--run-map", item, name.strip())
        maps.setdefault(name, {})[canon.strip()] = theirs.strip()
    formats: dict[str, str | None] = {}
    for item in run_format:
        name, sep, fmt = (x.strip() for x in item.partition("="))
        if not sep or not name or not fmt:
            raise UsageError(
                f"--run-format {item!r}: give NAME=FORMAT, e.g. --run-format icepop=jsonl."
            )
        name = known("--run-format", item, name)
        if fmt != "auto" and fmt not in FORMATS:
            raise UsageError(
                f"--run-format {item!r}: run {name!r}: unknown format {fmt!r}; known formats: "
                f"auto, {', '.join(FORMATS)}."
            )
        if name in formats and formats[name] != (None if fmt == "auto" else fmt):
            raise UsageError(f"--run-format: run {name!r} is given two formats; give it one.")
        formats[name] = None if fmt == "auto" else fmt
    probs = {known("--run-probs", n, n.strip()) for n in run_probs}
    out = []
    for r in runs:
        o = dataclasses.replace(
            opts,
            mapping={**opts.mapping, **maps.get(r.name, {})},
            format=formats.get(r.name, opts.format),
            probs=opts.probs or r.name in probs,
        )
        out.append(dataclasses.replace(r, options=o))
    return out


def compute(runs, opts, rules, **kw):
    """`drift_runs` on the runs (each with its own read options, else `opts`), with a
    progress bar."""
    import dataclasses

    from ..analysis.runs import drift_runs

    runs = [r if r.options is not None else dataclasses.replace(r, options=opts) for r in runs]
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
        t.add_column(escape(f"{rr.run.name}\nk3"), justify="right")
        for own in _owns(rr) or [None]:
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
            owns = _owns(rr) or [None]
            if s is None:
                cells += [""] * (1 + len(owns))
            else:
                cells.append(fmt_num(s.kl_k3_trimmed, 3) + (" D" if s.drift else "  "))
                cells += [pct(s.masked.get(own)) if own else "-" for own in owns]
            if extras and rr.entropy:
                cells.append(fmt_num(rr.entropy.get(step), 3))
            if extras and rr.reward:
                cells.append(fmt_num(rr.reward.get(step), 3))
        add_row(t, *cells)
    return t


def _owns(rr) -> list[str]:
    """The run's own rules, each once, as its result names them."""
    return list(rr.verdict.own_rules)


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
    for rr in res.runs:  # one row per own rule of a run (its run's cells on the first)
        v = rr.verdict
        for i, own in enumerate(_owns(rr) or [None]):
            said = v.rule_verdicts.get(own, "-") if own else "-"
            first = [
                v.run,
                f"{len(v.drift_steps)} steps" if v.drifted else "no",
                "-" if v.departs_at is None else str(v.departs_at),
                f"x{fmt_num(v.late_early_k3, 3)}",
            ]
            add_row(t, *(first if i == 0 else [""] * 4), given_spec(own) if own else "-",
                    SHORT.get(said, said))  # fmt: skip
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
