"""Grouping by sequence length (`--by length`) and prompt groups (`group_id`: the fraction of
GRPO groups whose every sample a rule masks), on both engine paths, against brute force.

The brute force is tests/brute.py's `evaluate`, steered through its `env` grouping: an `env`
column holding each token's length bucket gives the per-bucket counts (a sequence rule puts
a sequence in its first token's group, and every token of a sequence has the same bucket),
and an `env` column holding each token's sequence key gives each sequence's masked flag
(m2po still ranks whole steps: brute's grouping only sorts the results). Prompt groups are
then formed here, in plain Python, from the log's own rows."""

from __future__ import annotations

import math

import brute
import numpy as np
import polars as pl
import pytest
from conftest import log_file, logs, random_log, write_log
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import SETTINGS

from mismatch_replay import engine, fast, ingest
from mismatch_replay.engine.readout import GROUP_COLUMNS, group_label, length_label
from mismatch_replay.errors import DataError, UsageError
from mismatch_replay.rules import REGISTRY

COUNT_COLUMNS = ("tokens", "masked_tokens", "truncated_tokens", "sequences", "masked_sequences")
BACKENDS = ["numpy"] + (["numba"] if fast.backend() == "numba" else [])


def _rules():
    return [REGISTRY[n](**SETTINGS[n]) for n in brute.ALL_RULES]


def _loss(df: pl.DataFrame) -> pl.DataFrame:
    return df.filter(pl.col("loss_mask")) if "loss_mask" in df.columns else df


def _with_env(df: pl.DataFrame, env: list[str]) -> pl.DataFrame:
    """df (loss rows only) with `env` replaced: brute.evaluate's group key."""
    return _loss(df).with_columns(pl.Series("env", env, dtype=pl.String))


def _bucket(n: int) -> int:
    return 1 << (n.bit_length() - 1)  # [2^b, 2^(b+1)) by its lower edge


def brute_length(df: pl.DataFrame, name: str) -> dict[int, dict]:
    """Per length bucket (label: lower edge), every output of brute.evaluate."""
    d = _loss(df)
    keys = list(zip(d["step"].to_list(), d["sample_id"].to_list(), strict=True))
    n: dict = {}
    for k in keys:
        n[k] = n.get(k, 0) + 1
    env = [str(_bucket(n[k])) for k in keys]
    out = brute.evaluate(_with_env(d, env), name, SETTINGS[name], by="env")
    return {int(k): v for k, v in out.items()}


def brute_groups(df: pl.DataFrame, name: str, by: str | None = None) -> dict:
    """Per --by group (None, or the step): (prompt groups, fully masked prompt groups).
    A prompt group is (step, group_id) over the samples with a loss token, each sample in
    the group of its first loss token; a null group_id: a group of its own. A sample is
    masked when brute force masks it (any masked token, or the masked sequence)."""
    d = _loss(df)
    keys = list(zip(d["step"].to_list(), d["sample_id"].to_list(), strict=True))
    env = [f"{s}|{i}" for s, i in keys]
    per_seq = brute.evaluate(_with_env(d, env), name, SETTINGS[name], by="env")
    gid_of: dict = {}
    for k, g in zip(keys, d["group_id"].to_list(), strict=True):
        if k not in gid_of:
            gid_of[k] = (k[0], g) if g is not None else (k[0], None, k[1])
    members: dict = {}
    for k, g in gid_of.items():
        members.setdefault(g, []).append(per_seq[f"{k[0]}|{k[1]}"]["masked_sequences"] > 0)
    out: dict = {}
    for g, masked in members.items():
        key = None if by is None else g[0]
        tot, full = out.get(key, (0, 0))
        out[key] = (tot + 1, full + all(masked))
    return out


def _sweep(path, by=None, backend="numpy", **kw):
    with fast.use_backend(backend):
        return engine.sweep([path], rules=_rules(), by=by, **kw).table


def _add_groups(df: pl.DataFrame, rng: np.random.Generator, per_row: bool = False):
    """A group_id per (step, sample_id) (some null); per_row: one per row, so that a
    sample's tokens disagree and its first loss token's group must win."""
    if per_row:
        g = rng.integers(0, 3, df.height).tolist()
    else:
        sid = df["sample_id"].cast(pl.String).to_list()
        lut = {s: int(rng.integers(0, 3)) for s in set(sid)}
        g = [lut[s] for s in sid]
    g = [None if rng.random() < 0.1 else v for v in g]
    return df.with_columns(pl.Series("group_id", g, dtype=pl.Int64))


