"""The numba kernels of the fused path: one loop over a batch's tokens, m2po's steps.

Imported only by `runner.compiled()`, when numba is installed and the fused path is on.
Every per-token quantity (p, q, |dp| signed, l, the clamped ratio, k3, exp|l|, the binary
KLs) is computed with the same float64 operations, in the same order, as the rules'
TokenBatch computes it, with `vmath`'s exp/expm1/log, the bit-identical twins of `pmath`'s
(no fast-math, no contraction anywhere here), so the kernel bins, sums and maximises the
simple path's bits; which interval of a coordinate means which bin for which job is decided
in program.py, in numpy, from the rules' own score(). The coordinate codes (C_DP, ...) are
coordinates.COORDINATES' `code`s; the per-sequence outputs are named by the rules'
SEQ_STATS rows (SEQ_SUMS, SEQ_MAX, SEQ_MIN). tests/test_kernels.py checks both paths agree on random
logs; tests/test_pmath.py that neither depends on numpy's dispatched exp and log.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .jit_rows import (  # noqa: F401  (re-exported: compiled() hands out one module)
    add_replicates,
    check_column,
    poisson_weights_t,
    q_bucket_codes,
    seq_cost,
    seq_runs,
    take_runs,
)
from .vmath import vexp, vexpm1, vlog

INF = math.inf

# flags (F_METRICS2, F_ENT2: a follower Tally's metrics, runner.Fused.run's `follow`)
F_ADV, F_SEQ, F_ENT, F_INVN, F_METRICS, F_SCATTER, F_M2PO, F_W, F_TAIL, F_QB, F_CSEQ = range(11)
F_METRICS2, F_ENT2 = 11, 12
# coordinates (coordinates.COORDINATES gives their names and codes)
C_DP, C_L, C_KPOP, C_BKL_QP = range(4)


@intrinsic
def _f2u(typingctx, x):
    """The bits of a float64 as a uint64 (a no-op bitcast)."""
    if not isinstance(x, types.Float) or x.bitwidth != 64:
        return None
    sig = types.uint64(types.float64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


_SIGN = np.uint64(1 << 63)
_ONE = np.uint64(1)
_S63 = np.uint64(63)


@njit(inline="always")
def key(s):
    """A uint64 key with the order of the (non-NaN) float64 s; -0.0 and 0.0 share a key."""
    u = _f2u(s + 0.0)
    if (u >> _S63) == _ONE:
        return ~u
    return u | _SIGN


_U0 = np.uint64(0)
_U1 = np.uint64(1)


@njit(inline="always")
def _bucket(s, lut, l0, nl, klo, khi, shift):
    """(b, e) as uint64: s exceeds thresholds [0, b) for sure and none from e on.

    lut[l0:l0+nl+3] = [0, then for each of the nl buckets of keys (from klo, 2**shift keys
    wide) the number of thresholds with a smaller key, k, k]: the bucket of s's key gives the
    range of thresholds it can exceed. Below klo or above khi the bucket is the first or last
    sentinel (selects, not branches: range checks would mispredict on every other token).
    Unsigned indices spare numba's negative-index checks (a third of the time here).
    """
    kk = key(s)
    idx = ((kk - klo) >> shift) + _U1
    idx = idx if kk <= khi else np.uint64(nl) + _U1
    idx = idx if kk >= klo else _U0
    p = np.uint64(l0) + idx
    return np.uint64(lut[p]), np.uint64(lut[p + _U1])


@njit(inline="always")
def bin_of(s, k, thr, t0, lut, l0, nl, klo, khi, shift):
    """Number of the k sorted thresholds thr[t0:t0+k] that s exceeds (s > t), as uint64;
    k + 1 for s == +inf. Comparisons with the thresholds of s's bucket settle it (exact)."""
    b, e = _bucket(s, lut, l0, nl, klo, khi, shift)
    t = np.uint64(t0)
    while b < e and s > thr[t + b]:
        b += _U1
    return np.uint64(k) + _U1 if s == INF else b


@njit(inline="always")
def bin_incl(s, k, thr, t0, lut, l0, nl, klo, khi, shift):
    """bin_of for inclusive rules (s >= t)."""
    b, e = _bucket(s, lut, l0, nl, klo, khi, shift)
    t = np.uint64(t0)
    while b < e and s >= thr[t + b]:
        b += _U1
    return np.uint64(k) + _U1 if s == INF else b


