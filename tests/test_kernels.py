"""The fused path (fast/, numba) against the simple path (numpy, rule by rule).

Every optimisation has its own check: direct binning against np.searchsorted (ties, signed
zeros, infinities, duplicates, coarse tables), the fused pass against the simple pass on
random logs with exact threshold ties (every rule, grouping, batch sizes, threads), m2po's
per-step kernel against a stable argsort, the m2po store spilling to disk, rules the kernel
does not know falling back job by job, and the simple path forced by the environment.
Tests that need numba are skipped without it; the rest run either way.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pytest
from conftest import (
    NICE_RATIOS,
    assert_tables_equal,
    canonical_log,
    log_file,
    logs,
    random_log,
    write_log,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, fast, ingest
from mismatch_replay.rules import (
    IPO,
    REGISTRY,
    Domain,
    Param,
    Rule,
    TokenBatch,
    binary_kl,
    parse_grid,
)

HAVE_NUMBA = fast.backend() == "numba"
needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")


@contextlib.contextmanager
def env(**kw):
    old = {k: os.environ.get(k) for k in kw}
    os.environ.update({k: str(v) for k, v in kw.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- binning

SPECIALS = (0.0, -0.0, math.inf, -math.inf, 5e-324, -5e-324, 1e-300, 1.0, -1.0)


@st.composite
def threshold_sets(draw) -> np.ndarray:
    kind = draw(st.sampled_from(["log", "lin", "mixed", "dups"]))
    k = draw(st.integers(1, 150))
    if kind == "log":
        lo = draw(st.floats(1e-12, 1.0))
        v = np.geomspace(lo, lo * draw(st.floats(1.001, 1e6)), k)
    elif kind == "lin":
        lo = draw(st.floats(-10.0, 10.0))
        v = np.linspace(lo, lo + draw(st.floats(1e-9, 100.0)), k)
    elif kind == "mixed":
        v = np.array(
            draw(
                st.lists(
                    st.floats(allow_nan=False) | st.sampled_from(SPECIALS), min_size=1, max_size=k
                )
            )
        )
    else:
        v = np.repeat(np.array(draw(st.lists(st.floats(-5, 5), min_size=1, max_size=20))), 3)
    return np.sort(v.astype(np.float64))


@settings(max_examples=200)
@given(thr=threshold_sets(), data=st.data())
def test_direct_binning_equals_searchsorted(thr, data):
    """Scores on, just above and just below every threshold, and anywhere else."""
    extra = np.array(data.draw(st.lists(st.floats(allow_nan=False), max_size=30)), np.float64)
    s = np.concatenate(
        [thr, np.nextafter(thr, math.inf), np.nextafter(thr, -math.inf), extra, SPECIALS]
    )
    incl = data.draw(st.booleans())
    lut = data.draw(st.sampled_from([4, 5, 16, fast.MAX_LUT]))
    bn = fast.make_binner(thr, incl, max_lut=lut)
    ref = np.searchsorted(thr, s, side="right" if incl else "left")
    ref[s == math.inf] = thr.size + 1
    assert np.array_equal(fast.lut_bins(s, bn), ref)
    if HAVE_NUMBA:
        out = np.empty(s.size, np.int64)
        j = fast.compiled()
        err = j.bin_array(s, thr.size, bn.thr, incl, bn.lut, bn.nl, bn.klo, bn.khi, bn.shift, out)
        assert err == 0
        assert np.array_equal(out, ref)


def test_bin_scores_refuses_nan_on_both_paths():
    thr = np.array([0.1, 0.2])
    s = np.r_[np.zeros(5000), np.nan]
    for backend in ("numpy", "numba") if HAVE_NUMBA else ("numpy",):
        with fast.use_backend(backend), pytest.raises(AssertionError, match="NaN"):
            fast.bin_scores(s, thr, False)


# ----------------------------------------------------------------------------- fused pass


def _tie_values(rule: str, param: str, df: pl.DataFrame) -> list[float]:
    """Grid values whose threshold equals some token's score exactly."""
    ok = df.filter(pl.col("loss_mask")) if "loss_mask" in df.columns else df
    tb = TokenBatch(ok["trainer_logprob"].to_numpy(), ok["inference_logprob"].to_numpy())
    dp = tb.dp
    vals: dict[tuple[str, str], np.ndarray] = {
        ("ipo", "eps"): tb.abs_dp,
        ("ipo-v1", "high"): dp[dp > 0],
        ("ipo-v1", "low"): -dp[dp < 0],
        ("dppo-tv", "high"): dp[dp > 0],
        ("dppo-tv", "low"): -dp[dp < 0],
        ("token-k2", "hi"): tb.k2,
        ("token-k3", "hi"): tb.k3,
        ("dual-clip", "c"): tb.r[tb.r > 1],
        ("kpop", "phi"): np.maximum(binary_kl(tb.lp, tb.lq, 1e-6), binary_kl(tb.lq, tb.lp, 1e-6)),
        ("dppo-kl", "high"): binary_kl(tb.lq, tb.lp, 1e-6),
        ("dppo-kl", "low"): binary_kl(tb.lq, tb.lp, 1e-6),
    }
    v = vals.get((rule, param))
    if v is None:  # ratio thresholds: the log's exact-ratio tokens (conftest.NICE_RATIOS)
        return list(NICE_RATIOS)
    v = v[np.isfinite(v)]
    return sorted({float(x) for x in v})[:20]


def _grids(df: pl.DataFrame, data) -> dict[str, np.ndarray]:
    sweeps = {}
    for name, cls in REGISTRY.items():
        for p in cls.params:
            if not p.threshold:
                continue
            default = parse_grid(p.grid)
            ties = [v for v in _tie_values(name, p.name, df) if v in p.domain]
            pick = (
                data.draw(st.lists(st.sampled_from(ties), max_size=6), label=f"{name}.{p.name}")
                if ties
                else []
            )
            sweeps[f"{name}.{p.name}"] = np.unique(np.r_[default[::7], pick])
    return sweeps


def _both(sources, **kw):
    out = {}
    for backend in ("numba", "numpy"):
        with fast.use_backend(backend):
            out[backend] = engine.sweep(sources, **kw)
    return out["numba"], out["numpy"]


# Statistics computed as differences of sums (E[x^2] - E[x]^2): where the variance is tiny
# they amplify the last-bit differences that splitting a batch over threads makes in the sums.
CANCELLING = ("kl_k3_std", "abs_dp_std", "probs_pearson")


