"""prime-rl: the token export (`step_<n>/rank_<r>.jsonl`) and the traces that replaced it
(`traces/stream.jsonl` with the trainer's annotations).

Design
------
Read from PrimeIntellect-ai/prime-rl `src/prime_rl/trainer/rl/token_export.py`, `train.py`,
`loss.py` at 559b447; the trace annotations (PR #3444) `src/prime_rl/trainer/rl/
annotations.py` and `src/prime_rl/monitors/file/traces/update.py` at 65a1858 (a PR
#3444-era commit found in the code index, not in the 559b447 snapshot); the trace records
PrimeIntellect-ai/verifiers `verifiers/v1/graph.py`, `trace.py`, `episode.py` at a60a606.

Token export (`PRIME`, read by records.read_records): one object per packed sequence, with
per-token arrays. Index 0 of every record is the sample's first token, whose trainer
log-prob crosses the packing boundary (train.py shifts the packed micro batch right: log
1/vocab for its first sample, the previous sample's last value otherwise), so its
`loss_mask` is forced false. `sample_id = rank * PRIME_SEQ_STRIDE + export_sequence_idx`
(unique within a step across ranks, and readable: 2000017 is rank 2, sequence 17). The step
is the record's `step`, else the `step_<n>` directory. Tokens with `rl_weights == 0` and
`ref_kl_weights == 0` (a null stream is the default: rl 1.0, ref_kl 0.0) are CE / SFT /
distillation tokens without a sampling mismatch: they leave the loss mask, as in prime-rl's
own mismatch metric (`loss_mask & (rl_weights != 0 | ref_kl_weights != 0)`, train.py).
`is_masked` and `mismatch_kl` are the run's own decisions (`PRIME_CHECKS`), read only by
inspect.prime_check, which replays them. A step directory is complete once prime-rl writes
its `STABLE` marker (sources.py skips the others).

Traces (PR #3444, replaced the export on 2026-08-31): `traces/stream.jsonl` holds one episode
record per line (`{"id", "env", "run", "traces": [trace, ...]}`; a bare trace, `{"id",
"nodes", ...}`, is read too). A trace is a message graph: each node adds `token_ids`, a
per-token `mask` (True on sampled tokens) and `logprobs` over its sampled tokens only; a
branch is a root-to-leaf path, branches numbered by leaf in node order, and a branch's tokens
are its nodes' `token_ids` concatenated (the sample the trainer packed).
`traces/annotations/<producer>.jsonl` holds update records `{"version", "trace_id", "info",
"branches": [{"index", "trainer_logprobs", "entropies", "is_masked", "advantages"}]}`, whose
streams run over the branch's whole token prefix, null outside the trainer's loss mask and
at position 0 (the right shift crosses the packing boundary), floats rounded to the
monitor's `float_decimals`. Updates are folded in file order, newest wins
(`load_annotations`, cached for the read after the probe). A token is a loss token where
the trainer stream is not null; a node's `loss_weights` ("rl", "ref_kl") and a null
`is_masked` inside an annotated branch (prime-rl leaves tokens outside its RL component
unannotated: the fold rule of update.py) mark CE tokens, which leave the mask. The step is
the update's `info.train.trained_at_step`, else the episode's `run.work.step`; `sample_id`
numbers the (trace, branch) pairs in stream order; `env` is the episode's `env.name` (else
`env.id`). The annotations are indexed before the stream is read: 8 bytes per annotated
value (one per stream and token).

Hostile or broken input (issue 37): the annotations are held in memory (about their size on
disk), so together they are capped at `safe_read.data_cap()` (4 GB; MISMATCH_REPLAY_MAX_FILE_MB
raises it); each file is a regular file, each line at most `safe_read.LINE_CAP`; a stream or
update line whose structure is not a trace's (a node that is not an object, arrays of the
wrong type, nesting the parser cannot follow) is a bad record naming its line, never a
traceback.

On 2 shared cores the export reads at ~0.4M tokens/s (~200 bytes of JSON a token: every key
of the exporter), the traces at ~0.2M tokens/s (the standard library's JSON parser on whole
episode records).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from .. import safe_read
from .base import (
    BOOL,
    CAPTURE_HINT,
    F64,
    FRAMEWORK_BASE,
    I64,
    STR,
    Drops,
    Probe,
    floats,
    frame,
)
from .jsonl import first_record, json_lines
from .records import RecordFormat, as_bool

EXPORT_FILE = re.compile(r"rank_(\d+)\.jsonl")
STEP_DIR = re.compile(r"step_(\d+)")
TRACE_STREAM = "stream.jsonl"
PRIME_SEQ_STRIDE = 1_000_000  # prime-rl sample_id = rank * stride + export_sequence_idx
# Keys of prime-rl's own per-token decisions, read by inspect.prime_check only, and the
# columns they become (never canonical: canonicalisation drops them).
PRIME_CHECKS = {"is_masked": BOOL, "mismatch_kl": F64}


def step_dir(path: Path) -> Path | None:
    """The `step_<n>` directory of a prime-rl rank file (None when not in one)."""
    return path.parent if STEP_DIR.fullmatch(path.parent.name) else None


def traces_dir(path: Path) -> Path | None:
    """The prime-rl `traces/` directory a file sits in (up to two levels down), when it holds
    the trace stream; None otherwise."""
    for d in (path.parent, path.parent.parent, path.parent.parent.parent):
        if d.name == "traces" and (d / TRACE_STREAM).is_file():
            return d
    return None


# ----------------------------------------------------------------------------- token export


class PrimeExport(RecordFormat):
    """prime-rl's token export: env, CE tokens out of the mask, the shift pad, sample ids."""

    def probed(self, path, line, rec, wrapped, schema, columns):
        warnings = []
        if "env_name" in rec:
            columns["env"] = False
        ce = _prime_ce_tokens(rec)
        if ce:
            warnings.append(
                f"{path}: line {line} has {ce} loss token(s) with rl_weights == 0 and "
                "ref_kl_weights == 0 (CE, SFT or distillation tokens): they carry no sampling "
                "mismatch and are left out, as prime-rl's own mismatch metric does "
                "(loss_mask & (rl_weights != 0 | ref_kl_weights != 0))."
            )
        return schema, warnings

    def token_columns(self, cols, lit_step):
        step = pl.col("step").fill_null(lit_step) if "step" in cols else lit_step
        rank = pl.col("rank").fill_null(0) if "rank" in cols else pl.lit(0, dtype=I64)
        seq = (
            pl.col("export_sequence_idx").fill_null(pl.col("_rec"))
            if "export_sequence_idx" in cols
            else pl.col("_rec")
        )
        mask = as_bool("loss_mask") & (pl.col("_idx") != 0)  # index 0: the shift pad
        # CE / SFT / distillation tokens (rl and ref_kl weight 0) were not sampled by the
        # policy: prime-rl's mismatch mask is loss_mask & (rl_weights != 0 | ref_kl_weights
        # != 0), a null stream meaning its default (rl 1.0, ref_kl 0.0)
        if "rl_weights" in cols or "ref_kl_weights" in cols:
            rl = pl.col("rl_weights").fill_null(1.0) != 0 if "rl_weights" in cols else pl.lit(True)
            ref = (
                pl.col("ref_kl_weights").fill_null(0.0) != 0
                if "ref_kl_weights" in cols
                else pl.lit(False)
            )
            mask = mask & (rl | ref)
        exprs = [
            step.alias("step"),
            (rank * PRIME_SEQ_STRIDE + seq).cast(I64).alias("sample_id"),
            mask.alias("loss_mask"),
        ]
        if "position_ids" not in cols:
            exprs.append(pl.col("_idx").alias("position"))
        if "env_name" in cols:
            exprs.append(pl.col("env_name").cast(STR).alias("env"))
        if "is_masked" in cols:
            exprs.append(pl.col("is_masked").cast(BOOL).alias("logged_is_masked"))
        if "mismatch_kl" in cols:
            exprs.append(pl.col("mismatch_kl").cast(F64).alias("logged_mismatch_kl"))
        return exprs


