"""The command line's shared options, each declared once, and the group of read options.

Design
------
An option that several commands take is one `Annotated` type here (`Sources`, `JsonOpt`,
`RuleOpt`, `PrecisionOpt`, ...): its flag, metavar and --help text are written once and
every command signature names the type.

The seven options that say how to read a log (--map, --probs, --drop-invalid, --batch-rows,
--format, --include-unstable, --io-timeout) are one group, `READ_OPTIONS`, taken by nine
commands. A command takes the whole group as a single parameter, `read: Reads =
READ_DEFAULTS`; `with_read_group` (applied by `core.command`) replaces that parameter in the
signature typer sees by the seven options, in that order and at that place, and hands the
command one `ReadArgs` built from them.
`read.options()` turns it into the library's `ReadOptions` (inside the command, so that a
bad --map is a usage error like any other). A command that does not offer one of the
options fixes its value instead: inspect counts invalid rows rather than failing, so it
takes `ReadsCountingInvalid` (drop_invalid fixed to True, no --drop-invalid flag).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, get_args, get_origin

import typer

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
# drift / report / plot: SOURCES, or the arms of an ablation as --run NAME=SOURCES
SourcesOrRuns = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="[SOURCES]",
        show_default=False,
        help="Token logs (as for every command); leave them out when --run names the runs.",
    ),
]
RunOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run",
        metavar="NAME=SOURCES",
        help="One arm of an ablation (repeatable; the same NAME again adds sources to it), "
        "e.g. --run ipo=logs/ipo --run icepop=logs/icepop: each run replayed alone, side by "
        "side, with the read options above (a run's own: --run-map, --run-format, --run-probs).",
    ),
]
RunConfigOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run-config",
        metavar="NAME=FILE",
        help="The run's own trainer config (repeatable; later files win), as --from-config "
        "reads it: its rule is that run's own (masked_own), e.g. --run-config "
        "icepop=icepop.toml.",
    ),
]
RunRuleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run-rule",
        metavar="NAME=SPEC",
        help="The run's own rule given as a SPEC (repeatable), e.g. --run-rule "
        "ipo=ipo@prime-rl; -r rules apply to every run.",
    ),
]
# per-run read options: the run's own --map / --format / --probs over the shared ones
RunMapOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run-map",
        metavar="NAME:CANONICAL=THEIRS",
        help="That run's --map (repeatable), e.g. --run-map icepop:advantage=adv; "
        "added to the shared --map, the run's wins for a column both map.",
    ),
]
RunFormatOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run-format",
        metavar="NAME=FORMAT",
        help="That run's --format, in place of the shared one, e.g. --run-format icepop=jsonl.",
    ),
]
RunProbsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run-probs",
        metavar="NAME",
        help="That run's mapped columns hold probabilities (its --probs; repeatable).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]
PrecisionOpt = Annotated[
    str | None,
    typer.Option(
        "--precision",
        metavar="float64|float32",
        help="Default: each framework preset in its framework's precision (float32, as the "
        "log-prob tensors of a real run; a note where its exact count differs), a bare rule "
        "in float64. float64: exact arithmetic for every rule; float32: every rule in the "
        "float32 arithmetic the frameworks run on the GPU (NaNs and roundings included; "
        "metrics stay float64).",
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
RuleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rule", "-r", metavar="SPEC", help="Rule SPEC (repeatable), e.g. ipo, icepop@prime-rl."
    ),
]
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
        help="Rules to draw (repeatable SPEC), read as `sweep -r` reads them: a bare name "
        "(ipo) sweeps the rule's threshold parameters over their default grids (its "
        "masked-fraction panel, and report's sweep.csv, hold those rows) and draws its "
        "default setting; name:param=value (ipo:eps=0.3) or name@preset is that one "
        "setting, one row, drawn marked on its threshold curves (the default grid, the "
        "other parameters at its values). Default: IPO 0.3 and 0.1, IcePop [0.2, 5] and "
        "[0.5, 5], KPop "
        "0.1, DPPO-TV 0.2 (when the log has advantages), and every rule swept.",
    ),
]

# ----------------------------------------------------------------------------- read options

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
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        metavar="FORMAT",
        help="The log's format: auto (default: detected from the paths), parquet, jsonl, "
        "prime-rl (token export), prime-rl-traces, nemo-rl, slime or skyrl.",
    ),
]
UnstableOpt = Annotated[
    bool,
    typer.Option(
        "--include-unstable",
        help="Also read steps not yet marked complete: prime-rl steps without STABLE, "
        "captured steps (TokenWriter) without _SUCCESS.",
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

# the group: each field of ReadArgs, its option and its default, in --help order
READ_OPTIONS: dict[str, tuple[object, object]] = {
    "map": (MapOpt, None),
    "probs": (ProbsOpt, False),
    "drop_invalid": (DropOpt, False),
    "batch_rows": (BatchOpt, 1_000_000),
    "format": (FormatOpt, None),
    "include_unstable": (UnstableOpt, False),
    "io_timeout": (IoTimeoutOpt, 30.0),
}


@dataclass(frozen=True)
class ReadArgs:
    """The read options as the command line gave them (one field per READ_OPTIONS entry)."""

    map: list[str] | None = None
    probs: bool = False
    drop_invalid: bool = False
    batch_rows: int = 1_000_000
    format: str | None = None
    include_unstable: bool = False
    io_timeout: float = 30.0

    def options(self):
        """The library's ReadOptions (raises UsageError for a bad --map)."""
        from ..ingest import ReadOptions, parse_mapping

        return ReadOptions(
            mapping=parse_mapping(self.map or []),
            probs=self.probs,
            drop_invalid=self.drop_invalid,
            batch_rows=self.batch_rows,
            format=self.format,
            include_unstable=self.include_unstable,
            io_timeout=self.io_timeout or None,
        )


