"""What a mask costs (issue 32): corrective / divergent / neutral masked tokens, the |A| mass
removed and the masked tokens' entropy, on both engine paths, against brute.py's token loops."""

from __future__ import annotations

import importlib

import brute
import numpy as np
import polars as pl
import pytest
from conftest import close, log_file, logs, random_log
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import SETTINGS

from mismatch_replay import engine, fast
from mismatch_replay.rules import REGISTRY

COST = brute.COST_KEYS
INTS = ("masked_corrective", "masked_divergent", "masked_neutral")
BACKENDS = ("auto", "numpy") if fast.backend() == "numba" else ("numpy",)
# swept on a grid (several bins per job: the suffix sums), one value each is brute-forced
GRIDS = {
    "ipo": ("eps", [0.001, 0.01, 0.05, 0.1, 0.3]),
    "icepop": ("high", [1.01, 1.1, 1.5, 3.0]),
    "dppo-tv": ("high", [0.001, 0.01, 0.05, 0.2]),
    "kpop": ("phi", [1e-4, 1e-3, 0.01, 0.1]),
    "tis": ("cap", [1.001, 1.05, 1.2, 2.0]),
    "ppo-clip": ("eps_high", [0.01, 0.05, 0.1, 0.2]),
}


def _with_entropy(df: pl.DataFrame, seed: int) -> pl.DataFrame:
    """An entropy column: random, with a NaN now and then (left out of the means)."""
    rng = np.random.default_rng(seed)
    e = rng.gamma(1.0, 1.0, df.height)
    e[rng.random(df.height) < 0.1] = np.nan
    return df.with_columns(pl.Series("entropy", e))


def _check(df: pl.DataFrame, by: str | None) -> None:
    L = brute.Log(df)
    rules = [REGISTRY[n](**SETTINGS[n]) for n in brute.ALL_RULES]
    for backend in BACKENDS:
        with fast.use_backend(backend), log_file(df) as path:
            t = engine.sweep([path], rules=rules, by=by).table
            sw = engine.sweep(
                [path],
                rules=[REGISTRY[n](**SETTINGS[n]) for n in GRIDS],
                sweeps={f"{n}.{p}": np.array(g) for n, (p, g) in GRIDS.items()},
                by=by,
            ).table
        for name, params in SETTINGS.items():
            want = brute.evaluate(L, name, params, by=by)
            for row in t.filter(pl.col("rule") == name).iter_rows(named=True):
                _same(row, want[row[by] if by else None], (backend, name))
        for name, (param, grid) in GRIDS.items():
            want = brute.sweep(L, name, SETTINGS[name], param, grid, by=by)
            for row in sw.filter(pl.col("rule") == name).iter_rows(named=True):
                got = want[row["value"]][row[by] if by else None]
                _same(row, got, (backend, name, row["value"]))


def _same(row: dict, want: dict, where) -> None:
    if row["level"] == "step":  # m2po: its steps keep no per-token classes
        assert all(row[k] is None for k in COST), where
        return
    for k in COST:
        if k in INTS:
            assert row[k] == want[k], (where, k, row[k], want[k])
        else:
            assert close(row[k], want[k], rel=1e-9, abs_=1e-12), (where, k, row[k], want[k])


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(df=logs(max_steps=3), by=st.sampled_from([None, "step"]), seed=st.integers(0, 99))
def test_every_cost_column_matches_brute_force_on_both_paths(df, by, seed):
    _check(_with_entropy(df, seed), by)


def test_cost_columns_match_brute_force_on_a_random_log():
    df = _with_entropy(random_log(np.random.default_rng(32), steps=3, seqs=6), 5)
    _check(df, None)
    _check(df, "step")


def test_without_advantage_the_direction_columns_are_null_with_a_note():
    df = random_log(np.random.default_rng(1), steps=2, seqs=3).drop("advantage")
    df = _with_entropy(df, 2)
    for backend in BACKENDS:
        with fast.use_backend(backend), log_file(df) as path:
            res = engine.sweep([path], rules=[REGISTRY["ipo"](eps=0.05)])
        row = res.table.row(0, named=True)
        assert all(row[k] is None for k in COST[:6]), backend
        assert row["entropy_mean"] is not None
        assert any("masked_corrective" in n for n in res.notes), res.notes


