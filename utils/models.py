"""Models used by the scripts."""

from torch import nn


class ConvNet(nn.Module):
    """The classic two-block MNIST ConvNet: (Conv5x5 -> BN -> ReLU -> MaxPool) x 2 -> Linear.

    28x28 -> 14x14 (16 channels) -> 7x7 (32 channels) -> 10 logits.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))
