"""A report into Weights & Biases: the training run resumed by id (or a new run), and back.

Design
------
`log_to_wandb("ENTITY/PROJECT[/RUN_ID]", outputs)` writes, into one run:

* the per-step series under `mismatch_replay/<series>` (`mismatch_replay/kl_k3`,
  `mismatch_replay/masked_fraction/ipo:eps=0.3`, ...) against their own step metric
  `mismatch_replay/step` (`define_metric`), holding the log's trainer steps. Resuming a
  training run, W&B's `_step` is already past every replayed step and a `log(step=...)`
  below it would be dropped; with their own step metric the series are logged in order and
  still plot against the training steps;
* the figures as `wandb.Image` (`mismatch_replay/report/figures/<name>`), the sweep and the
  choose rows as `wandb.Table`, the page as `wandb.Html`, all at the last replayed step;
* the overall mismatch metrics in the run summary (`mismatch_replay/summary/<metric>`) and
  the command, sources and version in the run config under `mismatch_replay`;
* when asked, the converted Parquet token table as a `dataset` artifact.

Offline, `run.finish()` can return while W&B's core process still writes the last records;
`log_to_wandb` waits (up to 30 s) for the run's exit record, so the directory is complete when
it returns (`complete` in its result).

With a RUN_ID the run is resumed (`resume="allow"`: the training run when it exists, a new
run with that id otherwise); without one a new run (job type `mismatch-replay`). A run
object the caller already holds (`run=`) is logged into and left open. The mode is W&B's:
`WANDB_MODE=offline` writes `wandb/offline-run-*/run-<id>.wandb` locally for `wandb sync`.

W&B's own settings win over this module's defaults, as they would for the training run
(`wandb.init` takes an argument over its environment variable, so ours must not shadow the
user's). The run's directory: `dir=` when the caller gives one, else `WANDB_DIR` when set,
else `default_dir=` (`report --wandb` passes its report folder); the name and job type:
`WANDB_NAME` / `WANDB_JOB_TYPE` when set, else ours; the mode, tags and the rest of W&B's
variables (`WANDB_MODE`, `WANDB_TAGS`, `WANDB_RESUME`, ...) are never overridden unless the
caller passes them. The target's ENTITY/PROJECT[/RUN_ID] is the user's explicit choice on
the command line and goes to `wandb.init` as given.

`read_offline_run(path)` reads such a directory back without a server: the `.wandb` file is
W&B's transaction log (a LevelDB-style log of 32 KiB blocks whose records are W&B's own
`wandb_internal_pb2.Record` protobufs, each chunk CRC-32 checked); it returns the run, its
history rows, summary, metric definitions, files and artifacts as plain dicts.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from ..errors import DataError, UsageError
from .outputs import ReportOutputs, clean, series_rows

PREFIX = "mismatch_replay"
STEP = f"{PREFIX}/step"


def _wandb():
    try:
        import wandb
    except ImportError:
        raise UsageError(
            "--wandb needs the wandb package: pip install 'mismatch-replay[wandb]'."
        ) from None
    return wandb


def check(target: str) -> tuple[str | None, str, str | None]:
    """Before any pass over the log: the wandb package is there and the target parses."""
    _wandb()
    return parse_target(target)


_URL = re.compile(r"^https?://[^/]+/(?P<e>[^/]+)/(?P<p>[^/]+)(?:/runs/(?P<r>[^/?#]+))?")


def parse_target(target: str) -> tuple[str | None, str, str | None]:
    """`ENTITY/PROJECT[/RUN_ID]` or a run URL -> (entity, project, run id)."""
    t = target.strip()
    m = _URL.match(t)
    if m:
        return m["e"], m["p"], m["r"]
    parts = [p for p in t.strip("/").split("/")]
    if len(parts) == 3 and parts[2] == "runs":
        parts = parts[:2]
    if len(parts) == 4 and parts[2] == "runs":
        parts = [parts[0], parts[1], parts[3]]
    if len(parts) not in (2, 3) or not all(parts):
        raise UsageError(
            f"--wandb {target}: give ENTITY/PROJECT (a new run) or ENTITY/PROJECT/RUN_ID (the "
            "training run, resumed), e.g. my-team/grpo-math/3x7k2v9q."
        )
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def _table(wandb, df) -> Any:
    return wandb.Table(columns=list(df.columns), data=[[clean(v) for v in r] for r in df.rows()])


def log_to_wandb(
    target: str,
    outputs: ReportOutputs,
    *,
    artifact: str | Path | None = None,
    run=None,
    name: str | None = None,
    dir: str | Path | None = None,
    default_dir: str | Path | None = None,
    mode: str | None = None,
    tags: list[str] | None = None,
) -> dict:
    """Log a report's outputs to W&B (see the module docstring); returns where it went:
    entity, project, id, the local run directory, the mode, and the keys logged.

    `dir` is the run's directory, overriding `WANDB_DIR`; `default_dir` is used only when
    neither `dir` nor `WANDB_DIR` is set."""
    wandb = _wandb()
    entity, project, run_id = parse_target(target)
    own = run is None
    if own:
        run = wandb.init(
            **init_kwargs(
                entity,
                project,
                run_id,
                name=name or _name(outputs),
                dir=dir,
                default_dir=default_dir,
                mode=mode,
                tags=tags,
            )
        )
    keys: list[str] = []
    try:
        run.config.update(
            {
                PREFIX: {
                    "command": outputs.command,
                    "sources": outputs.sources,
                    "version": _version(),
                }
            },
            allow_val_change=True,
        )
        run.define_metric(STEP)
        run.define_metric(f"{PREFIX}/*", step_metric=STEP)
        if outputs.steps is not None:
            for step, vals in series_rows(outputs.steps):
                row = {f"{PREFIX}/{k}": v for k, v in vals.items()}
                keys += [k for k in row if k not in keys]
                run.log({STEP: step, **row})
        media: dict[str, Any] = {}
        for fig, path in outputs.figures.items():
            media[f"{PREFIX}/report/figures/{fig}"] = wandb.Image(str(path), caption=fig)
        if outputs.sweep is not None and outputs.sweep.height:
            media[f"{PREFIX}/report/sweep"] = _table(wandb, outputs.sweep)
        if outputs.choose:
            import polars as pl

            media[f"{PREFIX}/report/choose"] = _table(
                wandb, pl.DataFrame(outputs.choose, infer_schema_length=None)
            )
        if outputs.html is not None:
            media[f"{PREFIX}/report/page"] = wandb.Html(
                Path(outputs.html).read_text(encoding="utf-8"), inject=False
            )
        if media:
            if outputs.last_step is not None:
                media[STEP] = outputs.last_step
            run.log(media)
            keys += [k for k in media if k != STEP]
        for k, v in outputs.metrics.items():
            run.summary[f"{PREFIX}/summary/{k}"] = v
        if artifact is not None:
            keys.append(_log_artifact(wandb, run, Path(artifact), outputs))
        info = {
            "entity": getattr(run, "entity", entity),
            "project": getattr(run, "project", project),
            "id": run.id,
            "resumed": bool(run_id),
            "dir": str(Path(run.dir).parent),
            "mode": _mode(run),
            "keys": keys,
        }
    finally:
        if own:
            run.finish()
    if own and info["mode"] == "offline":
        info["complete"] = wait_complete(Path(info["dir"]) / f"run-{info['id']}.wandb")
    return info


def init_kwargs(
    entity: str | None,
    project: str,
    run_id: str | None,
    *,
    name: str,
    dir: str | Path | None = None,
    default_dir: str | Path | None = None,
    mode: str | None = None,
    tags: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The `wandb.init` arguments: the target as given, and each default of ours only where
    the user's W&B environment (`environ`, default `os.environ`) sets nothing. The user's
    `WANDB_DIR`, `WANDB_NAME` and `WANDB_JOB_TYPE` are read here, now, and passed on: wandb
    reads its environment once per process (at its first `wandb.setup`), so a variable set
    later in the same process would be missed."""
    env = os.environ if environ is None else environ
    kw: dict[str, Any] = {"entity": entity, "project": project}
    if run_id:
        kw |= {"id": run_id, "resume": "allow"}
    else:
        kw["job_type"] = env.get("WANDB_JOB_TYPE") or "mismatch-replay"
        kw["name"] = env.get("WANDB_NAME") or name
    if dir is None:
        dir = env.get("WANDB_DIR") or default_dir
    if dir is not None:
        Path(dir).mkdir(parents=True, exist_ok=True)
        kw["dir"] = str(dir)
    if mode is not None:
        kw["mode"] = mode
    if tags is not None:
        kw["tags"] = tags
    return kw


