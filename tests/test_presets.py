"""Issue 17: every preset equals its framework's own code, ties, clamps and float32 included.

For each preset, tests/frameworks.py re-derives the framework's decision in torch from its
source (file and commit named there); here the engine's sweep (both backends) is compared
with it on the golden log and on an edge log built below: tokens exactly on every threshold
(in the framework's arithmetic: exp(l) == bound with l != log(bound), k1 == log(lo),
p - q == eps, k2 == hi, ...), p at 0 and 1, |l| > 20, A == 0, an empty and one-token
sequences, a step where every token is masked. Totals, per-step counts and masked-sequence
counts must be equal. Presets that carry a paper's or docs' values (no framework code) are
checked against tests/brute.py (written from RULES.md). `--precision float32` is checked the
same way with the references run in torch.float32.
"""

from __future__ import annotations

import html
import math

import brute
import conftest
import frameworks as fw
import numpy as np
import polars as pl
import pytest
import torch
from conftest import GOLDEN_LOG, canonical_log, write_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import crmath, engine, fast, pmath
from mismatch_replay.rules import REGISTRY, parse_rule, token

# ----------------------------------------------------------------------------- edge log


def _t_exp(x: float) -> float:
    return torch.exp(torch.tensor(x, dtype=torch.float64)).item()


def _agree(x: float) -> bool:
    """crmath's exp (a preset's, correctly rounded) and torch's give the same bits at x."""
    return crmath.exp(x) == _t_exp(x)


def _around(x0: float, span: int) -> list[float]:
    out = [x0]
    for d in (math.inf, -math.inf):
        x = x0
        for _ in range(span):
            x = math.nextafter(x, d)
            out.append(x)
    return out


def ratio_ties(bound: float, span: int = 48) -> list[float]:
    """l values on a ratio bound: l == log(bound), and every l != log(bound) nearby with
    exp(l) == bound exactly (in torch and in pmath): exp(log 2 + 1 ulp) == 2.0."""
    l0 = math.log(bound)
    out = [l0] if _agree(l0) else []
    out += [x for x in _around(l0, span)[1:] if _agree(x) and crmath.exp(x) == bound]
    return out


def _search(fn_t, fn_n, target: float, x0: float, span: int = 4000) -> list[float]:
    """x near x0 where both the torch and the numpy form of a formula give exactly target."""
    hits = []
    for x in _around(x0, span):
        xt = torch.tensor(x, dtype=torch.float64)
        if fn_t(xt).item() == target and float(fn_n(np.float64(x))) == target:
            hits.append(x)
            if len(hits) >= 2:
                break
    return hits


def dp_ties(eps: float) -> list[tuple[float, float]]:
    """(lp, lq) with exp(lp) - exp(lq) == eps exactly: p == eps at q == 0 (lq = -1000), and
    pairs of two confident tokens where exp(lp) - exp(lq) == eps while the stable |dp|
    differs in the last bit (or the reverse)."""
    out = []
    for x in _around(math.log(eps), 64):
        if _agree(x) and crmath.exp(x) == eps:
            out += [(x, -1000.0), (-1000.0, x)]
            break
    rng = np.random.default_rng(int(eps * 1000))
    for q in rng.uniform(0.05, 0.9 - eps, 40):
        lq = math.log(q)
        for x in _around(math.log(q + eps), 6):
            prob = crmath.exp(x) - crmath.exp(lq)
            t = _t_exp(x) - _t_exp(lq)
            stable = crmath.exp(x) * -crmath.expm1(lq - x)
            if prob == t and (prob == eps) != (stable == eps):
                out.append((x, lq))
                break
        if len(out) >= 6:
            break
    return out