class ReadGroup:
    """Marks a command parameter as the group of read options. `fixed` names the options
    the command does not offer, with the value it reads with."""

    def __init__(self, **fixed: object) -> None:
        unknown = set(fixed) - set(READ_OPTIONS)
        if unknown:
            raise TypeError(f"not read options: {sorted(unknown)}")
        self.fixed = fixed


READ_DEFAULTS = ReadArgs()  # the group parameter's default: `read: Reads = READ_DEFAULTS`
Reads = Annotated[ReadArgs, ReadGroup()]
# inspect summarises a log's invalid rows instead of failing on them: no --drop-invalid
ReadsCountingInvalid = Annotated[ReadArgs, ReadGroup(drop_invalid=True)]


def _group_of(annotation) -> ReadGroup | None:
    if get_origin(annotation) is not Annotated:
        return None
    return next((a for a in get_args(annotation)[1:] if isinstance(a, ReadGroup)), None)


def with_read_group(fn):
    """`fn` with its `Reads` parameter (if any) spread into the read options for typer: the
    wrapper's signature lists the options in the parameter's place, and the wrapper calls
    `fn` with one ReadArgs gathered from them. Every other parameter is unchanged."""
    sig = inspect.signature(fn, eval_str=True)
    marks = [p for p in sig.parameters.values() if _group_of(p.annotation) is not None]
    if not marks:
        return fn
    (mark,) = marks
    fixed = _group_of(mark.annotation).fixed
    offered = [n for n in READ_OPTIONS if n not in fixed]
    kw = inspect.Parameter.KEYWORD_ONLY
    params = []
    for p in sig.parameters.values():
        if p is mark:
            params += [
                inspect.Parameter(n, kw, annotation=READ_OPTIONS[n][0], default=READ_OPTIONS[n][1])
                for n in offered
            ]
        else:
            params.append(p.replace(kind=kw))

    @functools.wraps(fn)
    def wrapper(**kwargs):
        read = ReadArgs(**fixed, **{n: kwargs.pop(n) for n in offered})
        return fn(**kwargs, **{mark.name: read})

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer reads the signature above, not fn's
    return wrapper