PRIME = PrimeExport(
    name="prime-rl",
    arrays={
        "trainer_logprobs": "trainer_logprob",
        "inference_logprobs": "inference_logprob",
        "loss_mask": "loss_mask",
        "advantages": "advantage",
        "entropy": "entropy",
        "token_ids": "token_id",
        "position_ids": "position",
    },
    required=("trainer_logprobs", "inference_logprobs", "loss_mask"),
    scalars={"step": I64, "rank": I64, "export_sequence_idx": I64, "env_name": STR},
    hint="prime-rl writes these with trainer.enable_token_export",
    extras={"rl_weights": F64, "ref_kl_weights": F64},
    checks=PRIME_CHECKS,
)


def _prime_ce_tokens(rec: dict) -> int:
    """Loss tokens of one prime-rl record outside the rl and ref_kl components."""
    mask = rec.get("loss_mask") or []
    rl = rec.get("rl_weights") or [None] * len(mask)
    ref = rec.get("ref_kl_weights") or [None] * len(mask)
    if not isinstance(mask, list) or not isinstance(rl, list) or not isinstance(ref, list):
        return 0
    n = 0
    for m, w, k in zip(mask[1:], rl[1:], ref[1:], strict=False):
        if m and (w if w is not None else 1.0) == 0 and (k if k is not None else 0.0) == 0:
            n += 1
    return n


