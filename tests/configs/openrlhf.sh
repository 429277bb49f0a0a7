# An OpenRLHF PPO launch (ray job), one command.
ray job submit --address="http://127.0.0.1:8265" -- python3 -m openrlhf.cli.train_ppo_ray \
   --actor.policy_loss_type ppo \
   --algo.advantage.is_correction_enable \
   --algo.advantage.is_correction_type icepop \
   --algo.advantage.is_correction_threshold 0.5 5.0 \
   --train.async_enable
