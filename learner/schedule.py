"""Learning-rate schedule for SFT and RL: linear warmup, then linear decay to a floor (docs/design.md,
"The method", step 4)."""

from __future__ import annotations

import torch


class LinearWarmupDecay:
    """lr multiplier for step s (LambdaLR's `lr_lambda`):

        s < warmup_steps:   s / warmup_steps   (0 at step 0, as in HF's linear schedule)
        s < total_steps:    1 - (1 - min_lr_ratio) · (s - warmup_steps) / (total_steps - warmup_steps)
        otherwise:          min_lr_ratio       (the floor)

    With warmup_steps == total_steps there is no decay phase: the multiplier drops from its last warmup
    value to the floor. A class rather than a closure so LambdaLR.state_dict() stores its fields and the
    scheduler can be checkpointed and pickled.
    """

    def __init__(self, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if warmup_steps > total_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr_ratio
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return 1.0 - (1.0 - self.min_lr_ratio) * progress


def linear_warmup_decay(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `LinearWarmupDecay` to every param group's base lr; `.step()` it once per optimizer
    step. The lr starts at 0, reaches the base lr at `warmup_steps`, falls linearly to
    `min_lr_ratio · base lr` at `total_steps` and stays there.
    """
    schedule = LinearWarmupDecay(
        warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
