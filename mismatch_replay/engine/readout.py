"""A Tally's readout: the long sweep table (one row per rule x swept value x group).

Design
------
Every job ends as per-bin sums of shape (groups, K + 2) (bins.py), which the Tally hands
over finished (`Tally.job_bins`): token rules have them from the streaming pass, sequence
rules from the per-sequence statistics, m2po from its steps (m2po.py, resolved in a
background thread while the other jobs' columns are built). One function then turns bins
into rows by suffix sums, so every rule reports the same columns:

rule, setting (the fixed parameters), param, value, [group], tokens, masked_tokens,
masked_fraction, truncated_tokens, truncated_fraction, sequences, masked_sequences,
masked_sequence_fraction, prompt_groups, fully_masked_groups, fully_masked_group_fraction,
masked_mass, masked_mass_fraction, masked_corrective, masked_divergent, masked_neutral,
masked_corrective_fraction, masked_adv_mass, masked_adv_mass_fraction, entropy_mean,
masked_entropy_mean, is_masked_mean (prime-rl's is_masked/mean, with match="prime-rl"),
weight_mean, weight_max, weight_ess, level, kind, spec.

What a mask costs (RULES.md): the masked tokens (a weight rule's truncated ones; a sequence
rule's masked sequences' tokens) split by the direction of their update -- corrective
(A * dp < 0), divergent (A * dp > 0), neutral (A == 0 or dp == 0) -- with
masked_corrective_fraction = corrective / (corrective + divergent); their |A| sum and its
share of the loss tokens' (masked_adv_mass_fraction: the gradient signal removed); their
mean entropy beside the group's (entropy_mean). Suffix sums of per-bin sums (bins.py), so
exact at every value; null where the log has no advantage (entropy: no entropy column), and
for m2po (its steps keep no per-token classes).

The functions here read a Tally (tally.py) through its public methods only -- jobs, groups,
`job_bins`, `prompt_layout`, `seq_stats`, the bootstrap counts -- and tally.py imports this
module for `Tally.result()`, so nothing here imports the Tally.

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
column is defined there. So is `length` (tally.py): a token's group is its sequence's length
bucket, so a sequence never spans groups and the sequence columns stay defined.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from .. import fast, pmath
from ..rules import LOG_CLAMP, Rule, fmt_value
from .bins import Q_BUCKET_EDGES, JobBins, suffix
from .jobs import Job
from .m2po import seal_pool

# Group keys that vary within a sequence (see the module docstring).
TOKEN_GROUPS = ("q_bucket", "lag", "position")
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
# what a mask costs (the module docstring); null without the log's column
COST_COLUMNS = (
    "masked_corrective",
    "masked_divergent",
    "masked_neutral",
    "masked_corrective_fraction",
    "masked_adv_mass",
    "masked_adv_mass_fraction",
    "entropy_mean",
    "masked_entropy_mean",
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
    "masked_corrective",
    "masked_divergent",
    "masked_neutral",
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
    *COST_COLUMNS,
    "is_masked_mean",
    "weight_mean",
    "weight_max",
    "weight_ess",
    "level",
    "kind",
    "spec",
)


def _frac(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _job_columns(tally, ji: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One job's (group, value) arrays, and each cell's group index."""
    job = tally.jobs[ji]
    rule = job.rule
    bins = tally.job_bins(ji)
    G, width = bins.count.shape
    K = width - 2
    inv = np.empty(K, dtype=np.int64)
    inv[job.order] = np.arange(K)  # value index -> sorted threshold index
    cnt_suf = suffix(bins.count)
    mass_suf = suffix(bins.mass)
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
        seq_suf = suffix(bins.seq_count)
        cols["sequences"] = np.broadcast_to(bins.seq_count.sum(axis=1)[:, None], (G, K))
        cols["masked_sequences"] = np.zeros((G, K), dtype=np.int64) if weight else seq_suf[:, k_idx]
    if tally.inv_n is not None and not weight and "sequences" in cols:
        if bins.seqfrac is not None:  # token rules: mean over sequences of masked fractions
            cols["is_masked_mean"] = _frac(suffix(bins.seqfrac)[:, k_idx], cols["sequences"])
        else:  # sequence rules mask whole sequences
            cols["is_masked_mean"] = _frac(cols["masked_sequences"], cols["sequences"])
    grp = _prompt_group_bins(tally, bins.seq_bin, width, G)
    if grp is not None:
        cols["prompt_groups"] = np.broadcast_to(grp.sum(axis=1)[:, None], (G, K))
        cols["fully_masked_groups"] = (
            np.zeros((G, K), dtype=np.int64) if weight else suffix(grp)[:, k_idx]
        )
    cols["masked_mass"] = np.zeros((G, K)) if weight else masked_mass
    cols["masked_mass_total"] = np.broadcast_to(mass_tot[:, None], (G, K))
    _cost_columns(cols, bins, hit, k_idx, G, K)
    if weight:
        wm, wx, we = _weight_stats(bins, job, inv)
        cols["weight_mean"], cols["weight_max"], cols["weight_ess"] = wm, wx, we
    return cols, gi


