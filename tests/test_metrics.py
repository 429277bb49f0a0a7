"""Mismatch metrics (k1, k2, k3 KL estimators, |dp|, chi2, ppl ratio, Pearson, entropy) against
float64 brute force, overall and per group, including the float64 accuracy of k3 at
bf16-scale mismatch (|l| ~ 1e-4), where float32 or exp(l) - 1 - l is rounding noise.
The core checks run on both engine backends (fused numba kernels and plain numpy)."""

from __future__ import annotations

import math

import brute
import numpy as np
import polars as pl
import pytest
from conftest import canonical_log, random_log, write_log

from mismatch_replay import engine

CLAMP = 20.0


def _metrics(tmp_path, df: pl.DataFrame, by=None) -> pl.DataFrame:
    return engine.sweep([write_log(tmp_path / "m.parquet", df)], rules=[], by=by).metrics


def _k3_series(x: np.ndarray) -> np.ndarray:
    """k3 = e^l - 1 - l by its Taylor series in l = x (|l| << 1): no cancellation at all."""
    return x * x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x * (1 / 720 + x / 5040)))))


def _bf16_scale_log(n: int = 20_000, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    lq = -rng.exponential(1.0, n)
    lp = np.minimum(lq + rng.normal(0.0, 1e-4, n), 0.0)
    return canonical_log(lp, lq, step=0, sample_id=np.arange(n) // 100)


def test_kl_k3_is_float64_accurate_at_bf16_scale(tmp_path, kernel_backend):
    df = _bf16_scale_log()
    m = _metrics(tmp_path, df)
    got = m["kl_k3"].item()
    lp = df["trainer_logprob"].to_numpy()
    lq = df["inference_logprob"].to_numpy()
    l = lp - lq  # noqa: E741
    assert np.abs(l).max() < 1e-3
    want = brute.kl_k3_mean(lp, lq)  # expm1(l) - l, math.fsum
    series = math.fsum(_k3_series(l).tolist()) / l.shape[0]  # independent of expm1
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got == pytest.approx(series, rel=1e-12, abs=0)
    # the tolerance means something: the careless computations are far off
    naive64 = math.fsum((np.exp(l) - 1.0 - l).tolist()) / l.shape[0]
    l32 = l.astype(np.float32)
    naive32 = float(np.mean(np.exp(l32) - np.float32(1.0) - l32, dtype=np.float32))
    assert abs(naive64 - series) / series > 1e-12
    assert abs(naive32 - series) / series > 1e-2
    # and k3 ~ l^2 / 2 = k2 at this scale
    assert m["kl_k2"].item() == pytest.approx(got, rel=1e-3)


def test_kl_k3_on_float32_columns(tmp_path, kernel_backend):
    """Logs often store float32 log-probs: l must be formed in float64 from those values."""
    df = _bf16_scale_log(5_000, seed=1).with_columns(
        pl.col("trainer_logprob").cast(pl.Float32), pl.col("inference_logprob").cast(pl.Float32)
    )
    got = _metrics(tmp_path, df)["kl_k3"].item()
    lp = df["trainer_logprob"].cast(pl.Float64).to_numpy()
    lq = df["inference_logprob"].cast(pl.Float64).to_numpy()
    assert got == pytest.approx(brute.kl_k3_mean(lp, lq), rel=1e-12, abs=0)


def _brute_metrics(df: pl.DataFrame) -> dict:
    """Every metric by hand in float64 on the loss tokens of df. The framework-named ones
    the way the frameworks compute them: k3 = exp(l) - l - 1 unclamped (prime-rl's
    mismatch_kl, loss.py; verl's rollout_corr/k3_kl, rollout_corr_helper.py), the stds
    with torch.std (Bessel; prime-rl's compute_stats, verl's rollout_probs_diff_std)."""
    import torch

    L = brute.Log(df)
    n = L.n
    lc = np.clip(L.l, -CLAMP, CLAMP)
    lt = torch.tensor(L.l, dtype=torch.float64)
    k3t = torch.exp(lt) - lt - 1
    k3 = [math.expm1(x) - x for x in L.l.tolist()]
    mean = lambda xs: math.fsum(xs) / n  # noqa: E731
    k3m = mean(k3)
    dpm = mean(L.abs_dp.tolist())
    p, q = np.exp(L.lp), np.exp(L.lq)
    dpt = torch.abs(torch.exp(torch.tensor(L.lp)) - torch.exp(torch.tensor(L.lq)))
    out = {
        "tokens": n,
        "kl_k1": mean((-L.l).tolist()),
        "kl_k2": mean((L.l * L.l / 2).tolist()),
        "kl_k3": k3m,
        "kl_k3_std": float(k3t.std()),
        "kl_k3_max": float(k3t.max()),
        "abs_dp_mean": dpm,
        "abs_dp_std": float(dpt.std()),
        "abs_dp_max": float(L.abs_dp.max()),
        "chi2_token": mean(np.exp(2 * lc).tolist()) - 1.0,
        "ppl_ratio": math.exp(mean((-L.l).tolist())),
        "probs_pearson": float(np.corrcoef(p, q)[0, 1]),
    }
    assert out["kl_k3"] == pytest.approx(float(k3t.mean()), rel=1e-12)
    return out


TOL = {"kl_k3_std": 1e-7, "abs_dp_std": 1e-7, "probs_pearson": 1e-9, "chi2_token": 1e-9}


def _check(row: dict, want: dict, what: str) -> None:
    for k, v in want.items():
        assert row[k] == pytest.approx(v, rel=TOL.get(k, 1e-11), abs=1e-300), (what, k)


def test_metrics_match_brute_force(tmp_path, kernel_backend):
    df = random_log(np.random.default_rng(21), steps=3, seqs=6, max_len=30, mismatch=0.2)
    m = _metrics(tmp_path, df)
    assert m.height == 1
    _check(m.row(0, named=True), _brute_metrics(df), "all")


@pytest.mark.parametrize("by", ["step", "env"])
def test_metrics_per_group_match_brute_force(tmp_path, by):
    df = random_log(np.random.default_rng(22), steps=4, seqs=5, max_len=30)
    m = _metrics(tmp_path, df, by=by)
    kept = df.filter(pl.col("loss_mask"))
    groups = sorted(set(kept[by].to_list()))
    assert m[by].to_list() == groups
    for row in m.iter_rows(named=True):
        _check(row, _brute_metrics(kept.filter(pl.col(by) == row[by])), f"{by}={row[by]}")
    assert m["tokens"].sum() == kept.height


def test_metrics_ignore_loss_mask_false_rows(tmp_path):
    df = random_log(np.random.default_rng(23), steps=2, seqs=4)
    m = _metrics(tmp_path, df).row(0, named=True)
    kept = df.filter(pl.col("loss_mask"))
    assert m["tokens"] == kept.height < df.height
    _check(m, _brute_metrics(kept), "kept")


def test_known_values_on_a_tiny_log(tmp_path):
    # l = log 2 and log(1/2): k1 mean 0, k2 = (log 2)^2 / 2,
    # k3 = ((2 - 1 - log 2) + (0.5 - 1 + log 2)) / 2 = 0.25
    lp = [0.0, math.log(0.5)]
    lq = [math.log(0.5), 0.0]
    m = _metrics(tmp_path, canonical_log(lp, lq)).row(0, named=True)
    assert m["tokens"] == 2
    assert m["kl_k1"] == pytest.approx(0.0, abs=1e-16)
    assert m["kl_k2"] == pytest.approx(math.log(2) ** 2 / 2, rel=1e-14)
    assert m["kl_k3"] == pytest.approx(0.25, rel=1e-14)
    assert m["kl_k3_max"] == pytest.approx(1 - math.log(2), rel=1e-14)
    assert m["abs_dp_mean"] == pytest.approx(0.5, rel=1e-14)
    assert m["chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-14)
    assert m["ppl_ratio"] == pytest.approx(1.0, rel=1e-14)
    assert m["probs_pearson"] == pytest.approx(-1.0, rel=1e-12)


def test_extreme_ratios_follow_the_frameworks_and_give_no_nan(tmp_path, kernel_backend):
    """l = +700 and -700: k3 unclamped, as prime-rl's mismatch_kl and verl's k3_kl are
    (finite here: expm1(700) < 1.8e308; its square overflows, so the std is inf -> null,
    never NaN); chi2_token clamps l to +-20 first, as verl does."""
    df = canonical_log([0.0, -700.0, -0.1], [-700.0, 0.0, -0.1], step=0, sample_id=[0, 1, 2])
    m = _metrics(tmp_path, df).row(0, named=True)
    for k in ("kl_k1", "kl_k2", "kl_k3", "kl_k3_max", "chi2_token", "abs_dp_mean"):
        assert m[k] is not None and math.isfinite(m[k]), k
    assert m["kl_k3_std"] is None
    k3 = [math.expm1(700.0) - 700.0, math.expm1(-700.0) + 700.0, 0.0]
    assert m["kl_k3"] == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert m["kl_k3_max"] == pytest.approx(k3[0], rel=1e-12)
    chi2 = (math.exp(40.0) + math.exp(-40.0) + 1.0) / 3 - 1.0
    assert m["chi2_token"] == pytest.approx(chi2, rel=1e-12)
    assert m["kl_k1"] == pytest.approx(0.0, abs=1e-12)  # k1 is not clamped: +-700 cancel
    assert m["kl_k2"] == pytest.approx(2 * 700.0**2 / 2 / 3, rel=1e-12)
    assert m["abs_dp_max"] == pytest.approx(1.0, rel=1e-12)


def test_k3_metrics_are_unclamped_as_on_the_dashboards(tmp_path, kernel_backend):
    """Issue 17: one token at l = -25 among 1,999 at l = 0: prime-rl's mismatch_kl/all/mean
    and verl's rollout_corr/k3_kl are 0.0120 (k3 = e^-25 + 24); a clamp at -20 gave 0.0095."""
    import torch

    lq = np.zeros(2000)
    lp = np.zeros(2000)
    lp[7] = -25.0
    df = canonical_log(lp, lq, step=0, sample_id=np.arange(2000) // 100)
    m = _metrics(tmp_path, df).row(0, named=True)
    lt = torch.tensor(lp - lq, dtype=torch.float64)
    k3 = torch.exp(lt) - lt - 1  # prime-rl compute_importance_ratio_and_mismatch_kl
    assert m["kl_k3"] == pytest.approx(float(k3.mean()), rel=1e-12)
    assert m["kl_k3"] == pytest.approx(0.0120, abs=1e-6)
    assert m["kl_k3_max"] == pytest.approx(float(k3.max()), rel=1e-12)
    assert m["kl_k3_std"] == pytest.approx(float(k3.std()), rel=1e-9)


@pytest.mark.parametrize("n", [2, 5, 12])
def test_std_metrics_are_torch_std_with_bessel(tmp_path, kernel_backend, n):
    """prime-rl's compute_stats (tensors.std()) and verl's rollout_probs_diff_std
    (torch.std) divide by n - 1: on 5 tokens the population std is 11% lower."""
    import torch

    rng = np.random.default_rng(n)
    lq = np.log(rng.uniform(0.05, 0.95, n))
    lp = np.minimum(lq + rng.normal(0.0, 0.3, n), 0.0)
    m = _metrics(tmp_path, canonical_log(lp, lq)).row(0, named=True)
    l = torch.tensor(lp - lq, dtype=torch.float64)  # noqa: E741
    k3 = torch.exp(l) - l - 1
    dp = torch.abs(torch.exp(torch.tensor(lp)) - torch.exp(torch.tensor(lq)))
    assert m["kl_k3_std"] == pytest.approx(float(k3.std()), rel=1e-9)
    assert m["abs_dp_std"] == pytest.approx(float(dp.std()), rel=1e-9)
    pop = float(dp.std(correction=0))
    assert abs(m["abs_dp_std"] / pop - math.sqrt(n / (n - 1))) < 1e-9


def test_std_of_one_token_is_null_as_torch_std_is_nan(tmp_path, kernel_backend):
    m = _metrics(tmp_path, canonical_log([-0.2], [-0.3])).row(0, named=True)
    assert m["kl_k3_std"] is None and m["abs_dp_std"] is None
    assert m["kl_k3"] is not None


def test_entropy_metrics(tmp_path):
    df = random_log(np.random.default_rng(24), steps=2, seqs=3)
    rng = np.random.default_rng(0)
    ent = rng.uniform(0.1, 3.0, df.height)
    m = _metrics(tmp_path, df.with_columns(entropy=pl.Series(ent))).row(0, named=True)
    keep = df["loss_mask"].to_numpy()
    assert m["entropy_mean"] == pytest.approx(ent[keep].mean(), rel=1e-12)
    assert m["kl_ent_ratio"] == pytest.approx(m["kl_k3"] / ent[keep].mean(), rel=1e-12)
    m0 = _metrics(tmp_path, df).row(0, named=True)
    assert m0["entropy_mean"] is None and m0["kl_ent_ratio"] is None


@pytest.mark.parametrize("batch_rows", [7, 1_000_000])
def test_pearson_is_null_where_a_column_is_constant(tmp_path, kernel_backend, batch_rows):
    """p constant (to 9 digits): the variance from the sums is rounding noise whose sign
    depends on the order of the additions; the correlation is undefined, never +-1 or 0."""
    from mismatch_replay import ingest

    rng = np.random.default_rng(3)
    n = 5_000
    lq = np.log(rng.uniform(0.05, 0.95, n))
    for lp in (np.full(n, math.log(0.7)), math.log(0.7) + rng.normal(0.0, 1e-12, n)):
        path = write_log(tmp_path / "c.parquet", canonical_log(np.minimum(lp, 0.0), lq))
        res = engine.sweep([path], rules=[], options=ingest.ReadOptions(batch_rows=batch_rows))
        assert res.metrics["probs_pearson"].item() is None
    # a genuine correlation is kept
    lp = np.minimum(lq + rng.normal(0.0, 0.05, n), 0.0)
    path = write_log(tmp_path / "c.parquet", canonical_log(lp, lq))
    got = engine.sweep([path], rules=[]).metrics["probs_pearson"].item()
    assert got == pytest.approx(np.corrcoef(np.exp(lp), np.exp(lq))[0, 1], rel=1e-9)
