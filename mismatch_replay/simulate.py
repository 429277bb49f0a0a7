"""Torch-based simulator of trainer/inference probability mismatch in async LLM RL.

``simulate(SimConfig(...), path)`` runs a small but real asynchronous RL job on the CPU
and writes its token log as Parquet in the canonical schema (one row per token):
``step, sample_id, position, token_id, trainer_logprob, inference_logprob,
old_logprob, entropy, advantage, loss_mask, env, reward`` (the sample's reward on each of
its tokens). No mismatch is drawn from a random
number generator: every gap between ``trainer_logprob`` and ``inference_logprob`` comes
from low-precision arithmetic and from weights that are some optimizer steps stale.

How it works
------------
* World. Three synthetic envs (``recall``, ``branch``, ``free``) are env-conditioned
  Markov chains over 252 content tokens whose next-token distributions look like an
  LLM's: mostly one dominant token (p ~ 0.95-0.99), some two-way forks and six-way
  open choices (more of them in ``free``), each with a Zipf tail over 40 rare tokens.
  At every fork/open context one successor is the "good" branch; a response's reward
  is the fraction of its fork decisions that took the good branch (a verifiable
  reward decided by a few high-entropy "forking" tokens, as in reasoning RL).
* Policy. A 2-layer pre-LN causal transformer (d=64, 4 heads, vocab 256, 136k
  parameters), pretrained for 100 Adam steps by distilling the chains' true next-token
  distributions (soft targets, ~5 s; with sampled targets even 300 steps fit worse).
  Its samples are peaked: 65-78% of sampled tokens have p > 0.9 (falling as RL
  reshapes the forks), ~9.5% have p < 0.1.
* Inference engine. Samples each prompt group (``group_size`` responses per prompt)
  with a KV cache, in bf16 (or fp16): weights and every stored activation are rounded
  to bf16, matmuls accumulate in fp32 (tensor-core semantics), logits are rounded to
  bf16 and the log-softmax is done in fp32, as vLLM/SGLang do. The engine logs the
  sampled tokens' log-probs (``inference_logprob``; prompt tokens get teacher-forced
  prefill log-probs, like vLLM's ``prompt_logprobs``). Native bf16 GEMMs on this AVX2
  CPU were ~40x slower than fp32 (2.0 ms vs 54 us for 128x64x256), so the rounding is
  emulated; products of bf16 numbers are exact in fp32, so the emulation is faithful
  up to accumulation order.
* Trainer. Recomputes every token's log-prob in fp32 with its current weights
  (``trainer_logprob``) and the entropy of its distribution (``entropy``), plus the
  fp32 log-prob under the sampler's weights (``old_logprob``; equal to
  ``trainer_logprob`` bit for bit when the lag is 0). Then one policy-gradient step
  (Adam, 5-step LR warm-up): REINFORCE on the token mean with group-centred advantages
  (Dr. GRPO: reward minus the group mean, no std division; one update per batch, so
  a PPO clip would only act through the staleness the log is meant to expose).
  ``freeze_io`` keeps the token and position embeddings, the final norm and the LM head
  out of the RL optimizer (they keep their pretrained values), as LoRA-style RL does:
  the update then reaches the logits only through the blocks, and a higher learning rate
  (drift: 1.2e-3) moves the fork tokens' probabilities by tenths in one step without the
  rare tokens' ratios following (plausibly because their head rows no longer move;
  measured: drift's first quarter has no IcePop token).
* FP8 migration (``migrate_bits``, ``migrate_span``). A rolling move of prompt groups to
  a second inference engine whose logits are rounded to ``migrate_bits`` mantissa bits
  (2 = FP8-E5M2) before the fp32 log-softmax: at step t the first
  round(n_groups * clip((t - a + 1) / (b - a + 1), 0, 1)) groups of the batch run there,
  a = round(migrate_span[0] * steps), b = round(migrate_span[1] * steps) (defaults
  0.25, 0.75: steps 10 and 30 of 40). Like a fleet moved to an FP8 engine group by group,
  it raises the mismatch of every migrated token, but by a bounded amount: rounding a
  logit z to 2 mantissa bits moves it by at most |z| / 8, so likely tokens' probabilities
  move a lot (IPO's |p - q|) while few ratios leave IcePop's [0.2, 5].
* Async pipeline. The trainer keeps a queue of weight snapshots; the sampler's weights
  lag the trainer's by ``staleness`` optimizer steps (``lag="fixed"``, the default) or
  by a per-prompt-group lag drawn uniformly from 0..staleness (``lag="uniform"``, a
  bounded-staleness buffer like AReaL's). The log starts once the pipeline is full
  (``staleness`` unlogged warm-up steps). All lags are sampled in one batched call
  (every weight carries a per-group leading dimension).

Scenarios (defaults: 40 steps x 128 sequences x 40 response tokens = 204,800 loss
tokens, 7 prompt rows per sequence, lr 3e-4, bf16 sampler)
* ``healthy``: fixed lag 4.
* ``stale``: fixed lag 8.
* ``drift`` (the bundled sample, data/README.md): a healthy run that drifts. Fixed lag 1,
  lr 1.04e-3 rising linearly to 1.664e-3 at the last step, ``freeze_io`` (RL on the blocks
  only) and the FP8-E5M2 migration from step 10 to step 30. Its first quarter masks what a
  healthy GLM-4.5-Air run masked (IPO eps 0.1 ~1.9%, eps 0.3 ~0.25%, IcePop nothing); the
  migration then raises the token-mean k3 ~5.7x while IcePop [0.2, 5] masks at most 3 of a
  step's 5,120 tokens. The calibration is one run of a chaotic system (data/README.md: its
  neighbours and other seeds miss).
Optional knobs, not used by the scenarios: ``staleness_end`` (a lag growing linearly
from ``staleness``; the drift scenario's mechanism before issue 19: 1 -> 6 raised k3
~10x but left IPO eps 0.3 at 0 in the early steps), ``lag="uniform"``, ``lr_end`` (the
LR at the last step, reached linearly; drift ramps to 1.6x by default) and
``logit_bits_end`` (round every group's logits to ever fewer mantissa bits, e.g. 7 -> 2
for bf16 -> FP8-E5M2; measured at lag 4: k3 rose only ~3x over the run, since each
rounding error is bounded by half a mantissa step).

Measured figures (seed 0, default configs, threads=1; numpy on the written file:
IPO eps masks |p_train - p_infer| > eps, IcePop masks r = p_train/p_infer outside
[0.2, 5], k3 = r - 1 - log r in float64, over loss tokens)
  scenario (seed)      tokens   k3       IPO 0.1  IPO 0.3  IcePop [0.2, 5]
  healthy (0)          204,800  6.5e-3   2.81%    0.080%   0.0005% (1 token)
  healthy (1)          204,800  6.4e-3   2.66%    0.141%   0.019% (39)
  drift (0) steps 0-9   51,200  4.79e-3  1.94%    0.246%   0% (0)
  drift (0) steps 30-39 51,200  2.75e-2  11.9%    1.01%    0.0137% (7)   k3 x5.7
  drift (0) all        204,800  1.52e-2  6.13%    0.436%   0.0068% (14)
  stale (0)            204,800  3.6e-2   9.72%    1.75%    0.62% (1,269)
The per-step k3 is not monotone: drift seed 0 has a bump at 0.8-1.5e-2 in steps 4-5
(the end of the LR warm-up), settles at 3-6e-3 in steps 6-13 and climbs with the
migration and the LR ramp to 2.0-3.4e-2 from step 25 on (reward 0.35 -> 0.97);
healthy seed 0 falls from 1.0e-2 (steps 10-19) to 3.6e-3 (steps 30-39) as the reward
saturates (0.34 -> 0.87) and the fork tokens stop being uncertain.

Calibration target: the public IPO ablation on GLM-4.5-Air (healthy: ~2% of loss tokens
masked at eps 0.1, ~0.25% at eps 0.3, ~0.003% by IcePop). Reached by healthy: eps 0.1
and IcePop on target, eps 0.3 2-3x low. The trade-off is structural with full-model RL:
staleness moves the fork tokens' logits by a few tenths of a nat with a light tail; the
exploratory runs whose tail reached 0.25% at eps 0.3 (higher lr, or per-group lags
``lag="uniform"``) also pushed IcePop to 0.02-0.05%, 7-15x its target. ``freeze_io``
breaks it: with the head frozen a 3.5-4x higher lr at lag 1 reaches eps 0.3's tail (drift's
first quarter: 0.246%) with no IcePop token at all. A 4-expert top-1 MoE (routing flips
under bf16, the GLM-like source of heavy tails) was tried and dropped: at lag 0 it
masked as many tokens by IcePop as by IPO at eps 0.3, mostly rare tokens.

Speed and determinism. 6.3k-7.1k loss tokens/s on one CPU thread including the ~5 s
pretraining and the Parquet write (29-33 s for a 204,800-token default run on one AVX2
EPYC core; 3.0-3.2 MB of zstd Parquet; drift, at lag 1: 12-22 s, 9.5k-15.5k tokens/s,
3.2-3.3 MB). ``threads`` (default 1) is part of the numerics:
the same seed and config give a bit-for-bit identical file for the same thread count,
torch build and CPU kernels (deterministic algorithms, explicit generators, fixed Parquet
writer settings, no timestamps); 1 and 2 threads give different files, and so may other CPU
kernels (an Intel AVX-512 Xeon wrote another file than an AVX2 EPYC, even with
ATEN_CPU_CAPABILITY=avx2; an AMD EPYC reporting AVX-512F wrote the same). One thread also
avoids OpenMP oversubscription, which made 2-thread runs 4x slower on a busy 2-core
machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "mismatch-replay simulate needs torch: pip install 'mismatch-replay[torch]' "
        "(CPU: pip install torch==2.13.0)"
    ) from exc

__all__ = ["ENVS", "SCENARIOS", "SimConfig", "simulate"]

SCENARIOS = ("healthy", "stale", "drift")
ENVS = ("recall", "branch", "free")
COLUMNS = (
    "step",
    "sample_id",
    "position",
    "token_id",
    "trainer_logprob",
    "inference_logprob",
    "old_logprob",
    "entropy",
    "advantage",
    "loss_mask",
    "env",
)
_LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MANTISSA = {"bf16": 7, "fp16": 10}

# Token layout: 0 = BOS, 1..len(ENVS) = env tags, then content tokens.
_N_SPECIAL = 1 + len(ENVS)
# Per-env mix of next-token distribution kinds: (deterministic, two-way fork, open).
_ENV_PROFILE = {
    "recall": (0.92, 0.07, 0.01),
    "branch": (0.80, 0.16, 0.04),
    "free": (0.68, 0.22, 0.10),
}
# scenario -> (staleness at the first step, staleness at the last step, learning rate,
#              freeze_io, migrate_bits, lr at the last step / lr at the first)
_SCENARIO_DEFAULTS = {
    "healthy": (4, 4, 3e-4, False, 0, 1.0),
    "stale": (8, 8, 3e-4, False, 0, 1.0),
    "drift": (1, 1, 1.04e-3, True, 2, 1.6),
}
# The parameters `freeze_io` keeps out of the RL optimizer (the pretraining still trains them).
_IO_PARAMS = ("tok", "pos", "lnf_w", "lnf_b", "head_w")
_LR_WARMUP = 5
_PRETRAIN_BATCH = 32


@dataclass(frozen=True)
class SimConfig:
    """Configuration of one simulated run (see the module docstring).

    scenario: "healthy" | "stale" | "drift" (sets the staleness schedule and lr defaults).
    steps: logged RL steps; batch: sequences per step (a multiple of group_size);
    seq_len: response tokens per sequence; seed: everything (world, init, sampling).
    staleness: optimizer steps the trainer's weights lead the sampler's (with
        staleness_end: at the first step); None = the scenario's default (healthy 4,
        stale 8, drift 1).
    staleness_end: optional: the lag at the last step, reached linearly (default: staleness,
        a constant lag).
    lag: "fixed" (every group lags `staleness` steps) or "uniform" (each prompt group's
        lag is drawn from 0..staleness).
    lr / lr_end: Adam learning rate at the first step (default 3e-4; drift 1.04e-3) and at
        the last, reached linearly (default: lr, a constant rate; drift: 1.6 x lr).
    freeze_io: RL updates only the transformer blocks: the token and position embeddings,
        the final norm and the LM head stay at their pretrained values (as in LoRA-style
        RL). None = the scenario's default (drift True, the others False).
    migrate_bits / migrate_span: a rolling migration of prompt groups to a second
        inference engine whose logits are rounded to `migrate_bits` mantissa bits (2 =
        FP8-E5M2). migrate_span = (a, b) as fractions of the run: the share of groups
        moved grows linearly from the first group at step round(a * steps) to every group
        at step round(b * steps). migrate_bits None = the scenario's default (drift 2, the
        others 0); 0 = no migration.
    group_size: responses per prompt (advantages are centred within a group).
    prompt_len: prompt tokens (BOS, env tag, chain); vocab, d_model, n_layers, n_heads:
        the policy's size. infer_dtype: the sampler's precision, "bf16" or "fp16".
    logit_bits_end: optional: round the sampler's logits to mantissa bits falling
        linearly from the dtype's (7 / 10) to this value at the last step.
    pretrain_steps: distillation steps before RL. threads: torch CPU threads (the
        output depends on it; keep it fixed for reproducible files).
    top_p / top_k: the sampler truncates (nucleus: the smallest set of tokens whose mass
        reaches top_p; top-k: the k likeliest), samples from the renormalised distribution
        and logs its log-prob, as an engine's processed log-probs are; the log gains
        `kept_mass`, the true kept mass S per token (1 on prompt tokens), so that
        lq + log S is the untruncated log-prob (`--map kept_mass=kept_mass`).
    temperature: the sampler samples at this temperature and logs the tempered log-prob;
        the trainer's stays at temperature 1 (a config mismatch diagnose detects).
    kv_fp8_from: engine noise from this token position on, as an fp8 KV cache from there
        gives (sglang#25790: a divergence from index 96): the sampler's logits of the tokens
        at positions >= kv_fp8_from are rounded to E4M3's 3 mantissa bits. (Rounding this
        small model's own keys and values to 3 bits moved the mean |l| by 3%, measured:
        its attention is too short-range to show what a long context's does.)
    loss: optional: a token masking rule SPEC (`ipo@prime-rl`, `icepop@prime-rl`) applied
        in the policy-gradient loss, as the trainer's `[trainer.loss]` does: the tokens it
        masks (trainer vs inference log-prob of this step) get no gradient; the loss stays
        the mean over all loss tokens (masked ones count 0). None: no mask (every token).
    """

    scenario: str = "drift"
    steps: int = 40
    batch: int = 128
    seq_len: int = 40
    seed: int = 0
    staleness: int | None = None
    staleness_end: int | None = None
    lag: str = "fixed"
    lr: float | None = None
    lr_end: float | None = None
    group_size: int = 8
    prompt_len: int = 8
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    infer_dtype: str = "bf16"
    logit_bits_end: int | None = None
    freeze_io: bool | None = None
    migrate_bits: int | None = None
    migrate_span: tuple[float, float] = (0.25, 0.75)
    pretrain_steps: int = 100
    threads: int = 1
    top_p: float | None = None
    top_k: int | None = None
    temperature: float = 1.0
    kv_fp8_from: int | None = None
    loss: str | None = None

    def resolved(self) -> dict:
        """Scenario defaults filled in: staleness at the first/last step, the learning rate,
        freeze_io, and the migration (first and last step of its ramp, logit bits; bits 0 =
        none)."""
        s0, s1, lr, freeze, mbits, ramp = _SCENARIO_DEFAULTS[self.scenario]
        if self.staleness is not None:
            s0 = s1 = self.staleness
        if self.staleness_end is not None:
            s1 = self.staleness_end
        lr = self.lr if self.lr is not None else lr
        lr_end = self.lr_end if self.lr_end is not None else lr * ramp
        freeze = self.freeze_io if self.freeze_io is not None else freeze
        mbits = self.migrate_bits if self.migrate_bits is not None else mbits
        a, b = self.migrate_span
        return {
            "staleness": s0,
            "staleness_end": s1,
            "lr": lr,
            "lr_end": lr_end,
            "freeze_io": freeze,
            "migrate_bits": mbits,
            "migrate_start": round(a * self.steps),
            "migrate_full": round(b * self.steps),
        }

    def validate(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}, got {self.scenario!r}")
        if self.infer_dtype not in _LOWP:
            raise ValueError(f"infer_dtype must be one of {tuple(_LOWP)}, got {self.infer_dtype!r}")
        if self.lag not in ("uniform", "fixed"):
            raise ValueError(f"lag must be 'uniform' or 'fixed', got {self.lag!r}")
        for name in ("steps", "batch", "seq_len", "group_size", "n_layers", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prompt_len < 3:
            raise ValueError("prompt_len must be >= 3 (BOS, env tag, one content token)")
        if self.batch % self.group_size:
            raise ValueError("batch must be a multiple of group_size")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        if self.vocab < _N_SPECIAL + 64:
            raise ValueError(f"vocab must be >= {_N_SPECIAL + 64}")
        r = self.resolved()
        if min(r["staleness"], r["staleness_end"]) < 0:
            raise ValueError("staleness must be >= 0")
        if min(r["lr"], r["lr_end"]) <= 0:
            raise ValueError("lr must be > 0")
        bits = self.logit_bits_end
        if bits is not None and not 1 <= bits <= _MANTISSA[self.infer_dtype]:
            raise ValueError(f"logit_bits_end must be in 1..{_MANTISSA[self.infer_dtype]}")
        mb = self.migrate_bits
        if mb is not None and not 0 <= mb <= _MANTISSA[self.infer_dtype]:
            raise ValueError(
                f"migrate_bits must be in 0..{_MANTISSA[self.infer_dtype]} (0 = no migration)"
            )
        a, b = self.migrate_span
        if not 0 <= a <= b <= 1:
            raise ValueError("migrate_span must be (a, b) with 0 <= a <= b <= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        if self.kv_fp8_from is not None and self.kv_fp8_from < 1:
            raise ValueError("kv_fp8_from must be >= 1 (a token position)")
        if self.loss is not None:
            _loss_rule(self.loss)

    @property
    def truncated(self) -> bool:
        return self.top_p is not None or self.top_k is not None


# --------------------------------------------------------------------------- model


def _round(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Round fp32 values to `dtype` and back: low-precision storage, fp32 accumulation."""
    return x if dtype is None else x.to(dtype).to(torch.float32)


def _round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round to `bits` explicit mantissa bits (bf16 = 7, fp16 = 10, fp8 e4m3 = 3, e5m2 = 2)."""
    m, e = torch.frexp(x)
    scale = float(2 ** (bits + 1))
    return torch.ldexp(torch.round(m * scale) / scale, e)


def _init_params(cfg: SimConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, v, t = cfg.d_model, cfg.vocab, cfg.prompt_len + cfg.seq_len

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    p = {"tok": normal(v, d), "pos": normal(t, d)}
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for i in range(cfg.n_layers):
        p |= {
            f"l{i}_ln1_w": torch.ones(d),
            f"l{i}_ln1_b": torch.zeros(d),
            f"l{i}_qkv_w": normal(3 * d, d),
            f"l{i}_qkv_b": torch.zeros(3 * d),
            f"l{i}_proj_w": normal(d, d, std=out_std),
            f"l{i}_proj_b": torch.zeros(d),
            f"l{i}_ln2_w": torch.ones(d),
            f"l{i}_ln2_b": torch.zeros(d),
            f"l{i}_up_w": normal(4 * d, d),
            f"l{i}_up_b": torch.zeros(4 * d),
            f"l{i}_down_w": normal(d, 4 * d, std=out_std),
            f"l{i}_down_b": torch.zeros(d),
        }
    p |= {"lnf_w": torch.ones(d), "lnf_b": torch.zeros(d), "head_w": normal(v, d)}
    return p


def _forward(
    params: dict[str, torch.Tensor],
    idx: torch.Tensor,
    n_layers: int,
    n_heads: int,
    lowp: torch.dtype | None = None,
    caches: list[dict] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Pre-LN causal transformer over idx [G, n, t]; every weight has a leading
    group dim of size 1 (shared) or G (one weight version per prompt group).
    `lowp` rounds weights' use and every stored activation to bf16/fp16 while
    matmuls accumulate in fp32 (tensor-core semantics); None = plain fp32."""

    def r(x):
        return _round(x, lowp)

    def lin(x, name):  # x [G, n, t, i] @ w [Gp, o, i]^T
        w, b = params[name + "_w"], params.get(name + "_b")
        g, n, t, i = x.shape
        y = torch.matmul(x.reshape(g, n * t, i), w.transpose(1, 2)).view(g, n, t, -1)
        return y if b is None else y + b[:, None, None, :]

    def norm(x, name):
        y = F.layer_norm(x, x.shape[-1:])
        return y * params[name + "_w"][:, None, None, :] + params[name + "_b"][:, None, None, :]

    g, n, t = idx.shape
    tok = params["tok"]
    x = tok[0][idx] if tok.shape[0] == 1 else tok[torch.arange(g)[:, None, None], idx]
    x = r(x + params["pos"][:, None, offset : offset + t])
    d = x.shape[-1]
    h, hd = n_heads, d // n_heads
    for i in range(n_layers):
        a = r(norm(x, f"l{i}_ln1"))
        qkv = r(lin(a, f"l{i}_qkv")).view(g, n, t, 3, h, hd).permute(3, 0, 1, 4, 2, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [G, n, h, t, hd]
        if caches is not None:
            c = caches[i]
            if "k" in c:
                k, v = torch.cat([c["k"], k], 3), torch.cat([c["v"], v], 3)
            c["k"], c["v"] = k, v
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
        if t > 1:
            tk = k.shape[3]
            s = s.masked_fill(~torch.ones(t, tk, dtype=torch.bool).tril(tk - t), float("-inf"))
        o = r(torch.matmul(r(torch.softmax(s, -1)), v))
        o = o.permute(0, 1, 3, 2, 4).reshape(g, n, t, d)
        x = r(x + r(lin(o, f"l{i}_proj")))
        a = r(norm(x, f"l{i}_ln2"))
        u = r(F.gelu(r(lin(a, f"l{i}_up"))))
        x = r(x + r(lin(u, f"l{i}_down")))
    x = r(norm(x, "lnf"))
    return r(lin(x, "head"))


# --------------------------------------------------------------------------- task


class _World:
    """Synthetic 'language': env-conditioned Markov chains whose next-token
    distributions are LLM-like (mostly one dominant token, some two-way forks and
    open choices, each with a Zipf tail over 40 rare tokens). At every fork/open
    context one successor is the 'good' branch; the RL reward of a response is the
    fraction of its fork decisions that took the good branch."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator) -> None:
        c = cfg.vocab - _N_SPECIAL
        self.n_content = c
        table = np.zeros((len(ENVS), c, c))
        good = np.full((len(ENVS), c), -1, dtype=np.int64)
        tail_w = 1.0 / np.arange(1, 41) ** 1.1
        tail_w /= tail_w.sum()
        for e, env in enumerate(ENVS):
            kinds = rng.choice(3, size=c, p=_ENV_PROFILE[env])
            for x in range(c):
                perm = rng.permutation(c)
                eps = rng.uniform(0.01, 0.05)
                row = np.zeros(c)
                row[perm[10:50]] = eps * tail_w
                if kinds[x] == 0:
                    row[perm[0]] += 1.0 - eps
                elif kinds[x] == 1:
                    a = rng.uniform(0.5, 0.8)
                    row[perm[0]] += (1.0 - eps) * a
                    row[perm[1]] += (1.0 - eps) * (1.0 - a)
                    good[e, x] = perm[rng.integers(2)]
                else:
                    row[perm[:6]] += (1.0 - eps) * rng.dirichlet(np.ones(6))
                    good[e, x] = perm[rng.integers(6)]
                table[e, x] = row / row.sum()
        self.probs = torch.from_numpy(table).to(torch.float32)
        self.entropy = float(-(table * np.log(np.maximum(table, 1e-300))).sum(-1).mean())
        cum = np.cumsum(table, axis=-1)
        cum[..., -1] = 1.0
        self.cum = torch.from_numpy(cum)
        self.good = torch.from_numpy(np.where(good >= 0, good + _N_SPECIAL, -1))

    def sequences(self, env: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        """[BOS, env tag, chain...] of `length` tokens for each env id."""
        n = env.shape[0]
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = 0
        out[:, 1] = 1 + env
        cur = torch.randint(0, self.n_content, (n,), generator=gen)
        out[:, 2] = cur + _N_SPECIAL
        for i in range(3, length):
            u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
            cur = torch.searchsorted(self.cum[env, cur], u).squeeze(1).clamp(max=self.n_content - 1)
            out[:, i] = cur + _N_SPECIAL
        return out

    def reward(self, env: torch.Tensor, ctx: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        c = ctx - _N_SPECIAL
        want = self.good[env[:, None], c.clamp(min=0)].masked_fill(c < 0, -1)
        fork = want >= 0
        return ((resp == want) & fork).sum(1) / fork.sum(1).clamp(min=1)


# --------------------------------------------------------------------------- training


def _pretrain(params, world, cfg, gen) -> float:
    """Distil the world's next-token distributions into the model (soft targets
    converge far faster than sampled ones); returns the final cross-entropy."""
    opt = torch.optim.Adam(params.values(), lr=2e-2)
    total = cfg.prompt_len + cfg.seq_len
    c0 = _N_SPECIAL
    uniform = torch.full((1, 1, world.n_content), 1.0 / world.n_content)
    loss = torch.zeros(())
    for i in range(cfg.pretrain_steps):
        env = torch.randint(0, len(ENVS), (_PRETRAIN_BATCH,), generator=gen)
        seq = world.sequences(env, total, gen)
        logits = _forward(_shared(params), seq[None, :, :-1], cfg.n_layers, cfg.n_heads)[0]
        logp = torch.log_softmax(logits[:, 1:], dim=-1)[..., c0:]
        tgt = world.probs[env[:, None], seq[:, 2:-1] - c0]
        tgt = torch.cat([uniform.expand(len(env), 1, -1), tgt], dim=1)
        loss = -(tgt * logp).sum(-1).mean()
        warm = min(1.0, (i + 1) / 20)
        for grp in opt.param_groups:
            grp["lr"] = 2e-2 * warm * 0.5 * (1 + math.cos(math.pi * i / cfg.pretrain_steps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _shared(params: dict) -> dict:
    return {k: v.unsqueeze(0) for k, v in params.items()}


def _stacked(snaps: list[dict], which: list[int]) -> dict:
    return {k: torch.stack([snaps[j][k] for j in which]) for k in snaps[0]}


def _engine_logits(logits, bits=None, migrated=None, migrate_bits=0):
    """The engine's logits [G, n, ...]: rounded to `bits` mantissa bits (logit_bits_end),
    and for the prompt groups in `migrated` (a bool [G]) to `migrate_bits` (the FP8 engine)."""
    if bits is not None:
        logits = _round_bits(logits, bits)
    if migrated is not None and migrated.any():
        sel = migrated.view((-1,) + (1,) * (logits.dim() - 1))
        logits = torch.where(sel, _round_bits(logits, migrate_bits), logits)
    return logits


@torch.no_grad()
def _generate(params, prompts, n_new, cfg, lowp, gen, bits=None, migrated=None, migrate_bits=0):
    """KV-cached sampling with the inference engine's numerics (one weight version
    per prompt group; `migrated` groups on the engine with `migrate_bits`-bit logits).
    Returns the response tokens and the engine's log-probs for prompt tokens 1..
    (prefill, like vLLM's prompt_logprobs) and response tokens."""
    g, n, _ = prompts.shape
    caches = [{} for _ in range(cfg.n_layers)]
    logits = _forward(params, prompts, cfg.n_layers, cfg.n_heads, lowp, caches)
    logits = _engine_logits(logits, bits, migrated, migrate_bits)
    prompt_lp = torch.log_softmax(logits[:, :, :-1], -1).gather(-1, prompts[..., 1:, None])[..., 0]
    last = logits[:, :, -1]
    toks, lps, kept = [], [], []
    pos = prompts.shape[-1]
    for i in range(n_new):
        if cfg.kv_fp8_from is not None and pos >= cfg.kv_fp8_from:  # the token at position pos
            last = _round_bits(last, 3)
        if cfg.temperature != 1.0:  # the sampler's temperature, in its log-probs too
            last = last / cfg.temperature
        logp = torch.log_softmax(last, dim=-1).view(g * n, -1)
        if cfg.truncated:
            logp, mass = _truncate(logp, cfg.top_p, cfg.top_k)
            kept.append(mass.view(g, n))
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        toks.append(nxt.view(g, n))
        lps.append(logp.gather(-1, nxt).view(g, n))
        if i + 1 < n_new:
            step_in = nxt.view(g, n, 1)
            last = _forward(params, step_in, cfg.n_layers, cfg.n_heads, lowp, caches, pos)
            last = _engine_logits(last[:, :, -1], bits, migrated, migrate_bits)
            pos += 1
    mass = torch.stack(kept, -1) if kept else None
    return torch.stack(toks, -1), prompt_lp, torch.stack(lps, -1), mass


def _truncate(logp: torch.Tensor, top_p: float | None, top_k: int | None):
    """Top-k then top-p (nucleus: the smallest prefix of the sorted tokens whose mass
    reaches top_p) on log-probs [N, V]: the renormalised log-probs (-inf outside) and the
    kept mass S [N] (in float64: lq + log S recovers the untruncated log-prob)."""
    srt, order = torch.sort(logp, dim=-1, descending=True)
    p = srt.exp()
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None:
        keep[:, top_k:] = False
    if top_p is not None:
        keep &= (torch.cumsum(p, -1) - p) < top_p
    keep_v = torch.zeros_like(keep).scatter(-1, order, keep)
    mass = torch.where(keep_v, logp.exp(), 0.0).double().sum(-1)
    out = torch.where(keep_v, logp - mass.log().float()[:, None], float("-inf"))
    return out, mass


def _loss_rule(spec: str):
    """The --loss SPEC's rule (a token masking rule at one setting), else ValueError."""
    from .errors import UsageError
    from .rules import parse_rule
    from .rules.mask import token_mask

    try:
        rule = parse_rule(spec)
        token_mask(rule, np.zeros(1), np.zeros(1), np.zeros(1))
    except UsageError as exc:
        raise ValueError(f"loss {spec!r}: {str(exc).rstrip('.')}") from None
    return rule


def _run(cfg: SimConfig, progress: Callable[[int, int], None] | None):
    res = cfg.resolved()
    loss_rule = _loss_rule(cfg.loss) if cfg.loss is not None else None
    s0, s1, lr0, lr1 = res["staleness"], res["staleness_end"], res["lr"], res["lr_end"]
    lowp = _LOWP[cfg.infer_dtype]
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    world = _World(cfg, rng)
    params = {k: v.requires_grad_() for k, v in _init_params(cfg, gen).items()}
    tp = time.perf_counter()
    pre_loss = _pretrain(params, world, cfg, gen)
    t_pre = time.perf_counter() - tp

    rl_params = [v for k, v in params.items() if not (res["freeze_io"] and k in _IO_PARAMS)]
    opt = torch.optim.Adam(rl_params, lr=lr0)
    m_bits, m_a, m_b = res["migrate_bits"], res["migrate_start"], res["migrate_full"]
    snaps: list[dict] = []
    lowp_snaps: list[dict] = []
    n_groups = cfg.batch // cfg.group_size
    gs, pl = cfg.group_size, cfg.prompt_len
    n_pred = pl + cfg.seq_len - 1  # predicted positions 1 .. pl + seq_len - 1
    cols: dict[str, list] = {k: [] for k in COLUMNS}
    per_step: dict[str, list] = {
        "k3": [],
        "reward": [],
        "staleness": [],
        "mean_lag": [],
        "migrated": [],
        "loss_masked": [],
    }
    env_names = np.array(ENVS, dtype=object)
    positions = np.tile(np.arange(1, n_pred + 1, dtype=np.int64), cfg.batch)
    sample_ids = np.repeat(np.arange(cfg.batch, dtype=np.int64), n_pred)
    loss_mask = torch.zeros(cfg.batch, n_pred, dtype=torch.bool)
    loss_mask[:, pl - 1 :] = True
    mask_np = loss_mask.reshape(-1).numpy()
    warm = s0  # unlogged steps that fill the async pipeline
    for t in range(-warm, cfg.steps):
        frac = max(t, 0) / max(cfg.steps - 1, 1)
        eta = round(s0 + (s1 - s0) * frac)
        lr = lr0 + (lr1 - lr0) * frac
        b1 = cfg.logit_bits_end
        bits = (
            None
            if b1 is None
            else round(_MANTISSA[cfg.infer_dtype] + (b1 - _MANTISSA[cfg.infer_dtype]) * frac)
        )
        snaps.append({k: v.detach().clone() for k, v in params.items()})
        lowp_snaps.append({k: _round(v, lowp) for k, v in snaps[-1].items()})
        del snaps[: -max(s0, s1) - 1], lowp_snaps[: -max(s0, s1) - 1]
        eta_eff = min(eta, len(snaps) - 1)
        if cfg.lag == "uniform":
            lags = torch.randint(0, eta_eff + 1, (n_groups,), generator=gen).tolist()
        else:
            lags = [eta_eff] * n_groups
        which = [len(snaps) - 1 - lag for lag in lags]
        migrated = None
        if m_bits:  # the first groups of the batch run on the migrated engine
            share = min(1.0, max(0.0, (t - m_a + 1) / (m_b - m_a + 1)))
            migrated = torch.arange(n_groups) < round(share * n_groups)

        env = torch.randint(0, len(ENVS), (n_groups,), generator=gen)
        prompts = world.sequences(env, pl, gen)[:, None, :].expand(n_groups, gs, pl)
        resp, p_lp, r_lp, r_mass = _generate(
            _stacked(lowp_snaps, which),
            prompts,
            cfg.seq_len,
            cfg,
            lowp,
            gen,
            bits,
            migrated,
            m_bits,
        )
        seq = torch.cat([prompts, resp], -1)  # [G, gs, pl + L]
        behaviour = _stacked(snaps, which)
        with torch.no_grad():
            old_lp = _token_lp(_forward(behaviour, seq[..., :-1], cfg.n_layers, cfg.n_heads), seq)
        flat = seq.reshape(1, cfg.batch, -1)
        logits = _forward(_shared(params), flat[..., :-1], cfg.n_layers, cfg.n_heads)[0]
        logp_all = torch.log_softmax(logits, -1)
        tr_lp = logp_all.gather(-1, flat[0, :, 1:, None])[..., 0]
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)

        envb = env.repeat_interleave(gs)
        reward = world.reward(envb, flat[0, :, pl - 1 : -1], resp.reshape(cfg.batch, -1))
        grp = reward.view(n_groups, gs)
        adv = (grp - grp.mean(1, keepdim=True)).reshape(-1)  # Dr. GRPO: no std division
        inf_lp = torch.cat([p_lp, r_lp], -1).reshape(cfg.batch, n_pred).double()
        if loss_rule is None:
            loss = -(adv[:, None] * tr_lp)[loss_mask].mean()
        else:  # the rule's mask in the loss: masked tokens get no gradient (--loss)
            from .rules.mask import token_mask

            sel = loss_mask.numpy()
            hit = token_mask(
                loss_rule,
                tr_lp.detach().double().numpy()[sel],
                inf_lp.numpy()[sel],
                adv.double()[:, None].expand(-1, n_pred).numpy()[sel],
            )
            keep = loss_mask.clone()
            keep[loss_mask] = torch.from_numpy(~hit)
            loss = -(adv[:, None] * tr_lp)[keep].sum() / loss_mask.sum()
            if t >= 0:
                per_step["loss_masked"].append(float(hit.mean()))
        for pg in opt.param_groups:
            pg["lr"] = lr * min(1.0, (t + warm + 1) / _LR_WARMUP)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if t < 0:
            continue

        trd = tr_lp.detach().double()
        cols["step"].append(np.full(cfg.batch * n_pred, t, dtype=np.int64))
        cols["sample_id"].append(sample_ids)
        cols["position"].append(positions)
        cols["token_id"].append(flat[0, :, 1:].reshape(-1).numpy())
        cols["trainer_logprob"].append(np.minimum(trd.reshape(-1).numpy(), 0.0))
        cols["inference_logprob"].append(np.minimum(inf_lp.reshape(-1).numpy(), 0.0))
        cols["old_logprob"].append(np.minimum(old_lp.double().reshape(-1).numpy(), 0.0))
        cols["entropy"].append(ent.detach().double().reshape(-1).numpy())
        cols["advantage"].append(np.repeat(adv.double().numpy(), n_pred))
        cols["loss_mask"].append(mask_np)
        cols["env"].append(np.repeat(env_names[envb.numpy()], n_pred))
        cols.setdefault("reward", []).append(np.repeat(reward.double().numpy(), n_pred))
        if r_mass is not None:  # prompt tokens: prefill, never truncated
            full = torch.ones(cfg.batch, n_pred, dtype=torch.float64)
            full[:, pl - 1 :] = r_mass.reshape(cfg.batch, -1)
            cols.setdefault("kept_mass", []).append(full.reshape(-1).numpy())
        lr_ = (trd - inf_lp)[loss_mask].numpy()
        per_step["k3"].append(float(np.mean(np.expm1(lr_) - lr_)))
        per_step["reward"].append(float(reward.mean()))
        per_step["staleness"].append(eta_eff)
        per_step["mean_lag"].append(float(np.mean(lags)))
        per_step["migrated"].append(0 if migrated is None else int(migrated.sum()) / n_groups)
        if progress is not None:
            progress(t + 1, cfg.steps)
    data = {k: np.concatenate(v) for k, v in cols.items()}
    summary = {
        "scenario": cfg.scenario,
        "steps": cfg.steps,
        "sequences": cfg.steps * cfg.batch,
        "tokens": int(data["loss_mask"].sum()),
        "rows": len(data["step"]),
        "k3_per_step": per_step["k3"],
        "reward_per_step": per_step["reward"],
        "staleness_per_step": per_step["staleness"],
        "mean_lag_per_step": per_step["mean_lag"],
        "migrated_per_step": per_step["migrated"],
        "loss_masked_per_step": per_step["loss_masked"],
        "pretrain_seconds": t_pre,
        "pretrain_loss": pre_loss,
        "pretrain_floor": world.entropy,
        "config": asdict(cfg) | {"resolved": res},
    }
    return data, summary