def _cost_columns(cols: dict, bins: JobBins, hit: np.ndarray, k_idx, G: int, K: int) -> None:
    """What a mask costs, (G, K) each, into `cols` (the module docstring): from the bins'
    direction and entropy sums (bins.py), over the `hit` tokens (masked or truncated)."""
    if bins.corr is not None and bins.div is not None and bins.amass is not None:
        corr = suffix(bins.corr)[:, k_idx]
        div = suffix(bins.div)[:, k_idx]
        cols["masked_corrective"] = corr
        cols["masked_divergent"] = div
        cols["masked_neutral"] = hit - corr - div
        cols["masked_corrective_fraction"] = _frac(corr, corr + div)
        cols["masked_adv_mass"] = suffix(bins.amass)[:, k_idx]
        tot = np.broadcast_to(bins.amass.sum(axis=1)[:, None], (G, K))
        cols["masked_adv_mass_fraction"] = _frac(cols["masked_adv_mass"], tot)
    if bins.ent is not None and bins.ent_n is not None:
        en = bins.ent_n.sum(axis=1)[:, None]
        cols["entropy_mean"] = np.broadcast_to(_frac(bins.ent.sum(axis=1)[:, None], en), (G, K))
        cols["masked_entropy_mean"] = _frac(
            suffix(bins.ent)[:, k_idx], suffix(bins.ent_n)[:, k_idx]
        )


def _prompt_group_bins(tally, seq_bin, width: int, G: int) -> np.ndarray | None:
    """Prompt groups per (--by group, bin of the group's least-masked sample): a group is
    fully masked at a value iff every sample is, iff its lowest sequence bin is above the
    value's, so the fully masked groups at a value are a suffix sum, like every count."""
    lay = tally.prompt_layout() if seq_bin is not None else None
    if lay is None:
        return None
    order, starts, by_group = lay
    b = np.maximum(np.asarray(seq_bin)[: order.shape[0]], 0).astype(np.int64)
    low = np.minimum.reduceat(b[order], starts)
    return np.bincount(by_group * width + low, minlength=G * width).reshape(G, width)


def job_frame(tally, ji: int) -> pl.DataFrame:
    """Rows of one job: every value x group."""
    cols, gi = _job_columns(tally, ji)
    df = _frame(_job_data(tally, tally.jobs[ji], cols, gi))
    return df.sort([tally.by, "value"]) if tally.by is not None else df


def _weight_stats(bins: JobBins, job: Job, inv: np.ndarray):
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
    swept_trunc = suffix(cnt[:, : K + 1])  # bins k+1..K truncated by the swept side
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


def _job_data(tally, job: Job, cols: dict, gi: np.ndarray) -> dict[str, object]:
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
    for k in COST_COLUMNS:
        if k in flat:
            data[k] = flat[k].astype(np.int64 if k in INT_COLUMNS else float)
        else:
            data[k] = np.full(n_rows, np.nan)
    data["is_masked_mean"] = (
        flat["is_masked_mean"].astype(float)
        if "is_masked_mean" in flat
        else np.full(n_rows, np.nan)
    )
    for k in ("weight_mean", "weight_max", "weight_ess"):
        data[k] = flat[k].astype(float) if k in flat else np.full(n_rows, np.nan)
    if tally.by in TOKEN_GROUPS:  # a sequence spans groups: undefined per group
        undefined = SEQUENCE_COLUMNS + (
            COUNT_COLUMNS + COST_COLUMNS if rule.level == "sequence" else ()
        )
        for k in undefined:
            data[k] = np.full(n_rows, np.nan)
    data["level"] = [rule.level] * n_rows
    data["kind"] = [rule.kind] * n_rows
    specs = value_specs(rule, param, set(flat["value"].tolist()))
    data["spec"] = [specs[v] for v in flat["value"].tolist()]  # once per value, not per group
    return data