def _assert_same(fused, simple, by, split: bool = False):
    """Counts exact, floats to 1e-9; with a batch split over threads (split=True), the
    metric sums to 1e-12 and the statistics that cancel are compared through them."""
    keys = ("rule", "setting", "param", "value", *([by] if by else []))
    assert_tables_equal(fused.table, simple.table, keys=keys, rel=1e-9)
    skip = CANCELLING if split else ()
    assert_tables_equal(fused.metrics, simple.metrics, keys=[by] if by else [], rel=1e-9, skip=skip)
    a, b = fused.tally.metrics, simple.tally.metrics
    for k in a.s:
        assert np.allclose(a.s[k], b.s[k], rtol=1e-12, atol=1e-300), k
    for k in a.m:
        assert np.array_equal(a.m[k], b.m[k]), k
    for name in ("hist_lin", "hist_log"):
        assert np.array_equal(getattr(fused.tally, name), getattr(simple.tally, name)), name


@pytest.mark.slow  # hypothesis examples through the numba kernel and the numpy path
@needs_numba
@settings(max_examples=40)
@given(df=logs(), data=st.data())
def test_fused_and_simple_paths_agree_on_random_logs(df, data):
    """Every rule, default grids thinned plus grid values tied exactly to token scores;
    grouping, batch sizes and threads drawn."""
    by = data.draw(st.sampled_from([None, "step", "env"]), label="by")
    batch = data.draw(st.sampled_from([3, 1_000_000]), label="batch_rows")
    threads = data.draw(st.sampled_from([1, 3]), label="threads")
    sweeps = _grids(df, data)
    old = fast.Fused.MIN_CHUNK
    fast.Fused.MIN_CHUNK = 1
    try:
        with env(MISMATCH_REPLAY_THREADS=threads), log_file(df) as path:
            fused, simple = _both(
                [path], sweeps=sweeps, by=by, options=ingest.ReadOptions(batch_rows=batch)
            )
    finally:
        fast.Fused.MIN_CHUNK = old
    _assert_same(fused, simple, by, split=threads > 1)


@needs_numba
@pytest.mark.parametrize("by", [None, "step", "q_bucket"])
def test_fused_and_simple_paths_agree_on_a_realistic_log(tmp_path, by):
    rng = np.random.default_rng(5)
    df = random_log(rng, steps=4, seqs=12, max_len=40, mismatch=0.2)
    path = write_log(tmp_path / "log.parquet", df)
    fused, simple = _both([path], by=by, options=ingest.ReadOptions(batch_rows=97))
    _assert_same(fused, simple, by)


@needs_numba
def test_fused_and_simple_paths_agree_with_prime_rl_conventions(tmp_path):
    rng = np.random.default_rng(6)
    path = write_log(tmp_path / "log.parquet", random_log(rng, steps=3, seqs=10, max_len=30))
    fused, simple = _both([path], match="prime-rl", options=ingest.ReadOptions(batch_rows=50))
    _assert_same(fused, simple, None)
    assert fused.table["is_masked_mean"].null_count() < fused.table.height


@needs_numba
def test_threads_split_a_batch_without_changing_counts(tmp_path):
    rng = np.random.default_rng(7)
    path = write_log(tmp_path / "log.parquet", random_log(rng, steps=3, seqs=20, max_len=60))
    old = fast.Fused.MIN_CHUNK
    fast.Fused.MIN_CHUNK = 1
    try:
        res = {}
        for t in (1, 2, 5):  # 1, 8 and 20 chunks taken by whichever thread is free
            for by in ("step", "q_bucket"):  # q_bucket: a sequence's first token decides
                with env(MISMATCH_REPLAY_THREADS=t):
                    res[t, by] = engine.sweep([path], by=by)
    finally:
        fast.Fused.MIN_CHUNK = old
    for t in (2, 5):
        for by in ("step", "q_bucket"):
            _assert_same(res[t, by], res[1, by], by, split=True)


@needs_numba
def test_threads_folded_past_the_memory_budget_keep_counts(tmp_path, monkeypatch):
    """With many groups, fewer threads keep their own bins (runner.ACCUM_BUDGET), where the
    bins are per thread (ORDERED_BUDGET 0: the ordered mode keeps one copy anyway)."""
    rng = np.random.default_rng(12)
    path = write_log(tmp_path / "log.parquet", random_log(rng, steps=6, seqs=10, max_len=40))
    monkeypatch.setattr(fast.Fused, "MIN_CHUNK", 1)
    monkeypatch.setattr(fast.runner, "ORDERED_BUDGET", 0)
    opts = ingest.ReadOptions(batch_rows=50)
    with env(MISMATCH_REPLAY_THREADS=3):
        base = engine.sweep([path], by="step", options=opts)
        monkeypatch.setattr(fast.runner, "ACCUM_BUDGET", 200_000)
        folded = engine.sweep([path], by="step", options=opts)
    assert base.tally._fused.t == 3 and folded.tally._fused.t == 1
    _assert_same(folded, base, "step", split=True)


@needs_numba
def test_unknown_rules_fall_back_to_the_simple_path(tmp_path):
    class MyIPO(IPO):  # a subclass may override score(): the kernel must not assume it
        def score(self, b, param):
            return b.abs_dp * 2.0

    rng = np.random.default_rng(8)
    path = write_log(tmp_path / "log.parquet", random_log(rng))
    rules = [MyIPO(), IPO()]
    prog = fast.Program([engine.Job(r, "eps", np.array([0.01, 0.1])) for r in rules])
    assert prog.slot[0] == -1 and prog.slot[1] >= 0
    assert prog.reasons == ["bins change between its critical points (checked)", None]
    fused, simple = _both([path], rules=rules, sweeps={"eps": "0.001:1:30:log"})
    _assert_same(fused, simple, None)
    mine = fused.table.filter(pl.col("rule") == "ipo")
    assert mine.height == 60  # both rules report (same name), and they differ
    a, b = mine[:30], mine[30:]
    assert (a["masked_tokens"] != b["masked_tokens"]).any()


def test_every_catalogue_token_rule_is_compiled():
    """A token rule of the catalogue declares the quantity each threshold parameter
    thresholds (Rule.quantities), and its score() is a function of it (or it would run on
    the simple path)."""
    missing = []
    for name, cls in REGISTRY.items():
        if cls.level != "token":
            continue
        for p in cls.params:
            if p.threshold:
                job = engine.Job(cls(**_complete(cls)), p.name, np.array([0.5, 2.0]))
                why = fast.Program([job]).reasons[0]
                if why is not None:
                    missing.append(f"{name}.{p.name}: {why}")
    assert not missing, f"not compiled: {missing}"


