"""Shared helpers for the rule / engine / metrics tests.

- `write_log(path, df)` / `log_file(df)`: a canonical token log DataFrame -> a Parquet file.
- `canonical_log(...)`: build a small canonical log from per-token lists.
- `random_log(rng, ...)`: a numpy-random realistic log (for splitting and metrics tests).
- `logs()`: a hypothesis strategy for small canonical logs that stress the rules: a few
  sequences over a few steps, sample ids repeating across steps, confident tokens, rare
  tokens, large mismatches, exact-ratio tokens (l == log(c) exactly, for boundary ties),
  extreme log-probs (0, -700, -1e-12), advantages with exact zeros, some loss_mask false rows,
  optionally shuffled rows (a sequence's tokens not contiguous).
- `assert_tables_equal(a, b)`: sorted comparison, integers exact, floats with a tolerance.

Hypothesis runs derandomized by default (a fixed set of examples, so CI is reproducible);
`HYPOTHESIS_PROFILE=explore` draws fresh random examples, more of them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # `import brute` from the test modules

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
# ci (the default): fixed examples, and a failure is reported as drawn, not shrunk (shrinking a
# failure of the slower property tests took minutes); dev: the same examples, shrunk to a
# minimal one; explore: fresh random examples, more of them, shrunk.
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile(
    "ci", deadline=None, derandomize=True, phases=_NO_SHRINK, suppress_health_check=_HEALTH
)
settings.register_profile("dev", deadline=None, derandomize=True, suppress_health_check=_HEALTH)
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=_HEALTH)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DATA = Path(__file__).parent / "data"
GOLDEN_LOG = DATA / "golden_log.parquet"
GOLDEN_EXPECTED = DATA / "golden_expected.csv"

# Ratios c for which tokens are built with l == math.log(c) exactly (lq = 0, lp = log c when
# c < 1; lp = 0, lq = -log c when c > 1), so a threshold of c is an exact tie in log space.
NICE_RATIOS = (0.1, 0.2, 0.5, 0.8, 1.25, 2.0, 3.0, 5.0, 6.0, 10.0)
# |l| values whose squares and sums are exact binary fractions (exact m2po ties).
DYADIC_L = (0.125, 0.25, 0.5, 1.0)
EXTREME_PAIRS = (
    (0.0, -700.0),
    (-700.0, 0.0),
    (-1e-12, 0.0),
    (0.0, -1e-12),
    (-1e-12, -2e-12),
    (-700.0, -700.0),
    (0.0, 0.0),
    (-700.0, -1e-12),
)


# ----------------------------------------------------------------------------- files


def write_log(path: str | Path, df: pl.DataFrame) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.write_parquet(path)
    return path


@contextlib.contextmanager
def log_file(df: pl.DataFrame, name: str = "log.parquet") -> Iterator[Path]:
    """A temporary Parquet file holding df (usable inside hypothesis tests)."""
    with tempfile.TemporaryDirectory() as d:
        yield write_log(Path(d) / name, df)


def ratio_pair(c: float) -> tuple[float, float]:
    """(lp, lq), both <= 0, with lp - lq == math.log(c) exactly."""
    lc = math.log(c)
    return (lc, 0.0) if lc <= 0 else (0.0, -lc)


def canonical_log(
    lp,
    lq,
    step=None,
    sample_id=None,
    advantage=None,
    loss_mask=None,
    env=None,
) -> pl.DataFrame:
    n = len(lp)
    cols: dict = {
        "trainer_logprob": pl.Series(np.asarray(lp, dtype=np.float64)),
        "inference_logprob": pl.Series(np.asarray(lq, dtype=np.float64)),
    }
    if step is not None:
        cols["step"] = pl.Series(np.broadcast_to(np.asarray(step), n).astype(np.int64))
    if sample_id is not None:
        cols["sample_id"] = pl.Series(list(sample_id))
    if advantage is not None:
        cols["advantage"] = pl.Series(np.asarray(advantage, dtype=np.float64))
    if loss_mask is not None:
        cols["loss_mask"] = pl.Series(list(loss_mask), dtype=pl.Boolean)
    if env is not None:
        cols["env"] = pl.Series(list(env), dtype=pl.String)
    return pl.DataFrame(cols)


def random_log(
    rng: np.random.Generator,
    steps: int = 3,
    seqs: int = 6,
    max_len: int = 25,
    mismatch: float = 0.05,
) -> pl.DataFrame:
    """A realistic log: per-sequence advantage (some exactly 0) and env, mostly confident
    tokens with bf16-scale mismatch, some rare tokens and a few large mismatches."""
    rows: dict[str, list] = {
        k: []
        for k in (
            "step",
            "sample_id",
            "position",
            "trainer_logprob",
            "inference_logprob",
            "advantage",
            "loss_mask",
            "env",
        )
    }
    for s in range(steps):
        for i in range(seqs):
            n = int(rng.integers(1, max_len + 1))
            adv = float(rng.choice([0.0, rng.normal()]))
            env = str(rng.choice(["code", "math"]))
            lq = -rng.exponential(0.6, n)
            rare = rng.random(n) < 0.1
            lq[rare] -= rng.uniform(3.0, 12.0, int(rare.sum()))
            lp = lq + rng.normal(0, mismatch, n)
            big = rng.random(n) < 0.05
            lp[big] = lq[big] + rng.normal(0, 2.0, int(big.sum()))
            lp = np.minimum(lp, 0.0)
            rows["step"] += [s] * n
            rows["sample_id"] += [i] * n
            rows["position"] += list(range(n))
            rows["trainer_logprob"] += lp.tolist()
            rows["inference_logprob"] += lq.tolist()
            rows["advantage"] += [adv] * n
            rows["loss_mask"] += (rng.random(n) > 0.1).tolist()
            rows["env"] += [env] * n
    return pl.DataFrame(rows)


# ----------------------------------------------------------------------------- hypothesis


@st.composite
def token_pairs(draw) -> tuple[float, float]:
    """(lp, lq) of one token, both <= 0."""
    kind = draw(
        st.sampled_from(
            ["confident", "bf16", "rare", "large", "ratio", "equal", "extreme", "dyadic"]
        )
    )
    if kind == "confident":
        return -draw(st.floats(1e-13, 1e-2)), -draw(st.floats(1e-13, 1e-2))
    if kind == "bf16":
        lq = -draw(st.floats(0.0, 6.0))
        return min(lq + draw(st.floats(-3e-3, 3e-3)), 0.0), lq
    if kind == "rare":
        lq = -draw(st.floats(3.0, 16.0))
        return min(lq + draw(st.floats(-3.0, 3.0)), 0.0), lq
    if kind == "large":
        return -draw(st.floats(0.0, 25.0)), -draw(st.floats(0.0, 25.0))
    if kind == "ratio":
        return ratio_pair(draw(st.sampled_from(NICE_RATIOS)))
    if kind == "equal":
        x = -draw(st.floats(0.0, 10.0))
        return x, x
    if kind == "dyadic":
        x = -draw(st.sampled_from(DYADIC_L))
        return (x, 0.0) if draw(st.booleans()) else (0.0, x)
    return draw(st.sampled_from(EXTREME_PAIRS))


ADVANTAGES = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, -1.0, 0.5, -2.0]),
    st.floats(-3.0, 3.0, allow_subnormal=False),
)


@st.composite
def logs(draw, max_steps: int = 3, max_seqs: int = 3, max_len: int = 5) -> pl.DataFrame:
    """A small canonical log (see the module docstring). At least one loss token."""
    steps = draw(st.lists(st.integers(0, 9), min_size=1, max_size=max_steps, unique=True))
    str_ids = draw(st.booleans())
    rows: dict[str, list] = {
        k: []
        for k in (
            "step",
            "sample_id",
            "position",
            "trainer_logprob",
            "inference_logprob",
            "advantage",
            "loss_mask",
            "env",
        )
    }
    for step in steps:
        ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=max_seqs, unique=True))
        for sid in ids:
            adv = draw(ADVANTAGES)
            env = draw(st.sampled_from(["a", "b"]))
            n = draw(st.integers(1, max_len))
            for pos in range(n):
                lp, lq = draw(token_pairs())
                rows["step"].append(step)
                rows["sample_id"].append(f"s{sid}" if str_ids else sid)
                rows["position"].append(pos)
                rows["trainer_logprob"].append(float(lp))
                rows["inference_logprob"].append(float(lq))
                rows["advantage"].append(float(adv))
                rows["loss_mask"].append(draw(st.sampled_from([True, True, True, False])))
                rows["env"].append(env)
    if not any(rows["loss_mask"]):
        rows["loss_mask"][0] = True
    df = pl.DataFrame(rows)
    if draw(st.booleans()):
        perm = draw(st.permutations(list(range(df.height))))
        df = df[list(perm)]
    return df


# ----------------------------------------------------------------------------- comparing

SORT_KEYS = ("rule", "setting", "param", "value")


def assert_tables_equal(
    a: pl.DataFrame, b: pl.DataFrame, keys=SORT_KEYS, rel: float = 1e-9, skip=()
) -> None:
    """Same rows (sorted by keys), integer/string columns exact, floats within rel."""
    assert a.columns == b.columns, (a.columns, b.columns)
    assert a.height == b.height, (a.height, b.height)
    keys = [k for k in keys if k in a.columns]
    a, b = a.sort(keys), b.sort(keys)
    for c in a.columns:
        if c in skip:
            continue
        x, y = a[c], b[c]
        if x.dtype == pl.Float64:
            assert (x.is_null() == y.is_null()).all(), f"column {c}: nulls differ"
            xv = x.fill_null(0.0).to_numpy()
            yv = y.fill_null(0.0).to_numpy()
            ok = np.isclose(xv, yv, rtol=rel, atol=1e-300) | (xv == yv)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise AssertionError(f"column {c} row {a.row(i, named=True)}: {xv[i]} != {yv[i]}")
        else:
            if not (x == y).fill_null(True).all() or not (x.is_null() == y.is_null()).all():
                i = int(np.flatnonzero(~(x == y).fill_null(False).to_numpy())[0])
                raise AssertionError(f"column {c} row {i}: {x[i]} != {y[i]}")


def close(a, b, rel: float = 1e-9, abs_: float = 1e-15) -> bool:
    """None == None; otherwise math.isclose (a NaN never compares equal)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.fixture(params=["auto", "numpy"])
