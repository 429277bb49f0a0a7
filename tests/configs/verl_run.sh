#!/usr/bin/env bash
# A verl launch script in the style of its examples: shell variables, Hydra overrides.
set -x
rollout_is="sequence"
rollout_is_threshold=2.0
rollout_rs="seq_mean_k1"
rollout_rs_threshold="0.999_1.001"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.rollout_correction.rollout_is=${rollout_is} \
    algorithm.rollout_correction.rollout_is_threshold=${rollout_is_threshold} \
    algorithm.rollout_correction.rollout_rs=\'${rollout_rs}\' \
    algorithm.rollout_correction.rollout_rs_threshold=\'${rollout_rs_threshold}\' \
    trainer.total_epochs=1 "$@"