def _complete(cls) -> dict:
    return {k: (v if v is not None else 0.5) for k, v in cls.defaults().items()}


def test_identical_jobs_share_a_kernel_slot():
    jobs, _ = engine.plan_jobs(None, None, ("trainer_logprob", "inference_logprob"))
    prog = fast.Program(jobs)
    slot = {j.label: prog.slot[i] for i, j in enumerate(jobs)}
    assert slot["icepop[high=5]:low"] == slot["token-mis[high=5]:low"]
    assert slot["icepop[low=0.5]:high"] == slot["token-mis[low=0.5]:high"]
    assert slot["ipo[]:eps"] != slot["icepop[low=0.5]:high"]


# ----------------------------------------------------------------------------- rules from anywhere


@dataclass(frozen=True)
class AbsLogRatio(Rule):
    """A rule defined outside the catalogue (not registered): masked iff |l| > eps."""

    name = "abs-l"
    title = "|log p - log q| band"
    params = (Param("eps", "largest |l| kept", "0.1,0.5,1"),)
    quantities = {"eps": "|l|"}
    eps: float | None = 0.5

    def score(self, b, param):
        return np.abs(b.l)


@dataclass(frozen=True)
class Misdeclared(Rule):
    """Declares a threshold on l, but its score reads p too."""

    name = "misdeclared"
    title = "l, where p > 0.5"
    params = (Param("eps", "threshold on l", "0.1,0.5,1"),)
    quantities = {"eps": "l"}
    eps: float | None = 0.5

    def score(self, b, param):
        return np.where(b.p > 0.5, b.l, -math.inf)


@needs_numba
def test_a_rule_defined_outside_the_package_runs_fused_with_exact_counts(tmp_path):
    """One class on an existing quantity: the fused path bins its own score() (the only
    implementation), and counts equal the simple path's and a count by hand."""
    rng = np.random.default_rng(15)
    df = random_log(rng, steps=3, seqs=10, max_len=40, mismatch=0.5)
    path = write_log(tmp_path / "log.parquet", df)
    values = np.array([0.1, 0.5, 1.0])
    prog = fast.Program([engine.Job(AbsLogRatio(), "eps", values)])
    assert prog.reasons == [None] and prog.slot == [0]
    assert [c.kind for c in prog.coords] == ["l"]
    sweeps = {"abs-l.eps": values}
    fused, simple = _both([path], rules=[AbsLogRatio()], sweeps=sweeps)
    _assert_same(fused, simple, None)
    assert fused.tally._fused is not None and fused.tally._fused.p.slot == [0]
    ok = df.filter(pl.col("loss_mask"))
    l = ok["trainer_logprob"].to_numpy() - ok["inference_logprob"].to_numpy()  # noqa: E741
    t = fused.table.sort("value")
    assert t["masked_tokens"].to_list() == [int((np.abs(l) > v).sum()) for v in values]


@needs_numba
def test_a_rule_that_misdeclares_its_quantity_runs_on_the_simple_path(tmp_path):
    """Declared on l but reading p: the two kinds of junk give different bins, so the job is
    not fused, and its counts are the simple path's."""
    path = write_log(tmp_path / "log.parquet", random_log(np.random.default_rng(16)))
    values = np.array([0.1, 0.5, 1.0])
    jobs = [engine.Job(Misdeclared(), "eps", values), engine.Job(AbsLogRatio(), "eps", values)]
    prog = fast.Program(jobs)
    assert prog.reasons == ["score is not a function of l (checked)", None]
    assert prog.slot[0] == -1
    rules = [Misdeclared(), AbsLogRatio()]
    sweeps = {"misdeclared.eps": values, "abs-l.eps": values}
    fused, simple = _both([path], rules=rules, sweeps=sweeps)
    _assert_same(fused, simple, None)


def test_programs_say_why_a_job_is_not_fused():
    """Program.reasons, job by job: None where fused."""
    from mismatch_replay.rules import KPop, SeqTIS, parse_rule

    v = np.array([0.1, 0.2])
    jobs = [
        engine.Job(IPO(), "eps", v),
        engine.Job(IPO(precision="float32"), "eps", v),
        engine.Job(SeqTIS(), "cap", np.array([2.0])),
        engine.Job(parse_rule("dppo-kl@verl").replace(precision="float64"), "high", v),
        engine.Job(parse_rule("ipo@prime-rl").replace(precision="float64"), "eps", v),
        engine.Job(KPop(clamp=1e-6), "phi", v),
        engine.Job(Misdeclared(), "eps", v),
    ]

    class Undeclared(IPO):
        quantities = {}

    jobs.append(engine.Job(Undeclared(), "eps", v))
    assert fast.Program(jobs).reasons == [
        None,
        "float32 replay",
        "sequence rule",
        "preset arithmetic 'verl' (its own formula)",
        None,
        None,
        "score is not a function of l (checked)",
        "no declared quantity",
    ]


# A rule per quantity: its score is the quantity itself, optionally only for one sign of the
# advantage and, on l and bkl(q||p), of l (the classes the program derives).
QUANTITY_SCORES = {
    "l": (lambda b, c: b.l, float),
    "|l|": (lambda b, c: np.abs(b.l), float),
    "log r": (lambda b, c: b.l, lambda t: math.log(t) if t > 0 else -math.inf),
    "r": (lambda b, c: b.r, float),
    "r-1": (lambda b, c: b.r, lambda t: 1.0 + t),
    "1-r": (lambda b, c: -b.r, lambda t: t - 1.0),
    "k2": (lambda b, c: b.k2, float),
    "k3": (lambda b, c: b.k3, float),
    "dp": (lambda b, c: b.dp, float),
    "-dp": (lambda b, c: -b.dp, float),
    "|dp|": (lambda b, c: b.abs_dp, float),
    "bkl": (lambda b, c: b.bkl(c), float),
    "bkl(q||p)": (lambda b, c: b.bkl_qp(c), float),
}