def value_specs(rule: Rule, param: str, values) -> dict[float, str]:
    """`rule.replace(**{param: v}).spec()` for each of `values`. A rule whose class keeps
    Rule's own replace, validation and spec is not rebuilt per value: the value is checked
    as Rule.__post_init__ checks it (its parameter's domain; the others are the rule's, checked
    when it was made), and the other parameters are formatted once -- the same text, ~6x
    faster (the sweep table's specs: thousands of values, ~0.05 s a report)."""
    cls = type(rule)
    own = all(getattr(cls, f) is getattr(Rule, f) for f in ("__post_init__", "replace", "spec"))
    if not own or cls.values is not Rule.values or param not in cls.param_names():
        return {v: rule.replace(**{param: v}).spec() for v in values}
    p = cls.param(param)
    vals = rule.values()
    names = list(vals)
    at = names.index(param)
    before = [f"{k}={fmt_value(vals[k])}" for k in names[:at] if vals[k] is not None]
    after = [f"{k}={fmt_value(vals[k])}" for k in names[at + 1 :] if vals[k] is not None]
    name = f"{rule.name}@{rule.preset}" if rule.preset else rule.name
    out = {}
    for v in values:
        if v is None:  # the parameter left out, as spec() leaves a None out
            out[v] = rule.replace(**{param: v}).spec()
            continue
        p.check(rule.name, float(v), f"rule '{rule.name}'")
        out[v] = f"{name}:{','.join([*before, f'{param}={fmt_value(v)}', *after])}"
    return out


def _frame(data: dict[str, object]) -> pl.DataFrame:
    df = pl.DataFrame(data)
    # NaN means "undefined" here: store it as null so JSON/CSV never carry NaN.
    df = df.with_columns(
        [pl.col(c).fill_nan(None) for c, t in df.schema.items() if t == pl.Float64]
    )
    return df.with_columns([pl.col(c).cast(pl.Int64) for c in INT_COLUMNS])


def sweep_table(tally) -> pl.DataFrame:
    """The long table of every job, in job order, values ascending, then group: one frame
    built from every job's columns at once. m2po's steps are resolved in a background
    thread (numba and numpy's sort, no GIL held) while the other jobs' columns are built."""
    tally.flush()
    tally.wait_m2po()
    pending = None
    if any(job.rule.level == "step" for job in tally.jobs):  # the replay's m2po thread
        pending = seal_pool().submit(tally.m2po_bins)
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
    if by == "position":
        return "[0, 1)" if int(v) == 0 else length_label(v)
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


def job_counts(tally, ji: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(values ascending, masked-or-truncated tokens at each value, loss tokens), all groups."""
    bins = tally.job_bins(ji)
    job = tally.jobs[ji]
    count = bins.count.sum(axis=0, keepdims=True)
    suf = suffix(count)[0]
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return job.values, suf[inv + 1], int(count.sum())


def boot_counts(tally, ji: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Bootstrap replicates: ((B, K) masked-or-truncated weighted tokens, (B,) weighted
    tokens), values in ascending order; None for m2po (batch-adaptive, not resampled)."""
    job = tally.jobs[ji]
    if not tally.boot_replicates or job.rule.level == "step":
        return None
    if job.rule.level == "sequence":
        st = tally.seq_stats()
        b = fast.bin_scores(
            job.rule.score(st, job.param), job.sorted_thresholds, job.rule.inclusive
        )
        per = st.n  # tokens, or (choose --of adv-mass) each sequence's |A| sum
        if getattr(tally, "boot_weight", None) == "adv":
            per = tally.sequences.column("cost_amass")
        w = tally.seq_unit_weights() * per[None, :]
        width = len(job.values) + 2
        counts = np.stack([np.bincount(b, weights=wb, minlength=width) for wb in w])
        tokens = w.sum(axis=1)
    else:
        counts = tally.boot_counts.get(ji)
        if counts is None:
            return None
        tokens = tally.boot_tokens
    suf = suffix(counts)
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return suf[:, inv + 1], tokens