def wait_complete(path: Path, timeout: float = 30.0) -> bool:
    """Wait until an offline run's transaction log holds its exit record: W&B's core process
    may still be writing the last records when `run.finish()` returns (seen with 0.31)."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        try:
            raws = records(path)
        except (DataError, UsageError, OSError):
            raws = []
        for raw in reversed(raws):
            if pb.Record.FromString(raw).WhichOneof("record_type") == "exit":
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _log_artifact(wandb, run, path: Path, outputs: ReportOutputs) -> str:
    if not path.exists():
        raise UsageError(f"--wandb-artifact {path}: no such file or directory.")
    art = wandb.Artifact(
        name=f"mismatch-replay-tokens-{run.id}",
        type="dataset",
        description="The canonical token table (mismatch-replay convert) the report replayed.",
        metadata={"sources": outputs.sources, "tool": f"mismatch-replay {_version()}"},
    )
    if path.is_dir():
        art.add_dir(str(path))
    else:
        art.add_file(str(path))
    run.log_artifact(art)
    return f"artifact:{art.name}"


def _name(outputs: ReportOutputs) -> str:
    src = Path(outputs.sources[0]).stem if outputs.sources else "log"
    return f"mismatch-replay {src}"


def _mode(run) -> str:
    try:
        return "offline" if run.settings._offline else "online"
    except AttributeError:  # pragma: no cover - other wandb versions
        return "unknown"


def _version() -> str:
    from .. import __version__

    return __version__


# ----------------------------------------------------------------------------- reading back

_HEADER = b":W&B"
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        found = sorted(p.glob("run-*.wandb"))
        if not found and (p / "latest-run").exists():
            found = sorted((p / "latest-run").glob("run-*.wandb"))
        if not found:
            found = sorted(p.glob("*/run-*.wandb")) or sorted(p.glob("wandb/*/run-*.wandb"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise UsageError(f"{p}: several W&B runs ({len(found)}); give one run directory.")
    raise DataError(f"{p}: no W&B run (run-<id>.wandb) found there.")


def records(path: str | Path) -> list[bytes]:
    """The raw records of a `.wandb` transaction log (each chunk's CRC checked)."""
    f = _wandb_file(path)
    data = f.read_bytes()
    if data[:4] != _HEADER:
        raise DataError(f"{f}: not a W&B transaction log (header {data[:7]!r}).")
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the block trailer is zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break  # a record still being written
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise DataError(f"{f}: record at byte {pos} fails its checksum.")
        pos += 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            buf = chunk
        elif kind == _MIDDLE:
            buf += chunk
        elif kind == _LAST:
            out.append(buf + chunk)
            buf = b""
    return out


def _items(items) -> dict:
    """W&B's (key | nested_key, value_json) items -> a nested dict."""
    out: dict = {}
    for it in items:
        path = list(it.nested_key) or [it.key]
        try:
            value = json.loads(it.value_json)
        except ValueError:
            value = it.value_json
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return out


def read_offline_run(path: str | Path) -> dict:
    """An offline (or synced) W&B run directory read back: {"run", "config", "history",
    "summary", "metrics", "files", "artifacts", "complete"} as plain Python values. A run
    still being written reads as far as it is written (complete: False)."""
    _wandb()
    from google.protobuf.json_format import MessageToDict
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict = {}
    config: dict = {}
    history: list[dict] = []
    summary: dict = {}
    metrics: list[dict] = []
    files: list[str] = []
    artifacts: list[dict] = []
    complete = False
    for raw in records(path):
        rec = pb.Record.FromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run = {
                "id": r.run_id,
                "entity": r.entity,
                "project": r.project,
                "resumed": bool(r.resumed),
                "display_name": r.display_name,
            }
            config.update(_items(r.config.update))
        elif kind == "config":
            config.update(_items(rec.config.update))
        elif kind == "history":
            history.append(_items(rec.history.item))
        elif kind == "summary":
            summary.update(_items(rec.summary.update))
        elif kind == "metric":
            metrics.append(MessageToDict(rec.metric, preserving_proto_field_name=True))
        elif kind == "files":
            files += [f.path for f in rec.files.files]
        elif kind == "artifact":
            a = MessageToDict(rec.artifact, preserving_proto_field_name=True)
            artifacts.append(a)
        elif kind == "exit":
            complete = True
    return {
        "path": str(_wandb_file(path)),
        "complete": complete,  # the run's exit record is there (a finished run)
        "run": run,
        "config": config,
        "history": history,
        "summary": summary,
        "metrics": metrics,
        "files": files,
        "artifacts": artifacts,
    }


__all__ = [
    "PREFIX",
    "STEP",
    "check",
    "init_kwargs",
    "log_to_wandb",
    "parse_target",
    "read_offline_run",
    "records",
    "wait_complete",
]
