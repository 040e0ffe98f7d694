"""`--model tests.tiny_model:tiny_cnn`: a classifier small enough that a checkpoint costs nothing."""

from torch import nn


def tiny_cnn(num_classes: int) -> nn.Module:
    """One convolution, BatchNorm, a linear head."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))