def _token_lp(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Log-prob of seq[..., 1:] under logits [G, n, T-1, V], flattened to [G*n, T-1]."""
    lp = torch.log_softmax(logits, -1).gather(-1, seq[..., 1:, None])[..., 0]
    return lp.reshape(-1, lp.shape[-1])


# --------------------------------------------------------------------------- output


def _write(data: dict, path: Path, force: bool = False) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "step": pa.int64(),
        "sample_id": pa.int64(),
        "position": pa.int64(),
        "token_id": pa.int64(),
        "trainer_logprob": pa.float64(),
        "inference_logprob": pa.float64(),
        "old_logprob": pa.float64(),
        "entropy": pa.float64(),
        "advantage": pa.float64(),
        "loss_mask": pa.bool_(),
        "env": pa.string(),
    }
    names = [*COLUMNS, *(c for c in ("kept_mass", "reward") if c in data)]
    types["kept_mass"] = types["reward"] = pa.float64()
    arrays = [pa.array(data[c].tolist() if c == "env" else data[c], types[c]) for c in names]
    table = pa.Table.from_arrays(arrays, schema=pa.schema([(c, types[c]) for c in names]))
    from .output import atomic_write

    # a hidden temporary, then an exclusive publish: never over a file that appeared meanwhile
    atomic_write(
        path,
        lambda tmp: pq.write_table(
            table,
            tmp,
            compression="zstd",
            compression_level=9,
            use_dictionary=["env"],
            row_group_size=1 << 20,
            write_statistics=True,
        ),
        force,
    )


def simulate(
    config: SimConfig,
    path: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
    force: bool = False,
) -> dict:
    """Run the simulated async-RL job described by `config` and write its token log
    to `path` (Parquet, canonical columns). Refuses to overwrite an existing file (or one
    that appears while it runs) unless `force`.
    `progress(done_steps, total_steps)` is called after every logged step.
    Returns a summary dict (tokens, sequences, steps, seconds, tokens_per_second,
    k3_per_step, reward_per_step, staleness_per_step, ...)."""
    config.validate()
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} already exists; refusing to overwrite it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"directory {path.parent} does not exist")
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    try:
        data, summary = _run(config, progress)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    _write(data, path, force)
    seconds = time.perf_counter() - t0
    summary["path"] = str(path)
    summary["seconds"] = seconds
    summary["tokens_per_second"] = summary["tokens"] / seconds
    summary["mean_k3"] = float(np.mean(summary["k3_per_step"]))
    return summary
