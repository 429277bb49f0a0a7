"""Draft (docstring written at the end)."""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "mismatch-replay simulate needs torch: pip install 'mismatch-replay[torch]' "
        "(CPU: pip install torch==2.13.0)"
    ) from exc

SCENARIOS = ("healthy", "stale", "drift")
ENVS = ("recall", "branch", "free")
INFER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# token layout: 0 = BOS, 1..len(ENVS) = env tags, then content tokens
_N_SPECIAL = 1 + len(ENVS)

# per-env mix of next-token distribution kinds: (deterministic, forking, open)
_ENV_PROFILE = {
    "recall": (0.92, 0.07, 0.01),
    "branch": (0.80, 0.16, 0.04),
    "free": (0.68, 0.22, 0.10),
}

_DEFAULT_STALENESS = {"healthy": 1, "stale": 8, "drift": 1}


@dataclass(frozen=True)
class SimConfig:
    scenario: str = "drift"
    steps: int = 40
    batch: int = 128
    seq_len: int = 40
    seed: int = 0
    staleness: int | None = None
    group_size: int = 8
    prompt_len: int = 8
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 0
    infer_dtype: str = "bf16"
    lr: float = 1e-3
    pretrain_steps: int = 150
    pretrain_lr: float = 2e-2
    threads: int = 2
    # experiment knobs
    drift_staleness_end: int | None = None
    drift_lr_end: float | None = None
    drift_logit_bits_end: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)


# --------------------------------------------------------------------------- model