@njit(inline="always")
def bin_coord(s, k, thr, t0, lut, l0, nl, klo, khi, shift, tiny, nz, gap, kpos, flag):
    """bin_incl on compact keys (program.make_coord_binner) and a flagged table
    (program.flag_lut): a bucket without an edge is its bin (one load, no comparison);
    a flagged one compares the value with its edges (a rare, well-predicted branch).
    |s| <= tiny is bin nz."""
    kk = key(s)
    kk = kk - gap if kk >= kpos else kk
    idx = ((kk - klo) >> shift) + _U1
    idx = idx if kk <= khi else np.uint64(nl) + _U1
    idx = idx if kk >= klo else _U0
    p = np.uint64(l0) + idx
    b = np.uint64(lut[p])
    if b & flag:
        b ^= flag
        e = np.uint64(lut[p + _U1]) & (flag - _U1)
        t = np.uint64(t0)
        while b < e and s >= thr[t + b]:
            b += _U1
    b = np.uint64(k) + _U1 if s == INF else b
    return nz if abs(s) <= tiny else b


@njit(nogil=True, cache=True, error_model="numpy")
def coord_bin_array(x, k, thr, lut, nl, klo, khi, shift, tiny, nz, gap, kpos, flag, out):
    """bin_coord over an array (the tests check the kernel's binning with it)."""
    for i in range(x.shape[0]):
        out[i] = bin_coord(x[i], k, thr, 0, lut, 0, nl, klo, khi, shift, tiny, nz, gap, kpos, flag)


@njit(nogil=True, cache=True, error_model="numpy")
def bin_array(score, k, thr, incl, lut, nl, klo, khi, shift, out):
    """bin_of over an array (sequence rules). Returns 1 if a score was NaN."""
    for i in range(score.shape[0]):
        s = score[i]
        if s != s:
            return 1
        if incl:
            out[i] = bin_incl(s, k, thr, 0, lut, 0, nl, klo, khi, shift)
        else:
            out[i] = bin_of(s, k, thr, 0, lut, 0, nl, klo, khi, shift)
    return 0


BLOCK = 512  # tokens per block: the block's derived arrays stay in L1/L2
# The per-sequence statistics coord_pass accumulates, by their names in the rules' SEQ_STATS
# (and the engine's "mass", the |dp| sum): the sums in these columns of sq_sum (r0..r5 in its
# loop), each sequence's largest k2 in sq_mx and its smallest l in sq_mn. runner.Fused.run
# hands them out by name (BatchOut.seq); any other statistic the engine adds on numpy.
SEQ_SUMS = ("n", "sum_l", "sum_k3", "sum_exp_abs_l", "mass", "sum_adv", "sum_lc", "sum_k3c")
# the last two (verl's clamped sums) only with flags[F_CSEQ]: zeros otherwise
N_CLAMPED_SUMS = 2
N_SEQ_SUMS = len(SEQ_SUMS)
SEQ_MAX = "max_k2"  # sq_mx
SEQ_MIN = "min_l"  # sq_mn
N_FSCRATCH = 19  # float64 scratch rows of coord_pass (13: a run's metric sums; 14-18: cost)
N_USCRATCH = 5  # uint64 scratch rows


@njit(inline="always")
def _flat(a):
    return a.reshape(a.size)


@njit(inline="always")
def _run_sums(start, ra, rb, b_l, b_p, b_q, b_k3c, b_adp, b_rc, ent, has_ent, clampv, out):
    """The metric sums of block tokens ra..rb-1 (one run of a group), each added in token
    order in a register, into out[0:17]: the 15 sums in MetricSums._SUMS order (count
    first; the entropy ones 0.0 unless has_ent), then the largest k3 and |dp|."""
    s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = s9 = s10 = s11 = s12 = 0.0
    s13 = s14 = 0.0
    bk3 = -INF
    bdp = -INF
    for t in range(ra, rb):
        l = b_l[t]  # noqa: E741
        p = b_p[t]
        q = b_q[t]
        # k3 unclamped, as prime-rl's mismatch_kl and verl's k3_kl compute it
        k3c = b_k3c[t] if abs(l) <= clampv else vexpm1(l) - l
        adp = b_adp[t]
        rc = b_rc[t]
        s1 += -l
        s2 += 0.5 * l * l
        s3 += k3c
        s4 += k3c * k3c
        s5 += adp
        s6 += adp * adp
        s7 += p
        s8 += q
        s9 += p * p
        s10 += q * q
        s11 += p * q
        s12 += rc * rc
        bk3 = max(bk3, k3c)
        bdp = max(bdp, adp)
    if has_ent:
        for t in range(ra, rb):
            e = ent[start + t]
            if math.isfinite(e):
                s13 += e
                s14 += 1.0
    out[0] = rb - ra
    out[1] = s1
    out[2] = s2
    out[3] = s3
    out[4] = s4
    out[5] = s5
    out[6] = s6
    out[7] = s7
    out[8] = s8
    out[9] = s9
    out[10] = s10
    out[11] = s11
    out[12] = s12
    out[13] = s13
    out[14] = s14
    out[15] = bk3
    out[16] = bdp


