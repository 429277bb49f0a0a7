"""Issue 30: at a tie, every preset decides as its framework's own comparison, bit for bit.

For each preset with framework code (tests/frameworks.py re-derives each in torch, file and
commit named there), tokens are built from the preset's own comparisons: the compared
quantity (exp(l), l, -clip(l), exp(lp) - exp(lq), the stable |dp|, k2, k3, exp|l|, the
log-ratio drop) exactly on each threshold, one ulp below and one ulp above it, in the
precision being replayed; then p in {0, 1}, |l| > 20, and a copy of every token at A = +1,
-1 and 0 (sequence presets: one token per sequence). The engine's count of each token (one
step each) must equal the framework's decision run in torch: in the preset's own precision
by default (float32 for a framework's preset: the frameworks hold float32 log-probs) and
with --precision float64. The quantity is the one torch computes; a candidate is kept only
where torch's exp agrees with the correctly rounded one (crmath, or its float32 rounding):
where torch's CPU exp is off by an ulp, no comparison can be bit for bit with every CPU's.
Where the arithmetic never lands on a bound (k3 = 0.01: exp(l) - 1 - l moves by ~100 ulps
of 0.01 per ulp of l) no tie exists and only the extremes are checked. The issue's table
rows are checked one by one.
"""

from __future__ import annotations

import math

import frameworks as fw
import numpy as np
import polars as pl
import pytest
import torch
from conftest import canonical_log, write_log

from mismatch_replay import crmath, engine
from mismatch_replay.rules import parse_rule

DT = {"float64": torch.float64, "float32": torch.float32}
NP = {"float64": np.float64, "float32": np.float32}


def _nbrs(x, npdt):
    x = npdt(x)
    return [np.nextafter(x, npdt(-np.inf)), x, np.nextafter(x, npdt(np.inf))]


def _cands(x0: float, npdt, n: int) -> np.ndarray:
    """The n values of this dtype on each side of x0 (and x0), ascending."""
    x = npdt(x0)
    lo, hi = [x], [x]
    for _ in range(n):
        lo.append(np.nextafter(lo[-1], npdt(-np.inf)))
        hi.append(np.nextafter(hi[-1], npdt(np.inf)))
    return np.array(lo[::-1] + hi[1:], dtype=npdt)


def _texp(x: np.ndarray, prec: str) -> np.ndarray:
    return torch.exp(torch.tensor(x, dtype=DT[prec])).numpy()


def _cr_ok(x: np.ndarray, prec: str) -> np.ndarray:
    """Where torch's exp is the correctly rounded one (float32: of the float32 value)."""
    cr = crmath.exp(np.asarray(x, dtype=np.float64))
    return _texp(x, prec) == (cr.astype(np.float32) if prec == "float32" else cr)


