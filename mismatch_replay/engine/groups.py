"""The --by groups of a Tally: every token's group code, before either path counts it.

Design
------
`Tally.add_batch` gives every token of a batch a group code first (`Grouping._group_codes`,
a mixin of `Tally`, like lead.py's `Leading`), so that the fused and the simple path group
identically: code i is `Tally.groups[i]`, registered by first appearance (`_gidx` maps a
group to its code), so the codes of a batch never change once given and `Tally + Tally`
renumbers the other's groups after this one's. Without `by` every token is group 0.

`step` and `env` are the token's column (an integer column in a few long runs, as a step
column holds, is coded run by run into one reused array: `_run_codes`); `q_bucket` its
inference probability's bucket (bins.q_bucket, on the fused backend through the kernel's
exp: the same bits), so a sequence then spans groups (readout.py); `length` its sequence's
bucket [2^k, 2^(k+1)) of loss tokens, from the replay's pre-pass (`Tally.seq_len`), so a
sequence never spans length buckets; `lag` (step - version) and `position` (the
position's power-of-two bucket) are derived per token (`derived_group`), so a sequence
spans groups too. The mixin reads the Tally's `by`, `groups`, `_gidx`, `_scratch` (per-batch
buffers) and `seq_len`.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from .. import fast, pmath
from ..errors import UsageError
from .bins import Q_BUCKET_EDGES, length_bucket, q_bucket

GROUP_KEYS = ("step", "env", "q_bucket", "length", "lag", "position")
Q_EDGES = np.asarray(Q_BUCKET_EDGES, dtype=np.float64)

# --by lag: the token's policy lag, step - version; --by position: its position's bucket
# [2^k, 2^(k+1)) by its lower edge (0 alone): both per token, so a sequence spans groups
DERIVED_GROUPS = ("lag", "position")


def derived_group(df: pl.DataFrame, by: str) -> pl.Series:
    """The --by lag / --by position group of every token of a batch, as an Int64 Series."""
    if by == "lag":
        return (df["step"].cast(pl.Int64) - df["version"].cast(pl.Int64)).alias("lag")
    p = df["position"].cast(pl.Int64).to_numpy()
    low = np.where(p > 0, np.left_shift(1, np.floor(np.log2(np.maximum(p, 1))).astype(np.int64)), 0)
    return pl.Series("position", low, dtype=pl.Int64)


class Grouping:
    """The group-code half of `Tally` (this module's docstring)."""

    def _group_codes(self, df: pl.DataFrame, seq=None) -> np.ndarray:
        if self.by == "length":
            return self._length_codes(seq[0])
        if self.by is None:
            if not self.groups:
                self.groups.append(None)
                self._gidx[None] = 0
            z = self._scratch.get("zeros")  # one read-only array of zeros: a fresh one per
            if z is None or z.shape[0] < df.height:  # batch cost a page fault per 512 tokens
                z = self._scratch["zeros"] = np.zeros(max(df.height, 1), dtype=np.int64)
                z.flags.writeable = False
            return z[: df.height]
        if self.by == "q_bucket":
            return self._q_bucket_codes(df["inference_logprob"].to_numpy())
        col = derived_group(df, self.by) if self.by in DERIVED_GROUPS else df[self.by]
        if col.dtype.is_integer() and col.null_count() == 0:
            got = self._run_codes(col.to_numpy())
            if got is not None:
                return got
        u = col.unique(maintain_order=True).to_list()
        for v in u:
            if v not in self._gidx:
                self._gidx[v] = len(self.groups)
                self.groups.append(v)
        lut = pl.DataFrame(
            {self.by: pl.Series(u, dtype=col.dtype), "_g": [self._gidx[v] for v in u]}
        )
        return (
            col.to_frame(self.by)
            .join(lut, on=self.by, how="left", maintain_order="left")["_g"]
            .to_numpy()
            .astype(np.int64)
        )

    def _run_codes(self, x: np.ndarray) -> np.ndarray | None:
        """Group codes of an integer column by its runs (a step column holds a few long
        ones): groups registered by first appearance, as the general path registers them;
        None where the runs are short (the general path is faster). The codes are this
        Tally's scratch, valid until its next batch (nothing keeps a batch's codes past
        it: m2po's store copies them)."""
        if x.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        starts = np.r_[0, np.flatnonzero(x[1:] != x[:-1]) + 1]
        if starts.shape[0] > 64 + x.shape[0] // 64:  # short runs: the general path
            return None
        codes = np.empty(starts.shape[0], dtype=np.int64)
        for k, v in enumerate(x[starts].tolist()):
            gi = self._gidx.get(v)
            if gi is None:
                gi = self._gidx[v] = len(self.groups)
                self.groups.append(v)
            codes[k] = gi
        out = self._scratch.get("run_codes")  # reused: a fresh array per batch cost its pages
        if out is None or out.shape[0] < x.shape[0]:
            out = self._scratch["run_codes"] = np.empty(x.shape[0], dtype=np.int64)
        out = out[: x.shape[0]]
        ends = [*starts[1:].tolist(), x.shape[0]]
        for a, b, c in zip(starts.tolist(), ends, codes.tolist(), strict=True):
            out[a:b] = c
        return out

    def _q_bucket_codes(self, lq: np.ndarray) -> np.ndarray:
        """--by q_bucket: each token's group, its q's bucket (bins.q_bucket; on the fused
        backend the kernel's exp, the same bits), groups registered by first appearance."""
        j = fast.compiled()
        if j is not None:
            b = np.empty(lq.shape[0], dtype=np.int64)
            first = np.full(Q_EDGES.shape[0], -1, dtype=np.int64)
            j.q_bucket_codes(np.ascontiguousarray(lq, dtype=np.float64), Q_EDGES, b, first)
            present = np.flatnonzero(first >= 0)
            first = first[present]
        else:
            b = q_bucket(pmath.exp(lq))
            present, first = np.unique(b, return_index=True)
        lut = np.full(Q_EDGES.shape[0], -1, dtype=np.int64)
        for k in present[np.argsort(first)].tolist():
            label = float(Q_EDGES[k])
            if label not in self._gidx:
                self._gidx[label] = len(self.groups)
                self.groups.append(label)
            lut[k] = self._gidx[label]
        return lut[b]

    def _length_codes(self, gid: np.ndarray) -> np.ndarray:
        """--by length: each token's group is its sequence's length bucket (from the
        pre-pass's counts, `seq_len`); the buckets are registered once, in ascending order."""
        codes = self._scratch.get("len_codes")
        if codes is None:
            if self.seq_len is None:
                raise UsageError(
                    "--by length needs each sequence's loss tokens up front: run it through "
                    "replay(), which counts them in a first pass."
                )
            b = length_bucket(self.seq_len)
            present = np.unique(b)
            lut = np.full(int(present.max(initial=0)) + 1, -1, dtype=np.int64)
            for v in present.tolist():
                label = 1 << v
                if label not in self._gidx:
                    self._gidx[label] = len(self.groups)
                    self.groups.append(label)
                lut[v] = self._gidx[label]
            codes = self._scratch["len_codes"] = lut[b]
        if gid.shape[0] and gid.max() >= codes.shape[0]:
            raise AssertionError("internal error: a sequence the length pre-pass did not see")
        return codes[gid]
