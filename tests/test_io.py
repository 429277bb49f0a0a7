"""Ingest: layouts, aliases, probabilities, projection and validation of the token table."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, fast, ingest
from mismatch_replay.errors import DataError, UsageError
from mismatch_replay.ingest import canonical, read, sources

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"


def test_canonical_log_reads_back_unchanged():
    raw = pl.read_parquet(GOLDEN).filter("loss_mask")
    got = ingest.read_table([GOLDEN])
    assert got.height == raw.height == 19598
    cols = ["step", "sample_id", "position", "trainer_logprob", "inference_logprob", "advantage"]
    assert got.select(cols).equals(raw.select(cols))


def test_projection_reads_only_what_is_asked():
    got = ingest.read_table([GOLDEN], columns=["trainer_logprob", "inference_logprob"])
    assert set(got.columns) == {"trainer_logprob", "inference_logprob", "step"}


def test_batch_size_does_not_change_the_table():
    a = ingest.read_table([GOLDEN])
    b = ingest.read_table([GOLDEN], ingest.ReadOptions(batch_rows=777))
    assert a.equals(b)


class _Meta:
    """Row-group sizes in the shape of pyarrow's FileMetaData (what _group_runs reads)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def row_group(self, i):
        return type("RG", (), {"num_rows": self.sizes[i]})()


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), max_size=25),
    batch=st.integers(1, 50),
    data=st.data(),
)
def test_group_runs_cover_every_group_once_and_fit_the_batch(sizes, batch, data):
    lo = data.draw(st.integers(0, len(sizes)), label="first group")
    hi = data.draw(st.integers(lo, len(sizes)), label="end")
    runs = list(read._group_runs(_Meta(sizes), range(lo, hi), batch))
    flat = [g for r in runs for g in (r if isinstance(r, list) else [r])]
    assert flat == list(range(lo, hi))  # every group, once, in order
    for k, r in enumerate(runs):
        if isinstance(r, int):  # streamed: exactly the groups larger than a batch
            assert sizes[r] > batch
            continue
        assert r and all(sizes[g] <= batch for g in r)
        assert sum(sizes[g] for g in r) <= batch
        nxt = runs[k + 1] if k + 1 < len(runs) else None
        if isinstance(nxt, list):  # greedy: the next group would not have fitted
            assert sum(sizes[g] for g in r) + sizes[nxt[0]] > batch


@pytest.mark.parametrize("batch", [1, 7, 40, 10_000])
def test_mixed_row_groups_read_every_row_in_order(tmp_path, batch):
    """Small row groups are read whole (several to a batch), large ones streamed: the rows
    come out in file order, in batches of at most batch_rows, whatever the mix."""
    import pyarrow.parquet as pq

    raw = pl.read_parquet(GOLDEN).filter("loss_mask").head(400)
    path = tmp_path / "mixed.parquet"
    with pq.ParquetWriter(path, raw.to_arrow().schema) as w:
        off = 0
        for size in (3, 1, 50, 2, 2, 120, 9, 0, 213):
            w.write_table(raw.slice(off, size).to_arrow(), size or 1)
            off += size
    opts = ingest.ReadOptions(batch_rows=batch)
    plan = ingest.plan_sources([path], opts)
    heights = [df.height for _, df in ingest.iter_batches(plan)]
    assert max(heights) <= batch and sum(heights) == 400
    got = ingest.read_table([path], opts)
    cols = ["step", "sample_id", "position", "trainer_logprob", "inference_logprob"]
    assert got.select(cols).equals(raw.select(cols))


def _as_lists(df: pl.DataFrame, names: dict[str, str]) -> pl.DataFrame:
    """Token rows -> one row per sequence with list columns, under trainer-style names."""
    return (
        df.sort("step", "sample_id", "position")
        .group_by("step", "sample_id", maintain_order=True)
        .agg(
            pl.col("trainer_logprob").alias(names["trainer_logprob"]),
            pl.col("inference_logprob").alias(names["inference_logprob"]),
            pl.col("loss_mask").alias(names["loss_mask"]),
            pl.col("advantage").first().alias(names["advantage"]),
            pl.col("env").first().alias(names["env"]),
        )
    )


@pytest.mark.parametrize(
    "names",
    [
        {  # slime-like
            "trainer_logprob": "log_probs",
            "inference_logprob": "rollout_log_probs",
            "loss_mask": "loss_masks",
            "advantage": "advantages",
            "env": "env_name",
        },
        {  # NeMo-RL-like
            "trainer_logprob": "prev_logprobs",
            "inference_logprob": "generation_logprobs",
            "loss_mask": "token_loss_mask",
            "advantage": "advantages",
            "env": "task",
        },
    ],
)
def test_list_columns_with_trainer_names_give_identical_counts(tmp_path, names):
    src = pl.read_parquet(GOLDEN)
    lists = _as_lists(src, names)
    lists.write_parquet(tmp_path / "lists.parquet")
    plan = ingest.plan_sources([tmp_path / "lists.parquet"])
    assert plan.per_sequence and plan.source["trainer_logprob"] == names["trainer_logprob"]
    specs = ["ipo:eps=0.05", "icepop@prime-rl", "seq-mis@verl", "opsm:delta=0.005", "m2po"]
    a = engine.sweep([GOLDEN], rules=specs).table
    b = engine.sweep([tmp_path / "lists.parquet"], rules=specs).table
    assert a["masked_tokens"].to_list() == b["masked_tokens"].to_list()
    assert a["masked_sequences"].to_list() == b["masked_sequences"].to_list()