def _pick(x: np.ndarray, q: np.ndarray, target, npdt, ok) -> list[float]:
    """One x for each of the quantity's values one ulp below, on and one ulp above target."""
    out = []
    for t in _nbrs(target, npdt):
        hit = np.flatnonzero((q == t) & ok)
        if hit.size:
            out.append(float(x[hit[hit.size // 2]]))
    return out


def _l_ties(space: str, bound: float, prec: str) -> list[float]:
    """log ratios l whose compared quantity is on / one ulp off the bound."""
    npdt = NP[prec]
    if space == "log":  # l against log(bound) computed as a tensor of the dtype
        t = torch.tensor(bound, dtype=DT[prec]).log().item()
        return [float(v) for v in _nbrs(t, npdt)]
    if space == "k1":  # -clip(l) against log(bound), a Python float against the tensor
        return [-float(v) for v in _nbrs(math.log(bound), npdt)]
    if space == "l":  # l against a fixed float32 value (slime's veto)
        return [float(x) for x in _nbrs(bound, npdt)]
    if space == "drop":  # lq - lp against bound
        return [-float(v) for v in _nbrs(bound, npdt)]
    if space == "k2":
        x = _cands(math.sqrt(2 * bound), npdt, 64)
        q = (0.5 * torch.tensor(x) ** 2).numpy()
        return _pick(x, q, bound, npdt, np.ones(x.size, bool))
    if space == "k3":
        root = 0.8577 if bound == 0.5 else math.sqrt(2 * bound)
        for _ in range(60):  # Newton on exp(l) - 1 - l = bound
            root -= (math.expm1(root) - root - bound) / math.expm1(root)
        x = _cands(root, npdt, 4000 if prec == "float64" else 64)
        t = torch.tensor(x)
        q = (torch.exp(t) - 1.0 - t).numpy()
        return _pick(x, q, bound, npdt, _cr_ok(x, prec))
    # ratio: exp(l) against the bound (the bound rounded to the dtype)
    x = _cands(math.log(bound), npdt, 64)
    return _pick(x, _texp(x, prec), bound, npdt, _cr_ok(x, prec))


def _dp_ties(eps: float, prec: str, stable: bool) -> list[tuple[float, float]]:
    """(lp, lq) where exp(lp) - exp(lq) (or the stable |dp|) is on / one ulp off eps."""
    npdt, out = NP[prec], []
    for q in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        if not 0 < q + eps < 1:
            continue
        lq = npdt(math.log(q))
        x = _cands(math.log(q + eps), npdt, 64)
        tp, tq = torch.tensor(x), torch.tensor(np.full(x.size, lq))
        if stable:
            hi, lo = torch.maximum(tp, tq), torch.minimum(tp, tq)
            val = (torch.exp(hi) * -torch.expm1(lo - hi)).numpy()
            cr = crmath.exp(np.maximum(x, lq).astype(float)) * -crmath.expm1(
                (np.minimum(x, lq) - np.maximum(x, lq)).astype(float)
            )
            ok = _cr_ok(x, prec) & (_texp(np.full(1, lq), prec)[0] > 0)
            if prec == "float64":
                ok &= val == cr
        else:
            val = (torch.exp(tp) - torch.exp(tq)).numpy()
            ok = _cr_ok(x, prec) & _cr_ok(np.full(x.size, lq), prec)
        out += [(lp, float(lq)) for lp in _pick(x, val, eps, npdt, ok)]
    return out


def _spaces(spec: str, rule) -> list[tuple[str, float]]:
    """The preset's comparisons: (space, bound) for each threshold it tests."""
    name, arith, v = rule.name, rule.arith, rule.values()
    if spec in fw.VERL_K1_SPECS:
        lo, hi = fw.VERL_K1_SPECS[spec]
        return [("k1", lo), ("k1", hi)]
    ratio = "log" if arith == "log-tensor" else "ratio"
    if name in ("icepop", "token-mis", "geo-mis", "seq-mis"):
        return [(ratio, b) for b in (v["low"], v["high"]) if b]
    if name in ("tis", "seq-tis"):
        return [("ratio", v["cap"])]
    if name == "cispo":
        return [("ratio", v["high"])]
    if name in ("ppo-clip", "dual-clip"):
        out = [(ratio, 1 - v["eps_low"]), (ratio, 1 + v["eps_high"])]
        return out + ([("ratio", v["c"])] if "c" in v else [])
    if name == "veto" and arith == "ratio-clamp":  # SkyRL: safe_exp(l) < low, ratio space
        return [("ratio", v["v"])]
    if name == "veto":  # l against log(torch.tensor(v)), a float32 tensor
        t = float(torch.log(torch.tensor(v["v"])))
        return [("l", t)]
    if name == "prob-error":
        return [("ratio", v["tau"])]  # exp(|l|) against tau
    if name == "opsm":
        return [("drop", v["delta"])]
    if name in ("token-k2", "seq-max-k2"):
        return [("k2", v["hi"])]
    if name in ("token-k3", "seq-mean-k3"):
        return [("k3", v["hi"])]
    if name == "ipo":
        return [("absdp" if not arith else "dp", v["eps"])]
    if name in ("ipo-v1", "dppo-tv"):
        return [("dp", v["high"]), ("dp", -v["low"])]
    return []  # kpop, dppo-kl, m2po: a binary KL or a rank, not a tie to build: extremes


EXTREMES = [
    (0.0, 0.0),
    (-1000.0, -0.5),  # p = 0
    (-0.5, -1000.0),  # q = 0
    (0.0, -1e-12),  # p = 1, q ~ 1
    (-1e-12, 0.0),
    (0.0, -25.0),  # |l| > 20
    (-25.0, 0.0),
    (0.0, -700.0),
    (-700.0, 0.0),
]


def _pair(l: float) -> tuple[float, float]:  # noqa: E741
    return (l, 0.0) if l <= 0 else (0.0, -l)


def tie_log(spec: str, rule, prec: str) -> pl.DataFrame:
    pairs = []
    for space, bound in _spaces(spec, rule):
        if space in ("dp", "absdp"):
            pairs += _dp_ties(bound, prec, space == "absdp")
        else:
            pairs += [_pair(x) for x in _l_ties(space, bound, prec)]
            if rule.name == "prob-error":  # exp(|l|): the negative side too
                pairs += [_pair(-x) for x in _l_ties(space, bound, prec)]
    pairs += EXTREMES
    lp, lq, adv, step = [], [], [], []
    for a in (1.0, -1.0, 0.0):
        for p, q in pairs:
            lp.append(p)
            lq.append(q)
            adv.append(a)
            step.append(len(step))
    return canonical_log(lp, lq, step=step, sample_id=step, advantage=adv)


def _compare(spec: str, tmp_path, prec: str | None):
    """(engine's per-token decisions, the framework's) on the tie log of `spec`."""
    rule = parse_rule(spec)
    extra = fw.EXTRA_VALUES.get(spec)
    if extra:
        rule = rule.replace(**extra)
    replay = rule.precision if prec is None else prec
    df = tie_log(spec, rule, replay)
    path = write_log(tmp_path / "ties.parquet", df)
    res = engine.sweep([path], rules=[rule], by="step", precision=prec)
    col = "truncated_tokens" if rule.kind == "weight" else "masked_tokens"
    got = np.zeros(df.height, dtype=bool)
    got[res.table["step"].to_numpy()] = res.table[col].to_numpy() > 0
    L = fw.Log(df)
    fn, src = fw.REFERENCES[spec]
    v = dict(rule.values())
    if spec in fw.VERL_K1_SPECS:
        v["_spec"] = fw.VERL_K1_SPECS[spec]
    want = fn(L, v, DT[replay])
    return got, want, df, src


TIE_SPECS = sorted(s for s in fw.REFERENCES if s != "m2po@areal")


@pytest.mark.slow
@pytest.mark.parametrize("prec", [None, "float64"])
@pytest.mark.parametrize("spec", TIE_SPECS)
def test_preset_decides_its_ties_as_its_framework(spec, prec, tmp_path):
    got, want, df, src = _compare(spec, tmp_path, prec)
    bad = np.flatnonzero(got != want)
    rows = df[bad.tolist()].select("trainer_logprob", "inference_logprob", "advantage")
    assert bad.size == 0, (spec, prec, src, rows.to_dicts()[:4])


def test_tie_logs_hold_ties():
    """The generator builds ties: exp(l) one ulp below, on and above each ratio bound."""
    for prec in ("float64", "float32"):
        for bound in (2.0, 0.8, 3.0):
            ls = _l_ties("ratio", bound, prec)
            vals = [_texp(np.array([x], dtype=NP[prec]), prec)[0] for x in ls]
            want = _nbrs(bound, NP[prec])
            assert set(vals) <= set(want) and len(vals) >= 2, (prec, bound)
            if bound != 3.0:  # exp(l) for l one ulp apart moves by less than an ulp here
                assert vals == want, (prec, bound)
    dp = _dp_ties(0.2, "float64", stable=False)
    assert any(math.exp(p) - math.exp(q) == 0.2 for p, q in dp)


# The issue's table: (preset, (lp, lq, A), the framework's decision) in float64.
TABLE = [
    ("dppo-tv@prime-rl", (-1.2039728043259361, -0.6931471805599453, -1.0), False),
    ("ppo-clip@prime-rl", (-0.2231435513142098, 0.0, -1.0), True),
    ("ipo@prime-rl-legacy", (-0.9162907318741551, -0.6931471805599453, 1.0), True),
    ("dppo-tv@verl", (-0.4307829160924543, -0.6931471805599453, 1.0), True),
    ("ppo-clip@dapo", (-0.2231435513142098, 0.0, -1.0), True),
    ("dual-clip@paper", (-0.2231435513142098, 0.0, -1.0), True),
    ("tis@trl", (0.0, -1.0986122886681098, -1.0), True),
    # the issue lists TRL as keeping this one; TRL's token_mask (grpo_trainer.py:2590-2617
    # @ f2cd577) compares exp(-800) = 0 with C_min = 0.5 and masks it, as the preset does
    ("token-mis@trl", (-800.0, 0.0, -1.0), True),
]


@pytest.mark.parametrize("spec,token,decides", TABLE)
def test_the_issue_table_rows_agree(spec, token, decides, tmp_path):
    """Each row, in exact arithmetic (--precision float64) and in the preset's default
    precision: the engine's decision is the framework's, re-run in torch."""
    lp, lq, a = token
    df = canonical_log([lp], [lq], step=[0], sample_id=[0], advantage=[a])
    path = write_log(tmp_path / "row.parquet", df)
    rule = parse_rule(spec)
    fn, src = fw.REFERENCES[spec]
    col = "truncated_tokens" if rule.kind == "weight" else "masked_tokens"
    for prec in ("float64", None):
        dt = DT[prec or rule.precision]
        want = bool(fn(fw.Log(df), dict(rule.values()), dt)[0])
        if prec == "float64":
            assert want == decides, (spec, src)  # the table's framework column
        got = engine.sweep([path], rules=[rule], precision=prec).table[col].item() > 0
        assert got == want, (spec, prec, src)


def _m2po_step(seed: int = 0) -> tuple[list[float], list[float]]:
    """One step whose l^2 lie within a few ulps of tau = 0.04 on both sides: the rounded
    suffix means dip under tau and come back above it (a rank after AReaL's first
    below-tau index still has a mean >= tau)."""
    vals = [0.2 + k * np.spacing(0.2) for k in range(-6, 7)]
    rng = np.random.default_rng(seed)
    l = rng.choice(vals, 400)  # noqa: E741
    return [-float(x) for x in l], [0.0] * 400


def test_m2po_areal_stops_at_the_first_mean_below_tau(tmp_path):
    lp, lq = _m2po_step()
    sid = [i // 4 for i in range(400)]  # 100 sequences of 4 tokens, one step
    df = canonical_log(lp, lq, step=[0] * 400, sample_id=sid, advantage=[1.0] * 400)
    path = write_log(tmp_path / "m2po.parquet", df)
    rule = parse_rule("m2po@areal")
    L = fw.Log(df)
    for prec in ("float64", None):
        want = int(fw.areal_m2po(L, dict(rule.values()), DT[prec or rule.precision]).sum())
        got = engine.sweep([path], rules=[rule], precision=prec).table["masked_tokens"].item()
        assert got == want, prec
    xs = np.sort(np.array(lp) ** 2)[::-1]
    mean = np.cumsum(xs[::-1])[::-1] / np.arange(400, 0, -1)
    first = int(np.argmax(mean < 0.04))
    assert (mean[first:-1] >= 0.04).any()  # the case: a later rank back at or above tau