@dataclass(frozen=True)
class OnQuantity(Rule):
    """masked iff quantity > t, where the advantage (and l) has the sign asked for."""

    name = "on-quantity"
    title = "a quantity against a threshold"
    needs = ("advantage",)
    params = (
        Param("t", "threshold", "0.1", domain=Domain(-math.inf)),
        Param("clamp", "clamp", "1e-6", threshold=False),
    )
    t: float | None = 0.1
    clamp: float | None = 1e-6
    what: str = field(default="l", kw_only=True)
    adv_sign: int = field(default=0, kw_only=True)
    l_sign: int = field(default=0, kw_only=True)

    @property
    def quantities(self):  # per instance here; a class attribute in the catalogue
        return {"t": self.what}

    def threshold(self, param, value):
        return QUANTITY_SCORES[self.what][1](value)

    def score(self, b, param):
        with np.errstate(all="ignore"):
            s = np.asarray(QUANTITY_SCORES[self.what][0](b, self.clamp), dtype=np.float64)
        keep = np.ones(s.shape, dtype=bool)
        if self.adv_sign:
            keep &= np.sign(b.adv(self.name)) == self.adv_sign
        if self.l_sign:
            keep &= np.sign(b.l) == self.l_sign
        return np.where(keep, s, -math.inf)


L_SIGNED = ("bkl(q||p)",)  # on l, a sign of l would be a critical point at 0: not derivable
IDENTITY = ("l", "|l|", "r", "k2", "k3", "dp", "|dp|", "bkl", "bkl(q||p)")  # threshold(t) = t


@needs_numba
@settings(max_examples=40)
@given(df=logs(), data=st.data())
def test_a_rule_on_any_declared_quantity_is_fused_with_the_simple_paths_counts(df, data):
    """Brute force: the simple path, on random logs, for a rule per quantity (its score the
    quantity, only where the advantage and l have the signs drawn), with thresholds tied
    exactly to token values; the program derives each of them (none on the simple path)."""
    what = data.draw(st.sampled_from(sorted(QUANTITY_SCORES)), label="quantity")
    rule = OnQuantity(
        clamp=data.draw(st.sampled_from([1e-8, 1e-6, 1e-3]), label="clamp"),
        what=what,
        adv_sign=data.draw(st.sampled_from([0, 1, -1]), label="adv_sign"),
        l_sign=data.draw(st.sampled_from([0, 1, -1]), label="l_sign") if what in L_SIGNED else 0,
    )
    ok = df.filter(pl.col("loss_mask"))
    tb = TokenBatch(ok["trainer_logprob"].to_numpy(), ok["inference_logprob"].to_numpy())
    with np.errstate(all="ignore"):
        q = np.asarray(QUANTITY_SCORES[what][0](tb, rule.clamp), dtype=np.float64)
    ties = sorted({float(x) for x in q[np.isfinite(q)]})[:12] if what in IDENTITY else []
    if what == "log r":
        ties = list(NICE_RATIOS)
    pick = data.draw(st.lists(st.sampled_from(ties), max_size=6), label="ties") if ties else []
    fixed = {"dp": [-0.3, 0.0, 0.2], "-dp": [-0.1, 0.0, 0.3], "1-r": [0.0, 0.3, 0.9]}
    values = np.unique(np.r_[fixed.get(what, [0.0, 0.1, 0.5, 2.0]), pick])
    job = engine.Job(rule, "t", values)
    assert fast.Program([job]).reasons == [None]
    with log_file(df) as path:
        fused, simple = _both([path], rules=[rule], sweeps={"on-quantity.t": values})
    _assert_same(fused, simple, None)


# ----------------------------------------------------------------------------- coordinates


@needs_numba
def test_call_free_exp_expm1_log_are_within_a_few_ulps_of_the_c_library():
    """vmath's functions feed every |dp| and binary KL the kernel bins; the windows around
    their critical points (coordinates.ERR_REL = 1e-13) assume <= ~1e-15 relative error."""
    from mismatch_replay.fast import vmath

    rng = np.random.default_rng(0)
    wide = rng.uniform(-760.0, 720.0, 400_000)
    near0 = np.r_[rng.normal(0.0, 1e-6, 100_000), rng.normal(0.0, 0.5, 200_000)]
    edges = np.array(
        [
            0.0,
            -0.0,
            5e-324,
            -5e-324,
            1e-300,
            0.3466,
            -0.3466,
            709.78,
            709.79,
            -708.4,
            -744.4,
            -745.13,
            -745.2,
            40.0,
            -40.0,
            60.0 * math.log(2),
        ]
    )
    x = np.r_[wide, near0, edges]
    pos = np.r_[
        np.exp(rng.uniform(-745.0, 709.0, 300_000)),
        1 + rng.normal(0, 1e-9, 100_000),
        rng.uniform(1e-6, 1 - 1e-6, 200_000),
        [5e-324, 1e-310, 1.0, np.finfo(float).max],
    ]
    for kind, ref, arg in ((0, np.exp, x), (1, np.expm1, x), (2, np.log, pos)):
        out = np.empty_like(arg)
        vmath.apply(kind, arg, out)
        with np.errstate(over="ignore"):
            want = ref(arg)
        fin = np.isfinite(want)
        assert np.array_equal(np.isfinite(out), fin), kind
        assert np.array_equal(out[~fin], want[~fin]), kind  # overflow to inf alike
        w, o = want[fin], out[fin]
        err = np.abs(o - w)
        tiny = np.abs(w) < 2.3e-308  # subnormal results: absolute error of an ulp or two
        assert (err[~tiny] <= 4e-15 * np.abs(w[~tiny])).all(), kind
        assert (err[tiny] <= 2e-323).all(), kind


