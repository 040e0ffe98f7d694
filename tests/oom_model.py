"""`--model tests.oom_model:small_cnn_out_of_memory_above_16`: a model that runs out of memory the way a GPU
does (torch.OutOfMemoryError, CUDA's message) whenever a batch holds more than 16 images, so that
--auto_find_batch_size can be tested on the CPU."""

import torch
from torch import nn

FITS = 16


class OutOfMemoryAboveBatchSize(nn.Module):
    def __init__(self, num_classes: int, fits: int = FITS):
        super().__init__()
        self.fits = fits
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(8, num_classes)

    def forward(self, images):
        if images.shape[0] > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (simulated: a batch of "
                                         f"{images.shape[0]} images, more than {self.fits})")
        return self.classifier(self.features(images))


def small_cnn_out_of_memory_above_16(num_classes: int) -> nn.Module:
    return OutOfMemoryAboveBatchSize(num_classes)


def always_out_of_memory(num_classes: int) -> nn.Module:
    return OutOfMemoryAboveBatchSize(num_classes, fits=0)
