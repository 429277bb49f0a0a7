"""Per-framework adapters: pull the named tensors off a framework's object, call write().

Each function takes the object a framework holds at the hook point documented in
docs/capture.md (where it was verified: repository, file, commit) and reads only attributes
and keys by name, so it needs none of the frameworks installed; the tests drive each one with
a stand-in object of the same attribute names and shapes. Each returns the loss tokens
queued, and raises ValueError naming the framework's setting when the inference log-probs (or
the trainer's) are not there, or are the same tensor (nothing to compare). Where a framework
hands over a whole step at once, the hook also commits the step (`commit=True`: queued, not
waited for), so that a run killed at its end (Ray actors run no atexit) keeps its last step;
TRL's hook does not, a TRL step can span several generation batches.

framework: the object at the hook -> trainer log-prob, inference log-prob, mask
  verl:     DataProto after compute_advantage -> old_log_probs, rollout_log_probs,
            response_mask
  TRL:      the dict _generate_and_score_completions returns -> old_per_token_logps,
            sampling_per_token_logps, completion_mask (x tool_mask)
  SkyRL:    TrainingInputBatch at on_step_end -> action_log_probs, rollout_logprobs, loss_mask
  AReaL:    the batched dict _compute_advantages returns -> prox_logp, logprobs, loss_mask
  OpenRLHF: the Experiences make_experience_batch returns -> action_log_probs,
            rollout_log_probs, action_mask
  slime:    rollout_data in the --rollout-data-postprocess-path function -> log_probs,
            rollout_log_probs, loss_masks
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .inputs import same_values as _same  # one tensor under two names: nothing to compare
from .writer import TokenWriter


def _get(obj, key):
    """obj[key] for mappings (dicts, TensorDicts, SkyRL's TensorBatch), None when absent."""
    try:
        keys = obj.keys()
    except AttributeError:
        return None
    return obj[key] if key in keys else None


def verl_batch(
    writer: TokenWriter,
    batch,
    step: int,
    env_key: str | None = "data_source",
    commit: bool = True,
) -> int:
    """verl: the `DataProto` in `RayPPOTrainer.fit` once `compute_advantage` has run
    (`batch.batch`: old_log_probs, rollout_log_probs, response_mask, advantages, all
    [B, response_length]; `batch.non_tensor_batch[env_key]` as env when present). The
    sequence's score, `token_level_scores` summed over its response (verl puts the reward
    model's or the rule's score on the last response token), is its `reward`."""
    td = batch.batch
    old = _get(td, "old_log_probs")
    rollout = _get(td, "rollout_log_probs")
    if rollout is None:
        raise ValueError(
            "verl: the batch has no rollout_log_probs; set "
            "actor_rollout_ref.rollout.calculate_log_probs=True so that the rollout returns them"
        )
    if old is None:
        raise ValueError("verl: the batch has no old_log_probs (capture after compute_advantage)")
    if _same(old, rollout):
        raise ValueError(
            "verl: old_log_probs is rollout_log_probs (algorithm.rollout_correction.bypass_mode"
            "=True skips the trainer's forward pass), so there is no trainer log-prob to compare;"
            " capture with bypass_mode off"
        )
    nt = getattr(batch, "non_tensor_batch", None) or {}
    env = nt.get(env_key) if env_key else None
    n = writer.write(
        step=step,
        trainer_logprobs=old,
        inference_logprobs=rollout,
        mask=td["response_mask"],
        advantages=_get(td, "advantages"),
        env=None if env is None else [str(e) for e in env],
        rewards=None if (scores := _get(td, "token_level_scores")) is None else scores.sum(-1),
    )
    if commit:
        writer.commit()
    return n


def trl_output(writer: TokenWriter, output: Mapping, step: int) -> int:
    """TRL: the dict `GRPOTrainer._generate_and_score_completions` returns
    (old_per_token_logps, sampling_per_token_logps, completion_mask [B, C]; tool_mask when
    tools ran; advantages [B], one per completion)."""
    old = output.get("old_per_token_logps")
    sampled = output.get("sampling_per_token_logps")
    if sampled is None:
        raise ValueError(
            "TRL: no sampling_per_token_logps; the sampler's log-probs are kept only when "
            "generating with vLLM (use_vllm=True) or a rollout_func that returns logprobs"
        )
    if old is None:
        raise ValueError(
            "TRL: no old_per_token_logps; with vLLM they are computed when "
            "vllm_importance_sampling_correction=True (the default)"
        )
    mask = output["completion_mask"]
    tool = output.get("tool_mask")
    if tool is not None:
        mask = mask * tool  # the loss mask TRL uses: completion tokens, tool output left out
    return writer.write(
        step=step,
        trainer_logprobs=old,
        inference_logprobs=sampled,
        mask=mask,
        advantages=output.get("advantages"),
    )


def skyrl_batch(writer: TokenWriter, batch, step: int, commit: bool = True) -> int:
    """SkyRL: `callback_input.batch` in `TrainingCallback.on_step_end` (a TrainingInputBatch:
    action_log_probs, rollout_logprobs, loss_mask, advantages, [B, response_len]); the rows
    SkyRL added to even out data-parallel shards (`metadata["pad_size"]`) are left out."""
    lp = _get(batch, "action_log_probs")
    rollout = _get(batch, "rollout_logprobs")
    if rollout is None:
        raise ValueError(
            "SkyRL: the batch has no rollout_logprobs; keep generator.sampling_params.logprobs "
            "at 0 or 1 (not None) so that the inference engine returns them"
        )
    if lp is None:
        raise ValueError(
            "SkyRL: the batch has no action_log_probs: the policy forward pass was skipped "
            "(a loss that optimises against the rollout log-probs, with no KL in the reward and "
            "no off-policy correction); enable trainer.algorithm.off_policy_correction or use "
            "a loss that reads old log-probs"
        )
    pad = int((getattr(batch, "metadata", None) or {}).get("pad_size", 0) or 0)
    n = lp.shape[0] - pad
    adv = _get(batch, "advantages")
    n = writer.write(
        step=step,
        trainer_logprobs=lp[:n],
        inference_logprobs=rollout[:n],
        mask=batch["loss_mask"][:n],
        advantages=None if adv is None else adv[:n],
    )
    if commit:
        writer.commit()
    return n


def areal_batch(writer: TokenWriter, data, step: int, commit: bool = True) -> int:
    """AReaL: what `PPOActor.compute_advantages` returns (a list of per-trajectory dicts,
    each tensor [group, L]) or the batched dict `_compute_advantages` returns ([B, T]):
    prox_logp (the proximal policy, recomputed by the trainer), logprobs (the inference
    engine's, shifted to the same positions and zero outside the loss mask), loss_mask,
    advantages. A list is written as one ragged batch (one row group, not one per
    trajectory)."""
    dicts = [data] if isinstance(data, Mapping) else list(data)
    for d in dicts:
        prox, behave = d.get("prox_logp"), d.get("logprobs")
        if prox is None:
            raise ValueError(
                "AReaL: prox_logp is None; with use_decoupled_loss=True it is recomputed only "
                "by a prox_logp_method that runs the forward pass (not the log-linear "
                "approximation)"
            )
        if behave is None or _same(prox, behave):
            raise ValueError(
                "AReaL: logprobs is prox_logp: without actor.use_decoupled_loss=True AReaL "
                "replaces the inference log-probs by the recomputed ones (or uses them as "
                "prox_logp); capture with use_decoupled_loss=True"
            )
    has_adv = all(d.get("advantages") is not None for d in dicts)
    if isinstance(data, Mapping):
        cols = {k: data[k] for k in ("prox_logp", "logprobs", "loss_mask")}
        adv = data.get("advantages")
    else:

        def rows(key):
            return [d[key][j] for d in dicts for j in range(d[key].shape[0])]

        cols = {k: rows(k) for k in ("prox_logp", "logprobs", "loss_mask")}
        adv = rows("advantages") if has_adv else None
    n = writer.write(
        step=step,
        trainer_logprobs=cols["prox_logp"],
        inference_logprobs=cols["logprobs"],
        mask=cols["loss_mask"],
        advantages=adv,
    )
    if commit:
        writer.commit()
    return n


def openrlhf_experiences(writer: TokenWriter, experiences, step: int, commit: bool = True) -> int:
    """OpenRLHF: the Experiences `RemoteExperienceMaker.make_experience_batch` returns (one
    or a list; action_log_probs, rollout_log_probs, action_mask, advantages, [B, A]). In agent
    mode the observation tokens' rollout log-probs are 0.0 placeholders; action_mask leaves
    them out."""
    if not isinstance(experiences, Iterable) or hasattr(experiences, "action_mask"):
        experiences = [experiences]
    total = 0
    for e in experiences:
        if getattr(e, "rollout_log_probs", None) is None:
            raise ValueError(
                "OpenRLHF: the experience has no rollout_log_probs; pass "
                "--algo.advantage.is_correction_enable so that vLLM returns them"
            )
        if getattr(e, "action_log_probs", None) is None:
            raise ValueError("OpenRLHF: the experience has no action_log_probs yet")
        total += writer.write(
            step=step,
            trainer_logprobs=e.action_log_probs,
            inference_logprobs=e.rollout_log_probs,
            mask=e.action_mask,
            advantages=getattr(e, "advantages", None),
        )
    if commit:
        writer.commit()
    return total


def slime_rollout_data(
    writer: TokenWriter, rollout_data: Mapping, step: int, commit: bool = True
) -> int:
    """slime: `rollout_data` as the `--rollout-data-postprocess-path` function receives it
    (lists of per-sample 1-D tensors: log_probs, rollout_log_probs, loss_masks, advantages;
    `partition` gives each sample's index in the whole rollout, used as its sample id)."""
    lp = rollout_data.get("log_probs")
    rollout = rollout_data.get("rollout_log_probs")
    if rollout is None:
        raise ValueError("slime: rollout_data has no rollout_log_probs")
    if lp is None:
        raise ValueError(
            "slime: rollout_data has no log_probs: they were not recomputed before training "
            "(slime reuses the training forward's when a rollout is one optimiser step with "
            "kl_coef 0, and with --use-rollout-logprobs), or this is not the last pipeline "
            "stage; --get-mismatch-metrics (which needs --custom-tis-function-path) forces the "
            "recomputation"
        )
    masks = rollout_data["loss_masks"]
    for i, (a, m) in enumerate(zip(lp, masks, strict=True)):
        if a.shape[0] != m.shape[0]:
            raise ValueError(
                f"slime: sample {i} has {a.shape[0]} log-probs but {m.shape[0]} loss-mask "
                "entries; with context parallelism each rank holds a slice of the log-probs: "
                "capture with --context-parallel-size 1"
            )
    n = writer.write(
        step=step,
        trainer_logprobs=lp,
        inference_logprobs=rollout,
        mask=masks,
        advantages=rollout_data.get("advantages"),
        sample_ids=rollout_data.get("partition"),
    )
    if commit:
        writer.commit()
    return n