def edge_log() -> pl.DataFrame:
    rows: list[tuple] = []  # (lp, lq, step, sample_id, advantage, loss_mask)

    def seq(pairs, step, sid, adv, mask=True):
        for lp, lq in pairs:
            rows.append((lp, lq, step, sid, adv, mask))

    def pair(l):  # noqa: E741 - (lp, lq) <= 0 with lp - lq == l exactly
        return (l, 0.0) if l <= 0 else (0.0, -l)

    # step 0: token ties, one copy per advantage sign (A == 0 included)
    token = []
    for b in (0.2, 0.5, 2.0, 3.0, 5.0, 1.2, 0.8, 1.28):
        token += [pair(x) for x in ratio_ties(b)]
    token += [pair(-math.log(0.6)), pair(-math.log(1.6))]  # verl token_k1 '0.6_1.6'
    for eps in (0.3, 0.1, 0.2, 0.15):
        token += dp_ties(eps)
    token += [pair(1.0), pair(-1.0)]  # k2 == 0.5 exactly
    k3 = _search(lambda x: torch.exp(x) - 1.0 - x, lambda x: (crmath.exp(x) - 1.0) - x, 0.5, 0.8577)
    token += [pair(x) for x in k3]
    extreme = [
        (0.0, 0.0),  # p = q = 1
        (0.0, -0.1),
        (-0.1, 0.0),
        (-1000.0, -0.5),  # p = 0
        (-0.5, -1000.0),  # q = 0
        (0.0, -25.0),  # |l| > 20
        (-25.0, 0.0),
        (0.0, -700.0),
        (-700.0, 0.0),
        (-1e-12, 0.0),
    ]
    for k, adv in enumerate((1.0, -1.0, 0.0)):
        seq(token, 0, k, adv)
        seq(extreme, 0, 10 + k, adv)
    # step 1: one-token sequences on the sequence rules' bounds, and a few longer ones
    one = []
    for b in (2.0, 3.0, 5.0, 0.5, 0.99, 1.01, 0.1, 10.0):
        one += ratio_ties(b)
    one += [-math.log(0.5), -math.log(2.0), -math.log(0.999), -math.log(1.001)]  # verl k1
    one += [x for x in _around(math.log(1.5), 8) if _agree(x) and crmath.exp(x) == 1.5]
    one += _search(lambda x: 0.5 * x * x, lambda x: 0.5 * x * x, 2.5, math.sqrt(5.0), 200)
    one += [25.0, -25.0, 0.0]
    sid = 100
    for k, x in enumerate(one):
        seq([pair(x)], 1, sid, (1.0, -1.0, 0.0)[k % 3])
        sid += 1
    seq([(-1.0, -0.5)], 1, sid, -1.0)  # opsm: lq - lp == 0.5 exactly, A < 0
    seq([(-1.0, -0.5)], 1, sid + 1, 1.0)
    # exp(G) = 0.9990003: inside [0.999, 1.001], outside verl's [1/1.001, 1/0.999]
    g = math.log(0.9990003)
    seq([pair(g)] * 84, 1, sid + 2, 1.0)
    seq([(-0.3, -0.2), (-0.2, -0.3)], 1, sid + 3, 0.0, mask=False)  # empty: no loss token
    # step 2: one l = -25 among 1,999 zeros (verl's k3 clamp: mean 0.0095 vs 0.012)
    seq([(-25.0, 0.0)] + [(-0.5, -0.5)] * 1999, 2, 0, -1.0)
    # step 3: every token's l^2 >= tau: the bare m2po masks all, AReaL all but one
    seq([pair(1.0), pair(-1.0), pair(0.5)], 3, 0, 1.0)
    seq([pair(0.75), pair(-2.0)], 3, 1, -1.0)
    # step 4: l = 0.25 and x with (0.0625 + x^2) / 2 == 0.04 exactly: the mean from the
    # largest token on is tau itself (masked: >=), the rest's mean is below
    x = math.sqrt(0.08 - 0.0625)
    while (x * x + 0.0625) / 2 != 0.04:
        x = math.nextafter(x, math.inf)
    seq([pair(0.25), pair(-x)], 4, 0, 1.0)
    lp, lq, step, sid_, adv, mask = zip(*rows, strict=True)
    return canonical_log(lp, lq, step=step, sample_id=sid_, advantage=adv, loss_mask=mask)


@pytest.fixture(scope="module")
def edge_path(tmp_path_factory):
    return write_log(tmp_path_factory.mktemp("edge") / "edge.parquet", edge_log())


@pytest.fixture(scope="module")
def logs(edge_path):
    return {"golden": GOLDEN_LOG, "edge": edge_path}


