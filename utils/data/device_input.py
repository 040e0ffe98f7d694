"""The model's input made on the device: a uint8 batch cast to the autocast dtype, normalised as torchvision's
pretrained weights expect, in the memory format asked for, in one copy."""

import functools

import torch

# torchvision's pretrained weights expect ImageNet-normalised inputs; from scratch it does no harm.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def model_input_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype autocast computes in under the launch's mixed precision ("fp16", "bf16"; float32 otherwise): what
    normalise_on_device should give, so the model's first layer casts nothing."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def normalise_on_device(images, dtype=torch.float32, channels_last: bool = False):
    """A uint8 (N, 3, H, W) batch, already on the device, as the model's input: `dtype` (the autocast dtype under
    mixed precision), normalised as torchvision's pretrained weights expect, channels-last if asked. One copy: the
    cast writes the new tensor in its final layout, and the normalisation works in place."""
    images = images.to(dtype=dtype, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    mean = torch.tensor(IMAGENET_MEAN, dtype=dtype, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, dtype=dtype, device=images.device).view(1, 3, 1, 1) * 255
    return images.sub_(mean).div_(std)


def device_normaliser(dtype=torch.float32, channels_last: bool = False):
    """normalise_on_device with this run's dtype and memory format: what the training loop applies to each batch."""
    return functools.partial(normalise_on_device, dtype=dtype, channels_last=channels_last)