def test_list_layout_without_ids_numbers_sequences_and_positions(tmp_path):
    pl.DataFrame(
        {"trainer_logprobs": [[-0.1, -0.2], [-0.3]], "inference_logprobs": [[-0.1, -0.3], [-0.2]]}
    ).write_parquet(tmp_path / "a.parquet")
    pl.DataFrame({"trainer_logprobs": [[-0.5]], "inference_logprobs": [[-0.4]]}).write_parquet(
        tmp_path / "b.parquet"
    )
    t = ingest.read_table([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert t["sample_id"].to_list() == [0, 0, 1, 2]
    assert t["position"].to_list() == [0, 1, 0, 0]


def test_probability_columns_detected_by_name(tmp_path):
    pl.DataFrame({"trainer_probs": [0.5, 1.0], "inference_probs": [0.25, 1.0]}).write_parquet(
        tmp_path / "p.parquet"
    )
    plan = ingest.plan_sources([tmp_path / "p.parquet"])
    assert plan.probs == {"trainer_logprob", "inference_logprob"}
    t = ingest.read_table(plan)
    np.testing.assert_allclose(t["trainer_logprob"], [math.log(0.5), 0.0])
    np.testing.assert_allclose(t["inference_logprob"], [math.log(0.25), 0.0])


def test_loss_mask_false_rows_are_ignored_even_when_invalid(tmp_path):
    pl.DataFrame(
        {
            "trainer_logprob": [None, -0.1, math.nan],
            "inference_logprob": [-0.2, -0.1, 0.7],
            "loss_mask": [False, True, False],
        }
    ).write_parquet(tmp_path / "m.parquet")
    t = ingest.read_table([tmp_path / "m.parquet"])
    assert t.height == 1


def test_map_to_a_column_that_is_not_there(tmp_path):
    pl.DataFrame({"trainer_logprob": [-0.1], "inference_logprob": [-0.2]}).write_parquet(
        tmp_path / "x.parquet"
    )
    with pytest.raises(DataError, match="names column 'nope'"):
        ingest.plan_sources(
            [tmp_path / "x.parquet"], ingest.ReadOptions(mapping={"advantage": "nope"})
        )
    with pytest.raises(UsageError, match="not a canonical column"):
        ingest.plan_sources([tmp_path / "x.parquet"], ingest.ReadOptions(mapping={"bogus": "x"}))


def test_invalid_rows_error_counts_the_whole_file(tmp_path):
    n = 5000
    lp = np.full(n, -0.1)
    lp[[10, 3000, 4999]] = np.nan
    pl.DataFrame({"trainer_logprob": lp, "inference_logprob": np.full(n, -0.1)}).write_parquet(
        tmp_path / "big.parquet"
    )
    with pytest.raises(DataError, match=r"3 of 5,000 loss rows are NaN"):
        ingest.read_table([tmp_path / "big.parquet"], ingest.ReadOptions(batch_rows=100))
    report = ingest.ReadReport()
    t = ingest.read_table(
        [tmp_path / "big.parquet"],
        ingest.ReadOptions(batch_rows=100, drop_invalid=True),
        None,
        report,
    )
    assert t.height == n - 3 and report.dropped_rows == 3


def test_sources_deduplicate_and_keep_order(tmp_path):
    for name in ("b", "a"):
        pl.DataFrame({"trainer_logprob": [-0.1], "inference_logprob": [-0.2]}).write_parquet(
            tmp_path / f"{name}.parquet"
        )
    files = ingest.resolve_sources([tmp_path / "b.parquet", tmp_path, str(tmp_path / "*.parquet")])
    assert [f.name for f in files] == ["b.parquet", "a.parquet"]
    with pytest.raises(UsageError):
        ingest.resolve_sources([])
    with pytest.raises(DataError, match="matches no file"):
        ingest.resolve_sources([str(tmp_path / "*.nothing")])


# ----------------------------------------------------------------------------- object stores


def _store(tmp_path: Path) -> Path:
    """A 'bucket': two Parquet objects under a prefix (one in a hive step=N folder)."""
    raw = pl.read_parquet(GOLDEN)
    root = tmp_path / "bucket" / "runs"
    (root / "step=9").mkdir(parents=True)
    raw[:7000].write_parquet(root / "a.parquet")
    raw[7000:].write_parquet(root / "step=9" / "b.parquet")
    (root / "notes.txt").write_text("not a log")
    return root


def test_uris_pass_through_to_pyarrow_filesystems(tmp_path):
    """file:// goes through pyarrow.fs like s3:// or gs:// would: a prefix, a glob and one
    object read exactly what the local paths read."""
    root = _store(tmp_path)
    local = engine.sweep([root], rules=["ipo", "tis"])
    for uri in (f"file://{root}", f"file://{root}/**.parquet"):
        plan = ingest.plan_sources([uri])
        assert [str(f) for f in plan.files] == [
            f"file://{root}/a.parquet",
            f"file://{root}/step=9/b.parquet",
        ]
        remote = engine.sweep([uri], rules=["ipo", "tis"])
        assert remote.table.equals(local.table)
    one = ingest.plan_sources([f"file://{root}/a.parquet"])
    assert one.rows == (7000,)


def test_s3_uris_open_through_the_filesystem_pyarrow_returns(tmp_path, monkeypatch):
    """s3://bucket/key: resolved, listed, read and pickled (Ray) through the filesystem that
    pyarrow.fs.FileSystem.from_uri gives (sources.filesystem_from_uri; here a local stand-in for
    S3: no network in tests)."""
    import pickle

    from pyarrow import fs as pafs

    root = _store(tmp_path)
    seen = []

    def from_uri(uri, timeout=None):
        seen.append(uri)
        assert uri.startswith("s3://")
        return pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()), uri[5:]

    monkeypatch.setattr(sources, "filesystem_from_uri", from_uri)
    plan = ingest.plan_sources(["s3://bucket/runs/"])
    assert seen == ["s3://bucket/runs/"]
    assert [str(f) for f in plan.files] == [
        "s3://bucket/runs/a.parquet",
        "s3://bucket/runs/step=9/b.parquet",
    ]
    assert plan.file_steps == (None, 9)
    again = pickle.loads(pickle.dumps(plan))
    assert [str(f) for f in again.files] == [str(f) for f in plan.files]
    assert engine.sweep(again, rules=["ipo"]).table.equals(
        engine.sweep([root], rules=["ipo"]).table
    )


def test_uri_errors_name_the_location_and_the_fix(tmp_path):
    root = _store(tmp_path)
    with pytest.raises(DataError, match="cannot open this location"):
        ingest.plan_sources(["nosuchscheme://bucket/x"])
    with pytest.raises(DataError, match="no such object or prefix"):
        ingest.plan_sources([f"file://{root}/missing"])
    with pytest.raises(DataError, match="glob matches no object"):
        ingest.plan_sources([f"file://{root}/*.csv"])
    with pytest.raises(DataError, match="must be Parquet"):
        ingest.plan_sources([f"file://{root}/notes.txt"])
    with pytest.raises(UsageError, match="local files only"):
        ingest.plan_sources([f"file://{root}"], ingest.ReadOptions(format="jsonl"))


def test_row_group_ranges_read_exactly_their_rows(tmp_path):
    raw = pl.read_parquet(GOLDEN)
    path = tmp_path / "log.parquet"
    raw.write_parquet(path, row_group_size=3000)
    sizes = ingest.row_group_rows(path)
    assert len(sizes) == 7 and sum(sizes) == raw.height
    plan = ingest.plan_sources([path])
    parts = []
    for a, b in ((0, 2), (2, 5), (5, 7)):
        sub = replace(plan, row_groups=((a, b),), rows=(sum(sizes[a:b]),))
        parts.append(pl.concat([df for _, df in ingest.iter_batches(sub)]))
    assert pl.concat(parts).equals(pl.concat([df for _, df in ingest.iter_batches(plan)]))


SPECIAL = [0.0, -0.0, 1e-7, 1e-6, 2e-6, -1.0, -1e300, 5e-324, math.nan, math.inf, -math.inf]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_quick_check_agrees_with_the_full_validation(data):
    """canonical.quick_check (one pass per column) says clean exactly when no row would be flagged
    by the per-problem expressions, and asks for the clip whenever a log-prob is above 0."""
    n = data.draw(st.integers(1, 20))
    vals = st.one_of(st.sampled_from(SPECIAL), st.floats(-50.0, 0.0))
    cols = {
        "trainer_logprob": data.draw(st.lists(vals, min_size=n, max_size=n)),
        "inference_logprob": data.draw(st.lists(vals, min_size=n, max_size=n)),
    }
    if data.draw(st.booleans()):
        adv = st.one_of(st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf]), st.floats())
        cols["advantage"] = data.draw(st.lists(adv, min_size=n, max_size=n))
    df = pl.DataFrame(cols, schema={k: pl.Float64 for k in cols})
    if data.draw(st.booleans()):  # a null somewhere
        c = data.draw(st.sampled_from(sorted(cols)))
        df = df.with_columns(
            pl.when(pl.int_range(pl.len()) == 0).then(None).otherwise(pl.col(c)).alias(c)
        )
    plan = ingest.plan_sources([GOLDEN])
    flagged = bool(canonical.invalid_mask(df, plan).any())
    for backend in ("numpy", "numba") if fast.backend() == "numba" else ("numpy",):
        with fast.use_backend(backend):
            clean, positive = canonical.quick_check(df)
        assert clean == (not flagged), backend
        lps = [df[c] for c in ("trainer_logprob", "inference_logprob")]
        if clean:
            assert positive == any((s > 0).any() for s in lps), backend