# ----------------------------------------------------------------------------- helpers


def preset_rule(spec: str, precision: str = "float64"):
    rule = parse_rule(spec)
    extra = fw.EXTRA_VALUES.get(spec)
    if extra:
        rule = rule.replace(**extra)
    return rule.replace(precision=precision)


def ref_values(spec: str, rule) -> dict:
    v = dict(rule.values())
    if spec in fw.VERL_K1_SPECS:
        v["_spec"] = fw.VERL_K1_SPECS[spec]
    return v


def engine_counts(path, rule, precision: str = "float64") -> dict:
    res = engine.sweep([path], rules=[rule], by="step", precision=precision)
    t = res.table
    col = "truncated_tokens" if rule.kind == "weight" else "masked_tokens"
    per_step = {int(s): int(c) for s, c in zip(t["step"], t[col], strict=True)}
    out = {"total": sum(per_step.values()), "per_step": per_step}
    if rule.kind != "weight":  # a weight rule masks no sequence
        out["sequences"] = int(t["masked_sequences"].sum())
    return out


def reference_counts(L: fw.Log, masked: np.ndarray, weight: bool) -> dict:
    per_step = {int(s): int(masked[L.step == s].sum()) for s in np.unique(L.step)}
    out = {"total": int(masked.sum()), "per_step": per_step}
    if not weight:
        out["sequences"] = int(np.unique(L.seq[masked]).size) if L.seq is not None else 0
    return out


_CACHE: dict = {}


def framework(spec: str, path, dtype=torch.float64) -> dict:
    key = (spec, str(path), dtype)
    if key not in _CACHE:
        df = pl.read_parquet(path)
        L = fw.Log(df)
        rule = preset_rule(spec)
        fn, _ = fw.REFERENCES[spec]
        masked = fn(L, ref_values(spec, rule), dtype)
        _CACHE[key] = reference_counts(L, masked, rule.kind == "weight")
    return _CACHE[key]