def kernel_backend(request) -> Iterator[str]:
    """Run a test on each engine backend: the fused numba kernels ("auto", when numba is
    installed) and the plain numpy path. Both must give the same (brute-force) answers."""
    fast = pytest.importorskip("mismatch_replay.fast")
    if request.param == "auto" and fast.backend() == "numpy":
        pytest.skip("numba is not installed: 'auto' is the numpy path")
    with fast.use_backend(request.param):
        yield request.param


@pytest.fixture
def golden_log() -> Path:
    return GOLDEN_LOG


@pytest.fixture
def golden_expected() -> pl.DataFrame:
    return pl.read_csv(GOLDEN_EXPECTED)


class Reads(list):
    """The reads of a log the package made, one entry (its batches) per read that went on
    past its first batch or to the end; `partial` counts the reads stopped after their first
    batch (a sample read ahead)."""

    partial = 0


@pytest.fixture
def reads(monkeypatch) -> Reads:
    """A Reads that gains an entry each time the package reads a log (ingest.iter_batches,
    wherever a module imported it), when that read ends."""
    from mismatch_replay import ingest

    seen = Reads()
    real = ingest.iter_batches

    def counted(*a, **k):
        n, whole = 0, False
        try:
            for item in real(*a, **k):
                n += 1
                yield item
            whole = True
        finally:
            if whole or n > 1:
                seen.append(n)
            else:
                seen.partial += 1

    for name, mod in list(sys.modules.items()):
        if name.startswith("mismatch_replay") and getattr(mod, "iter_batches", None) is real:
            monkeypatch.setattr(mod, "iter_batches", counted)
    return seen
