"""Tally -> the long sweep table (one row per rule x swept value x group).

Design
------
Every job ends as per-bin sums of shape (groups, K + 2) (see engine.py); token rules have them
from the streaming pass, sequence rules and m2po get them here, from the per-sequence sums and
the per-step l^2 values (one step at a time from the engine's M2POStore, steps spread over the
cores: a step's running sums never mix with another step's). One function then turns bins into
rows by suffix sums, so every rule reports the same columns:

rule, setting (the fixed parameters), param, value, [group], tokens, masked_tokens,
masked_fraction, truncated_tokens, truncated_fraction, sequences, masked_sequences,
masked_sequence_fraction, prompt_groups, fully_masked_groups, fully_masked_group_fraction,
masked_mass, masked_mass_fraction, is_masked_mean (prime-rl's is_masked/mean, with
match="prime-rl"), weight_mean, weight_max, weight_ess, level, kind, spec.

Undefined values (no sequences in the log, a weight statistic of a mask rule) are null.

Prompt groups (the log has a `group_id`, e.g. verl's `uid`): a group is (step, group_id);
its samples are the sequences (step, sample_id) with at least one loss token, each in the
group of its first loss token (a null group_id: a group of its own). A sample is masked by
a mask rule at a value when the rule masks any of its loss tokens (token rules, m2po) or the
sequence itself (sequence rules) -- the sample's `masked_sequences` flag; a group is fully
masked when every one of its samples is: under GRPO such a group adds nothing to the
gradient (verl#6375). Weight rules mask nothing: 0 fully masked groups. From each
sequence's bin (its highest token bin, or its sequence bin) a group's lowest sample bin
decides, so the fully masked groups at every value are one bincount and a suffix sum per job,
as exact as the other counts; the replay keeps one code per sequence (8 bytes) and one dict
entry per group. The columns are null without a group_id, and where a prompt group's
samples fall in different --by groups: always by q_bucket and by length, by env where an env
is not constant within a group (a group is inside one step, so --by step is defined).

Grouping by a token property (`q_bucket`, the inference probability of each token) splits a
sequence over several groups, while the replay keeps one group per sequence (its first
token's). Counts that need a sequence inside one group are therefore null there: the
sequence columns (sequences, masked_sequences, masked_sequence_fraction, is_masked_mean) of
every rule, and every count of a sequence rule (it masks whole sequences, so its tokens per
bucket would need each sequence's tokens per bucket, which the replay does not keep). Token
and m2po counts per bucket are exact. `step` and `env` are constant within a sequence: every
column is defined there. So is `length` (engine.py): a token's group is its sequence's length
bucket, so a sequence never spans groups and the sequence columns stay defined.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from . import kernels, pmath
from .engine import (
    Q_BUCKET_EDGES,
    Job,
    Tally,
    _accumulate,
    _bins,
    _JobBins,
    _m2po_pool,
    _new_bins,
    m2po_resolve,
)
from .rules import LOG_CLAMP

# Group keys that vary within a sequence (see the module docstring).
TOKEN_GROUPS = ("q_bucket",)
SEQUENCE_COLUMNS = ("sequences", "masked_sequences", "masked_sequence_fraction", "is_masked_mean")
COUNT_COLUMNS = (
    "tokens",
    "masked_tokens",
    "masked_fraction",
    "truncated_tokens",
    "truncated_fraction",
    "masked_mass",
    "masked_mass_fraction",
    "weight_mean",
    "weight_max",
    "weight_ess",
)
# prompt groups (the log has a group_id): see the module docstring
GROUP_COLUMNS = ("prompt_groups", "fully_masked_groups", "fully_masked_group_fraction")
INT_COLUMNS = (
    "tokens",
    "masked_tokens",
    "truncated_tokens",
    "sequences",
    "masked_sequences",
    "prompt_groups",
    "fully_masked_groups",
)

COLUMNS = (
    "rule",
    "setting",
    "param",
    "value",
    "tokens",
    "masked_tokens",
    "masked_fraction",
    "truncated_tokens",
    "truncated_fraction",
    "sequences",
    "masked_sequences",
    "masked_sequence_fraction",
    "prompt_groups",
    "fully_masked_groups",
    "fully_masked_group_fraction",
    "masked_mass",
    "masked_mass_fraction",
    "is_masked_mean",
    "weight_mean",
    "weight_max",
    "weight_ess",
    "level",
    "kind",
    "spec",
)


def _suffix(a: np.ndarray) -> np.ndarray:
    """s[:, j] = sum of a[:, j:], with a trailing zero column."""
    rev = np.cumsum(a[:, ::-1], axis=1)[:, ::-1]
    return np.concatenate([rev, np.zeros((a.shape[0], 1), dtype=a.dtype)], axis=1)


def _seq_bins(tally: Tally, score: np.ndarray, job: Job, G: int) -> np.ndarray:
    """Sequences per (group, bin) for per-sequence scores."""
    thr = job.thresholds[job.order]
    b = _bins(score, thr, job.rule.inclusive)
    width = len(job.values) + 2
    g = tally.seq["group"].a[: len(tally.seq_keys)].astype(np.int64)
    return np.bincount(g * width + b, minlength=G * width).reshape(G, width).astype(np.int64)


def _seq_count(tally: Tally, maxbin: np.ndarray, width: int, G: int) -> np.ndarray:
    """Sequences per (group, bin) from each sequence's max bin over its tokens (-1: none)."""
    g = tally.seq["group"].a[: len(tally.seq_keys)].astype(np.int64)
    b = np.maximum(maxbin, 0).astype(np.int64)
    return np.bincount(g * width + b, minlength=G * width).reshape(G, width).astype(np.int64)