@settings(max_examples=150)
@given(data=st.data())
def test_coordinate_binner_counts_edges_at_or_below(data):
    """Compact keys (values within +-tiny skip the table; the table spans the core of the
    edges and far outliers are scanned): the count of edges <= x, every x."""
    pos = data.draw(st.lists(st.floats(1e-6, 1e3), max_size=80), label="pos")
    neg = data.draw(st.lists(st.floats(1e-6, 1e3), max_size=80), label="neg")
    far = data.draw(st.lists(st.sampled_from([1e154, -1e154, 1e300, -1e300, 7e2]), max_size=3))
    e = np.unique(np.r_[pos, [-v for v in neg], far, 1.0])
    bn = fast.make_coord_binner(e, data.draw(st.sampled_from([16, 1024, 8192])))
    extra = np.array(data.draw(st.lists(st.floats(allow_nan=False), max_size=30)), np.float64)
    with np.errstate(over="ignore"):
        x = np.r_[e, np.nextafter(e, math.inf), np.nextafter(e, -math.inf), extra, SPECIALS]
    ref = np.searchsorted(e, x, side="right")
    ref[x == math.inf] = e.size + 1
    assert np.array_equal(fast.lut_bins(x, bn), ref)
    # the kernel's flagged table (a bucket without an edge is its bin), numpy and numba
    for flag, dtype in ((1 << 15, np.uint16), (1 << 31, np.uint32)):
        fl = fast.flag_lut(bn.lut, flag).astype(dtype)
        assert np.array_equal(fast.flagged_bins(x, bn, fl, flag), ref)
        j = fast.compiled()
        if j is not None:
            out = np.empty(x.size, np.uint64)
            args = (bn.nl, bn.klo, bn.khi, bn.shift, bn.tiny, np.uint64(bn.nz), bn.gap, bn.kpos)
            j.coord_bin_array(x, np.uint64(e.size), bn.thr, fl, *args, np.uint64(flag), out)
            assert np.array_equal(out.astype(np.int64), ref)


def test_coordinate_table_refuses_more_edges_than_its_flag_leaves_room_for():
    with pytest.raises(ValueError, match="do not fit"):
        fast.flag_lut(np.array([0, 3, 40_000, 40_000]), 1 << 15)


def test_coordinate_intervals_hold_one_bin_per_slot_and_class():
    """Program's interval tables against the slots' own bins at random points inside every
    interval (the build checks 16 evenly spaced points; these are elsewhere)."""
    jobs, _ = engine.plan_jobs(None, None, ("trainer_logprob", "inference_logprob", "advantage"))
    prog = fast.Program(jobs)
    assert [c.kind for c in prog.coords] == ["dp", "l", "bkl", "bkl_qp"]
    assert [c.ncls for c in prog.coords] == [3, 3, 1, 9]
    rng = np.random.default_rng(1)
    for c in prog.coords:
        lo = np.r_[-1e6, np.nextafter(c.edges[1::2], math.inf)]
        hi = np.r_[np.nextafter(c.edges[0::2], -math.inf), 1e6]
        ok = lo < hi
        u = rng.random((ok.sum(), 8))
        pts = lo[ok, None] + (hi[ok] - lo[ok])[:, None] * u
        pts = np.clip(pts, lo[ok, None], hi[ok, None])
        x = pts.reshape(-1)
        for si, plan in enumerate(c.plans):
            for cl, (a, ls) in enumerate(c.classes):
                want = c.jobbin[si, cl, : c.intervals][ok]
                b = fast.sample_bins(plan, x, a, ls).reshape(pts.shape)
                assert (b == want[:, None]).all(), (c.kind, si, cl)
                if c.kind != "l":
                    continue
                # on l, a real batch with these log ratios: the score as the engine sees it
                tb = TokenBatch(x, np.zeros_like(x), np.full_like(x, a))
                with np.errstate(all="ignore"):
                    score = plan.rule.score(tb, plan.param)
                b = fast.reference_bins(score, plan.thr, plan.inclusive).reshape(pts.shape)
                assert (b == want[:, None]).all(), (c.kind, si, cl)


@needs_numba
def test_tokens_on_a_threshold_go_to_the_simple_path(tmp_path):
    """Ties at thresholds of |dp|, l, k3 and the binary KL: the kernel sends those tokens to
    the simple path (and only a few), and both paths count the same."""
    rng = np.random.default_rng(13)
    df = random_log(rng, steps=3, seqs=10, max_len=30, mismatch=0.3)
    path = write_log(tmp_path / "log.parquet", df)
    ok = df.filter(pl.col("loss_mask"))
    tb = TokenBatch(ok["trainer_logprob"].to_numpy(), ok["inference_logprob"].to_numpy())
    pick = rng.choice(tb.l.shape[0], 6, replace=False)
    bkl = binary_kl(tb.lq, tb.lp, 1e-6)
    sweeps = {
        "ipo.eps": np.unique(np.r_[0.01, 0.1, tb.abs_dp[pick]]),
        "tis.cap": np.unique(np.r_[1.5, 3.0, np.exp(np.abs(tb.l[pick]))]),
        "token-k3.hi": np.unique(np.r_[0.01, tb.k3[pick]]),
        "dppo-kl.high": np.unique(np.r_[0.01, bkl[pick]]),
    }
    rules = ["ipo", "tis", "token-k3", "dppo-kl"]
    fused, simple = _both([path], rules=rules, sweeps=sweeps, by="step")
    _assert_same(fused, simple, "step")
    flagged = fused.tally._fused.flagged_tokens
    assert 0 < flagged <= 4 * 6 * 3 + 10, flagged


@needs_numba
def test_more_coordinates_than_flag_bits_fall_back_to_the_simple_path(tmp_path):
    """Each distinct kpop clamp is a coordinate; past 32 the engine runs the numpy path."""
    from mismatch_replay.rules import KPop

    path = write_log(tmp_path / "log.parquet", random_log(np.random.default_rng(14)))
    grid = np.array([1e-3, 1e-2, 0.1])
    jobs = [engine.Job(KPop(clamp=10.0 ** -(4 + i / 8)), "phi", grid) for i in range(33)]
    with pytest.raises(fast.TooManyCoordinates):
        fast.Program(jobs)
    tally = engine.replay([path], jobs=jobs)
    assert tally._fused is None and any("fast path off" in n for n in tally.notes)
    few = engine.replay([path], jobs=jobs[:3])
    assert few._fused is not None
    with fast.use_backend("numpy"):
        ref = engine.replay([path], jobs=jobs)
    assert_tables_equal(tally.result().table, ref.result().table)


@needs_numba
def test_sequence_codes_agree_across_backends():
    """Runs of (step, sample_id), a sequence resumed later in the batch, string ids."""
    df = pl.DataFrame(
        {
            "step": [0, 0, 0, 1, 1, 0, 0, 2, 2, 2],
            "sample_id": [5, 5, 6, 5, 5, 5, 6, 1, 1, 0],
        }
    )
    for frame in (df, df.with_columns(pl.col("sample_id").cast(pl.Utf8))):
        out = {}
        for backend in ("numba", "numpy"):
            with fast.use_backend(backend):
                t = engine.Tally([], None, has_seq=True)
                t.seq_codes(frame[:4])
                out[backend] = (t.seq_codes(frame[4:]), dict(t.seq_keys))
        (ga, (ua, la)), ka = out["numba"]
        (gb, (ub, lb)), kb = out["numpy"]
        assert ka == kb
        assert np.array_equal(ga, gb) and np.array_equal(ua, ub) and np.array_equal(la, lb)
        assert np.array_equal(ua[la], ga)


