"""Optimizers and learning-rate schedules by name, as the image script's flags choose them."""

import math

import torch

DEFAULT_LEARNING_RATE = {"sgd": 0.1, "adamw": 1e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 1e-4, "adamw": 0.05}


def build_optimizer(model, name: str, learning_rate: float, weight_decay: float, momentum: float = 0.9):
    """SGD with momentum (torchvision's ResNet recipe) or AdamW (its ViT recipe) over the model's parameters."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)


ONECYCLE_DEFAULT_WARMUP = 0.15  # of the run: OneCycleLR's pct_start, the MNIST recipe


def warmup_steps_of(warmup_steps, warmup_epochs, steps_per_epoch: int, total_steps: int):
    """--warmup_steps (optimizer steps), or --warmup_epochs in optimizer steps, never more than the run; None when
    neither was given (build_lr_scheduler: 15% of the run for onecycle, no warmup for the others)."""
    if warmup_steps is not None:
        return min(warmup_steps, total_steps)
    if warmup_epochs is not None:
        return min(round(warmup_epochs * steps_per_epoch), total_steps)
    return None


def build_lr_scheduler(optimizer, name: str, plan, warmup_steps=None, warmup_epochs=None):
    """--lr_scheduler_type `name` over the run `plan` describes (utils/run/steps.py StepPlan: `total_steps`, its
    max_steps, in epochs of its steps_per_epoch), with the Hugging Face Trainer's names and shapes: a linear warmup
    over --warmup_steps `warmup_steps`, or --warmup_epochs `warmup_epochs` in steps (warmup_steps_of; from
    1/warmup_steps of the peak: the first step is not wasted at 0), then
    cosine: a cosine decay to 0 at `total_steps`; linear: a straight line to 0 at `total_steps`;
    constant_with_warmup: the peak to the end; step: a tenth of the peak after each third of the steps after the
    warmup (torchvision's ResNet recipe: epochs 30 and 60 of 90); onecycle: torch's OneCycleLR (its warmup is
    cosine, from a 25th of the peak, and its decay ends 10^4 times lower; pct_start = warmup_steps / total_steps)."""
    total_steps = plan.max_steps
    warmup_steps = warmup_steps_of(warmup_steps, warmup_epochs, plan.steps_per_epoch, total_steps)
    if name == "onecycle":
        peak = [group["lr"] for group in optimizer.param_groups]
        pct_start = ONECYCLE_DEFAULT_WARMUP if warmup_steps is None else max(1, warmup_steps) / total_steps
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, peak, total_steps, pct_start=pct_start)
    warmup_steps = warmup_steps or 0
    decay_steps = max(1, total_steps - warmup_steps)
    after_warmup = {
        "cosine": lambda done: 0.5 * (1 + math.cos(math.pi * done / decay_steps)),
        "linear": lambda done: max(0.0, 1 - done / decay_steps),
        "constant_with_warmup": lambda done: 1.0,
        "step": lambda done: 0.1 ** min(2, 3 * done // decay_steps),
    }[name]

    def factor(step):
        """The learning rate after `step` optimizer steps, as a fraction of the peak."""
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return after_warmup(step - warmup_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
