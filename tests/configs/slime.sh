#!/bin/bash
# A slime launch script: argument arrays, as its examples build them.
ROLLOUT_ARGS=(
   --rollout-batch-size 32
   --n-samples-per-prompt 8
)
GRPO_ARGS=(
   --advantage-estimator grpo
   --use-tis
   --tis-clip 2.0
   --tis-clip-low 0.5
   --custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function
   --use-opsm
   --opsm-delta 0.0001
)
python3 train.py "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}"
