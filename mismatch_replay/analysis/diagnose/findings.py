"""diagnose's seven findings, each a function of a `DiagnoseStats` returning a `Diagnosis`
(the package docstring has each signature)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from ...rules import Rule, TokenBatch, parse_rule
from .stats import (
    EXACT_POS,
    FREQ_LIMIT,
    HIST_BINS,
    HIST_DECADES,
    JUMP,
    MIN_WINDOW,
    MIN_WINDOW_TOKENS,
    RATIO_FLOOR,
    SENTINEL,
    SLOPE_LIMIT,
    TITLES,
    VERDICTS,
    WINDOW,
    ZERO_MIN,
    ZERO_SHARE,
    DiagnoseStats,
    ci,
    g,
    pct_text,
    pos_bin_start,
)

# ----------------------------------------------------------------------------- findings


@dataclass
class Diagnosis:
    """One finding: its verdict (found / clear / can't tell), the evidence in words with
    its numbers, what to do, and its numbers (`numbers`) and rows (`rows`: per step, per
    position, per lag) for --json."""

    key: str
    verdict: str
    evidence: str
    action: str
    numbers: dict = field(default_factory=dict)
    rows: pl.DataFrame | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"diagnosis {self.key}: verdict {self.verdict!r}")

    @property
    def title(self) -> str:
        return TITLES.get(self.key, self.key)

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            return v

        return {
            "finding": self.key,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "action": self.action,
            "numbers": {k: clean(v) for k, v in self.numbers.items()},
            "rows": None if self.rows is None else _rows(self.rows),
        }


def _rows(t: pl.DataFrame) -> list[dict]:
    out = []
    for r in t.iter_rows(named=True):
        out.append(
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in r.items()
            }
        )
    return out


def truncation(st: DiagnoseStats) -> Diagnosis:
    """Token-mean p/q with its bootstrap interval, overall and per step."""
    n, sr = st.mom[0], st.mom[1]
    mean = sr / n
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = st.boot[:, 1] / st.boot[:, 0]
    lo, hi = ci(reps)
    steps = sorted(st.step_index)
    rows = []
    for s in steps:
        i = st.step_index[s]
        sn, ss = st.step_mom[i]
        slo = shi = math.nan
        if i < st.step_boot_n:
            with np.errstate(invalid="ignore", divide="ignore"):
                slo, shi = ci(st.step_boot[i, :, 1] / st.step_boot[i, :, 0])
        rows.append((s, int(sn), ss / sn, slo, shi))
    table = pl.DataFrame(
        rows,
        schema={"step": pl.Int64, "tokens": pl.Int64, "mean_ratio": pl.Float64,
                "ci_low": pl.Float64, "ci_high": pl.Float64},
        orient="row",
    )  # fmt: skip
    nums = {"mean_ratio": mean, "ci_low": lo, "ci_high": hi, "units": st.units}
    kept = "kept_mass" in st.columns
    if kept:
        nums["kept_mass_mean"] = st.kept_mass_sum / st.tokens
    unit = "sequences" if st.unit == "sequence" else "steps"
    if st.units < 10 or not math.isfinite(lo):
        return Diagnosis(
            "truncation",
            "can't tell",
            f"mean p/q {g(mean, 4)} over {st.tokens:,} tokens, but only {st.units} {unit}: "
            "too few for an interval (needs sample_id, or more steps)",
            "map a sample_id column (--map sample_id=COLUMN)",
            nums,
            table,
        )
    ev = f"mean p/q {mean:.4f} (95% CI {lo:.4f}–{hi:.4f}, {st.units:,} {unit})"
    if len(rows) > 1:
        per = table["mean_ratio"]
        ev += f"; per step {per.min():.3f}–{per.max():.3f}"
    if hi < RATIO_FLOOR:
        nums["kept_mass"] = mean
        return Diagnosis(
            "truncation",
            "found",
            f"{ev}: below 1, as when the engine logs a renormalised top-p/top-k "
            f"distribution; estimated kept mass {g(mean, 3)}",
            "log each token's kept mass and replay with --map kept_mass=COLUMN (or log the "
            "unprocessed log-probs)",
            nums,
            table,
        )
    if kept:
        ev += f"; kept_mass applied (mean {g(nums['kept_mass_mean'], 3)})"
    return Diagnosis("truncation", "clear", ev + ": E_q[p/q] = 1 holds", "nothing", nums, table)


def regression_slope(m: np.ndarray, with_entropy: bool) -> np.ndarray:
    """The least-squares slope of l on lq from moment sums `m` (..., MOMENTS): plain, or
    controlling for the trainer's entropy h (l ~ lq + h + 1), which absorbs most of the
    per-context offset c (see `temperature`)."""
    n = m[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        sx, sy = m[..., 2], m[..., 3]
        cxx = m[..., 4] - sx * sx / n
        cxy = m[..., 5] - sx * sy / n
        if not with_entropy:
            return cxy / cxx
        sh = m[..., 6]
        cxh = m[..., 7] - sx * sh / n
        chh = m[..., 8] - sh * sh / n
        chy = m[..., 9] - sh * sy / n
        return (cxy * chh - cxh * chy) / (cxx * chh - cxh * cxh)


def temperature(st: DiagnoseStats) -> Diagnosis:
    """The least-squares slope of l on lq with its bootstrap interval: T - 1.

    Within one context l = (T - 1) lq + c with c = T logsumexp(z / T) - logsumexp(z); across
    contexts of different shapes c correlates with lq and pulls the plain slope toward 0
    (measured on 20,000 constructed contexts at T = 0.7: 0.757 plain). Where the log has the
    trainer's entropy, the slope is taken with it as a second regressor (0.704 there)."""
    ent = "entropy" in st.columns
    b = float(regression_slope(st.mom, ent))
    lo, hi = ci(regression_slope(st.boot, ent))
    nums = {"slope": b, "ci_low": lo, "ci_high": hi, "temperature_ratio": 1 + b}
    nums["controls_entropy"] = ent
    if not math.isfinite(b) or not math.isfinite(lo):
        return Diagnosis(
            "temperature",
            "can't tell",
            f"slope {g(b)}: too few {st.unit}s or a constant inference log-prob",
            "map a sample_id column (--map sample_id=COLUMN)",
            nums,
        )
    how = ", entropy held fixed" if ent else ""
    ev = (
        f"slope of l on lq {g(b)} (95% CI {g(lo)}–{g(hi)}{how}): implied temperature ratio "
        f"T_engine/T_trainer {g(1 + b)}"
    )
    if abs(b) > SLOPE_LIMIT and (lo > 0 or hi < 0) and truncation(st).verdict == "found":
        # the renormalisation adds -log S(context) to l, and S falls with lq (flat contexts
        # keep less): it moves the slope too (-0.056 at top_p 0.8 in the simulator)
        return Diagnosis(
            "temperature",
            "can't tell",
            ev + "; truncated sampling found: its renormalisation moves the slope too",
            "map the kept mass (--map kept_mass=COLUMN), then judge the temperature",
            nums,
        )
    if abs(b) > SLOPE_LIMIT and (lo > 0 or hi < 0):
        if not ent:
            ev += " (no entropy column: contexts of different shapes pull it toward 1)"
        return Diagnosis(
            "temperature",
            "found",
            ev,
            "log the log-probs at the temperature the trainer uses (or recompute the "
            "trainer's at the sampler's temperature)",
            nums,
        )
    return Diagnosis("temperature", "clear", ev, "nothing", nums)


def staleness(st: DiagnoseStats) -> Diagnosis:
    """Trainer vs old (policy lag) against old vs inference (engine), and the lag."""
    nums: dict = {}
    parts = []
    rows = None
    if st.lag:
        lags = sorted(st.lag)
        rows = pl.DataFrame(
            {
                "lag": lags,
                "tokens": [st.lag[k][0] for k in lags],
                "kl_k3": [st.lag[k][1] / st.lag[k][0] for k in lags],
            }
        )
        w = np.array([st.lag[k][0] for k in lags], float)
        mean_lag = float(np.dot(lags, w) / w.sum())
        nums.update(lag_min=lags[0], lag_max=lags[-1], lag_mean=mean_lag)
        parts.append(f"lag step − version {lags[0]}–{lags[-1]} (mean {g(mean_lag)})")
    if st.stale[4] > 0:
        n = st.stale[4]
        k1_to, k3_to, k1_oi, k3_oi = (
            -st.stale[0] / n,
            st.stale[1] / n,
            -st.stale[2] / n,
            st.stale[3] / n,
        )
        nums.update(k1_lag=k1_to, k3_lag=k3_to, k1_engine=k1_oi, k3_engine=k3_oi)
        if k3_to >= 2 * k3_oi:
            dom, act = "staleness dominates", "shorten the lag (off-policy steps) or correct for it"
        elif k3_oi >= 2 * k3_to:
            dom, act = (
                "the engine dominates",
                "look at the engine: kernels, precision, sampler settings",
            )
        else:
            dom, act = "both contribute", "both the lag and the engine"
        nums["dominant"] = dom
        parts.insert(
            0,
            f"k3 trainer‖old {g(k3_to)} (k1 {g(k1_to)}) vs old‖inference {g(k3_oi)} "
            f"(k1 {g(k1_oi)}): {dom}",
        )
        return Diagnosis("staleness", "clear", "; ".join(parts), act, nums, rows)
    if parts:
        return Diagnosis(
            "staleness",
            "clear",
            "; ".join(parts) + " (no old_logprob: the split by cause needs it)",
            "log old_logprob to split staleness from the engine",
            nums,
            rows,
        )
    return Diagnosis(
        "staleness",
        "can't tell",
        "no old_logprob column (the trainer's log-prob at the rollout's weights) and no "
        "version column",
        "log old_logprob (--map old_logprob=COLUMN) or the policy version",
        nums,
    )


def position_table(st: DiagnoseStats) -> pl.DataFrame:
    """Mean |l| and k3 by position bin (exact below 4,096, then power-of-two buckets)."""
    have = np.flatnonzero(st.pos[:, 0])
    c = st.pos[have]
    return pl.DataFrame(
        {
            "position": [pos_bin_start(int(b)) for b in have],
            "tokens": c[:, 0].astype(np.int64),
            "mean_abs_l": c[:, 1] / c[:, 0],
            "kl_k3": c[:, 3] / c[:, 0],
        }
    )


def changepoint(st: DiagnoseStats) -> dict | None:
    """The position P maximising mean |l| over [P, P+64) / over [P-64, P) (exact positions;
    windows cut at the ends of the range, at least 8 positions and 100 tokens each), with
    the ratio's 95% interval (delta method on the two means, tokens independent)."""
    c = st.pos[:EXACT_POS]
    have = np.flatnonzero(c[:, 0])
    if have.size < 2 * MIN_WINDOW:
        return None
    lo_p, hi_p = int(have[0]), int(have[-1])
    cs = np.vstack([np.zeros((1, 4)), np.cumsum(c, axis=0)])
    best = None
    for p in range(lo_p + MIN_WINDOW, hi_p - MIN_WINDOW + 2):
        a, b = max(lo_p, p - WINDOW), min(hi_p + 1, p + WINDOW)
        prev, nxt = cs[p] - cs[a], cs[b] - cs[p]
        if min(prev[0], nxt[0]) < MIN_WINDOW_TOKENS or prev[1] <= 0:
            continue
        ratio = (nxt[1] / nxt[0]) / (prev[1] / prev[0])
        if best is None or ratio > best[0]:
            best = (ratio, p, prev, nxt)
    if best is None:
        return None
    ratio, p, prev, nxt = best

    def rel_var(s):
        m = s[1] / s[0]
        var = max(s[2] / s[0] - m * m, 0.0)
        return var / (s[0] * m * m)

    se = math.sqrt(rel_var(prev) + rel_var(nxt))
    return {
        "position": p,
        "ratio": ratio,
        "ci_low": ratio * math.exp(-1.96 * se),
        "ci_high": ratio * math.exp(1.96 * se),
        "before": prev[1] / prev[0],
        "after": nxt[1] / nxt[0],
    }


def position(st: DiagnoseStats) -> Diagnosis:
    """Position effects: a changepoint of mean |l|, and the first token against the rest."""
    if not st.pos[:, 0].any():
        return Diagnosis(
            "position",
            "can't tell",
            "no position column and no sample_id to count positions by",
            "map a position or sample_id column",
        )
    table = position_table(st)
    nums: dict = {}
    parts = []
    found = []
    cp = changepoint(st)
    if cp is not None:
        nums.update({f"changepoint_{k}": v for k, v in cp.items()})
        text = (
            f"mean |l| over the next {WINDOW} positions vs the previous {WINDOW}: at most "
            f"{g(cp['ratio'])}× (95% CI {g(cp['ci_low'])}–{g(cp['ci_high'])}), at position "
            f"{cp['position']} ({g(cp['after'])} vs {g(cp['before'])})"
        )
        parts.append(text)
        if cp["ratio"] >= JUMP and cp["ci_low"] > 1:
            found.append(f"mismatch jumps at position {cp['position']}")
    else:
        parts.append("positions too few for a changepoint")
    f = st.first
    if f[0] >= MIN_WINDOW_TOKENS and f[3] >= MIN_WINDOW_TOKENS and f[4] > 0:
        m1, m2 = f[1] / f[0], f[4] / f[3]
        ratio = m1 / m2
        v1 = max(f[2] / f[0] - m1 * m1, 0) / (f[0] * m1 * m1) if m1 > 0 else math.inf
        v2 = max(f[5] / f[3] - m2 * m2, 0) / (f[3] * m2 * m2)
        se = math.sqrt(v1 + v2)
        lo = ratio * math.exp(-1.96 * se) if math.isfinite(se) else 0.0
        nums.update(first_token_ratio=ratio, first_token_ci_low=lo, first_tokens=int(f[0]))
        parts.append(f"first token {g(ratio)}× the rest (mean |l| {g(m1)} vs {g(m2)})")
        if ratio >= JUMP and lo > 1:
            found.append("the first token is off")
    if found:
        return Diagnosis(
            "position",
            "found",
            "; ".join(parts),
            "look at what changes there: a KV-cache dtype or paged-attention block (from "
            "that position), the prefill/decode split (first token)",
            nums,
            table,
        )
    return Diagnosis("position", "clear", "; ".join(parts), "nothing", nums, table)


def _where(st: DiagnoseStats, prefix: str) -> tuple[str, dict]:
    """Where the located tokens of categories starting with `prefix` sit."""
    if st.seqs is None:
        return "", {}
    hs = [h for c, h, _ in st.located if c.startswith(prefix)]
    if not hs:
        return "", {}
    h = np.concatenate(hs)
    i = np.concatenate([x for c, _, x in st.located if c.startswith(prefix)])
    last = i == st.seqs.length(h) - 1
    first = i == 0
    nl, nf = int(last.sum()), int((first & ~last).sum())
    seqs = int(np.unique(h).size)
    parts = []
    if nl:
        parts.append(f"on the last token of {int(np.unique(h[last]).size):,} sequences")
    if nf:
        parts.append(f"on the first token of {int(np.unique(h[first & ~last]).size):,}")
    inner = i.size - nl - nf
    if inner:
        parts.append(f"{inner:,} inside sequences")
    text = ", ".join(parts)
    if nl and nl >= 0.9 * i.size:
        text += ": an appended stop token?"
    return text, {"last": nl, "first": nf, "inner": inner, "sequences": seqs}


def placeholders(st: DiagnoseStats) -> Diagnosis:
    """Exact 0.0 against a low log-prob, sentinels, invalid rows, one over-frequent value."""
    nums: dict = {}
    found, notes = [], []
    share_min = max(ZERO_MIN, ZERO_SHARE * st.tokens)
    for side in ("inference", "trainer"):
        other = "trainer" if side == "inference" else "inference"
        z = st.zero_low[side]
        nums[f"zero_{side}"] = z
        if z:
            where, w = _where(st, f"zero:{side}")
            text = f"{side} log-prob exactly 0.0 while {other} < log 0.5 on {z:,} tokens"
            text += f" ({where})" if where else ""
            (found if z >= share_min else notes).append(text)
            nums.update({f"zero_{side}_{k}": v for k, v in w.items()})
        s = st.sentinel[side]
        nums[f"sentinel_{side}"] = s
        if s:
            where, _ = _where(st, f"sentinel:{side}")
            found.append(
                f"{side} log-prob ≤ {SENTINEL:g} (a sentinel) on {s:,} tokens"
                + (f" ({where})" if where else "")
            )
        bad = sum(v for (f, c), v in st.report.dropped.items() if c == f"{side}_logprob")
        nums[f"invalid_{side}"] = bad
        if bad:
            found.append(f"{bad:,} rows with {side}_logprob NaN, ±inf or null (-inf: a sentinel?)")
        for v, cnt in st.tracked[side].items():
            if cnt > FREQ_LIMIT * st.tokens:
                where, _ = _where(st, f"value:{side}:{v!r}")
                nums[f"value_{side}"] = v
                nums[f"value_{side}_tokens"] = cnt
                found.append(
                    f"{side} log-prob {v:.6g} on {cnt:,} tokens ({pct_text(cnt / st.tokens)})"
                    + (f" ({where})" if where else "")
                )
    if found:
        return Diagnosis(
            "placeholders",
            "found",
            "; ".join(found + notes),
            "fix the export: these are fill values, not log-probs (mask those tokens out of "
            "the loss, or log the engine's real log-prob)",
            nums,
        )
    ev = "no exact-0.0-vs-low pairs, sentinels or over-frequent values"
    if notes:
        ev = "; ".join(notes) + f" (below {ZERO_SHARE:.2%} of tokens: not a pattern)"
    return Diagnosis("placeholders", "clear", ev, "nothing", nums)


def _quantile(hist: np.ndarray, q: float) -> float:
    tot = hist.sum()
    if tot == 0:
        return math.nan
    cum = np.cumsum(hist)
    k = int(np.searchsorted(cum, q * tot, side="left"))
    if k == 0:
        return 0.0
    lo_, hi_ = HIST_DECADES
    width = (hi_ - lo_) / HIST_BINS
    below = cum[k - 1]
    frac = (q * tot - below) / hist[k] if hist[k] else 0.5
    return 10 ** (lo_ + (k - 1 + frac) * width)


def rule_threshold_l(rule: Rule, q: float) -> float | None:
    """The smallest |l| at which `rule` (a token rule at one setting) masks a token whose
    inference probability is q (either sign of l, advantage of either sign); None where it
    never does within |l| < 20 or is not a token rule."""
    if rule.level != "token":
        return None
    names = [p.name for p in rule.params if p.threshold]
    if not names or any(getattr(rule, n) is None for n in names):
        return None
    d = np.geomspace(1e-9, 20.0, 4001)
    lq = np.full(d.size, math.log(q))
    best = math.inf
    for sign in (1.0, -1.0):
        lp = np.minimum(lq + sign * d, 0.0)
        for adv in (1.0, -1.0):
            b = TokenBatch(lp, lq, np.full(d.size, adv))
            hit = np.zeros(d.size, bool)
            for p in names:
                s = rule.score(b, p)
                t = rule.threshold(p, getattr(rule, p))
                hit |= (s >= t) if getattr(rule, "inclusive", False) else (s > t)
            ok = np.flatnonzero(hit & (np.abs(lp - lq) > 0))
            if ok.size:
                best = min(best, float(np.abs(lp - lq)[ok[0]]))
    return best if math.isfinite(best) else None


def noise_floor(st: DiagnoseStats, settings: Sequence[str | Rule] = ()) -> Diagnosis:
    """bf16 / fp16 grids, the floor's p50 / p90 of |l| on p, q > 0.9, settings below it."""
    nums: dict = {}
    grids = []
    for side in ("trainer", "inference"):
        bf, hf = st.grid[side]
        nums[f"{side}_bf16"] = bf / st.tokens
        nums[f"{side}_fp16"] = hf / st.tokens
        if bf == st.tokens:
            grids.append(f"{side} on the bf16 grid")
        elif hf == st.tokens:
            grids.append(f"{side} on the fp16 grid")
    n_floor = int(st.floor_lq[0])
    if n_floor < MIN_WINDOW_TOKENS:
        return Diagnosis(
            "noise_floor",
            "can't tell",
            f"only {n_floor} tokens with p, q > 0.9",
            "nothing",
            nums,
        )
    p50, p90 = _quantile(st.floor_hist, 0.5), _quantile(st.floor_hist, 0.9)
    q_med = math.exp(st.floor_lq[1] / n_floor)
    nums.update(p50=p50, p90=p90, floor_tokens=n_floor)
    ev = f"|l| on {n_floor:,} tokens with p, q > 0.9: p50 {g(p50)}, p90 {g(p90)}; " + (
        ", ".join(grids) if grids else "log-probs on no bf16/fp16 grid"
    )
    below = []
    for s in settings:
        rule = parse_rule(s) if isinstance(s, str) else s
        t = rule_threshold_l(rule, q_med)
        if t is not None and t < p90:
            below.append(f"{rule.spec()} (masks at |l| ≥ {g(t)} there)")
    nums["below_floor"] = len(below)
    if below:
        return Diagnosis(
            "noise_floor",
            "found",
            ev + "; below the p90: " + ", ".join(below) + ": masks rounding noise",
            "raise the threshold above the floor's p90 (choose picks one for a target)",
            nums,
        )
    tail = f"; {len(settings)} setting(s) above it" if settings else ""
    return Diagnosis("noise_floor", "clear", ev + tail, "nothing", nums)


def alignment(st: DiagnoseStats) -> Diagnosis:
    """inspect's off-by-one check and degenerate columns."""
    a = st.alignment
    if a is None or a.means() is None:
        return Diagnosis(
            "alignment",
            "can't tell",
            "no sample_id column: consecutive tokens of a sequence cannot be paired",
            "map a sample_id column (--map sample_id=COLUMN)",
        )
    m = a.means()
    nums = {"d0": m[0], "d_plus1": m[1], "d_minus1": m[-1], "pairs": a.pairs, "shift": a.shift()}
    warn = a.warnings()
    if warn:
        return Diagnosis(
            "alignment",
            "found",
            a.line() + "; " + " ".join(warn),
            "check how the two columns were cut (the logits at t predict token t + 1)",
            nums,
        )
    return Diagnosis("alignment", "clear", a.line(), "nothing", nums)
