"""The commands that write a log rather than read one: simulate, demo and convert.

Design
------
commands.py holds the commands that read a log and answer a question about it; these
three make or rewrite one: `simulate` writes a token log whose mismatch comes from real
numerics (a small torch model, bf16 sampler vs fp32 trainer: simulate.py), `demo` runs
the whole tool on the bundled sample (viz.jobs.demo) and `convert` turns any supported
log into the canonical table (ingest.convert). They follow commands.py's pattern: a
signature that is the interface, registered on the same `core.app` by `@command`, a body
under `core.run`, the library imported inside it so that --help starts fast, the result
printed by a `render.print_*`. cli/__init__.py imports this module after commands.py, so
that --help lists them last, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from . import render
from .core import command, run
from .options import READ_DEFAULTS, ForceOpt, JsonOpt, OutDir, Reads, Sources


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
    top_p: Annotated[
        float | None,
        typer.Option("--top-p", metavar="P", help="Sample top-p, log the renormalised log-prob."),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option("--top-k", metavar="K", help="Sample top-k (also logs kept_mass)."),
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", metavar="T", help="The sampler's temperature.")
    ] = 1.0,
    kv_fp8_from: Annotated[
        int | None,
        typer.Option("--kv-fp8-from", metavar="P", help="Engine noise from position P on."),
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(
            "--loss",
            metavar="SPEC",
            help="Train with this token rule's mask in the loss, e.g. ipo@prime-rl or "
            "icepop@prime-rl (the tokens it masks get no gradient): one arm of an ablation.",
        ),
    ] = None,
) -> None:
    """Write a token log whose mismatch comes from real numerics (needs torch).

    A small transformer sampled in bf16 by an 'inference engine' and rescored in fp32 by a
    'trainer' that runs ahead by --staleness optimizer steps, in an async policy-gradient
    loop.
    """

    def body():
        import dataclasses

        try:
            from ..simulate import SCENARIOS, SimConfig
            from ..simulate import simulate as run_sim
        except ImportError as exc:
            raise UsageError(str(exc)) from None
        if scenario not in SCENARIOS:
            raise UsageError(f"--scenario {scenario}: use one of {', '.join(SCENARIOS)}.")
        given = {"steps": steps, "batch": batch, "seq_len": seq_len, "staleness": staleness}
        given |= {"top_p": top_p, "top_k": top_k, "kv_fp8_from": kv_fp8_from}
        given["temperature"] = temperature
        given["loss"] = loss
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
        with render.progress("simulate", unit="steps") as cb:
            summary = run_sim(cfg, output, progress=cb, force=force)
        render.say(
            f"wrote {output}: {summary.get('tokens', 0):,} tokens, "
            f"{summary.get('tokens_per_second', 0):,.0f} tokens/s",
            to_err=True,
        )

    run(body)


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
        from ..viz.jobs import demo as run_demo

        keep: dict = {}
        with render.progress("demo") as cb:
            paths = run_demo(output, force, cb, keep=keep)
        render.print_demo(output, paths)
        render.print_findings(keep.get("findings", ()))

    run(body)


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
    read: Reads = READ_DEFAULTS,
    json_: JsonOpt = False,
) -> None:
    """Any supported log to the canonical token table: convert once, replay fast after.

    Reads prime-rl, NeMo-RL, slime, JSONL or Parquet logs; writes zstd Parquet, loss tokens
    only.

    Written to a temporary file and renamed at the end, so an interrupted run leaves nothing.
    """

    def body():
        from ..ingest.convert import convert as run_convert

        opts = read.options()
        with render.progress("convert") as cb:
            s = run_convert(
                sources,
                output,
                opts,
                partition_by=partition_by,
                force=force,
                progress=cb,
                row_group_rows=row_group_rows,
            )
        render.print_convert(s, json_)

    run(body)