# ----------------------------------------------------------------------------- traces


_STREAMS = ("trainer_logprobs", "entropies", "advantages", "is_masked")
# what a line whose structure is not a trace's raises in the code below (a node that is not
# an object, a mask of strings, an index that is a list ...): a bad record, never a traceback
_MALFORMED = (
    TypeError,
    ValueError,
    AttributeError,
    KeyError,
    IndexError,
    RecursionError,
    pl.exceptions.PolarsError,
)


def _malformed(exc: BaseException) -> str:
    return f"its structure is not a trace's ({type(exc).__name__}: {str(exc)[:120]})"


_TRACES_HINT = (
    "prime-rl's file monitor writes <run>/monitors/file/traces/stream.jsonl and its RL trainer "
    "the annotations beside it (traces/annotations/trainer.jsonl, PR #3444)"
)


@dataclass
class _Annotations:
    """The folded update records of a trace stream: trace id -> branch -> stream -> values
    (float64, NaN for null; is_masked as int8, -1 for null), and trace id -> merged info."""

    branches: dict[str, dict[int, dict[str, np.ndarray]]]
    info: dict[str, dict]
    files: list[Path]
    tokens: int
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # skipped update lines

    def count_drops(self, report) -> None:
        """Add the update lines skipped (--drop-invalid) to a read's report."""
        if report is not None:
            for k, v in self.dropped.items():
                report.dropped[k] = report.dropped.get(k, 0) + v


_ANNOTATION_CACHE: dict[tuple, _Annotations] = {}


def _annotation_files(stream: Path) -> list[Path]:
    d = stream.parent / "annotations"
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.jsonl") if not p.name.endswith(".index.jsonl"))


def _deep_merge(old, new):
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _deep_merge(old.get(k), v) for k, v in new.items()}}
    return new


def _stream_values(name: str, v: list) -> np.ndarray:
    if name == "is_masked":
        return np.array([-1 if x is None else int(bool(x)) for x in v], dtype=np.int8)
    return floats(v)


class _SkipCounts:
    """Where Drops counts skipped records while the annotations are indexed (the index is
    cached and shared by the probe and every read, each of which takes the counts)."""

    def __init__(self) -> None:
        self.dropped: dict[tuple[str, str], int] = {}


