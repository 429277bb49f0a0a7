#!/usr/bin/env bash
# A SkyRL launch script: variables and Hydra-style overrides.
TIS_TYPE=token
TIS_IMP_RATIO_CAP=2.0
SEQUENCE_MASK_METRIC=geometric
GEO_MASK_HIGH=1.01
GEO_MASK_LOW=0.99

uv run --isolated -m skyrl.train.entrypoints.main_base \
  trainer.algorithm.advantage_estimator="grpo" \
  trainer.algorithm.off_policy_correction.tis_ratio_type=$TIS_TYPE \
  trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high=$TIS_IMP_RATIO_CAP \
  trainer.algorithm.off_policy_correction.sequence_mask_metric=$SEQUENCE_MASK_METRIC \
  trainer.algorithm.off_policy_correction.geo_mask_high=$GEO_MASK_HIGH \
  trainer.algorithm.off_policy_correction.geo_mask_low=$GEO_MASK_LOW \
  trainer.epochs=1