# ----------------------------------------------------------------------------- m2po


@settings(max_examples=80)
@given(data=st.data())
def test_m2po_step_kernel_equals_stable_argsort(data):
    """Heavy ties (few distinct l^2 values), thresholds on exact suffix means."""
    n = data.draw(st.integers(1, 60), label="n")
    pool = data.draw(
        st.lists(st.sampled_from([0.0, 1 / 64, 1 / 16, 0.25, 1.0, 2.0, 1e-9]), min_size=1),
        label="values",
    )
    x = np.array(data.draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000), label="seed"))
    g = rng.integers(0, 3, n)
    seq = rng.integers(0, 5, n)
    mass = rng.random(n)
    inv = rng.random(n)
    xs = np.sort(x)[::-1]
    means = [math.fsum(xs[m:]) / (n - m) for m in range(n)]
    thr = np.unique(
        np.r_[data.draw(st.lists(st.sampled_from(means), min_size=1, max_size=5)), 0.5, 1e-3]
    )

    def run(backend):
        out = (np.zeros((3, thr.size + 2), np.int64), np.zeros((3, thr.size + 2)))
        sf = np.zeros((3, thr.size + 2))
        sb = np.full(5, -1, np.int64)
        with fast.use_backend(backend):
            fast.m2po_step_bins(x, g, mass, seq, inv, thr, 3, 5, out[0], out[1], sf, sb)
        return out[0], out[1], sf, sb

    ref = run("numpy")
    if 1e-9 not in pool:  # dyadic values: every running sum is exact, so is the definition
        for k, tau in enumerate(thr):  # rank m is masked iff mean(xs[m:]) >= tau
            assert ref[0][:, k + 1 :].sum() == sum(1 for m in range(n) if means[m] >= tau)
    if HAVE_NUMBA:
        got = run("numba")
        assert np.array_equal(got[0], ref[0])
        assert np.allclose(got[1], ref[1], rtol=1e-12, atol=0)
        assert np.allclose(got[2], ref[2], rtol=1e-12, atol=0)
        assert np.array_equal(got[3], ref[3])


def test_m2po_store_spills_to_disk_with_identical_results(tmp_path):
    rng = np.random.default_rng(9)
    df = random_log(rng, steps=4, seqs=8, max_len=30)
    path = write_log(tmp_path / "log.parquet", df)
    rules = ["m2po", "ipo"]
    sweeps = {"m2po.tau": "0.0001:1:40:log"}
    base = engine.replay([path], rules=rules, sweeps=sweeps, by="step")
    assert base.m2po.spilled_tokens == 0
    with env(MISMATCH_REPLAY_M2PO_MEMORY="0.0005"):  # ~500 bytes: spills every batch
        spilled = engine.replay(
            [path], rules=rules, sweeps=sweeps, by="step", options=ingest.ReadOptions(batch_rows=40)
        )
    assert 0 < spilled.m2po.spilled_tokens <= spilled.m2po.tokens == base.m2po.tokens
    assert spilled.m2po.nbytes <= 40 * 28
    keys = ("rule", "setting", "param", "value", "step")
    assert_tables_equal(base.result().table, spilled.result().table, keys=keys)


@needs_numba
@pytest.mark.parametrize("final", [False, True])
def test_runner_buffers_never_overwrite_what_m2pos_store_holds(tmp_path, final):
    """m2po's store keeps a batch's l^2, |dp| and sequence ids until their step is resolved,
    batches later: the runner hands those over fresh and reuses only its own arrays (the
    window flags, the scatter counts), batch after batch. The numpy path, which allocates
    afresh, gives the same table."""
    import pyarrow.parquet as pq

    df = random_log(np.random.default_rng(41), steps=5, seqs=6, max_len=40)
    df = df.sort("step", maintain_order=True)
    path = tmp_path / "log.parquet"
    pq.write_table(df.to_arrow(), path, row_group_size=30)
    kw = dict(rules=["m2po", "ipo", "seq-mis"], options=ingest.ReadOptions(batch_rows=20))
    fused = engine.replay([path], final=final, **kw)
    assert fused._fused is not None
    assert {"tflag", "hist_lin", "hist_log"} <= set(fused._fused._own)
    with fast.use_backend("numpy"):
        simple = engine.replay([path], final=final, **kw)
    keys = ("rule", "setting", "param", "value")
    assert_tables_equal(simple.result().table, fused.result().table, keys=keys)


def test_m2po_store_memory_is_per_token_and_bounded():
    store = engine.M2POStore(limit_bytes=10_000)
    for i in range(20):
        n = 300
        store.add(np.full(n, i % 3), np.ones(n), np.ones(n), None, np.arange(n))
        assert store.nbytes <= 10_000 + n * 24
    assert store.tokens == 6000 and store.spilled_tokens > 0
    x, _, g, seq = store.step(1)
    assert x.shape == (7 * 300,) and not g.any()
    assert np.array_equal(seq[:300], np.arange(300))  # input order kept across the spill


# ----------------------------------------------------------------------------- backends


def test_simple_path_forced_by_the_environment(tmp_path):
    path = write_log(tmp_path / "log.parquet", random_log(np.random.default_rng(10)))
    with env(MISMATCH_REPLAY_KERNEL="numpy"):
        assert fast.backend() == "numpy"
        assert fast.compiled() is None
        tally = engine.replay([path])
        assert tally._fused is None and tally._fused_off
    with env(MISMATCH_REPLAY_KERNEL="bogus"), pytest.raises(ValueError, match="KERNEL"):
        fast.backend()


