"""veto@skyrl: SkyRL's outlier mask (compute_outlier_token_mask, off_policy_correction_utils.py
@ a956457, line 114) with its low threshold, against a re-run of SkyRL's arithmetic in torch
(tests/frameworks.py skyrl_outlier): a sequence is masked when any loss token has
safe_exp_delta(l) = exp(clamp(l, -20, 20)) < low, the ratio in float32 (SkyRL's) or float64
(--precision float64). On random logs, and on the tokens whose ratio lies nearest the
bound on either side (exp(l) cannot land on 1e-4 itself: near l = -9.2 one ulp of l moves
the ratio by about 13 of its ulps in float32)."""

from __future__ import annotations

import frameworks as fw
import numpy as np
import torch
from conftest import canonical_log, log_file, logs, write_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import crmath, engine
from mismatch_replay.rules import parse_rule

DT = {"float32": torch.float32, "float64": torch.float64}
NP = {"float32": np.float32, "float64": np.float64}


def counts(path, rule, precision):
    t = engine.sweep([path], rules=[rule], by="step", precision=precision).table
    return {int(s): int(c) for s, c in zip(t["step"], t["masked_tokens"], strict=True)}


def reference(df, v, precision):
    L = fw.Log(df)
    masked = fw.skyrl_outlier(L, {"v": v}, DT[precision])
    return {int(s): int(masked[L.step == s].sum()) for s in np.unique(L.step)}


def test_the_preset():
    rule = parse_rule("veto@skyrl")
    assert (rule.v, rule.arith, rule.precision) == (1e-4, "ratio-clamp", "float32")
    assert "compute_outlier_token_mask" in type(rule).preset_sources["skyrl"]


def _torch_exp_is_correctly_rounded(x: np.ndarray, precision: str) -> np.ndarray:
    """Where torch's exp is the correctly rounded one the engine uses (crmath)."""
    t = torch.exp(torch.tensor(x, dtype=torch.float64).to(DT[precision])).numpy()
    return t == crmath.exp(x.astype(np.float64)).astype(NP[precision])


@settings(max_examples=40, deadline=None)
@given(
    df=logs(),
    v=st.sampled_from([1e-4, 0.05, 0.5, 0.9]),
    precision=st.sampled_from(["float32", "float64"]),
)
def test_equals_skyrl_on_random_logs(df, v, precision):
    lp = df["trainer_logprob"].to_numpy().astype(NP[precision])
    lq = df["inference_logprob"].to_numpy().astype(NP[precision])
    l = np.clip(lp - lq, -20, 20)  # noqa: E741
    if not _torch_exp_is_correctly_rounded(l, precision).all() or not df["loss_mask"].any():
        return
    rule = parse_rule("veto@skyrl").replace(v=v)
    with log_file(df) as path:
        assert counts(path, rule, precision) == reference(df, v, precision), (v, precision)


def _near_bound(v: float, precision: str, k: int = 400) -> np.ndarray:
    """l around log(v), k ulps either side, whose exp torch rounds correctly."""
    npdt = NP[precision]
    x = npdt(np.log(v))
    below = [x]
    above = [x]
    for _ in range(k):
        below.append(np.nextafter(below[-1], npdt(-np.inf)))
        above.append(np.nextafter(above[-1], npdt(np.inf)))
    ls = np.unique(np.array(below + above, dtype=npdt)).astype(np.float64)
    return ls[_torch_exp_is_correctly_rounded(ls, precision)]


def test_equals_skyrl_on_its_ties(tmp_path):
    """Each near-bound token alone in its sequence, and each inside a sequence of in-band
    tokens (one outlier vetoes them all); the nearest ratios below and above the bound
    are among them; in each precision, its preset default and 0.5 (exp(l) = 0.5 exactly)."""
    for precision in ("float32", "float64"):
        for v in (1e-4, 0.5):
            ls = _near_bound(v, precision)
            r = crmath.exp(ls).astype(NP[precision])
            bound = NP[precision](v)
            assert (r < bound).any() and (r >= bound).any()
            lp, lq, sid, step = [], [], [], []
            for i, x in enumerate(ls):
                for j, (p, q) in enumerate([(x, 0.0), (0.0, 0.0), (-0.1, 0.0)]):
                    lp.append(float(p) if j == 0 else p)
                    lq.append(q)
                    sid.append(i)
                    step.append(i % 7)
            extremes = [(-1000.0, 0.0), (0.0, -1000.0), (-25.0, 0.0), (0.0, 0.0)]
            for k, (p, q) in enumerate(extremes):
                lp.append(p)
                lq.append(q)
                sid.append(len(ls) + k)
                step.append(0)
            df = canonical_log(lp, lq, step=step, sample_id=sid)
            path = write_log(tmp_path / f"ties-{precision}-{v}.parquet", df)
            rule = parse_rule("veto@skyrl").replace(v=v)
            want = reference(df, v, precision)
            assert sum(want.values()) > 0
            prec = None if precision == "float32" else "float64"
            assert counts(path, rule, prec) == want, (precision, v)