# ----------------------------------------------------------------------------- length


def test_length_bucket_is_exact_floor_log2():
    n = np.array([1, 2, 3, 4, 7, 8, 15, 16, 1023, 1024, 1025, 2**40 - 1, 2**40])
    want = [int(v).bit_length() - 1 for v in n]
    assert engine.length_bucket(n).tolist() == want
    assert length_label(4) == "[4, 8)"
    assert group_label("length", 1) == "[1, 2)"
    assert group_label("step", 3) == "3"


def _check_length(df: pl.DataFrame, backend: str, **kw) -> None:
    with log_file(df) as path:
        t = _sweep(path, by="length", backend=backend, **kw)
        flat = _sweep(path, backend=backend, **kw)
    for name in SETTINGS:
        exp = brute_length(df, name)
        rows = t.filter(pl.col("rule") == name)
        assert sorted(rows["length"].to_list()) == sorted(exp), name
        for row in rows.iter_rows(named=True):
            want = exp[row["length"]]
            for k in COUNT_COLUMNS:
                assert row[k] == want[k], (name, row["length"], k, row[k], want[k])
            mm, wm = row["masked_mass"], want["masked_mass"]
            assert math.isclose(mm, wm, rel_tol=1e-9, abs_tol=1e-300), (name, mm, wm)
        # the buckets add up to the ungrouped row, sequences included (none spans buckets)
        total = flat.filter(pl.col("rule") == name).row(0, named=True)
        for k in COUNT_COLUMNS:
            assert rows[k].sum() == total[k], (name, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_buckets_match_brute_force(backend):
    rng = np.random.default_rng(5)
    df = random_log(rng, steps=3, seqs=12, max_len=70)
    _check_length(df, backend)
    # interleaved sequences read in tiny batches: a sequence's tokens in many batches
    mixed = df.sample(fraction=1.0, shuffle=True, seed=2)
    _check_length(mixed, backend, options=ingest.ReadOptions(batch_rows=5))


@settings(max_examples=40, deadline=None)
@given(df=logs(max_steps=3, max_seqs=3, max_len=9), backend=st.sampled_from(BACKENDS))
def test_length_buckets_property(df, backend):
    _check_length(df, backend)


def test_length_separates_product_from_geometric_rules(tmp_path):
    """i.i.d. small l per token: seq-mis (product of ratios) masks long sequences more,
    geo-mis (geometric mean) masks them less (the mean concentrates)."""
    df = length_demo_log(np.random.default_rng(0))
    path = write_log(tmp_path / "demo.parquet", df)
    t = engine.sweep(
        [path], rules=["seq-mis:low=0.5,high=2", "geo-mis:low=0.98,high=1.02"], by="length"
    ).table
    frac = {
        r: dict(zip(p["length"], p["masked_sequence_fraction"], strict=True))
        for (r,), p in t.group_by(["rule"])
    }
    assert frac["seq-mis"][1024] > 0.5 > 0.05 > frac["seq-mis"][4]
    assert frac["geo-mis"][1024] < 0.05 < 0.2 < frac["geo-mis"][4]


def length_demo_log(rng: np.random.Generator, per_bucket: int = 64, sigma: float = 0.05):
    """Sequences of 4..1024 loss tokens, l ~ N(0, sigma) i.i.d. per token."""
    lens = np.concatenate([rng.integers(2**b, 2 ** (b + 1), per_bucket) for b in range(2, 11)])
    n = int(lens.sum())
    lq = -rng.exponential(0.5, n)
    lp = np.minimum(lq + rng.normal(0.0, sigma, n), 0.0)
    sid = np.repeat(np.arange(lens.shape[0]), lens)
    return pl.DataFrame(
        {
            "step": np.zeros(n, np.int64),
            "sample_id": sid,
            "trainer_logprob": lp,
            "inference_logprob": lq,
            "group_id": sid // 8,
        }
    )


def test_length_with_prime_rl_matching_counts_kept_tokens(tmp_path):
    """One pre-pass serves both: lengths count the tokens prime-rl keeps (advantage != 0)."""
    df = random_log(np.random.default_rng(8), steps=2, seqs=10, max_len=40)
    path = write_log(tmp_path / "a.parquet", df)
    t = engine.sweep([path], rules=["ipo:eps=0.1"], by="length", match="prime-rl").table
    kept = _loss(df).filter(pl.col("advantage") != 0)
    n = kept.group_by(["step", "sample_id"]).len()["len"].to_list()
    want: dict = {}
    for v in n:
        want[_bucket(v)] = want.get(_bucket(v), 0) + 1
    assert dict(zip(t["length"], t["sequences"], strict=True)) == want
    assert t["is_masked_mean"].null_count() == 0


def test_length_needs_sample_id_and_the_local_engine(tmp_path):
    df = random_log(np.random.default_rng(1), 1, 2).drop("sample_id")
    path = write_log(tmp_path / "a.parquet", df)
    with pytest.raises(DataError, match="sample_id"):
        engine.sweep([path], rules=["ipo"], by="length")
    with pytest.raises(UsageError, match="--by length"):
        engine.sweep([path], rules=["ipo"], by="length", engine="ray")


def test_length_tallies_sharing_a_sequence_refuse_to_add(tmp_path):
    df = random_log(np.random.default_rng(2), 1, 3, max_len=10)
    pa = write_log(tmp_path / "a.parquet", df)
    pb = write_log(tmp_path / "b.parquet", df.head(df.height // 2))
    ta = engine.replay([pa], rules=["ipo"], by="length")
    with pytest.raises(ValueError, match="length"):
        ta + engine.replay([pb], rules=["ipo"], by="length")


# ----------------------------------------------------------------------------- groups


def _check_groups(df: pl.DataFrame, backend: str, by: str | None = None, **kw) -> None:
    with log_file(df) as path:
        t = _sweep(path, by=by, backend=backend, **kw)
    for name in SETTINGS:
        exp = brute_groups(df, name, by)
        rows = t.filter(pl.col("rule") == name)
        assert rows.height == len(exp), name
        for row in rows.iter_rows(named=True):
            tot, full = exp[row[by] if by else None]
            got = (row["prompt_groups"], row["fully_masked_groups"])
            assert got == (tot, full), (name, by, row.get(by), got, (tot, full))
            assert row["fully_masked_group_fraction"] == full / tot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("by", [None, "step"])
def test_fully_masked_groups_match_brute_force(backend, by):
    rng = np.random.default_rng(9)
    df = _add_groups(random_log(rng, steps=3, seqs=12, max_len=30), rng)
    _check_groups(df, backend, by)
    # tokens of one sample carrying different ids, interleaved, tiny batches: first wins
    mixed = _add_groups(df.drop("group_id"), rng, per_row=True).sample(
        fraction=1.0, shuffle=True, seed=1
    )
    _check_groups(mixed, backend, by, options=ingest.ReadOptions(batch_rows=4))


@settings(max_examples=40, deadline=None)
@given(
    df=logs(max_steps=3, max_seqs=4, max_len=5),
    seed=st.integers(0, 2**32 - 1),
    per_row=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    by=st.sampled_from([None, "step"]),
)
def test_fully_masked_groups_property(df, seed, per_row, backend, by):
    _check_groups(_add_groups(df, np.random.default_rng(seed), per_row), backend, by)


def test_groups_are_read_under_verls_name_and_merge_across_files(tmp_path):
    rng = np.random.default_rng(4)
    df = _add_groups(random_log(rng, steps=2, seqs=10, max_len=20), rng)
    one = write_log(tmp_path / "one.parquet", df.rename({"group_id": "uid"}))
    half = df.height // 2  # a sequence and its group split over two files
    pa = write_log(tmp_path / "a.parquet", df.head(half))
    pb = write_log(tmp_path / "b.parquet", df.tail(df.height - half))
    base = engine.sweep([one], rules=_rules()).table
    merged = (engine.replay([pa], rules=_rules()) + engine.replay([pb], rules=_rules())).result()
    cols = ["rule", *GROUP_COLUMNS]
    assert base.select(cols).equals(merged.table.select(cols))
    for name in SETTINGS:
        tot, full = brute_groups(df, name)[None]
        row = base.filter(pl.col("rule") == name).row(0, named=True)
        assert (row["prompt_groups"], row["fully_masked_groups"]) == (tot, full)


def test_group_columns_null_where_undefined(tmp_path):
    rng = np.random.default_rng(6)
    df = random_log(rng, steps=2, seqs=6)
    plain = write_log(tmp_path / "plain.parquet", df)
    t = engine.sweep([plain], rules=["ipo:eps=0.1"]).table
    assert all(t[c].null_count() == t.height for c in GROUP_COLUMNS)
    grouped = write_log(tmp_path / "g.parquet", _add_groups(df, rng))
    for by in ("length", "q_bucket"):  # a prompt group's samples span these groups
        t = engine.sweep([grouped], rules=["ipo:eps=0.1", "seq-mis"], by=by).table
        assert all(t[c].null_count() == t.height for c in GROUP_COLUMNS), by
    # env varies within a prompt group here: undefined per env; constant per group: defined
    mixed = _add_groups(df, rng).with_columns(pl.lit(7, pl.Int64).alias("group_id"))
    p = write_log(tmp_path / "m.parquet", mixed)
    assert engine.sweep([p], rules=["ipo"], by="env").table["prompt_groups"].null_count() > 0
    same = mixed.with_columns(pl.col("env").first().over("step"))
    p = write_log(tmp_path / "s.parquet", same)
    t = engine.sweep([p], rules=["ipo"], by="env").table
    assert t["prompt_groups"].null_count() == 0
    assert t["prompt_groups"].sum() == same["step"].n_unique() * t["value"].n_unique()


# ----------------------------------------------------------------------------- readout


def test_masked_by_length_figure(tmp_path):
    from mismatch_replay import viz

    df = length_demo_log(np.random.default_rng(1), per_bucket=16)
    path = write_log(tmp_path / "demo.parquet", df)
    specs = ["seq-mis:low=0.5,high=2", "geo-mis:low=0.98,high=1.02", "tis:cap=1.5"]
    t = engine.sweep([path], rules=specs, by="length").table
    fig = viz.masked_by_length(t)
    ax = fig.axes[0]
    lines = {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}
    for spec in t["spec"].unique().to_list():
        ln = lines[f"length|{spec}"]
        x, y = ln.get_xdata(), ln.get_ydata()
        assert len(x) == 9 and np.isfinite(y).all() and (y > 0).all()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "length" in ax.get_xlabel() and "masked" in ax.get_ylabel()
    assert "floor" in lines  # seq-mis masks nothing among short sequences: drawn on the floor
    seq = viz.masked_by_length(t, column="masked_sequence_fraction").axes[0]
    assert not any("tis" in (ln.get_gid() or "") for ln in seq.get_lines())  # weight: none
    with pytest.raises(UsageError):
        viz.masked_by_length(t.drop("length"))


def test_cli_shows_groups_and_json_carries_nulls(tmp_path):
    import json

    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    rng = np.random.default_rng(3)
    df = _add_groups(random_log(rng, steps=2, seqs=6), rng).rename({"group_id": "uid"})
    path = write_log(tmp_path / "a.parquet", df)
    r = CliRunner().invoke(app, ["sweep", str(path), "-r", "ipo:eps=0.1", "-r", "seq-mis"])
    assert r.exit_code == 0, r.output
    assert "prompt groups (step, group_id)" in r.output and "groups all masked" in r.output
    r = CliRunner().invoke(app, ["sweep", str(path), "-r", "ipo:eps=0.1", "--by", "length"])
    assert r.exit_code == 0, r.output
    assert "[1, 2)" in r.output or "[2, 4)" in r.output or "[4, 8)" in r.output
    out = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["sweep", str(path), "-r", "ipo", "--by", "length", "-o", out])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "NaN" not in text
    rows = json.loads(text)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert all(row["prompt_groups"] is None for row in rows)  # groups span length buckets
    assert all(row["sequences"] is not None for row in rows)  # sequences never do


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_counts_the_rows_drop_invalid_keeps(tmp_path, backend):
    """The pre-pass reads the replay's own columns: a row dropped for a NaN advantage is
    not counted in its sequence's length either."""
    rng = np.random.default_rng(12)
    df = random_log(rng, steps=2, seqs=10, max_len=20)
    bad = rng.random(df.height) < 0.15
    adv = np.where(bad, np.nan, df["advantage"].to_numpy())
    dirty = df.with_columns(pl.Series("advantage", adv))
    path = write_log(tmp_path / "dirty.parquet", dirty)
    opts = ingest.ReadOptions(drop_invalid=True)
    t = _sweep(path, by="length", backend=backend, options=opts)
    clean = df.filter(pl.Series(~bad))
    for name in SETTINGS:
        exp = brute_length(clean, name)
        for row in t.filter(pl.col("rule") == name).iter_rows(named=True):
            for k in COUNT_COLUMNS:
                assert row[k] == exp[row["length"]][k], (name, row["length"], k)