def _sequence_job_bins(tally: Tally, job: Job, G: int) -> _JobBins:
    st = tally.seq_stats()
    rule = job.rule
    score = rule.score(st, job.param)
    thr = job.thresholds[job.order]
    b = _bins(score, thr, rule.inclusive)
    bins = _new_bins(len(job.values), G, rule.kind == "weight")
    g = tally.seq["group"].a[: len(tally.seq_keys)].astype(np.int64)
    mass = tally.seq["mass"].a[: len(tally.seq_keys)]
    w = rule.weight(st, job.param) if rule.kind == "weight" else None
    _accumulate(bins, b, g, G, mass, w, count=st.n)
    bins.seq_count = _seq_bins(tally, score, job, G)
    bins.seq_bin = b
    return bins


def m2po_scores(tally: Tally) -> dict[str, np.ndarray]:
    """Per-token m2po scores: the mean l^2 of the step's tokens ranked at or below this one.

    Within a step, sort l^2 descending: x_1 >= ... >= x_n. The token of rank m (0-based) gets
    M_m = mean(x_{m+1..n}); M is non-increasing in m, so "mask the largest until the rest's
    mean is < tau" masks exactly the tokens with M_m >= tau. Ties are broken by input order.
    The running sums restart at each step (a step's scores never depend on another step).
    For inspection and tests: it holds every token; the sweep itself bins step by step
    (`_m2po_bins`).
    """
    out: dict[str, list[np.ndarray]] = {"score": [], "g": [], "mass": [], "seq": []}
    for _, (x, mass, g, seq) in tally.m2po.steps():
        n = x.shape[0]
        order = np.argsort(-x, kind="stable")
        xs = x[order]
        suffix = np.cumsum(xs[::-1])[::-1]  # from the smallest up: no cancellation
        out["score"].append(suffix / (n - np.arange(n)))
        out["g"].append(g[order])
        out["mass"].append(mass[order])
        out["seq"].append(seq[order])
    z = np.zeros(0)
    kinds = {"score": z, "g": z.astype(np.int64), "mass": z, "seq": z.astype(np.int64)}
    return {k: np.concatenate(v) if v else kinds[k] for k, v in out.items()}