@pytest.mark.parametrize("backend", BACKENDS)
def test_dppo_and_ppo_clip_never_mask_a_corrective_token(backend):
    """By construction (RULES.md): DPPO and PPO-clip mask only divergent updates."""
    for seed in range(3):
        df = random_log(np.random.default_rng(seed), steps=3, seqs=8, mismatch=0.3)
        with fast.use_backend(backend), log_file(df) as path:
            rules = [REGISTRY[n] for n in ("dppo-tv", "dppo-kl", "ppo-clip")]  # default grids
            t = engine.sweep([path], rules=rules).table
        assert t.height > 30
        assert t["masked_corrective"].null_count() == 0
        assert (t["masked_corrective"] == 0).all(), t.filter(pl.col("masked_corrective") > 0)
        assert t["masked_divergent"].sum() > 0  # not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
def test_ipo_corrective_fraction_is_one_half_on_a_log_symmetric_in_a(backend):
    """A independent of dp and symmetric: IPO masks by |dp| alone, so each masked token is
    corrective with probability 1/2."""
    rng = np.random.default_rng(7)
    n = 40_000
    lq = np.log(rng.uniform(0.05, 1.0, n))
    lp = np.minimum(lq + rng.normal(0.0, 0.6, n), 0.0)
    a = rng.choice([-1.0, 1.0], n) * rng.exponential(1.0, n)
    df = pl.DataFrame(
        {
            "step": np.repeat(np.arange(10), n // 10),
            "sample_id": np.arange(n) // 50,
            "trainer_logprob": lp,
            "inference_logprob": lq,
            "advantage": a,
        }
    )
    with fast.use_backend(backend), log_file(df) as path:
        t = engine.sweep([path], rules=[REGISTRY["ipo"](eps=0.1)]).table
    row = t.row(0, named=True)
    m = row["masked_corrective"] + row["masked_divergent"]
    assert m > 2000
    sigma = 0.5 / np.sqrt(m)
    assert abs(row["masked_corrective_fraction"] - 0.5) < 4 * sigma, (row, sigma)


@pytest.mark.parametrize("target", [0.05, 0.2])
def test_choose_of_adv_mass_equals_a_brute_force_search(target):
    """choose --of adv-mass: the chosen eps removes the share of sum |A| (recomputed at it by
    brute.py) closest to the target that any eps can, within choose's tolerance: a brute-force
    search over every token's |dp| (the fraction only changes there) finds no closer one."""
    from mismatch_replay.analysis.choose import choose

    df = random_log(np.random.default_rng(21), steps=4, seqs=10, max_len=40, mismatch=0.2)
    L = brute.Log(df)
    with log_file(df) as path:
        res = choose([path], target, rules=["ipo"], of="adv-mass", bootstrap=30, tol=0.01)
    (c,) = res.rows
    got = brute.evaluate(L, "ipo", {"eps": c.value})[None]
    assert c.of == "adv-mass" and c.status in ("ok", "ties"), c
    assert close(c.masked_adv_mass_fraction, got["masked_adv_mass_fraction"], rel=1e-9)
    assert c.masked_tokens == got["masked_tokens"]
    # brute force: masking |dp| > eps, eps just below each token's |dp| in turn
    a = np.abs(L.adv)
    order = np.argsort(-L.abs_dp, kind="stable")
    reach = np.cumsum(a[order]) / a.sum()  # the fractions eps can give (each score: a step)
    best = reach[np.argmin(np.abs(reach - target))]
    err = abs(c.masked_adv_mass_fraction - target)
    assert err <= max(0.01 * target, abs(best - target)) + 1e-12, (c, best)
    assert c.ci_low is not None and c.ci_low <= c.value <= c.ci_high


def test_choose_of_adv_mass_refuses_m2po_and_a_log_without_advantage():
    from mismatch_replay.analysis.choose import choose
    from mismatch_replay.errors import DataError, UsageError

    df = random_log(np.random.default_rng(2), steps=2, seqs=3)
    with log_file(df) as path:
        with pytest.raises(UsageError, match="m2po"):
            choose([path], 0.1, rules=["m2po"], of="adv-mass", bootstrap=0)
        with pytest.raises(UsageError, match="--of"):
            choose([path], 0.1, rules=["ipo"], of="mass", bootstrap=0)
    with log_file(df.drop("advantage")) as path, pytest.raises(DataError, match="advantage"):
        choose([path], 0.1, rules=["ipo"], of="adv-mass", bootstrap=0)


@pytest.mark.slow
def test_compare_cells_split_by_direction_as_brute_force():
    """compare's cells: corrective + divergent + neutral = tokens; A's cells (both, only A)
    hold A's masked corrective and divergent tokens, B's likewise; the disputed tokens say
    their direction."""
    from mismatch_replay.analysis.compare import compare

    df = random_log(np.random.default_rng(5), steps=3, seqs=8, mismatch=0.3)
    L = brute.Log(df)
    a, b = {"eps": 0.05}, {"low": 0.02, "high": 0.02}
    for backend in BACKENDS:
        with fast.use_backend(backend), log_file(df) as path:
            res = compare([path], "ipo:eps=0.05", "dppo-tv:low=0.02,high=0.02", examples=3)
        cells = res.cells
        for c in cells.values():
            assert c.corrective + c.divergent + c.neutral == c.tokens
        for name, params, mine in (
            ("ipo", a, ("both", "only_a")),
            ("dppo-tv", b, ("both", "only_b")),
        ):
            want = brute.evaluate(L, name, params)[None]
            for k, col in (("corrective", "masked_corrective"), ("divergent", "masked_divergent")):
                assert sum(getattr(cells[m], k) for m in mine) == want[col], (backend, name, k)
            mass = sum(cells[m].adv_mass for m in mine)
            assert close(mass, want["masked_adv_mass"], rel=1e-9), (backend, name)
        assert cells["only_b"].corrective == 0 and cells["both"].corrective == 0  # DPPO
        assert res.examples and all(
            e["direction"] in ("corrective", "divergent", "neutral") for e in res.examples
        )


def test_figure_table_finding_and_definitions():
    """figure_data's mask_cost rows are the presets' sweep rows; masked_direction draws one
    bar a setting and direction; the finding quotes IPO's numbers; `rules --json` carries
    the definitions."""
    import json

    from typer.testing import CliRunner

    from mismatch_replay import analysis

    F = importlib.import_module("mismatch_replay.analysis.findings")
    from mismatch_replay.analysis.mask_cost import COST_PRESETS
    from mismatch_replay.cli import app
    from mismatch_replay.viz.direction import masked_direction

    df = _with_entropy(random_log(np.random.default_rng(9), steps=3, seqs=6, mismatch=0.3), 1)
    with log_file(df) as path:
        data = analysis.figure_data([path])
        rows = engine.sweep([path], rules=list(COST_PRESETS)).table
    t = data.mask_cost
    assert set(COST_PRESETS) <= {s.split(":")[0] for s in t["spec"].to_list()}
    for r in rows.iter_rows(named=True):
        got = t.filter(pl.col("spec") == r["spec"]).row(0, named=True)
        for k in ("masked_tokens", *COST):
            assert got[k] == r[k] or close(got[k], r[k], rel=1e-12), (r["spec"], k)
    fig = masked_direction(t)
    axes = fig.get_axes()
    assert len(axes) == 3
    bars = [p for p in axes[0].patches if str(p.get_gid()).startswith("dir|")]
    assert len(bars) == 3 * t.height
    f = F.mask_cost(F.Context(data, None))
    ipo = t.filter(pl.col("spec").str.starts_with("ipo@prime-rl:")).row(0, named=True)
    assert f is not None and f.value("ipo.adv_mass_fraction") == ipo["masked_adv_mass_fraction"]
    assert f.value("ipo.corrective_fraction") == ipo["masked_corrective_fraction"]
    doc = json.loads(CliRunner().invoke(app, ["rules", "--json"]).stdout)
    assert doc["mask_cost"]["corrective"].startswith("A * (p - q) < 0")
    by = {r["name"]: r["masks_updates"] for r in doc["rules"]}
    assert by["dppo-tv"].startswith("divergent only") and by["ipo"].startswith("corrective")