def load_annotations(stream: Path, drop: bool = False) -> _Annotations:
    """Fold every producer's update records (file order, newest wins), as prime-rl's
    `fold_trace_updates` does onto the stream. The last stream's annotations are cached."""
    files = _annotation_files(stream)
    stats = []
    for p in files:
        try:
            stats.append(p.stat())
        except OSError as exc:
            raise DataError(f"{p}: cannot read it ({exc.strerror or exc}).") from None
    key = (
        str(stream),
        drop,
        *((str(p), st.st_mtime_ns, st.st_size) for p, st in zip(files, stats, strict=True)),
    )
    if key in _ANNOTATION_CACHE:
        return _ANNOTATION_CACHE[key]
    cap = safe_read.data_cap()
    total = sum(st.st_size for st in stats)
    if total > cap:
        raise DataError(
            f"{stream.parent / 'annotations'}: {len(files)} annotation file(s) of "
            f"{safe_read.size_text(total)} in all, over the {safe_read.size_text(cap)} limit for "
            "the annotations, which are held in memory while the stream is read (about their "
            f"size on disk). Set {safe_read.ENV_CAP} to a larger number of megabytes on a "
            "machine with the memory, or read a run with fewer steps."
        )
    branches: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    info: dict[str, dict] = {}
    seen = _SkipCounts()
    for path in files:
        drops = Drops(path, drop, seen)
        for n, upd in json_lines(path, drops):
            tid = upd.get("trace_id") if isinstance(upd, dict) else None
            if not isinstance(tid, str) or not isinstance(upd.get("branches", []), list):
                drops.bad(
                    f"line {n}",
                    "not a trace update",
                    "not a prime-rl trace update (expected keys version, trace_id, info, branches)",
                )
                continue
            if isinstance(upd.get("info"), dict) and upd["info"]:
                try:
                    merged = _deep_merge(info.get(tid, {}), upd["info"])
                except RecursionError:
                    drops.bad(f"line {n}", "not a trace update", "info nested too deep to merge")
                    continue
                info[tid] = merged
            for br in upd.get("branches") or []:
                idx = br.get("index") if isinstance(br, dict) else None
                if not isinstance(idx, int) or isinstance(idx, bool):
                    drops.bad(f"line {n}", "not a trace update", "a branch without an index")
                    continue
                slot = branches.setdefault(tid, {}).setdefault(idx, {})
                for name in _STREAMS:
                    v = br.get(name)
                    if not v:
                        continue
                    try:
                        slot[name] = _stream_values(name, v)
                    except (TypeError, ValueError, pl.exceptions.PolarsError) as exc:
                        drops.bad(
                            f"line {n}",
                            "values of the wrong type",
                            f"branch {idx}, key '{name}': {str(exc)[:120]}",
                        )
    tokens = sum(
        len(s["trainer_logprobs"])
        for b in branches.values()
        for s in b.values()
        if "trainer_logprobs" in s
    )
    ann = _Annotations(branches, info, files, tokens, dropped=seen.dropped)
    _ANNOTATION_CACHE.clear()
    _ANNOTATION_CACHE[key] = ann
    return ann


def _leaf_paths(nodes: list) -> list[list[int]]:
    """Root-to-leaf node indexes, one per branch, leaves in node order (verifiers'
    `graph.leaves`: a leaf is no node's parent)."""
    n = len(nodes)
    parents = {
        p
        for node in nodes
        if isinstance(node, dict)
        and isinstance(p := node.get("parent"), int)
        and not isinstance(p, bool)
        and 0 <= p < n
    }
    paths = []
    for leaf in (i for i in range(n) if i not in parents):
        path: list[int] = []
        seen: set[int] = set()
        i: int | None = leaf
        while isinstance(i, int) and 0 <= i < n and i not in seen:
            seen.add(i)
            path.append(i)
            i = nodes[i].get("parent") if isinstance(nodes[i], dict) else None
        paths.append(path[::-1])
    return paths


def _spread(nodes: list[dict], key: str) -> tuple[np.ndarray, bool]:
    """A per-sampled-token node field widened to the branch's tokens: each node's values on
    its sampled positions, 0.0 elsewhere (verifiers `Branch.spread`); and whether any node
    carries the field."""
    out, any_values = [], False
    for node in nodes:
        mask = np.asarray(node.get("mask") or [], dtype=bool)
        vals = node.get(key)
        row = np.zeros(len(mask))
        if vals:
            any_values = True
            at = np.flatnonzero(mask)
            k = min(at.size, len(vals))
            row[at[:k]] = floats(vals[:k]) if k else row[:0]
        out.append(row)
    return (np.concatenate(out) if out else np.zeros(0)), any_values


def _loss_weight(nodes: list[dict], name: str) -> np.ndarray | None:
    """A named loss-weight stream over the branch's tokens (0.0 where a node lacks it), or
    None when no node carries a nonzero weight (prime-rl then applies its default)."""
    parts, found = [], False
    for node in nodes:
        n = len(node.get("token_ids") or [])
        w = (node.get("loss_weights") or {}).get(name)
        if w is None or len(w) != n:
            parts.append(np.zeros(n))
        else:
            found = True
            parts.append(floats(w))
    if not found:
        return None
    arr = np.concatenate(parts) if parts else np.zeros(0)
    return arr if arr.any() else None