def _m2po_bins(tally: Tally) -> dict[int, _JobBins]:
    """Bins of every m2po job: the steps resolved during the replay (Tally.seal_m2po) plus
    the tally's M2POStore, resolved step by step (memory: one step per thread), steps spread
    over the threads; cached until the tally changes."""
    cached = getattr(tally, "_m2po_cache", None)
    if cached is not None and cached[0] == tally.version:
        return cached[1]
    G = len(tally.groups)
    n_seq = len(tally.seq_keys)
    matching = tally.inv_n is not None
    todo = {ji: job for ji, job in enumerate(tally.jobs) if job.rule.level == "step"}
    steps = tally.m2po.step_ids()
    nt = max(1, min(kernels.threads(), len(steps)))

    def work(part: list[int]):
        out = {ji: _new_bins(len(job.values), G, False, matching) for ji, job in todo.items()}
        seq_bin = {ji: np.full(max(n_seq, 1), -1, np.int64) for ji in todo}
        m2po_resolve(tally, (tally.m2po.step(s) for s in part), out, seq_bin, G, n_seq)
        return out, seq_bin

    if nt == 1:
        parts = [work(steps)]
    else:
        parts = list(kernels._executor(nt).map(work, [steps[t::nt] for t in range(nt)]))
    out, seq_bin = parts[0]
    sealed = []  # steps resolved during the replay
    if any(ji in tally.m2po_done for ji in todo):
        for ji in todo:
            tally._sealed_bins(ji, G, n_seq)
        sealed = [(tally.m2po_done, tally.m2po_done_seq)]
    for o, sb in [*parts[1:], *sealed]:
        for ji in todo:
            out[ji].count += o[ji].count[:G]
            out[ji].mass += o[ji].mass[:G]
            if matching:
                out[ji].seqfrac += o[ji].seqfrac[:G]
            np.maximum(seq_bin[ji], sb[ji][: seq_bin[ji].shape[0]], out=seq_bin[ji])
    if tally.has_seq:
        for ji, job in todo.items():
            out[ji].seq_count = _seq_count(tally, seq_bin[ji][:n_seq], len(job.values) + 2, G)
            out[ji].seq_bin = seq_bin[ji][:n_seq]
    tally._m2po_cache = (tally.version, out)
    return out


def job_bins(tally: Tally, ji: int) -> _JobBins:
    """The finished per-bin sums of job `ji`, shape (groups, K + 2)."""
    tally.flush()
    job = tally.jobs[ji]
    G = len(tally.groups)
    if job.rule.level == "sequence":
        return _sequence_job_bins(tally, job, G)
    if job.rule.level == "step":
        return _m2po_bins(tally)[ji]
    bins = tally.bins[ji]
    bins.grow(G)
    if tally.has_seq and ji in tally.seq_max:
        maxbin = tally.seq_max[ji].a[: len(tally.seq_keys)]
        bins.seq_count = _seq_count(tally, maxbin, len(job.values) + 2, G)
        bins.seq_bin = maxbin
    return bins


