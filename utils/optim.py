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


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps` optimizer steps, then cosine decay to 0 at `total_steps`."""

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