def _trace_records(obj) -> list[tuple[dict, dict]] | None:
    """(episode, trace) pairs of one stream line: an episode record, or a bare trace."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("traces"), list):
        return [(obj, t) for t in obj["traces"] if isinstance(t, dict)]
    if isinstance(obj.get("nodes"), list):
        return [({}, obj)]
    return None


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _trace_step(episode: dict, info: dict) -> int:
    train = _dict(info.get("train"))
    for v in (
        train.get("trained_at_step"),
        _dict(_dict(episode.get("run")).get("work")).get("step"),
    ):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


def _env_name(episode: dict) -> str | None:
    env = _dict(episode.get("env"))
    name = env.get("name") or env.get("id") or None
    return name if isinstance(name, str) else None if name is None else str(name)


def _branch_tokens(
    nodes: list[dict], streams: dict[str, np.ndarray]
) -> dict[str, np.ndarray] | str:
    """One annotated branch -> token arrays over its trainer stream, or why it cannot be read."""
    n = sum(len(node.get("token_ids") or []) for node in nodes)
    mask = np.concatenate(
        [np.asarray(node.get("mask") or [], dtype=bool) for node in nodes] or [np.zeros(0, bool)]
    )
    if mask.size != n:
        return f"node masks cover {mask.size} tokens but the nodes hold {n} token_ids"
    tr = streams.get("trainer_logprobs")
    if tr is None:
        return "no trainer_logprobs stream"
    length = tr.size
    if length > n:
        return f"the trainer_logprobs stream has {length} values but the branch {n} tokens"
    lq, _ = _spread(nodes, "logprobs")
    k = np.arange(length)
    loss = mask[:length] & ~np.isnan(tr) & (k > 0)
    rl, ref = _loss_weight(nodes, "rl"), _loss_weight(nodes, "ref_kl")
    if rl is not None or ref is not None:
        sampled = (rl[:length] != 0) if rl is not None else np.ones(length, bool)
        if ref is not None:
            sampled |= ref[:length] != 0
        loss &= sampled
    im = streams.get("is_masked")
    if im is not None:
        im = np.concatenate([im[:length], np.full(max(0, length - im.size), -1, np.int8)])
        if (im[loss] != -1).any():  # an RL-annotated branch: unannotated tokens are CE tokens
            loss &= im != -1
    out = {
        "position": k.astype(np.int64),
        "trainer_logprob": tr,
        "inference_logprob": lq[:length],
        "loss_mask": loss,
    }
    adv = streams.get("advantages")
    if adv is None:
        node_adv, found = _spread(nodes, "advantages")
        adv = node_adv if found else None
    if adv is not None:
        out["advantage"] = np.concatenate(
            [adv[:length], np.full(max(0, length - adv.size), np.nan)]
        )
    ent = streams.get("entropies")
    if ent is not None:
        out["entropy"] = np.concatenate([ent[:length], np.full(max(0, length - ent.size), np.nan)])
    if im is not None:
        out["logged_is_masked"] = im
    return out


def probe_traces(path: Path, drop: bool) -> Probe | None:
    """Columns a prime-rl trace stream delivers: the annotations decide (the stream holds only
    the sampler's side)."""
    ann = load_annotations(path, drop)
    if not ann.files or not ann.branches:
        where = path.parent / "annotations"
        seen = (
            f"{len(ann.files)} annotation file(s) with no update record"
            if ann.files
            else (f"no {where}")
        )
        raise DataError(
            f"{path}: no trainer annotations beside the trace stream ({seen}), so there are no "
            "trainer log-probs to replay: the traces hold only the sampler's. "
            f"{_TRACES_HINT}; point at a run whose trainer has written some, {CAPTURE_HINT}."
        )
    streams = [s for b in ann.branches.values() for s in b.values()]
    if not any("trainer_logprobs" in s for s in streams):
        raise DataError(
            f"{path}: the annotations ({', '.join(p.name for p in ann.files)}) carry no "
            "trainer_logprobs stream. " + _TRACES_HINT + "."
        )
    columns = dict.fromkeys([*FRAMEWORK_BASE, "loss_mask", "env"], False)
    adv = any("advantages" in s for s in streams)
    if not adv:
        first = first_record(path, drop)
        pairs = _trace_records(first[0]) if first else None
        nodes = [t.get("nodes") for _, t in pairs or []]
        adv = any(
            node.get("advantages")
            for ns in nodes
            if isinstance(ns, list)
            for node in ns
            if isinstance(node, dict)
        )
    if adv:
        columns["advantage"] = False
    if any("entropies" in s for s in streams):
        columns["entropy"] = False
    return Probe(columns=columns, schema={}, rows=ann.tokens)


def _line_branches(n: int, obj, ann: _Annotations, drops: Drops, seen: set[str]) -> list:
    """(token arrays, step, env) of each annotated branch of one stream line, in order; a
    branch that does not fit its annotations is a bad record (`drops`)."""
    pairs = _trace_records(obj)
    if pairs is None:
        drops.bad(
            f"line {n}",
            "not an episode record",
            "neither an episode record (key 'traces') nor a trace (key 'nodes')",
        )
        return []
    out = []
    for episode, trace in pairs:
        tid = trace.get("id")
        todo = ann.branches.get(tid) if isinstance(tid, str) else None
        if not todo:
            continue  # never trained on (eval, filtered, still in flight)
        seen.add(tid)
        nodes = trace.get("nodes") or []
        if not isinstance(nodes, list) or not all(isinstance(x, dict) for x in nodes):
            drops.bad(f"line {n}", "not an episode record", f"trace {tid}: nodes are not objects")
            continue
        paths = _leaf_paths(nodes)
        step = _trace_step(episode, ann.info.get(tid, {}))
        env = _env_name(episode)
        for b in sorted(todo):
            if not 0 <= b < len(paths):
                drops.bad(
                    f"line {n}",
                    "branch not in the trace",
                    f"trace {tid}: the annotations name branch {b}, the trace has "
                    f"{len(paths)} branch(es)",
                )
                continue
            toks = _branch_tokens([nodes[i] for i in paths[b]], todo[b])
            if isinstance(toks, str):
                drops.bad(
                    f"line {n}",
                    "branch and stream disagree",
                    f"trace {tid}, branch {b}: {toks}",
                )
                continue
            out.append((toks, step, env))
    return out


def read_traces(
    path: Path,
    wanted: set[str] | None,
    drop: bool,
    report,
    batch_rows: int,
    checks: bool = False,
) -> Iterator[pl.DataFrame]:
    """A prime-rl trace stream with its annotations -> canonical token frames, one row per
    token of each annotated branch's trainer stream."""
    ann = load_annotations(path, drop)
    ann.count_drops(report)
    drops = Drops(path, drop, report)
    seen: set[str] = set()
    sample = 0
    buf: dict[str, list[np.ndarray]] = {}
    nbuf = 0
    for n, obj in json_lines(path, drops):
        try:
            found = _line_branches(n, obj, ann, drops, seen)
        except _MALFORMED as exc:
            drops.bad(f"line {n}", "not an episode record", _malformed(exc))
            continue
        for toks, step, env in found:
            if not checks:
                toks.pop("logged_is_masked", None)
            size = toks["position"].size
            toks["step"] = np.full(size, step, np.int64)
            toks["sample_id"] = np.full(size, sample, np.int64)
            toks["env"] = np.full(size, env, dtype=object)
            sample += 1
            for k, v in toks.items():
                buf.setdefault(k, []).append(v)
            nbuf += size
            if nbuf >= batch_rows:
                yield frame(_concat(buf), wanted)
                buf, nbuf = {}, 0
    if nbuf:
        yield frame(_concat(buf), wanted)
    missing = [t for t in ann.branches if t not in seen]
    if missing and report is not None:
        note = (
            f"{path}: {len(missing):,} trace(s) named by the trainer annotations are not in the "
            f"stream (e.g. {missing[0]}); their tokens are not read."
        )
        if note not in report.warnings:
            report.warnings.append(note)


def _concat(buf: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in buf.items()}