def _frac(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _job_columns(tally: Tally, ji: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One job's (group, value) arrays, and each cell's group index."""
    job = tally.jobs[ji]
    rule = job.rule
    bins = job_bins(tally, ji)
    G, width = bins.count.shape
    K = width - 2
    inv = np.empty(K, dtype=np.int64)
    inv[job.order] = np.arange(K)  # value index -> sorted threshold index
    cnt_suf = _suffix(bins.count)
    mass_suf = _suffix(bins.mass)
    tokens = bins.count.sum(axis=1)
    mass_tot = bins.mass.sum(axis=1)
    k_idx = inv + 1  # bins strictly above the value's sorted threshold
    hit = cnt_suf[:, k_idx]  # (G, K) masked or truncated tokens
    masked_mass = mass_suf[:, k_idx]
    weight = rule.kind == "weight"
    cols: dict[str, np.ndarray] = {}
    gi, vi = np.meshgrid(np.arange(G), np.arange(K), indexing="ij")
    cols["value"] = np.full((G, K), job.report_value) if job.report_param else job.values[vi]
    cols["tokens"] = np.broadcast_to(tokens[:, None], (G, K))
    cols["masked_tokens"] = np.zeros((G, K), dtype=np.int64) if weight else hit
    cols["truncated_tokens"] = hit if weight else np.zeros((G, K), dtype=np.int64)
    if bins.seq_count is not None:
        seq_suf = _suffix(bins.seq_count)
        cols["sequences"] = np.broadcast_to(bins.seq_count.sum(axis=1)[:, None], (G, K))
        cols["masked_sequences"] = np.zeros((G, K), dtype=np.int64) if weight else seq_suf[:, k_idx]
    if tally.inv_n is not None and not weight and "sequences" in cols:
        if bins.seqfrac is not None:  # token rules: mean over sequences of masked fractions
            cols["is_masked_mean"] = _frac(_suffix(bins.seqfrac)[:, k_idx], cols["sequences"])
        else:  # sequence rules mask whole sequences
            cols["is_masked_mean"] = _frac(cols["masked_sequences"], cols["sequences"])
    grp = _prompt_group_bins(tally, bins.seq_bin, width, G)
    if grp is not None:
        cols["prompt_groups"] = np.broadcast_to(grp.sum(axis=1)[:, None], (G, K))
        cols["fully_masked_groups"] = (
            np.zeros((G, K), dtype=np.int64) if weight else _suffix(grp)[:, k_idx]
        )
    cols["masked_mass"] = np.zeros((G, K)) if weight else masked_mass
    cols["masked_mass_total"] = np.broadcast_to(mass_tot[:, None], (G, K))
    if weight:
        wm, wx, we = _weight_stats(bins, job, inv)
        cols["weight_mean"], cols["weight_max"], cols["weight_ess"] = wm, wx, we
    return cols, gi


def _prompt_layout(tally: Tally):
    """(sequence order by prompt group, each group's first position in it, each group's
    --by group) -- or None where the counts are undefined: no group id, or a prompt group
    whose samples fall in different --by groups (always for q_bucket and length; for env
    where an env is not constant within a prompt group). Cached until the tally changes."""
    cached = getattr(tally, "_pgroup_cache", None)
    if cached is not None and cached[0] == tally.version:
        return cached[1]
    out = None
    n = len(tally.seq_keys)
    if tally.has_pgroup and tally.has_seq and n and tally.by not in (*TOKEN_GROUPS, "length"):
        pg = tally.seq["pgroup"].a[:n].astype(np.int64)
        sg = tally.seq["group"].a[:n].astype(np.int64)
        order = np.argsort(pg, kind="stable")
        ps = pg[order]
        starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
        gs = sg[order]
        lo = np.minimum.reduceat(gs, starts)
        hi = np.maximum.reduceat(gs, starts)
        if (ps[0] >= 0) and (lo == hi).all():
            out = (order, starts, lo)
    tally._pgroup_cache = (tally.version, out)
    return out


def _prompt_group_bins(tally: Tally, seq_bin, width: int, G: int) -> np.ndarray | None:
    """Prompt groups per (--by group, bin of the group's least-masked sample): a group is
    fully masked at a value iff every sample is, iff its lowest sequence bin is above the
    value's, so the fully masked groups at a value are a suffix sum, like every count."""
    lay = _prompt_layout(tally) if seq_bin is not None else None
    if lay is None:
        return None
    order, starts, by_group = lay
    b = np.maximum(np.asarray(seq_bin)[: order.shape[0]], 0).astype(np.int64)
    low = np.minimum.reduceat(b[order], starts)
    return np.bincount(by_group * width + low, minlength=G * width).reshape(G, width)


def job_frame(tally: Tally, ji: int) -> pl.DataFrame:
    """Rows of one job: every value x group."""
    cols, gi = _job_columns(tally, ji)
    df = _frame(_job_data(tally, tally.jobs[ji], cols, gi))
    return df.sort([tally.by, "value"]) if tally.by is not None else df


def _weight_stats(bins: _JobBins, job: Job, inv: np.ndarray):
    """Mean, max and ESS fraction of the weights at every value (cap = the value)."""
    G, width = bins.count.shape
    K = width - 2
    # the value at each sorted threshold position; a truncated token's weight is the cap, but
    # never beyond the clamped ratio's range [e^-20, e^20] (weights use exp(clip(l, -20, 20)))
    cap = np.clip(job.values[job.order], pmath.exp(-LOG_CLAMP), pmath.exp(LOG_CLAMP))
    cnt = bins.count.astype(float)
    pre_sum = np.cumsum(bins.wsum, axis=1)  # bins 0..k untruncated natural weights
    pre_sq = np.cumsum(bins.wsq, axis=1)
    pre_max = np.maximum.accumulate(bins.wmax, axis=1)
    swept_trunc = _suffix(cnt[:, : K + 1])  # bins k+1..K truncated by the swept side
    out_sum = np.empty((G, K))
    out_sq = np.empty((G, K))
    out_max = np.empty((G, K))
    for k in range(K):
        t = swept_trunc[:, k + 1]
        out_sum[:, k] = pre_sum[:, k] + cap[k] * t + bins.wsum[:, K + 1]
        out_sq[:, k] = pre_sq[:, k] + cap[k] ** 2 * t + bins.wsq[:, K + 1]
        mx = np.maximum(pre_max[:, k], bins.wmax[:, K + 1])
        out_max[:, k] = np.where(t > 0, np.maximum(mx, cap[k]), mx)
    n = cnt.sum(axis=1)[:, None]
    mean = _frac(out_sum, np.broadcast_to(n, (G, K)))
    ess = _frac(out_sum * out_sum, n * out_sq)
    # back to value order
    return mean[:, inv], np.where(n > 0, out_max[:, inv], np.nan), ess[:, inv]


def _job_data(tally: Tally, job: Job, cols: dict, gi: np.ndarray) -> dict[str, object]:
    """One job's table columns (arrays and lists), before they become a frame."""
    G, K = gi.shape
    rule = job.rule
    flat = {k: np.asarray(v).reshape(-1) for k, v in cols.items()}
    n_rows = G * K
    param = job.report_param or job.param
    data: dict[str, object] = {
        "rule": [rule.name] * n_rows,
        "setting": [rule.setting(param)] * n_rows,
        "param": [param] * n_rows,
        "value": flat["value"].astype(float),
    }
    if tally.by is not None:
        data[tally.by] = [tally.groups[i] for i in gi.reshape(-1)]
    tokens = flat["tokens"].astype(np.int64)
    data["tokens"] = tokens
    data["masked_tokens"] = flat["masked_tokens"].astype(np.int64)
    data["masked_fraction"] = _frac(flat["masked_tokens"], tokens)
    data["truncated_tokens"] = flat["truncated_tokens"].astype(np.int64)
    data["truncated_fraction"] = _frac(flat["truncated_tokens"], tokens)
    if "sequences" in flat:
        data["sequences"] = flat["sequences"].astype(np.int64)
        data["masked_sequences"] = flat["masked_sequences"].astype(np.int64)
        data["masked_sequence_fraction"] = _frac(flat["masked_sequences"], flat["sequences"])
    else:
        data["sequences"] = np.full(n_rows, np.nan)
        data["masked_sequences"] = np.full(n_rows, np.nan)
        data["masked_sequence_fraction"] = np.full(n_rows, np.nan)
    if "prompt_groups" in flat:
        data["prompt_groups"] = flat["prompt_groups"].astype(np.int64)
        data["fully_masked_groups"] = flat["fully_masked_groups"].astype(np.int64)
        data["fully_masked_group_fraction"] = _frac(
            flat["fully_masked_groups"], flat["prompt_groups"]
        )
    else:
        for k in GROUP_COLUMNS:
            data[k] = np.full(n_rows, np.nan)
    data["masked_mass"] = flat["masked_mass"].astype(float)
    data["masked_mass_fraction"] = _frac(flat["masked_mass"], flat["masked_mass_total"])
    data["is_masked_mean"] = (
        flat["is_masked_mean"].astype(float)
        if "is_masked_mean" in flat
        else np.full(n_rows, np.nan)
    )
    for k in ("weight_mean", "weight_max", "weight_ess"):
        data[k] = flat[k].astype(float) if k in flat else np.full(n_rows, np.nan)
    if tally.by in TOKEN_GROUPS:  # a sequence spans groups: undefined per group
        undefined = SEQUENCE_COLUMNS + (COUNT_COLUMNS if rule.level == "sequence" else ())
        for k in undefined:
            data[k] = np.full(n_rows, np.nan)
    data["level"] = [rule.level] * n_rows
    data["kind"] = [rule.kind] * n_rows
    specs = {v: rule.replace(**{param: v}).spec() for v in set(flat["value"].tolist())}
    data["spec"] = [specs[v] for v in flat["value"].tolist()]  # once per value, not per group
    return data


def _frame(data: dict[str, object]) -> pl.DataFrame:
    df = pl.DataFrame(data)
    # NaN means "undefined" here: store it as null so JSON/CSV never carry NaN.
    df = df.with_columns(
        [pl.col(c).fill_nan(None) for c, t in df.schema.items() if t == pl.Float64]
    )
    return df.with_columns([pl.col(c).cast(pl.Int64) for c in INT_COLUMNS])


def sweep_table(tally: Tally) -> pl.DataFrame:
    """The long table of every job, in job order, values ascending, then group: one frame
    built from every job's columns at once. m2po's steps are resolved in a background
    thread (numba and numpy's sort, no GIL held) while the other jobs' columns are built."""
    tally.flush()
    tally.wait_m2po()
    pending = None
    if any(job.rule.level == "step" for job in tally.jobs):  # the replay's m2po thread
        pending = _m2po_pool().submit(_m2po_bins, tally)
    parts: list = [
        None if job.rule.level == "step" else _job_columns(tally, ji)
        for ji, job in enumerate(tally.jobs)
    ]
    if pending is not None:
        pending.result()  # cached on the tally: _job_columns finds it there
        parts = [_job_columns(tally, ji) if p is None else p for ji, p in enumerate(parts)]
    if not parts:
        return pl.DataFrame()
    datas = [_job_data(tally, job, *p) for job, p in zip(tally.jobs, parts, strict=True)]
    data = {}
    for k in datas[0]:
        cols = [d[k] for d in datas]
        if isinstance(cols[0], list):
            data[k] = [v for c in cols for v in c]
        else:
            data[k] = np.concatenate([np.asarray(c) for c in cols])
    df = _frame(data)
    if tally.by is not None:  # within each job: by group, then value
        job = np.repeat(np.arange(len(datas)), [len(d["spec"]) for d in datas])
        df = (
            df.with_columns(pl.Series("_job", job))
            .sort(["_job", tally.by, "value"], maintain_order=True)
            .drop("_job")
        )
    return df


def loss_tokens(df: pl.DataFrame, by: str | None = None) -> int | None:
    """The loss tokens a sweep table counts: the tokens of one row, or with `by`, of one
    rule setting and value summed over its groups (each token is in exactly one group).
    Rows without counts (a sequence rule by q_bucket) are skipped; None if no row counts."""
    rows = df.filter(pl.col("tokens").is_not_null())
    if rows.height == 0:
        return None
    if by is None:
        return int(rows["tokens"].max())
    first = rows.row(0, named=True)
    keys = ("rule", "setting", "param", "value")
    one = rows.filter(pl.all_horizontal([pl.col(k).eq_missing(first[k]) for k in keys]))
    return int(one["tokens"].sum())


def prompt_groups(df: pl.DataFrame, by: str | None = None) -> int | None:
    """The prompt groups a sweep table counts (like `loss_tokens`: with `by`, one rule
    setting and value summed over its groups); None where the table has none."""
    if "prompt_groups" not in df.columns:
        return None
    rows = df.filter(pl.col("prompt_groups").is_not_null())
    if rows.height == 0:
        return None
    if by is None:
        return int(rows["prompt_groups"].max())
    first = rows.row(0, named=True)
    keys = ("rule", "setting", "param", "value")
    one = rows.filter(pl.all_horizontal([pl.col(k).eq_missing(first[k]) for k in keys]))
    return int(one["prompt_groups"].sum())


def length_label(low: int) -> str:
    """'[4, 8)' for the --by length bucket of sequences with 4..7 loss tokens."""
    return f"[{int(low)}, {2 * int(low)})"


def group_label(by: str | None, v) -> str:
    """A --by group's value as text: its bucket for q_bucket and length, else the value."""
    if by == "q_bucket":
        return q_bucket_label(v)
    if by == "length":
        return length_label(v)
    return str(v)


def q_bucket_label(low: float) -> str:
    """'[0.01, 0.1)' for the q_bucket whose lower edge is 0.01; the last is closed: '[0.99, 1]'."""
    edges = list(Q_BUCKET_EDGES)
    j = edges.index(low)
    if j + 1 == len(edges):
        return f"[{low:g}, 1]"
    return f"[{low:g}, {edges[j + 1]:g})"


def preview(df: pl.DataFrame, per_job: int = 9) -> pl.DataFrame:
    """A readable subset of a long sweep table: per rule/param/setting (and group), at most
    `per_job` values, evenly spread over the grid (its ends included)."""
    keys = ["rule", "setting", "param"]
    parts = []
    for _, part in df.group_by(keys, maintain_order=True):
        values = part["value"].unique(maintain_order=True).to_numpy()
        if values.size > per_job:
            pick = values[np.unique(np.linspace(0, values.size - 1, per_job).round().astype(int))]
            part = part.filter(pl.col("value").is_in(pick.tolist()))
        parts.append(part)
    return pl.concat(parts) if parts else df


def job_counts(tally: Tally, ji: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(values ascending, masked-or-truncated tokens at each value, loss tokens), all groups."""
    bins = job_bins(tally, ji)
    job = tally.jobs[ji]
    count = bins.count.sum(axis=0, keepdims=True)
    suf = _suffix(count)[0]
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return job.values, suf[inv + 1], int(count.sum())


def boot_counts(tally: Tally, ji: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Bootstrap replicates: ((B, K) masked-or-truncated weighted tokens, (B,) weighted
    tokens), values in ascending order; None for m2po (batch-adaptive, not resampled)."""
    job = tally.jobs[ji]
    if not tally.boot_replicates or job.rule.level == "step":
        return None
    if job.rule.level == "sequence":
        st = tally.seq_stats()
        b = _bins(job.rule.score(st, job.param), job.thresholds[job.order], job.rule.inclusive)
        w = tally.seq_unit_weights() * st.n[None, :]
        width = len(job.values) + 2
        counts = np.stack([np.bincount(b, weights=wb, minlength=width) for wb in w])
        tokens = w.sum(axis=1)
    else:
        counts = tally.boot_counts.get(ji)
        if counts is None:
            return None
        tokens = tally.boot_tokens
    suf = _suffix(counts)
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return suf[:, inv + 1], tokens
