"""The numba side of `kernels`: one fused loop over the tokens of a batch (see kernels.py).

Imported only when numba is installed and the fused path is on; nothing else imports it.
Every score is computed with the same float64 operations, in the same order, as the rule's
numpy `score()` in rules.py (the same libm exp/expm1/log calls, no fast-math, no contraction),
so the fused path bins bit-identical scores; tests/test_kernels.py checks it on random logs.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

INF = math.inf

# score ops (kernels.OPS gives their names); keep in sync with kernels.compile_job
OP_ABS_DP = 0
OP_IPOV1_HIGH = 1
OP_IPOV1_LOW = 2
OP_BAND_HIGH = 3
OP_BAND_LOW = 4
OP_KPOP = 5
OP_K2 = 6
OP_K3 = 7
OP_DPPOTV_HIGH = 8
OP_DPPOTV_LOW = 9
OP_DPPOKL_HIGH = 10
OP_DPPOKL_LOW = 11
OP_PPO_HIGH = 12
OP_PPO_LOW = 13
OP_PPO_C = 14
OP_L = 15
# base quantities (kernels.BASES gives their names)
B_ADP = 0
B_DP = 1
B_NEG_DP = 2
B_L = 3
B_NEG_L = 4
B_R = 5
B_NEG_R = 6
B_K2 = 7
B_K3 = 8
B_KPOP = 9
B_BKL_QP = 10
# weight ops
W_NONE = 0
W_RCLAMP = 1
W_CISPO_HIGH = 2
W_CISPO_LOW = 3

# flags
F_ADV, F_SEQ, F_ENT, F_INVN, F_METRICS, F_SCATTER, F_M2PO = range(7)


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


@njit(nogil=True, cache=True, error_model="numpy")
def bin_array(score, k, thr, incl, lut, nl, klo, khi, shift, out):
    """bin_of over an array (sequence rules, m2po). Returns 1 if a score was NaN."""
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


@njit(inline="always")
def _flat(a):
    return a.reshape(a.size)


@njit(nogil=True, cache=True, error_model="numpy")
def token_pass(
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
    op,
    wop,
    cix,
    fp,
    kk,
    base,
    off,
    woff,
    bop,
    bcix,
    bk,
    bt0,
    bl0,
    bnl,
    bklo,
    bkhi,
    bshift,
    thr,
    lut,
    clamps,
    consts,
    cnt,
    mass,
    sfrac,
    wsum,
    wsq,
    wmax,
    smax,
    msum,
    mmax,
    hlin,
    hlog,
    sq_sum,
    sq_mx,
    sq_mn,
    sq_first,
    m2x,
    m2m,
):
    """Tokens lo..hi-1 of a batch: every compiled job, metrics, scatter, sequence sums.

    Block by block: first one loop derives every shared quantity of the block's tokens
    (and adds metrics and sequence sums); then, job by job, a tight loop makes the job's
    scores from them and another bins them and adds count and mass. Job-major blocks keep
    each job's table, thresholds and sums hot in L1 and its loops free of branches on the
    rule; 2-D accumulators are used flat with unsigned indices. Accumulates into this
    thread's arrays; returns 1 if a score was NaN (a bug), else 0.
    consts: [LOG_CLAMP, scatter lin lo, lin width, log lo, log width, ln 10, bins].
    clamps: (C, 4) rows of [c, log(c), log1p(-c), 1 - c].
    """
    has_adv = flags[F_ADV] != 0
    has_seq = flags[F_SEQ] != 0
    has_ent = flags[F_ENT] != 0
    has_invn = flags[F_INVN] != 0
    do_metrics = flags[F_METRICS] != 0
    do_scatter = flags[F_SCATTER] != 0
    do_m2po = flags[F_M2PO] != 0
    njobs = op.shape[0]
    nbase = bop.shape[0]
    nclamp = clamps.shape[0]
    clampv = consts[0]
    lin_lo, lin_w, log_lo, log_w, ln10 = consts[1], consts[2], consts[3], consts[4], consts[5]
    nbins = np.int64(consts[6])
    W = np.uint64(cnt.shape[1])
    WW = np.uint64(wsum.shape[1])
    NU = np.uint64(smax.shape[1])
    cntf = _flat(cnt)
    massf = _flat(mass)
    sfracf = _flat(sfrac)
    wsumf = _flat(wsum)
    wsqf = _flat(wsq)
    wmaxf = _flat(wmax)
    smaxf = _flat(smax)
    msumf = _flat(msum)
    mmaxf = _flat(mmax)
    sqf = _flat(sq_sum)
    B = BLOCK
    b_l = np.empty(B)
    b_adp = np.empty(B)
    b_dp = np.empty(B)
    b_k2 = np.empty(B)
    b_k3 = np.empty(B)
    b_r = np.empty(B)
    b_rc = np.empty(B)
    b_a = np.zeros(B)
    b_gw = np.empty(B, np.uint64)  # group * W
    b_g = np.empty(B, np.uint64)
    b_pq = np.empty((max(nclamp, 1), B))
    b_qp = np.empty((max(nclamp, 1), B))
    sc = np.empty(B)
    bins = np.empty(B, np.uint64)
    bbins = np.empty(max(nbase, 1) * B, np.uint64)
    b_p = np.empty(B)
    b_q = np.empty(B)
    sx = np.empty(B)
    sy = np.empty(B)
    tx = np.empty(B)
    ty = np.empty(B)
    bad = False
    for start in range(lo, hi, B):
        nb = min(B, hi - start)
        # ---- shared quantities, metrics, sequences, m2po
        for t in range(nb):
            i = start + t
            lpi = lp[i]
            lqi = lq[i]
            gi = g[i]
            l = lpi - lqi  # noqa: E741
            p = math.exp(lpi)
            q = math.exp(lqi)
            # |dp| = exp(max) * -expm1(min - max), as TokenBatch.abs_dp
            ge = lpi >= lqi
            adp = (p if ge else q) * -math.expm1((lqi - lpi) if ge else (lpi - lqi))
            k2 = 0.5 * l * l
            k3 = math.expm1(l) - l
            r = math.exp(l)
            lc = min(max(l, -clampv), clampv)
            if lc == l:
                rc = r
                k3c = k3
            else:
                rc = math.exp(lc)
                k3c = math.expm1(lc) - lc
            b_l[t] = l
            b_adp[t] = adp
            b_dp[t] = math.copysign(adp, l)
            b_k2[t] = k2
            b_k3[t] = k3
            b_r[t] = r
            b_rc[t] = rc
            b_g[t] = np.uint64(gi)
            b_gw[t] = np.uint64(gi) * W
            if has_adv:
                b_a[t] = adv[i]
            for c in range(nclamp):
                cv = clamps[c, 0]
                clo = clamps[c, 1]
                chi = clamps[c, 2]
                c1 = clamps[c, 3]
                la = min(max(lpi, clo), chi)
                lb = min(max(lqi, clo), chi)
                ea = p if la == lpi else math.exp(la)
                eb = q if lb == lqi else math.exp(lb)
                ca = min(max(-math.expm1(la), cv), c1)
                cb = min(max(-math.expm1(lb), cv), c1)
                lca = math.log(ca)
                lcb = math.log(cb)
                b_pq[c, t] = ea * (la - lb) + ca * (lca - lcb)
                b_qp[c, t] = eb * (lb - la) + cb * (lcb - lca)
            if do_metrics:
                mo = np.uint64(gi) * np.uint64(15)
                msumf[mo] += 1.0
                msumf[mo + np.uint64(1)] += -l
                msumf[mo + np.uint64(2)] += k2
                msumf[mo + np.uint64(3)] += k3c
                msumf[mo + np.uint64(4)] += k3c * k3c
                msumf[mo + np.uint64(5)] += adp
                msumf[mo + np.uint64(6)] += adp * adp
                msumf[mo + np.uint64(7)] += p
                msumf[mo + np.uint64(8)] += q
                msumf[mo + np.uint64(9)] += p * p
                msumf[mo + np.uint64(10)] += q * q
                msumf[mo + np.uint64(11)] += p * q
                msumf[mo + np.uint64(12)] += rc * rc
                if has_ent:
                    e = ent[i]
                    if math.isfinite(e):
                        msumf[mo + np.uint64(13)] += e
                        msumf[mo + np.uint64(14)] += 1.0
                xo = np.uint64(gi) * np.uint64(2)
                mmaxf[xo] = max(mmaxf[xo], k3c)
                mmaxf[xo + _U1] = max(mmaxf[xo + _U1], adp)
            if do_scatter:
                b_p[t] = p
                b_q[t] = q
            if has_seq:
                so = np.uint64(sl[i])
                sq = so * np.uint64(6)
                sqf[sq] += 1.0
                sqf[sq + np.uint64(1)] += l
                sqf[sq + np.uint64(2)] += k3
                sqf[sq + np.uint64(3)] += r if l >= 0 else math.exp(-l)
                sqf[sq + np.uint64(4)] += adp
                if has_adv:
                    sqf[sq + np.uint64(5)] += adv[i]
                sq_mx[so] = max(sq_mx[so], k2)
                sq_mn[so] = min(sq_mn[so], l)
                if sq_first[so] < 0:
                    sq_first[so] = gi
            if do_m2po:
                m2x[i] = l * l
                m2m[i] = adp
        if do_scatter:  # separate loops: the divisions vectorise
            for t in range(nb):
                sx[t] = (b_q[t] - lin_lo) / lin_w
                sy[t] = (b_p[t] - lin_lo) / lin_w
                tx[t] = (lq[start + t] / ln10 - log_lo) / log_w
                ty[t] = (lp[start + t] / ln10 - log_lo) / log_w
            top = nbins - 1
            for t in range(nb):
                ix = min(max(np.int64(math.floor(sx[t])), 0), top)
                iy = min(max(np.int64(math.floor(sy[t])), 0), top)
                hlin[np.uint64(ix * nbins + iy)] += 1
                jx = min(max(np.int64(math.floor(tx[t])), 0), top)
                jy = min(max(np.int64(math.floor(ty[t])), 0), top)
                hlog[np.uint64(jx * nbins + jy)] += 1
        # ---- bases: the quantities jobs bin (|dp|, dp, -dp, l, -l, r, -r, k2, k3, binary
        # KLs), each binned once per grid; a job's own conditions only move tokens to bin 0
        # (score -inf) or K + 1 (score +inf), so jobs that differ only there share the bins.
        for u in range(nbase):
            bo = bop[u]
            c = bcix[u]
            if bo == B_ADP:
                for t in range(nb):
                    sc[t] = b_adp[t]
            elif bo == B_DP:
                for t in range(nb):
                    sc[t] = b_dp[t]
            elif bo == B_NEG_DP:
                for t in range(nb):
                    sc[t] = -b_dp[t]
            elif bo == B_L:
                for t in range(nb):
                    sc[t] = b_l[t]
            elif bo == B_NEG_L:
                for t in range(nb):
                    sc[t] = -b_l[t]
            elif bo == B_R:
                for t in range(nb):
                    sc[t] = b_r[t]
            elif bo == B_NEG_R:
                for t in range(nb):
                    sc[t] = -b_r[t]
            elif bo == B_K2:
                for t in range(nb):
                    sc[t] = b_k2[t]
            elif bo == B_K3:
                for t in range(nb):
                    sc[t] = b_k3[t]
            elif bo == B_KPOP:
                for t in range(nb):
                    x1 = b_pq[c, t]
                    x2 = b_qp[c, t]
                    sc[t] = x1 if x1 >= x2 else x2
            else:  # B_BKL_QP
                for t in range(nb):
                    sc[t] = b_qp[c, t]
            kj = bk[u]
            tj = bt0[u]
            lj = bl0[u]
            nlj = bnl[u]
            klj = bklo[u]
            khj = bkhi[u]
            shj = bshift[u]
            row = np.uint64(u) * np.uint64(B)
            for t in range(nb):
                x = sc[t]
                bad |= x != x
                bbins[row + np.uint64(t)] = bin_of(x, kj, thr, tj, lut, lj, nlj, klj, khj, shj)
        # ---- jobs: each base bin, moved by the job's conditions, then the sums
        for j in range(njobs):
            o = op[j]
            f0 = fp[j, 0]
            f1 = fp[j, 1]
            f2 = fp[j, 2]
            f3 = fp[j, 3]
            row = np.uint64(base[j]) * np.uint64(B)
            k1 = np.uint64(kk[j]) + _U1  # the bin of +inf
            if o == OP_IPOV1_HIGH:
                for t in range(nb):
                    bb = bbins[row + np.uint64(t)]
                    bins[t] = k1 if b_dp[t] < -f0 else bb
            elif o == OP_IPOV1_LOW:
                for t in range(nb):
                    bb = bbins[row + np.uint64(t)]
                    bins[t] = k1 if b_dp[t] > f0 else bb
            elif o == OP_BAND_HIGH:
                for t in range(nb):
                    bb = bbins[row + np.uint64(t)]
                    bins[t] = k1 if b_l[t] < f0 else bb
            elif o == OP_BAND_LOW:
                for t in range(nb):
                    bb = bbins[row + np.uint64(t)]
                    bins[t] = k1 if b_l[t] > f0 else bb
            elif o == OP_DPPOTV_HIGH:
                for t in range(nb):
                    a = b_a[t]
                    bb = bbins[row + np.uint64(t)] if a > 0 else _U0
                    bins[t] = k1 if (a <= 0) & (b_dp[t] < -f0) else bb
            elif o == OP_DPPOTV_LOW:
                for t in range(nb):
                    a = b_a[t]
                    bb = bbins[row + np.uint64(t)] if a <= 0 else _U0
                    bins[t] = k1 if (a > 0) & (b_dp[t] > f0) else bb
            elif OP_DPPOKL_HIGH <= o <= OP_DPPOKL_LOW:  # consecutive ops
                c = cix[j]
                hi_side = o == OP_DPPOKL_HIGH
                for t in range(nb):
                    a = b_a[t]
                    x = b_l[t]
                    up = (a > 0) & (x > 0)
                    down = (a < 0) & (x < 0)
                    valid = up if hi_side else down
                    other = down if hi_side else up
                    bb = bbins[row + np.uint64(t)] if valid else _U0
                    bins[t] = k1 if other & (b_qp[c, t] > f0) else bb
            elif OP_PPO_HIGH <= o <= OP_PPO_C:  # the three ppo ops are consecutive
                # fp: [1 + eps_high, 1 - eps_low, c, has_c]
                for t in range(nb):
                    a = b_a[t]
                    r = b_r[t]
                    up = (a > 0) & (r > f0)
                    down = (a < 0) & (r < f1)
                    extra = (f3 != 0) & (a < 0) & (r > f2)
                    if o == OP_PPO_HIGH:
                        valid = a > 0
                        inf = down | extra
                    elif o == OP_PPO_LOW:
                        valid = a < 0
                        inf = up | extra
                    else:
                        valid = a < 0
                        inf = up | down
                    bb = bbins[row + np.uint64(t)] if valid else _U0
                    bins[t] = k1 if inf else bb
            else:  # abs_dp, kpop, k2, k3, l: the base's bins as they are
                for t in range(nb):
                    bins[t] = bbins[row + np.uint64(t)]
            oj = np.uint64(off[j])
            for t in range(nb):
                col = b_gw[t] + oj + bins[t]
                cntf[col] += 1
                massf[col] += b_adp[t]
            if has_invn:
                for t in range(nb):
                    sfracf[b_gw[t] + oj + bins[t]] += invn[start + t]
            if has_seq:  # sequences are runs of tokens: keep the run's max in a register
                ju = np.uint64(j)
                cur = np.uint64(sl[start])
                mx = np.uint64(smaxf[cur * NU + ju])
                for t in range(nb):
                    si = np.uint64(sl[start + t])
                    if si != cur:
                        smaxf[cur * NU + ju] = mx
                        cur = si
                        mx = np.uint64(smaxf[cur * NU + ju])
                    mx = max(mx, bins[t])
                smaxf[cur * NU + ju] = mx
            w_op = wop[j]
            if w_op != W_NONE:
                wo = np.uint64(woff[j])
                for t in range(nb):
                    rc = b_rc[t]
                    x = b_l[t]
                    if w_op == W_RCLAMP:
                        w = rc
                    elif w_op == W_CISPO_HIGH:
                        w = f1 if x < f0 else rc
                    else:
                        w = f1 if x > f0 else rc
                    wc = b_g[t] * WW + wo + bins[t]
                    wsumf[wc] += w
                    wsqf[wc] += w * w
                    wmaxf[wc] = max(wmaxf[wc], w)
    return 1 if bad else 0


@njit(inline="always")
def _count_ge(vals, j, v, strict):
    """Number of vals[0:j] (non-increasing) that are >= v (> v when strict)."""
    a = 0
    b = j
    while a < b:
        mid = (a + b) >> 1
        if vals[mid] > v or (not strict and vals[mid] == v):
            a = mid + 1
        else:
            b = mid
    return a


@njit(nogil=True, cache=True, error_model="numpy")
def m2po_step(
    xs, x, g, mass, seq, invn, k, thr, lut, nl, klo, khi, shift, cnt, msum, sfrac, smax, has_invn
):
    """m2po for one step. xs: the step's l^2 sorted descending; x, g, mass, seq, invn: its
    tokens in input order. Adds into cnt/msum/sfrac[g, bin] and sets smax[seq] = max bin.
    Returns 1 if a score was NaN.

    Rank m gets the mean of xs[m:] (suffix sums accumulated from the smallest value up, as
    tables.m2po_scores computes them, restarted at each step); its bin is bin_of(mean). Bins
    depend on the rank only, and change at a few ranks m_j (at most one per threshold when
    the means fall monotonically). A token of value v has a rank in the run of v's ties, so
    its bin is the level after the boundaries with xs[m_j] >= v (a binary search over the
    boundaries), unless a boundary falls inside v's tie run: then the ties' input order
    decides (the k-th tie in input order has rank #(xs > v) + k).
    """
    n = xs.shape[0]
    brank = np.empty(n, np.int64)
    # suffix sums accumulated from the smallest value up: no cancellation against the large
    # values at the top of the step (a total minus a running prefix would lose the digits)
    suf = np.empty(n)
    acc = 0.0
    for m in range(n - 1, -1, -1):
        acc += xs[m]
        suf[m] = acc
    nbd = 0
    for m in range(n):
        sc = suf[m] / (n - m)
        if sc != sc:
            return 1
        brank[m] = bin_incl(sc, k, thr, 0, lut, 0, nl, klo, khi, shift)
        if m > 0 and brank[m] != brank[m - 1]:
            nbd += 1
    bval = np.empty(nbd)  # xs at each boundary (non-increasing)
    btie = np.empty(nbd, np.bool_)  # the boundary splits a run of ties
    level = np.empty(nbd + 1, np.int64)
    level[0] = brank[0]
    j = 0
    for m in range(1, n):
        if brank[m] != brank[m - 1]:
            bval[j] = xs[m]
            btie[j] = xs[m - 1] == xs[m]
            level[j + 1] = brank[m]
            j += 1
    nt = 0
    ties = np.empty(x.shape[0], np.int64)
    for i in range(x.shape[0]):
        v = x[i]
        ge = _count_ge(bval, nbd, v, False)
        gt = _count_ge(bval, nbd, v, True)
        tie = False
        for jj in range(gt, ge):
            if btie[jj]:
                tie = True
        if tie:
            ties[nt] = i
            nt += 1
            continue
        bi = level[ge]
        gi = g[i]
        cnt[gi, bi] += 1
        msum[gi, bi] += mass[i]
        if has_invn:
            sfrac[gi, bi] += invn[i]
        if bi > smax[seq[i]]:
            smax[seq[i]] = bi
    if nt == 0:
        return 0
    tv = np.empty(nt)
    for t in range(nt):
        tv[t] = x[ties[t]]
    order = np.argsort(tv, kind="mergesort")  # stable: input order within a value
    run = 0
    for u in range(nt):
        t = order[u]
        if u > 0 and tv[order[u - 1]] == tv[t]:
            run += 1
        else:
            run = 0
        i = ties[t]
        v = x[i]
        a = 0
        b = n
        while a < b:  # lo = #(xs > v)
            mid = (a + b) >> 1
            if xs[mid] > v:
                a = mid + 1
            else:
                b = mid
        bi = brank[a + run]
        gi = g[i]
        cnt[gi, bi] += 1
        msum[gi, bi] += mass[i]
        if has_invn:
            sfrac[gi, bi] += invn[i]
        if bi > smax[seq[i]]:
            smax[seq[i]] = bi
    return 0