@needs_numba
def test_fused_tally_pickles_and_merges(tmp_path):
    """Ray ships Tallies between processes: a pickled Tally keeps its fused sums."""
    import pickle

    rng = np.random.default_rng(11)
    df = random_log(rng, steps=2, seqs=6)
    a = write_log(tmp_path / "a.parquet", df[: df.height // 2])
    b = write_log(tmp_path / "b.parquet", df[df.height // 2 :])
    ta = pickle.loads(pickle.dumps(engine.replay([a])))
    tb = pickle.loads(pickle.dumps(engine.replay([b])))
    both = engine.replay([a, b]).result()
    assert_tables_equal((ta + tb).result().table, both.table)


_START = """
import sys
from mismatch_replay import fast
j = fast.compiled()
assert j is not None
probe = sys.modules.get("scipy.linalg.cython_blas", "absent")
print("scipy.linalg" in sys.modules, probe is None)
import numpy as np
assert j.check_column(np.array([-1.0, -2.0]), 0.0) == 0
"""


@pytest.mark.slow  # a fresh interpreter (subprocess)
def test_numba_starts_without_importing_scipy_and_leaves_it_importable():
    """fast.compiled() starts numba's target without its BLAS probe (scipy.linalg, 0.2-0.3 s):
    in a fresh process scipy.linalg is not imported by it, no None entry is left behind, and
    scipy's BLAS still imports and works in numba afterwards."""
    import subprocess
    import sys

    pytest.importorskip("numba")
    scipy = pytest.importorskip("scipy")
    env = {**os.environ, "MISMATCH_REPLAY_KERNEL": "numba"}
    out = subprocess.run(
        [sys.executable, "-c", _START], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
    after = (
        _START
        + """
import scipy.linalg.cython_blas
from numba import njit
dot = njit(lambda a, b: np.dot(a, b))
assert dot(np.ones((2, 2)), np.ones((2, 2))).sum() == 8.0
"""
    )
    subprocess.run([sys.executable, "-c", after], env=env, check=True)
    assert scipy is not None


def test_numba_start_leaves_a_loaded_scipy_alone(monkeypatch):
    """Where scipy.linalg is loaded already, the probe is not blocked (nothing to save);
    where it is not, it is blocked only while the target starts."""
    import sys

    pytest.importorskip("numba")
    from numba.core.registry import cpu_target

    probe = "scipy.linalg.cython_blas"
    seen = []
    monkeypatch.setattr(
        cpu_target.typing_context, "refresh", lambda: seen.append(sys.modules.get(probe, "-"))
    )
    monkeypatch.setitem(sys.modules, "scipy.linalg", object())
    fast.runner._start_numba_target()
    assert seen and None not in seen
    seen.clear()
    monkeypatch.delitem(sys.modules, "scipy.linalg")
    monkeypatch.delitem(sys.modules, probe, raising=False)
    fast.runner._start_numba_target()
    assert seen and all(x is None for x in seen)  # blocked while the target starts
    assert probe not in sys.modules  # and unblocked after


@needs_numba
def test_the_kernels_sequence_statistics_are_rows_of_the_table():
    """BatchOut.seq names each per-sequence output by its SEQ_STATS row (same combine), and
    covers every row but the optional ones (which the engine adds on numpy)."""
    from mismatch_replay.rules import SEQ_STATS

    j = fast.compiled()
    how = {s.name: s.combine for s in SEQ_STATS} | {"mass": "sum"}
    got = {**dict.fromkeys(j.SEQ_SUMS, "sum"), j.SEQ_MAX: "max", j.SEQ_MIN: "min"}
    assert {k: how.get(k) for k in got} == got
    assert {s.name for s in SEQ_STATS if not s.optional} <= set(got)


def _exact_ties_with_mean(target: float, seqs: int, rng) -> pl.DataFrame:
    """Two-token sequences, l < 0, whose exp(|l|) (pmath) add up to 2 * target exactly."""
    from mismatch_replay import pmath

    lq0 = math.log(0.95)
    rows: dict[str, list] = {"lp": [], "sid": []}
    while len(rows["sid"]) < 2 * seqs:
        l1 = -rng.uniform(0.05, 0.6)
        e2 = 2 * target - pmath.exp(-l1)
        x = -math.log(e2)
        for c in (x, np.nextafter(x, 0.0), np.nextafter(x, -1.0)):
            if c < 0 and pmath.exp(-float(c)) == e2:
                s = len(rows["sid"]) // 2
                rows["lp"] += [lq0 + l1, lq0 + float(c)]
                rows["sid"] += [s, s]
                break
    n = len(rows["sid"])
    return canonical_log(np.array(rows["lp"]), np.full(n, lq0), sample_id=np.array(rows["sid"]))


@pytest.mark.parametrize("batch_rows", [1_000_000, 2])
def test_sequence_statistics_at_a_tie_are_decided_as_rules_py_decides(tmp_path, batch_rows):
    """prob-error at exactly mean exp|l| = 1.5 (NeMo-RL's `>`): kept on both paths, masked
    just below; the per-token exp|l| are the same bits on both paths (pmath)."""
    from mismatch_replay.rules import ProbError, SeqStats

    df = _exact_ties_with_mean(1.5, 30, np.random.default_rng(1))
    path = write_log(tmp_path / "tie.parquet", df)
    grid = {"prob-error.tau": np.array([1.4999, 1.5])}
    got = {}
    for backend in ("numba", "numpy") if HAVE_NUMBA else ("numpy",):
        with fast.use_backend(backend):
            res = engine.sweep(
                [path],
                rules=["prob-error"],
                sweeps=grid,
                options=ingest.ReadOptions(batch_rows=batch_rows),
            )
        t = res.table.filter(pl.col("rule") == "prob-error").sort("value")
        got[backend] = t["masked_tokens"].to_list()
    # rules.py on the whole sequences
    tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy())
    from mismatch_replay import pmath

    e = pmath.exp(np.abs(tb.l)).reshape(-1, 2).sum(axis=1)
    one = np.ones_like(e)
    stats = SeqStats(2 * one, one, one, one, one, e, one)
    score = ProbError().score(stats, "tau")
    assert (score == 1.5).all()
    for masked in got.values():
        assert masked == [df.height, 0]


def _no_numba_find_spec(real):
    def find_spec(name, *args, **kw):
        return None if name == "numba" else real(name, *args, **kw)

    return find_spec


def test_without_numba_the_numpy_path_runs_with_one_note(monkeypatch):
    import importlib.util
    import warnings

    monkeypatch.setattr(importlib.util, "find_spec", _no_numba_find_spec(importlib.util.find_spec))
    monkeypatch.setattr(fast.runner, "_fallback_noted", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fast.backend() == "numpy"
        assert fast.backend() == "numpy"
    notes = [w for w in seen if issubclass(w.category, fast.KernelWarning)]
    assert len(notes) == 1
    assert "numba is not installed" in str(notes[0].message)
    assert "pip install numba" in str(notes[0].message)


@pytest.mark.slow  # a fresh interpreter (subprocess)
def test_without_numba_the_cli_says_so_once_on_stderr(golden_log):
    import subprocess
    import sys

    code = (
        "import importlib.util as u, sys\n"
        "real = u.find_spec\n"
        "u.find_spec = lambda n, *a, **k: None if n == 'numba' else real(n, *a, **k)\n"
        "from mismatch_replay.cli import main\n"
        f"sys.argv = ['mismatch-replay', 'sweep', {str(golden_log)!r}, '-r', 'ipo', '-r', 'kpop']\n"
        "main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("numba is not installed") == 1, res.stderr
    assert "ipo" in res.stdout and "numba" not in res.stdout


# ----------------------------------------------------------------------------- small kernels


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
@given(st.integers(0, 2**31), st.integers(1, 300), st.integers(0, 10**6))
def test_poisson_weights_kernel_is_numpys(seed, replicates, boot_seed):
    """The kernel's Poisson(1) weights are numpy's bit for bit (ids large and negative too)."""
    from mismatch_replay.engine import bins

    rng = np.random.default_rng(seed)
    units = np.unique(np.r_[rng.integers(-(2**62), 2**62, 400), np.arange(300), [0, 2**63 - 1, -1]])
    want = bins.poisson_weights_numpy(units, replicates, boot_seed)
    assert np.array_equal(bins.poisson_weights(units, replicates, boot_seed), want)
    wt = bins.poisson_weights(units, replicates, boot_seed, transposed=True)
    assert np.array_equal(wt, want.T)
    small = bins.poisson_weights(units, replicates, boot_seed, transposed=True, dtype=np.uint8)
    assert small.dtype == np.uint8 and np.array_equal(small, want.T)  # the same weights


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
def test_poisson_weights_pass_the_first_eight_cdf_entries_as_numpy_does():
    """The kernel counts the first 8 inverse-CDF entries without a branch, then searches:
    weights of 8 and more (once in ~10^6 draws) are numpy's too."""
    from mismatch_replay.engine import bins

    units = np.arange(20_000)
    want = bins.poisson_weights_numpy(units, 200, 5)
    assert want.max() >= 8  # the search past the branchless part ran
    assert np.array_equal(bins.poisson_weights(units, 200, 5), want)


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
def test_replicate_tokens_with_uint8_weights_are_exact():
    """Replicate token totals from uint8 weights: the float64 product, exactly."""
    from mismatch_replay.analysis.tail_counts import replicate_tokens

    rng = np.random.default_rng(4)
    n = rng.integers(1, 4000, 3000).astype(np.float64)
    w = rng.poisson(1.0, (3000, 64))
    got = replicate_tokens(n, w.astype(np.uint8))
    assert np.array_equal(got, n @ w.astype(np.float64))


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
def test_replicate_bins_kernel_is_numpys():
    """Replicate sums per bin: the kernel and numpy's add.at give the same (exact) sums."""
    rng = np.random.default_rng(1)
    wt = rng.poisson(1.0, (50, 30)).astype(np.float64)
    unit = rng.integers(0, 50, 2000)
    b = rng.integers(0, 7, 2000)
    mult = rng.integers(1, 600, 2000).astype(np.float64)
    got = fast.replicate_bins(unit, b, mult, wt, 7)
    with fast.use_backend("numpy"):
        want = fast.replicate_bins(unit, b, mult, wt, 7)
    assert np.array_equal(got, want)
    ref = np.zeros((30, 7))
    for u, k, m in zip(unit, b, mult, strict=True):
        ref[:, k] += m * wt[u]
    assert np.array_equal(got, ref)


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
def test_q_bucket_codes_are_numpys_at_the_edges():
    """The kernel's q buckets (its own exp) are bins.q_bucket's on pmath's exp, also for
    log-probs within a few ulps of log(edge)."""
    from mismatch_replay import pmath
    from mismatch_replay.engine import Q_BUCKET_EDGES
    from mismatch_replay.engine.bins import q_bucket

    j = fast.compiled()
    edges = np.asarray(Q_BUCKET_EDGES, dtype=np.float64)
    logs = np.log(edges[1:])
    near = (logs.view(np.int64)[:, None] + np.arange(-8, 9)[None, :]).ravel().view(np.float64)
    lq = np.r_[near, -np.random.default_rng(2).exponential(3.0, 20000), 0.0, -800.0]
    out = np.empty(lq.shape[0], dtype=np.int64)
    first = np.full(edges.shape[0], -1, dtype=np.int64)
    j.q_bucket_codes(lq, edges, out, first)
    want = q_bucket(pmath.exp(lq))
    assert np.array_equal(out, want)
    for k in range(edges.shape[0]):
        hit = np.flatnonzero(want == k)
        assert first[k] == (hit[0] if hit.size else -1)


@pytest.mark.skipif(fast.backend() != "numba", reason="the kernels need numba")
@pytest.mark.parametrize("seed", [3, 4])
def test_clamped_sequence_sums_in_the_kernel_are_numpys(tmp_path, seed):
    """verl's sequence presets read sums of clip(l, +-20) and (exp(lc) - 1) - lc: the kernel
    accumulates them (flags[F_CSEQ]) and every grid point's count is the numpy path's, l far
    beyond the clamp included."""
    from conftest import random_log

    from mismatch_replay.analysis.search import choice_jobs
    from mismatch_replay.rules import parse_rule

    df = random_log(np.random.default_rng(seed), steps=4, seqs=30, max_len=40, mismatch=0.5)
    lp = df["trainer_logprob"].to_numpy().copy()
    lp[::97] = -60.0  # l beyond the clamp
    df = df.with_columns(pl.Series("trainer_logprob", lp))
    path = tmp_path / "v.parquet"
    df.write_parquet(path)
    specs = ["seq-mis@verl", "geo-mis@verl", "seq-mean-k3@verl", "seq-max-k2@verl"]
    jobs = choice_jobs([parse_rule(s) for s in specs], True)
    got = engine.replay([path], jobs=jobs, final=True)
    with fast.use_backend("numpy"):
        ref = engine.replay([path], jobs=jobs, final=True)
    st, sr = got.seq_stats(), ref.seq_stats()
    for name in ("sum_lc", "sum_k3c"):
        np.testing.assert_allclose(getattr(st, name), getattr(sr, name), rtol=1e-12, atol=1e-12)
    a, b = got.result().table, ref.result().table
    assert a["masked_tokens"].to_list() == b["masked_tokens"].to_list()