def _round(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Round fp32 values to `dtype` and back (emulated low-precision storage)."""
    if dtype is None:
        return x
    return x.to(dtype).to(torch.float32)


class _Block(nn.Module):
    def __init__(self, d: int, n_heads: int, n_experts: int = 0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_experts = n_experts
        if n_experts:
            self.router = nn.Linear(d, n_experts, bias=False)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, lp, cache):
        b, t, d = x.shape
        h = self.n_heads
        hd = d // h
        a = lp(F.layer_norm(x, (d,), self.ln1.weight, self.ln1.bias))
        qkv = lp(F.linear(a, self.qkv.weight, self.qkv.bias))
        q, k, v = qkv.view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if cache.get("k") is not None:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd))
        tk = k.shape[2]
        if t > 1:
            mask = torch.ones(t, tk, dtype=torch.bool).tril(diagonal=tk - t)
            s = s.masked_fill(~mask, float("-inf"))
        p = lp(torch.softmax(s, dim=-1))
        o = lp((p @ v).transpose(1, 2).reshape(b, t, d))
        x = lp(x + lp(F.linear(o, self.proj.weight, self.proj.bias)))
        a = lp(F.layer_norm(x, (d,), self.ln2.weight, self.ln2.bias))
        u = lp(F.gelu(lp(F.linear(a, self.up.weight, self.up.bias))))
        if not self.n_experts:
            return lp(x + lp(F.linear(u, self.down.weight, self.down.bias)))
        ne = self.n_experts
        gate = torch.softmax(lp(F.linear(a, self.router.weight)).float(), dim=-1)
        top = gate.argmax(-1, keepdim=True)
        w = gate.gather(-1, top)
        hdim = u.shape[-1] // ne
        u = u.reshape(b * t, ne, hdim).transpose(0, 1)  # [ne, N, hdim]
        dw = self.down.weight.view(d, ne, hdim).permute(1, 2, 0)  # [ne, hdim, d]
        y_all = torch.bmm(u, dw).transpose(0, 1)  # [N, ne, d]
        y = y_all.gather(1, top.reshape(b * t, 1, 1).expand(b * t, 1, d)).view(b, t, d)
        y = lp(y + self.down.bias)
        self.aux = (gate.mean((0, 1)) * F.one_hot(top.squeeze(-1), ne).float().mean((0, 1))).sum() * ne
        return lp(x + lp(w * y))


class _TinyLM(nn.Module):
    def __init__(
        self, vocab: int, d: int, n_layers: int, n_heads: int, max_len: int, n_experts: int = 0
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_Block(d, n_heads, n_experts) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.act_dtype: torch.dtype | None = None

    def forward(self, idx, caches=None, offset: int = 0):
        dt = self.act_dtype

        def lp(x):
            return _round(x, dt)

        t = idx.shape[1]
        x = lp(self.tok(idx) + self.pos.weight[offset : offset + t])
        for i, blk in enumerate(self.blocks):
            x = blk(x, lp, None if caches is None else caches[i])
        x = lp(F.layer_norm(x, (x.shape[-1],), self.ln_f.weight, self.ln_f.bias))
        return lp(F.linear(x, self.head.weight))


def _load_lowp(model: _TinyLM, state: dict, dtype: torch.dtype) -> None:
    with torch.no_grad():
        model.load_state_dict({k: _round(v, dtype) for k, v in state.items()})
    model.act_dtype = dtype


# --------------------------------------------------------------------------- task


class _World:
    """Synthetic 'language': env-conditioned Markov chains with LLM-like peaked
    next-token distributions, plus a per-env goal set that defines the RL reward."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator) -> None:
        v = cfg.vocab
        c = v - _N_SPECIAL
        self.n_content = c
        table = np.zeros((len(ENVS), c, c))
        for e, env in enumerate(ENVS):
            kinds = rng.choice(3, size=c, p=_ENV_PROFILE[env])
            for x in range(c):
                perm = rng.permutation(c)
                tail_w = 1.0 / np.arange(1, 41) ** 1.1
                tail_w /= tail_w.sum()
                eps = rng.uniform(0.01, 0.05)
                row = np.zeros(c)
                row[perm[10:50]] = eps * tail_w
                if kinds[x] == 0:
                    row[perm[0]] += 1.0 - eps
                elif kinds[x] == 1:
                    a = rng.uniform(0.5, 0.8)
                    row[perm[0]] += (1.0 - eps) * a
                    row[perm[1]] += (1.0 - eps) * (1.0 - a)
                else:
                    row[perm[:6]] += (1.0 - eps) * rng.dirichlet(np.full(6, 1.0))
                table[e, x] = row / row.sum()
        self.probs = torch.from_numpy(table).to(torch.float32)
        self.entropy = float(-(table * np.log(np.maximum(table, 1e-30))).sum(-1).mean())
        self.cum = torch.from_numpy(np.cumsum(table, axis=-1)).to(torch.float64)
        self.cum[..., -1] = 1.0
        goal = np.zeros((len(ENVS), v), dtype=bool)
        for e in range(len(ENVS)):
            goal[e, _N_SPECIAL + rng.permutation(c)[: c // 2]] = True
        self.goal = torch.from_numpy(goal)

    def sample_chains(self, env: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        n = env.shape[0]
        out = torch.empty(n, length, dtype=torch.long)
        cur = torch.randint(0, self.n_content, (n,), generator=gen)
        out[:, 0] = cur
        for i in range(1, length):
            u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
            cur = torch.searchsorted(self.cum[env, cur], u).squeeze(1)
            out[:, i] = cur
        return out + _N_SPECIAL

    def sequences(self, env: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        body = self.sample_chains(env, length - 2, gen)
        head = torch.stack([torch.zeros_like(env), 1 + env], dim=1)
        return torch.cat([head, body], dim=1)


# --------------------------------------------------------------------------- helpers


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return lp, logp


def _pretrain(model, world, cfg, gen) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.pretrain_lr)
    total = cfg.prompt_len + cfg.seq_len
    losses = []
    c0 = _N_SPECIAL
    uniform = torch.full((world.n_content,), 1.0 / world.n_content)
    for i in range(cfg.pretrain_steps):
        env = torch.randint(0, len(ENVS), (cfg.extra.get("pre_batch", 32),), generator=gen)
        seq = world.sequences(env, total, gen)
        logits = model(seq[:, :-1])
        logp = torch.log_softmax(logits[:, 1:], dim=-1)[..., c0:]
        cur = seq[:, 2:-1] - c0
        tgt = world.probs[env.unsqueeze(1), cur]
        tgt = torch.cat([uniform.expand(len(env), 1, -1), tgt], dim=1)
        loss = -(tgt * logp).sum(-1).mean()
        if cfg.n_experts:
            loss = loss + 0.01 * sum(blk.aux for blk in model.blocks)
        lr = (
            cfg.pretrain_lr
            * min(1.0, (i + 1) / 20)
            * 0.5
            * (1 + math.cos(math.pi * i / cfg.pretrain_steps))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def _generate(sampler, prompts, n_new, gen, logit_bits=None):
    """KV-cached decode with the sampler's numerics; returns tokens and log-probs
    (prompt positions 1.. from the prefill, response positions from decode)."""
    caches = [{} for _ in sampler.blocks]
    logits = sampler(prompts, caches=caches, offset=0)
    if logit_bits is not None:
        logits = _round_bits(logits, logit_bits)
    prompt_lp, _ = _token_logprobs(logits[:, :-1], prompts[:, 1:])
    last = logits[:, -1]
    toks, lps = [], []
    pos = prompts.shape[1]
    for i in range(n_new):
        logp = torch.log_softmax(last.float(), dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        toks.append(nxt)
        lps.append(logp.gather(-1, nxt))
        if i + 1 < n_new:
            last = sampler(nxt, caches=caches, offset=pos)[:, -1]
            if logit_bits is not None:
                last = _round_bits(last, logit_bits)
            pos += 1
    return torch.cat(toks, 1), prompt_lp, torch.cat(lps, 1)


def _round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    m, e = torch.frexp(x)
    scale = float(2**bits)
    return torch.ldexp(torch.round(m * scale) / scale, e)


def _schedule(start, end, t, steps):
    if end is None or steps <= 1:
        return start
    return start + (end - start) * t / (steps - 1)


# --------------------------------------------------------------------------- main


def simulate(
    config: SimConfig,
    path: str | Path,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    cfg = config
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; refusing to overwrite it")
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        cols, summary = _run(cfg, progress)
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)
    _write(cols, path)
    secs = time.perf_counter() - t0
    summary["seconds"] = secs
    summary["tokens_per_second"] = summary["tokens"] / secs
    return summary


def _run(cfg: SimConfig, progress):
    lowp = INFER_DTYPES[cfg.infer_dtype]
    s0 = cfg.staleness if cfg.staleness is not None else _DEFAULT_STALENESS[cfg.scenario]
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    world = _World(cfg, rng)
    total = cfg.prompt_len + cfg.seq_len
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = _TinyLM(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, total, cfg.n_experts)
        sampler = _TinyLM(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, total, cfg.n_experts)
        old = _TinyLM(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, total, cfg.n_experts)
    tp = time.perf_counter()
    losses = _pretrain(model, world, cfg, gen)
    t_pre = time.perf_counter() - tp
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    snaps = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    n_prompts = cfg.batch // cfg.group_size
    out = {
        k: []
        for k in (
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
    }
    k3_steps, rew_steps, stal_steps = [], [], []
    warm = s0 if cfg.extra.get("warm", True) else 0
    for t in range(-warm, cfg.steps):
        s_t = int(round(_schedule(s0, cfg.drift_staleness_end, max(t, 0), cfg.steps)))
        s_eff = min(s_t, len(snaps) - 1)
        lr_t = _schedule(cfg.lr, cfg.drift_lr_end, max(t, 0), cfg.steps)
        bits = cfg.drift_logit_bits_end
        bits_t = None if bits is None else int(round(_schedule(8, bits, max(t, 0), cfg.steps)))
        behav = snaps[-1 - s_eff]
        _load_lowp(sampler, behav, lowp)
        old.load_state_dict(behav)
        env = torch.randint(0, len(ENVS), (n_prompts,), generator=gen)
        prompts = world.sequences(env, cfg.prompt_len, gen)
        env = env.repeat_interleave(cfg.group_size)
        prompts = prompts.repeat_interleave(cfg.group_size, dim=0)
        resp, p_lp_inf, r_lp_inf = _generate(sampler, prompts, cfg.seq_len, gen, bits_t)
        seq = torch.cat([prompts, resp], 1)
        tgt = seq[:, 1:]
        with torch.no_grad():
            old_lp, _ = _token_logprobs(old(seq[:, :-1]), tgt)
        logits = model(seq[:, :-1])
        tr_lp, logp_all = _token_logprobs(logits, tgt)
        ent = -(logp_all.exp() * logp_all).sum(-1).detach()
        hit = world.goal[env.unsqueeze(1), resp].float()
        if cfg.extra.get("reward", "frac") == "frac":
            reward = hit.mean(1)
        elif cfg.extra["reward"] == "last":
            reward = hit[:, -1]
        else:
            reward = (hit.mean(1) > cfg.extra["reward"]).float()
        g = reward.view(n_prompts, cfg.group_size)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
        mask = torch.zeros_like(tgt, dtype=torch.bool)
        mask[:, cfg.prompt_len - 1 :] = True
        loss = -(adv.unsqueeze(1) * tr_lp)[mask].mean()
        for gr in opt.param_groups:
            gr["lr"] = lr_t
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if len(snaps) > 64:
            snaps.pop(0)
        if t < 0:
            continue
        inf_lp = torch.cat([p_lp_inf, r_lp_inf], 1)
        tr = tr_lp.detach().double()
        inf = inf_lp.double()
        b, n = tgt.shape
        out["step"].append(np.full(b * n, t, dtype=np.int64))
        out["sample_id"].append(np.repeat(np.arange(b, dtype=np.int64), n))
        out["position"].append(np.tile(np.arange(1, n + 1, dtype=np.int64), b))
        out["token_id"].append(tgt.reshape(-1).numpy().astype(np.int64))
        out["trainer_logprob"].append(np.minimum(tr.reshape(-1).numpy(), 0.0))
        out["inference_logprob"].append(np.minimum(inf.reshape(-1).numpy(), 0.0))
        out["old_logprob"].append(np.minimum(old_lp.double().reshape(-1).numpy(), 0.0))
        out["entropy"].append(ent.double().reshape(-1).numpy())
        out["advantage"].append(np.repeat(adv.double().numpy(), n))
        out["loss_mask"].append(mask.reshape(-1).numpy())
        out["env"].append(np.repeat(np.array(ENVS, dtype=object)[env.numpy()], n))
        r = np.exp(tr[mask].numpy() - inf[mask].numpy())
        k3_steps.append(float(np.mean(r - 1 - np.log(r))))
        rew_steps.append(float(reward.mean()))
        stal_steps.append(s_eff)
        if progress is not None:
            progress(t + 1, cfg.steps)
    cols = {k: np.concatenate(v) for k, v in out.items()}
    summary = {
        "scenario": cfg.scenario,
        "steps": cfg.steps,
        "sequences": cfg.steps * cfg.batch,
        "tokens": int(cols["loss_mask"].sum()),
        "rows": int(cols["loss_mask"].size),
        "k3_per_step": k3_steps,
        "reward_per_step": rew_steps,
        "staleness_per_step": stal_steps,
        "pretrain_loss": [losses[0], losses[-1], world.entropy],
        "pretrain_seconds": t_pre,
        "config": asdict(cfg),
    }
    return cols, summary


def _write(cols: dict, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "step": pa.array(cols["step"], pa.int64()),
            "sample_id": pa.array(cols["sample_id"], pa.int64()),
            "position": pa.array(cols["position"], pa.int64()),
            "token_id": pa.array(cols["token_id"], pa.int64()),
            "trainer_logprob": pa.array(cols["trainer_logprob"], pa.float64()),
            "inference_logprob": pa.array(cols["inference_logprob"], pa.float64()),
            "old_logprob": pa.array(cols["old_logprob"], pa.float64()),
            "entropy": pa.array(cols["entropy"], pa.float64()),
            "advantage": pa.array(cols["advantage"], pa.float64()),
            "loss_mask": pa.array(cols["loss_mask"], pa.bool_()),
            "env": pa.array(cols["env"].tolist(), pa.string()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd", compression_level=9, row_group_size=1 << 20)
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
