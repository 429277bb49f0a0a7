"""capture: write the canonical token table from inside a training loop.

```python
from mismatch_replay.capture import TokenWriter

writer = TokenWriter("runs/exp1/tokens", rank=rank, world_size=world,
                     meta={"trainer_logprob": "old", "framework": "verl"})
writer.write(step=step, trainer_logprobs=old_lp, inference_logprobs=rollout_lp,
             mask=response_mask, advantages=adv)
writer.close()
```

For the frameworks that write no per-token log of their own, and for anyone who wants the
canonical table directly. `writer` (TokenWriter: a background thread, atomic per-step
commits, a bounded queue), `commit` (the protocol on disk: paths, markers, run id, lock
file), `inputs` (what write() does before it returns: only loss tokens
leave the device; whole-sequence sampling), `hooks` (one adapter per framework, for the hook
points in docs/capture.md). The log reads like any other: `mismatch-replay sweep runs/exp1/tokens`.
torch is never imported here; tensors are recognised when the caller has imported torch.
"""

from .commit import RUN_ID_ENV, lock_file, rank_file, rank_marker, step_dir
from .writer import (
    META_KEY,
    TRAINER_LOGPROB_KINDS,
    CaptureError,
    CaptureWarning,
    RankInUseError,
    TokenWriter,
    read_meta,
)

__all__ = [
    "META_KEY",
    "RUN_ID_ENV",
    "TRAINER_LOGPROB_KINDS",
    "CaptureError",
    "CaptureWarning",
    "RankInUseError",
    "TokenWriter",
    "lock_file",
    "rank_file",
    "rank_marker",
    "read_meta",
    "step_dir",
]