@njit(inline="always")
def _add_run(run, row, msumf, mmaxf, with_ent):
    """A run's sums (`_run_sums`) into group `row` of msum (flat, 15 a row) and its maxima
    into mmax (2 a row); the entropy sums only `with_ent` (else they stay as they are: the
    0.0 a pass without entropy adds)."""
    mo = np.uint64(row) * np.uint64(15)
    for k in range(13):
        msumf[mo + np.uint64(k)] += run[k]
    if with_ent:
        msumf[mo + np.uint64(13)] += run[13]
        msumf[mo + np.uint64(14)] += run[14]
    # maxima: the per-token values are the simple path's bits (pmath), so as they are
    xo = np.uint64(row) * np.uint64(2)
    mmaxf[xo] = max(mmaxf[xo], run[15])
    mmaxf[xo + _U1] = max(mmaxf[xo + _U1], run[16])


@njit(inline="always")
def _is_run(a, start, ra, rb, nb):
    """Whether block tokens ra..rb-1 are a whole run of equal a within the block (tokens
    start..start+nb-1): a is constant there and differs on either side inside the block."""
    if ra > 0 and a[start + ra - 1] == a[start + ra]:
        return False
    if rb < nb and a[start + rb] == a[start + rb - 1]:
        return False
    a0 = a[start + ra]
    t = ra + 1
    while t < rb and a[start + t] == a0:
        t += 1
    return t == rb


@njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
def coord_pass(
    lo,
    hi,
    lp,
    lq,
    adv,
    g,
    sl,
    invn,
    ent,
    flags,
    ckind,
    ccix,
    cma,
    cml,
    ck,
    ct0,
    cl0,
    cnl,
    cklo,
    ckhi,
    cshift,
    ctiny,
    cnz,
    cgap,
    ckpos,
    choff,
    cm1,
    csoff,
    edges,
    lut,
    lflag,
    clamps,
    consts,
    cm,
    sfrac,
    wsum,
    wsq,
    wmax,
    smn,
    smx,
    tflag,
    nflag,
    msum,
    mmax,
    g2,
    g2off,
    msum2,
    mmax2,
    hlin,
    hlog,
    sq_sum,
    sq_mx,
    sq_mn,
    sq_first,
    m2x,
    m2m,
    fs,
    us,
    b_pq,
    b_qp,
    tcut,
    tkeep,
    tbits,
    qedges,
    qcnt,
    tk_i,
    tk_f,
    tk_b,
    tk_n,
):
    """Tokens lo..hi-1 of a batch: every coordinate's intervals, metrics, scatter, sums.

    Block by block: one loop derives every per-token quantity of the block (and adds the
    metrics and the sequence sums); then, coordinate by coordinate, a tight loop bins the
    coordinate on its edges (a table lookup and a comparison or two) and adds the token to
    its (group, class, interval) sums and to its sequence's lowest and highest interval per
    class. A token inside a window is not added: its bit in tflag is set (the caller runs
    it on the simple path) and nflag[c] counts it. 2-D accumulators are used flat with
    unsigned indices. Returns 1 if a coordinate was NaN (a bug), else 0.
    consts: [LOG_CLAMP, scatter lin lo, lin width, log lo, log width, ln 10, bins].
    clamps: (C, 4) rows of [c, log(c), log1p(-c), 1 - c]. fs (N_FSCRATCH, BLOCK) float64,
    us (N_USCRATCH, BLOCK) uint64 (rows 0 and 3 zero), b_pq and b_qp (C or 1, BLOCK): scratch.
    With flags[F_TAIL], a token whose coordinate c is <= tcut[c, 0] or >= tcut[c, 1], lies
    inside a window, or falls in an interval where tkeep (hwidth,) is set (a fixed side of
    some job masks it there) gets bit c in tbits (the engine keeps it: engine/tail.py).
    With flags[F_QB], qcnt[k] counts the tokens whose q falls in [qedges[k], qedges[k + 1])
    (np.searchsorted(qedges, q, "right") - 1; qedges[0] = 0) and qcnt[K + k] sums their
    |dp| (K = len(qedges)); qcnt[2K + k] their |A| (with an advantage), qcnt[3K + k] and
    qcnt[4K + k] their finite entropies' sum and count (with an entropy column).
    With flags[F_TAIL], the tokens given a bit are also written out, block by block while
    their values are in cache, in input order from index lo on: tk_i[0] their batch index,
    tk_i[1] their sequence (sl; 0 without), tk_f[0..2] lp, lq and adv (0 without), tk_b
    their bits; tk_n[0] = how many (at most hi - lo: the chunks' stretches never meet).
    With flags[F_METRICS2], the metrics are also summed per run of one g2 group into
    msum2 and mmax2 at row g2 - g2off (a follower Tally's groups: runner.Fused.run's
    `follow`), the entropy sums only with flags[F_ENT2]. sq_first[s] = the batch index of
    sequence s's first token in lo..hi-1 (-1: none).
    """
    has_adv = flags[F_ADV] != 0
    has_seq = flags[F_SEQ] != 0
    has_ent = flags[F_ENT] != 0
    has_invn = flags[F_INVN] != 0
    do_metrics = flags[F_METRICS] != 0
    do_scatter = flags[F_SCATTER] != 0
    do_m2po = flags[F_M2PO] != 0
    do_w = flags[F_W] != 0
    do_tail = flags[F_TAIL] != 0
    do_qb = flags[F_QB] != 0
    do_cseq = flags[F_CSEQ] != 0
    do_m2 = flags[F_METRICS2] != 0
    has_ent2 = flags[F_ENT2] != 0
    nqe = qedges.shape[0]
    ncoord = ckind.shape[0]
    nclamp = clamps.shape[0]
    clampv = consts[0]
    lin_lo, lin_w, log_lo, log_w, ln10 = consts[1], consts[2], consts[3], consts[4], consts[5]
    nbins = np.int64(consts[6])
    HW = np.uint64(cm.shape[1])
    # cm's last axis: count, |dp| mass and, 5 wide (a log with an advantage), |A| and the
    # corrective and divergent tokens; 7 wide (an entropy column) also the finite
    # entropies' sum and count (what a mask costs: fast/program.expand)
    CW = np.uint64(cm.shape[2])
    cost_a = has_adv and cm.shape[2] >= 5
    cost_e = has_ent and cm.shape[2] >= 7
    SW = np.uint64(smn.shape[1])
    cmf = _flat(cm)
    sfracf = _flat(sfrac)
    wsumf = _flat(wsum)
    wsqf = _flat(wsq)
    wmaxf = _flat(wmax)
    smnf = _flat(smn)
    smxf = _flat(smx)
    msumf = _flat(msum)
    mmaxf = _flat(mmax)
    msum2f = _flat(msum2)
    mmax2f = _flat(mmax2)
    sqf = _flat(sq_sum)
    B = BLOCK
    # scratch rows from the caller (no allocation here: the kernel is compiled without
    # reference counting, whose atomic increments around every token's additions cost more
    # than the additions; runner.py's docstring)
    b_l = fs[0]
    b_adp = fs[1]
    b_dp = fs[2]
    b_rc = fs[3]
    b_k3c = fs[4]
    b_eabs = fs[5]
    sc = fs[6]
    b_p = fs[7]
    b_q = fs[8]
    sx = fs[9]
    sy = fs[10]
    tx = fs[11]
    ty = fs[12]
    b_run = fs[13]  # a run's metric sums (_run_sums)
    b_aa = fs[14]  # |A| (what a mask costs)
    b_cor = fs[15]  # 1.0 where A * l < 0 (corrective), else 0.0
    b_div = fs[16]  # 1.0 where A * l > 0 (divergent)
    b_en = fs[17]  # the entropy where finite, else 0.0
    b_eok = fs[18]  # 1.0 where the entropy is finite
    b_cls = us[0]  # advantage class: 0 a == 0, 1 a > 0, 2 a < 0 (zeros from the caller)
    b_lc = us[1]  # the same for l
    b_gw = us[2]  # group * HW
    b_so = us[3]  # sequence * SW (zeros from the caller)
    b_bin = us[4]  # a coordinate's bin_coord
    bad = False
    nkept = np.int64(0)
    for start in range(lo, hi, B):
        nb = min(B, hi - start)
        # ---- per-token quantities: call-free exp/expm1/log (vmath), so these loops run
        # four tokens at a time (a few ulps off the C library: the windows of |dp| and the
        # binary KLs are wide enough for that: coordinates.py)
        for t in range(nb):
            i = start + t
            lpi = lp[i]
            lqi = lq[i]
            l = lpi - lqi  # noqa: E741
            p = vexp(lpi)
            q = vexp(lqi)
            al = abs(l)
            adp = (p if lpi >= lqi else q) * -vexpm1(-al)
            lc = min(max(l, -clampv), clampv)
            b_l[t] = l
            b_p[t] = p
            b_q[t] = q
            b_adp[t] = adp
            b_dp[t] = math.copysign(adp, l)
            rc = vexp(lc)
            b_rc[t] = rc
            b_k3c[t] = vexpm1(lc) - lc
            b_eabs[t] = vexp(al)  # exp(|l|), unclamped (sequence sums)
        for c in range(nclamp):
            cv = clamps[c, 0]
            clo = clamps[c, 1]
            chi = clamps[c, 2]
            c1 = clamps[c, 3]
            for t in range(nb):
                i = start + t
                la = min(max(lp[i], clo), chi)
                lb = min(max(lq[i], clo), chi)
                ea = vexp(la)
                eb = vexp(lb)
                ca = min(max(-vexpm1(la), cv), c1)
                cb = min(max(-vexpm1(lb), cv), c1)
                lca = vlog(ca)
                lcb = vlog(cb)
                d = la - lb
                t1 = ea * d
                t2 = eb * -d
                pq = t1 + ca * (lca - lcb)
                qp = t2 + cb * (lcb - lca)
                b_pq[c, t] = pq
                b_qp[c, t] = qp
        if do_qb:  # the tokens of each inference-probability bucket
            for t in range(nb):
                qv = b_q[t]
                k = 0
                while k + 1 < nqe and qv >= qedges[k + 1]:
                    k += 1
                qcnt[k] += 1.0
                qcnt[nqe + k] += b_adp[t]
                if has_adv:  # what a mask costs, per bucket: |A| (engine/tail.py)
                    qcnt[2 * nqe + k] += abs(adv[start + t])
                if has_ent:  # ... the finite entropies' sum and count
                    e = ent[start + t]
                    if math.isfinite(e):
                        qcnt[3 * nqe + k] += e
                        qcnt[4 * nqe + k] += 1.0
        # ---- classes, metrics, sequences, m2po
        for t in range(nb):
            i = start + t
            gi = g[i]
            l = b_l[t]  # noqa: E741
            b_gw[t] = np.uint64(gi) * HW
            b_lc[t] = np.uint64(1) if l > 0 else (np.uint64(2) if l < 0 else _U0)
            if has_adv:
                a = adv[i]
                b_cls[t] = np.uint64(1) if a > 0 else (np.uint64(2) if a < 0 else _U0)
                if cost_a:  # the direction of the token's update (engine/bins.direction_class)
                    b_aa[t] = abs(a)
                    b_cor[t] = 1.0 if (a > 0 and l < 0) or (a < 0 and l > 0) else 0.0
                    b_div[t] = 1.0 if (a > 0 and l > 0) or (a < 0 and l < 0) else 0.0
            if cost_e:
                e = ent[i]
                fin = e - e == 0.0
                b_en[t] = e if fin else 0.0
                b_eok[t] = 1.0 if fin else 0.0
            if has_seq:
                b_so[t] = np.uint64(sl[i]) * SW
            if do_m2po:
                m2x[i] = l * l
                m2m[i] = b_adp[t]
        # metrics: each run of one group (usually the whole block) summed in registers;
        # with flags[F_METRICS2] also each run of one g2 group, into msum2 and mmax2 (a
        # follower Tally's groups: the sums its own pass would make, bit for bit). A run
        # that is a run of both (a block inside one step of an ungrouped replay) is summed
        # once for both.
        ra = 0
        while do_metrics and ra < nb:
            g0 = g[start + ra]
            rb = ra + 1
            while rb < nb and g[start + rb] == g0:
                rb += 1
            _run_sums(start, ra, rb, b_l, b_p, b_q, b_k3c, b_adp, b_rc, ent, has_ent, clampv, b_run)
            _add_run(b_run, g0, msumf, mmaxf, True)
            if do_m2 and _is_run(g2, start, ra, rb, nb):
                _add_run(b_run, g2[start + ra] - g2off, msum2f, mmax2f, has_ent2)
            ra = rb
        ra = 0
        while do_m2 and ra < nb:
            h0 = g2[start + ra]
            rb = ra + 1
            while rb < nb and g2[start + rb] == h0:
                rb += 1
            if not (do_metrics and _is_run(g, start, ra, rb, nb)):
                _run_sums(
                    start, ra, rb, b_l, b_p, b_q, b_k3c, b_adp, b_rc, ent, has_ent2, clampv, b_run
                )
                _add_run(b_run, h0 - g2off, msum2f, mmax2f, True)
            ra = rb
        if has_seq:  # sequences are runs of tokens: their sums stay in registers
            cs = np.uint64(sl[start])
            r0 = r1 = r2 = r3 = r4 = r5 = r6 = r7 = 0.0
            rmx = -INF
            rmn = INF
            for t in range(nb + 1):
                so = np.uint64(sl[start + t]) if t < nb else ~cs
                if so != cs:
                    sq = cs * np.uint64(N_SEQ_SUMS)
                    sqf[sq] += r0
                    sqf[sq + np.uint64(1)] += r1
                    sqf[sq + np.uint64(2)] += r2
                    sqf[sq + np.uint64(3)] += r3
                    sqf[sq + np.uint64(4)] += r4
                    sqf[sq + np.uint64(5)] += r5
                    sqf[sq + np.uint64(6)] += r6
                    sqf[sq + np.uint64(7)] += r7
                    sq_mx[cs] = max(sq_mx[cs], rmx)
                    sq_mn[cs] = min(sq_mn[cs], rmn)
                    if t == nb:
                        break
                    cs = so
                    r0 = r1 = r2 = r3 = r4 = r5 = r6 = r7 = 0.0
                    rmx = -INF
                    rmn = INF
                i = start + t
                if sq_first[so] < 0:  # the sequence's first token (the caller: its groups)
                    sq_first[so] = i
                l = b_l[t]  # noqa: E741
                if abs(l) <= clampv:
                    k3 = b_k3c[t]
                    eabs = b_eabs[t]
                else:  # beyond the clamp: unclamped k3 and exp(|l|) (rare)
                    k3 = vexpm1(l) - l
                    eabs = b_eabs[t]
                r0 += 1.0
                r1 += l
                r2 += k3
                r3 += eabs
                r4 += b_adp[t]
                if has_adv:
                    r5 += adv[i]
                if do_cseq:  # verl's k1 and token_k3: lc = clip(l), (exp(lc) - 1) - lc
                    lcl = min(max(l, -clampv), clampv)
                    r6 += lcl
                    r7 += (b_rc[t] - 1.0) - lcl
                rmx = max(rmx, 0.5 * l * l)
                rmn = min(rmn, l)
        if do_scatter:  # separate loops: the divisions vectorise
            for t in range(nb):
                sx[t] = (b_q[t] - lin_lo) / lin_w
                sy[t] = (b_p[t] - lin_lo) / lin_w
                tx[t] = (lq[start + t] / ln10 - log_lo) / log_w
                ty[t] = (lp[start + t] / ln10 - log_lo) / log_w
            top = nbins - 1
            for t in range(nb):
                fx = sx[t]
                fy = sy[t]
                ix = min(max(np.int64(math.floor(fx)), 0), top)
                iy = min(max(np.int64(math.floor(fy)), 0), top)
                hlin[np.uint64(ix * nbins + iy)] += 1
                jx = min(max(np.int64(math.floor(tx[t])), 0), top)
                jy = min(max(np.int64(math.floor(ty[t])), 0), top)
                hlog[np.uint64(jx * nbins + jy)] += 1
        # ---- coordinates: dp, l, a binary KL per clamp; each binned once on its edges
        for c in range(ncoord):
            kind = ckind[c]
            ci = ccix[c]
            if kind == C_DP:
                for t in range(nb):
                    sc[t] = b_dp[t]
            elif kind == C_L:
                for t in range(nb):
                    sc[t] = b_l[t]
            elif kind == C_KPOP:
                for t in range(nb):
                    x1 = b_pq[ci, t]
                    x2 = b_qp[ci, t]
                    sc[t] = x1 if x1 >= x2 else x2
            else:  # C_BKL_QP
                for t in range(nb):
                    sc[t] = b_qp[ci, t]
            kj = ck[c]
            tj = ct0[c]
            lj = cl0[c]
            nlj = cnl[c]
            klj = cklo[c]
            khj = ckhi[c]
            shj = cshift[c]
            tyj = ctiny[c]
            nzj = cnz[c]
            gpj = cgap[c]
            kpj = ckpos[c]
            ho = choff[c]
            m1 = cm1[c]
            ma = cma[c]
            ml = cml[c]
            so0 = csoff[c]
            bit = np.uint32(1) << np.uint32(c)
            wt = do_w and kind == C_L
            nf = 0
            # a sequence's lowest and highest interval are kept in registers along its run
            cur = ~_U0
            cmin = np.int64(0)
            cmax = np.int64(0)
            # two loops: binning (a table load a token), then the sums (loads and stores at
            # the token's interval); apart, each keeps more tokens' memory accesses in
            # flight than one loop doing both
            for t in range(nb):
                x = sc[t]
                bad |= x != x
                b_bin[t] = bin_coord(
                    x, kj, edges, tj, lut, lj, nlj, klj, khj, shj, tyj, nzj, gpj, kpj, lflag
                )
            if do_tail:  # the tails the engine keeps (a rare, well-predicted branch)
                tlo = tcut[c, 0]
                thi = tcut[c, 1]
                for t in range(nb):
                    x = sc[t]
                    if x <= tlo or x >= thi:
                        tbits[start + t] |= bit
            for t in range(nb):
                b = b_bin[t]
                if b & _U1:  # inside a window: the simple path decides
                    tflag[start + t] |= bit
                    if do_tail:
                        tbits[start + t] |= bit
                    nf += 1
                    continue
                m = b >> _U1
                cls = b_cls[t] * ma + b_lc[t] * ml
                if do_tail and tkeep[ho + cls * m1 + m]:
                    tbits[start + t] |= bit
                h = b_gw[t] + ho + cls * m1 + m
                h2 = h * CW  # count and |dp| mass side by side: one cache line a token
                cmf[h2] += 1.0
                cmf[h2 + _U1] += b_adp[t]
                if cost_a:  # |A|, corrective, divergent (the block's, computed once)
                    cmf[h2 + np.uint64(2)] += b_aa[t]
                    cmf[h2 + np.uint64(3)] += b_cor[t]
                    cmf[h2 + np.uint64(4)] += b_div[t]
                if cost_e:
                    cmf[h2 + np.uint64(5)] += b_en[t]
                    cmf[h2 + np.uint64(6)] += b_eok[t]
                if has_invn:
                    sfracf[h] += invn[start + t]
                if wt:
                    rc = b_rc[t]
                    wsumf[h] += rc
                    wsqf[h] += rc * rc
                    wmaxf[h] = max(wmaxf[h], rc)
                if has_seq:
                    so = b_so[t] + so0 + cls
                    if so != cur:
                        if cur != ~_U0:
                            smnf[cur] = cmin
                            smxf[cur] = cmax
                        cur = so
                        cmin = smnf[so]
                        cmax = smxf[so]
                    mi = np.int64(m)
                    cmin = min(cmin, mi)
                    cmax = max(cmax, mi)
            if cur != ~_U0:
                smnf[cur] = cmin
                smxf[cur] = cmax
            nflag[c] += nf
        if do_tail:  # the block's kept tokens, compacted (what the engine's tail gathers)
            for t in range(nb):
                i = start + t
                tb = tbits[i]
                if tb != 0:
                    k = lo + nkept
                    tk_i[0, k] = i
                    tk_i[1, k] = sl[i] if has_seq else 0
                    tk_f[0, k] = lp[i]
                    tk_f[1, k] = lq[i]
                    tk_f[2, k] = adv[i] if has_adv else 0.0
                    tk_b[k] = tb
                    nkept += 1
    tk_n[0] = nkept
    return 1 if bad else 0