BACKENDS = ["numpy", "numba"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "numba" and fast.backend() == "numpy":
        pytest.skip("numba is not installed")
    with fast.use_backend(request.param):
        yield request.param


# ----------------------------------------------------------------------------- the catalogue


def test_every_preset_has_a_reference():
    """Each preset is mirrored from its framework's code or (no code) checked against the
    RULES.md brute force; the arithmetic presets name the file and commit they follow."""
    specs = {f"{name}@{p}" for name, cls in REGISTRY.items() for p in cls.presets}
    assert specs == set(fw.REFERENCES) | set(fw.DOCS_ONLY)
    for name, cls in REGISTRY.items():
        for p, arith in cls.preset_arith.items():
            if arith:
                assert "@" in cls.preset_sources[p], (name, p)


@pytest.mark.parametrize("spec", sorted(fw.REFERENCES))
@pytest.mark.parametrize("which", ["golden", "edge"])
def test_preset_equals_its_framework(spec, which, logs, backend):
    path = logs[which]
    got = engine_counts(path, preset_rule(spec))
    want = framework(spec, path)
    assert got == want, (spec, which, fw.REFERENCES[spec][1])


@pytest.mark.parametrize("spec", fw.DOCS_ONLY)
@pytest.mark.parametrize("which", ["golden", "edge"])
def test_docs_only_preset_equals_the_rules_md_brute_force(spec, which, logs, backend):
    path = logs[which]
    rule = preset_rule(spec)
    df = pl.read_parquet(path)
    exp = brute.evaluate(df, rule.name, rule.values())[None]
    got = engine.sweep([path], rules=[rule]).table.row(0, named=True)
    col = "truncated_tokens" if rule.kind == "weight" else "masked_tokens"
    assert got[col] == exp[col], spec
    assert got["masked_sequences"] == exp["masked_sequences"], spec


# ----------------------------------------------------------------------------- the fixes


def _masked(path, spec_or_rule) -> int:
    rule = parse_rule(spec_or_rule) if isinstance(spec_or_rule, str) else spec_or_rule
    row = engine.sweep([path], rules=[rule]).table.row(0, named=True)
    return row["truncated_tokens" if rule.kind == "weight" else "masked_tokens"]


def test_dppo_kl_verl_sends_a_zero_to_the_low_side_and_does_not_clamp(logs):
    """Point 1: verl's dppo_kl masks more than the bare rule at the same thresholds, by the
    A == 0 tokens its low-side test takes, and differs at p = 1 (no clamp, +1e-8)."""
    path = logs["golden"]
    bare = _masked(path, "dppo-kl:low=0.05,high=0.05,clamp=1e-6")
    verl = _masked(path, "dppo-kl@verl")
    assert bare == 622  # tests/data/golden_expected.csv, unchanged
    assert verl == framework("dppo-kl@verl", path)["total"]
    assert verl > bare


def test_geo_mis_verl_inverts_its_bands(logs):
    """Point 2: '0.999_1.001' keeps exp(G) in [1/1.001, 1/0.999]: an 84-token sequence at
    exp(G) = 0.9990003 is masked by verl (and by the preset), kept by the literal band."""
    rule = parse_rule("geo-mis@verl")
    assert rule.low == pytest.approx(1 / 1.001) and rule.high == pytest.approx(1 / 0.999)
    g = math.log(0.9990003)
    df = canonical_log([g] * 84, [0.0] * 84, step=0, sample_id=[0] * 84)
    path = write_log(logs["edge"].parent / "geo.parquet", df)
    res = engine.sweep([path], rules=["geo-mis@verl", "geo-mis:low=0.999,high=1.001"])
    assert any("1/hi <= exp(G) <= 1/lo" in w for w in res.warnings)
    got = dict(zip(res.table["spec"], res.table["masked_tokens"], strict=True))
    assert got == {
        "geo-mis@verl:low=0.9990009990009991,high=1.001001001001001": 84,
        "geo-mis:low=0.999,high=1.001": 0,
    }
    assert framework("geo-mis@verl", path)["total"] == 84


def test_verl_clamps_l_before_k2_and_k3(logs):
    """Point 3: one l = -25 among 1,999 zeros: mean k3 0.0120 unclamped (masked at 0.01),
    0.0095 with verl's clamp (kept)."""
    path = logs["edge"]
    t = engine.sweep([path], rules=["seq-mean-k3:hi=0.01", "seq-mean-k3@verl"], by="step").table
    s2 = t.filter(pl.col("step") == 2).sort("spec")
    bare = s2.filter(~pl.col("spec").str.contains("@verl"))["masked_tokens"].item()
    verl = s2.filter(pl.col("spec").str.contains("@verl"))["masked_tokens"].item()
    assert (bare, verl) == (2000, 0)
    k2 = engine.sweep([path], rules=["token-k2@verl:hi=250", "token-k2:hi=250"]).table
    assert sorted(k2["masked_tokens"].to_list()) != [0, 0]  # l = 25: k2 312.5, clamped 200


def test_m2po_areal_keeps_one_token_when_no_tail_fits(logs):
    """Point 5: a step where every token's l^2 >= tau: the bare rule masks all 5, AReaL 4;
    a step whose mean from its largest token on is exactly tau: both mask that token (>=)."""
    t = engine.sweep([logs["edge"]], rules=["m2po@paper", "m2po@areal"], by="step").table
    get = {
        (r["spec"].startswith("m2po@areal"), r["step"]): r["masked_tokens"]
        for r in t.iter_rows(named=True)
    }
    assert (get[(False, 3)], get[(True, 3)]) == (5, 4)
    assert (get[(False, 4)], get[(True, 4)]) == (1, 1)


def test_ratio_space_ties_decide_as_the_frameworks_do(logs):
    """Point 6: at l = log 2 + 1 ulp, exp(l) == 2.0: verl's TIS (weight > 2) does not
    truncate it, the bare rule's log-space test (l > log 2) does."""
    x = math.nextafter(math.log(2.0), math.inf)
    assert crmath.exp(x) == 2.0 == _t_exp(x)
    df = canonical_log([0.0], [-x], step=0, sample_id=[0])
    path = write_log(logs["edge"].parent / "tie.parquet", df)
    assert _masked(path, "tis:cap=2") == 1
    assert _masked(path, "tis@verl") == 0
    assert _masked(path, "tis@trl:cap=2") == 0


def test_presets_stay_on_the_fast_path_where_their_arithmetic_allows():
    """A preset whose arithmetic equals the stable form away from its thresholds (ratio-space
    bounds, exp(lp) - exp(lq), prime-rl's / AReaL's binary KL) is compiled with windows wide
    enough for the two forms' difference; dppo-kl@verl (another function: +1e-8, no clamp),
    float32 and the k2/k3 clamps take the simple path, job by job."""
    from mismatch_replay.engine import Job

    def slot(spec, precision="float64"):
        rule = preset_rule(spec, precision)
        param = next(p.name for p in rule.params if p.threshold)
        value = float(getattr(rule, param) or 0.5)
        return fast.Program([Job(rule, param, np.array([value]))]).slot[0]

    for spec in ("icepop@verl", "icepop@prime-rl", "ipo@prime-rl", "dppo-tv@verl", "tis@trl"):
        assert slot(spec) >= 0, spec
    for spec in ("kpop@prime-rl", "kpop@areal", "cispo@prime-rl", "token-mis@trl"):
        assert slot(spec) >= 0, spec
    for spec in ("dppo-kl@verl", "token-k3@verl", "token-mis@verl-k1"):
        assert slot(spec) == -1, spec
    assert slot("icepop@verl", "float32") == -1


@pytest.mark.slow  # a million tokens of every kind
def test_preset_windows_cover_the_framework_forms():
    """The windows' premise, on a million tokens of every kind (confident, rare, near the
    clamps): prime-rl's binary-KL form is within FUZZY_KL / c of the stable one, and
    exp(lp) - exp(lq) within FUZZY_PROB of the stable |dp|."""
    from mismatch_replay.rules import binary_kl, binary_kl_prob

    rng = np.random.default_rng(0)
    n = 250_000
    lp = np.concatenate([-rng.exponential(s, n) for s in (1.0, 1e-7, 1e-3)] + [[0.0, -800.0]])
    lq = np.concatenate([-rng.exponential(s, n) for s in (1e-7, 1.0, 1e-3)] + [[-800.0, 0.0]])
    for c in (1e-6, 1e-8):
        p = np.clip(crmath.exp(lp), c, 1 - c)
        q = np.clip(crmath.exp(lq), c, 1 - c)
        a = np.fmax(binary_kl_prob(p, q), binary_kl_prob(q, p))
        b = np.maximum(binary_kl(lp, lq, c), binary_kl(lq, lp, c))
        assert np.abs(a - b).max() < 0.01 * token.FUZZY_KL / c
    hi, lo = np.maximum(lp, lq), np.minimum(lp, lq)
    stable = pmath.exp(hi) * -pmath.expm1(lo - hi)
    prob = np.abs(crmath.exp(lp) - crmath.exp(lq))
    assert np.abs(prob - stable).max() < 0.1 * token.FUZZY_PROB


# ----------------------------------------------------------------------------- float32

F32_SPECS = [
    "kpop@areal",
    "kpop@prime-rl",
    "icepop@areal",
    "icepop@verl",
    "ipo@prime-rl",
    "dppo-kl@verl",
    "token-mis@trl",
    "tis@verl",
    "geo-mis@skyrl",
    "seq-mis@trl",
    "m2po@areal",
]


@pytest.mark.parametrize("spec", F32_SPECS)
@pytest.mark.parametrize("which", ["golden", "edge"])
def test_float32_replay_equals_the_framework_in_float32(spec, which, logs):
    path = logs[which]
    got = engine_counts(path, preset_rule(spec), precision="float32")
    want = framework(spec, path, torch.float32)
    assert got["total"] == want["total"], (spec, which)
    assert got["per_step"] == want["per_step"], (spec, which)


def test_float32_kpop_areal_masks_the_nan_tokens(logs):
    """Point 7: AReaL's binary KL in float32 turns p = 1 into NaN (1 - 1e-8 rounds to 1):
    NaN <= upper is False, so the token is masked."""
    path = logs["edge"]
    f64 = engine_counts(path, preset_rule("kpop@areal"))["total"]
    f32 = engine_counts(path, preset_rule("kpop@areal"), precision="float32")["total"]
    assert f32 > f64
    assert np.float32(1.0 - 1e-8) == np.float32(1.0)


# ----------------------------------------------------------------------------- properties


def _same_exp(df: pl.DataFrame) -> pl.DataFrame:
    """The rows where torch's exp and pmath's agree on lp, lq and l: at a tie in exp's last
    bit (l = log 3: pmath gives 3.0, the C library and torch 3.0000000000000004) the decision
    depends on the machine's exp, in the frameworks too (their GPU's exp is another)."""
    lp = df["trainer_logprob"].to_numpy()
    lq = df["inference_logprob"].to_numpy()
    keep = np.ones(df.height, dtype=bool)
    for x in (lp, lq, lp - lq, np.clip(lp - lq, -20.0, 20.0)):
        keep &= crmath.exp(x) == torch.exp(torch.tensor(x, dtype=torch.float64)).numpy()
    return df.filter(pl.Series(keep))


@settings(max_examples=60)
@given(df=conftest.logs(), spec=st.sampled_from(sorted(fw.REFERENCES)))
def test_presets_equal_their_frameworks_on_random_logs(df, spec):
    df = _same_exp(df)
    if not df["loss_mask"].any():
        return
    with conftest.log_file(df) as path:
        L = fw.Log(df)
        rule = preset_rule(spec)
        fn, src = fw.REFERENCES[spec]
        want = reference_counts(
            L, fn(L, ref_values(spec, rule), torch.float64), rule.kind == "weight"
        )
        for backend in ("numpy", "numba"):
            with fast.use_backend(backend):
                assert engine_counts(path, rule) == want, (spec, backend, src)


def test_m2po_presets_on_a_step_larger_than_the_store_chunk(logs, monkeypatch):
    """A step over the m2po store's chunk is resolved streamed; AReaL's keep-last and the
    float32 replay resolve it whole, with the same counts as in memory."""
    path = logs["edge"]
    want = {
        p: engine_counts(path, preset_rule("m2po@areal"), precision=p)
        for p in ("float64", "float32")
    }
    bare = engine_counts(path, preset_rule("m2po@paper"))
    monkeypatch.setenv(engine.M2PO_MEMORY_ENV, str(1024 * 300 / 2**20))  # chunk: 1024 tokens
    for p, counts in want.items():
        assert engine_counts(path, preset_rule("m2po@areal"), precision=p) == counts
    assert engine_counts(path, preset_rule("m2po@paper")) == bare
    assert want["float64"] == framework("m2po@areal", path)


@pytest.mark.slow  # a whole report, twice the precision
def test_precision_reaches_choose_compare_and_the_report(tmp_path):
    """--precision float32 as a library parameter: sweep, choose, compare, the report; a
    report line where float32 and float64 disagree by more than the threshold."""
    from mismatch_replay import analysis
    from mismatch_replay.errors import UsageError
    from mismatch_replay.viz import jobs

    with pytest.raises(UsageError, match="float32"):
        engine.sweep([GOLDEN_LOG], rules=["ipo"], precision="float16")
    f32 = framework("kpop@areal", GOLDEN_LOG, torch.float32)["total"]
    res = analysis.compare([GOLDEN_LOG], "kpop@areal", "icepop@areal", precision="float32")
    assert res.masked_a == f32
    rows = analysis.choose([GOLDEN_LOG], None, ["kpop@areal"], bootstrap=0, precision="float32")
    assert rows[0].masked_tokens == f32
    check = analysis.precision_check([GOLDEN_LOG], ["kpop@areal", "icepop@areal"])
    flagged = [r.spec for r in check.rows if r.flagged]
    assert flagged == ["kpop@areal:phi=2,clamp=1e-08"] and len(check.lines) == 1
    assert "float32" in check.lines[0] and f"{f32:,}" in check.lines[0]
    assert [(n.float32, n.exact) for n in check.notes] == [
        (f32, framework("kpop@areal", GOLDEN_LOG)["total"])
    ]
    page = jobs.report(
        [GOLDEN_LOG], tmp_path / "r", "cmd", ["kpop@areal"], bootstrap=0, precision="float32"
    ).read_text()
    assert "float32 vs float64" in page and html.escape(check.lines[0]) in page
