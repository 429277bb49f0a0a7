"""Into the tools a user already runs: the trainer's own config, W&B and TensorBoard.

Design
------
Small modules, none of which computes anything the core does not: they translate.

* `config_in`  the trainer's config file(s) -> the catalogue rules it selects
  (`read_config("rl.toml").specs() == ["ipo:eps=0.2"]`);
* `config_out` a `choose` result -> the override that sets it, in the framework's syntax
  (`emit("verl", choices, base=cfg)`); `frameworks` holds the key mappings of both, one
  class (and module) per framework, each checked against that framework's config code
  (commit in its `checked`); `settings` the types both sides share (`Settings`,
  `TrainerConfig`, `ConfigRule`);
* `wandb_log`  a report's figures, sweep table, page and per-step series -> a W&B run (the
  training run resumed by id, or a new one), and back: `read_offline_run` reads an offline
  run directory without a server;
* `tensorboard_log` the per-step series as scalars at their steps, the figures as images ->
  event files (tensorboardX), and `read_events` to read them back.

`outputs.ReportOutputs` is what both loggers take: the paths and tables a report produced,
so logging never re-reads the token log when the report's data is at hand.

W&B and tensorboardX are optional (`pip install 'mismatch-replay[wandb]'`,
`'[tensorboard]'`); nothing here imports them until a logger runs. docs/integrations.md has
the per-framework key tables.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "ConfigRule": "settings",
    "TrainerConfig": "settings",
    "read_config": "config_in",
    "read_text": "config_in",
    "emit": "config_out",
    "assignments": "config_out",
    "FRAMEWORKS": "frameworks",
    "get_framework": "frameworks",
    "ReportOutputs": "outputs",
    "collect": "outputs",
    "step_series": "outputs",
    "log_to_wandb": "wandb_log",
    "read_offline_run": "wandb_log",
    "log_to_tensorboard": "tensorboard_log",
    "read_events": "tensorboard_log",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