@njit(inline="always")
def _count_ge(vals, j, v):
    """Number of vals[0:j] (non-increasing) that are >= v (a binary search; its branches
    are well predicted: most tokens' l^2 fall below every boundary)."""
    a = 0
    b = j
    while a < b:
        mid = (a + b) >> 1
        if vals[mid] >= v:
            a = mid + 1
        else:
            b = mid
    return a


@njit(inline="always")
def _m2po_add(i, bi, g, mass, seq, invn, cnt, msum, sfrac, smax, has_invn):
    """Token i of a step in m2po bin bi: its group's count and sums, its sequence's max."""
    gi = g[i]
    cnt[gi, bi] += 1
    msum[gi, bi] += mass[i]
    if has_invn:
        sfrac[gi, bi] += invn[i]
    if bi > smax[seq[i]]:
        smax[seq[i]] = bi


@njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
def m2po_step(
    xs,
    x,
    g,
    mass,
    seq,
    invn,
    k,
    thr,
    cnt,
    msum,
    sfrac,
    smax,
    has_invn,
    brank,
    suf,
    bval,
    btie,
    level,
    ties,
):
    """m2po for one step. xs: the step's l^2 sorted descending; x, g, mass, seq, invn: its
    tokens in input order. Adds into cnt/msum/sfrac[g, bin] and sets smax[seq] = max bin.
    brank, suf, bval, level (n + 1), btie, ties: scratch of the step's length (no allocation
    here: compiled without reference counting, whose atomic operations around every token's
    additions cost more than the additions). Returns -1 if a score was NaN, else the number
    of tokens left in ties[:nt] for m2po_ties (their bin depends on their input order).

    Rank m gets the mean of xs[m:] (suffix sums accumulated from the smallest value up, as
    engine.m2po.m2po_scores computes them, restarted at each step); its bin is bin_of(mean). Bins
    depend on the rank only, and change at a few ranks m_j (at most one per threshold when
    the means fall monotonically). A token of value v has a rank in the run of v's ties, so
    its bin is the level after the boundaries with xs[m_j] >= v (a binary search over the
    boundaries), unless a boundary falls inside v's tie run: then the ties' input order
    decides (the k-th tie in input order has rank #(xs > v) + k).
    """
    n = xs.shape[0]
    # suffix sums accumulated from the smallest value up: no cancellation against the large
    # values at the top of the step (a total minus a running prefix would lose the digits)
    acc = 0.0
    for m in range(n - 1, -1, -1):
        acc += xs[m]
        suf[m] = acc
    # each rank's bin, the number of thresholds <= its score, found by walking from the
    # previous rank's (scores barely move from one rank to the next; exact either way)
    b = 0
    for m in range(n):
        sc = suf[m] / (n - m)
        if sc != sc:
            return -1
        if sc == INF:
            brank[m] = k + 1
            continue
        b = min(b, k)
        while b > 0 and sc < thr[b - 1]:
            b -= 1
        while b < k and sc >= thr[b]:
            b += 1
        brank[m] = b
    # boundaries: xs at each (non-increasing), whether it splits a run of ties, the level
    level[0] = brank[0]
    nbd = 0
    for m in range(1, n):
        if brank[m] != brank[m - 1]:
            bval[nbd] = xs[m]
            btie[nbd] = xs[m - 1] == xs[m]
            level[nbd + 1] = brank[m]
            nbd += 1
    nt = 0
    low = bval[nbd - 1] if nbd > 0 else INF  # the smallest boundary
    for i in range(x.shape[0]):
        v = x[i]
        # below every boundary (no search, no tie): the last level
        ge = nbd if v < low else _count_ge(bval, nbd, v)
        # boundaries equal to v sit just below ge (bval is non-increasing): usually none,
        # so the second search of the boundaries strictly above v is rarely needed
        tie = False
        jj = ge - 1
        while jj >= 0 and bval[jj] == v:
            if btie[jj]:
                tie = True
            jj -= 1
        if tie:
            ties[nt] = i
            nt += 1
            continue
        bi = level[ge]
        _m2po_add(i, bi, g, mass, seq, invn, cnt, msum, sfrac, smax, has_invn)
    return nt


@njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
def m2po_ties(xs, x, ties, order, brank, g, mass, seq, invn, cnt, msum, sfrac, smax, has_invn):
    """The tokens m2po_step left in ties, in `order` (a stable sort of their values): the
    k-th of equal values in input order has rank #(xs > v) + k."""
    run = 0
    n = xs.shape[0]
    for u in range(order.shape[0]):
        t = order[u]
        i = ties[t]
        v = x[i]
        if u > 0 and x[ties[order[u - 1]]] == v:
            run += 1
        else:
            run = 0
        a = 0
        b = n
        while a < b:  # lo = #(xs > v)
            mid = (a + b) >> 1
            if xs[mid] > v:
                a = mid + 1
            else:
                b = mid
        bi = brank[a + run]
        _m2po_add(i, bi, g, mass, seq, invn, cnt, msum, sfrac, smax, has_invn)
