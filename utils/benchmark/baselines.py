"""The baselines' runtime (scripts/baselines/: plain, raw DDP, DataParallel; and scripts/benchmark_train.py): AMP as
Accelerate picks it, the optimizer steps GradScaler skipped, autocast inside DataParallel's replicas, synthetic images.
No distribution logic in here."""

import torch
from torch.utils.data import TensorDataset

from ..errors import UserError


def autocast_dtype(mixed_precision, device: torch.device):
    """torch's native AMP dtype for --mixed_precision (None: full fp32), as Accelerate chooses it.

    fp16 needs a GPU: on the CPU Accelerate ignores it and trains in fp32, so the baselines
    refuse it rather than compare different things.
    """
    if mixed_precision in (None, "no"):
        return None
    if mixed_precision == "fp16" and device.type != "cuda":
        raise UserError("--mixed_precision fp16 needs a CUDA GPU; on the CPU use --mixed_precision bf16 or no")
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


class OptimizerStepWatch:
    """Whether `optimizer.step()` ran since the last look. GradScaler skips the call when fp16
    gradients overflowed; a post-hook on the optimizer knows that without reading anything off the
    GPU (the usual recipe, comparing `scaler.get_scale()` before and after, costs two host syncs a
    step). Accelerate's `optimizer_step_was_skipped` works the same way, by wrapping `step`."""

    def __init__(self, optimizer):
        self.stepped = False
        optimizer.register_step_post_hook(self._mark)

    def _mark(self, optimizer, step_args, step_kwargs):
        self.stepped = True

    def take(self) -> bool:
        stepped, self.stepped = self.stepped, False
        return stepped


class AutocastInForward(torch.nn.Module):
    """autocast is thread-local, and DataParallel runs each replica in a thread of its own,
    passing on only whether autocast is on, not its dtype (a bf16 run would compute in fp16).
    PyTorch's AMP notes for DataParallel: enter autocast inside forward."""

    def __init__(self, module: torch.nn.Module, amp_dtype):
        super().__init__()
        self.module, self.amp_dtype = module, amp_dtype

    def forward(self, x):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            return self.module(x)


def synthetic_images(num_samples: int, image_size: int, num_classes: int = 1000, seed: int = 0) -> TensorDataset:
    """Random normalised images and labels, as the classic ImageNet benchmarks use to time the
    GPU without the JPEG decoder (e.g. pytorch/examples imagenet --dummy)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return TensorDataset(images, labels)
