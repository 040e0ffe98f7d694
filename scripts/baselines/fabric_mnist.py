#!/usr/bin/env python
"""MNIST trained the way Lightning Fabric's examples/fabric/image_classifier/train_fabric.py trains it: the "before"
of scripts/converted_fabric_style.py.

    fabric run --accelerator cuda --devices 4 --strategy ddp scripts/baselines/fabric_mnist.py --data-dir MNIST/raw
    fabric run --accelerator cpu --devices 2 --strategy ddp scripts/baselines/fabric_mnist.py --data-dir MNIST/raw
    python scripts/baselines/fabric_mnist.py --data-dir path/to/MNIST/raw     # one process

What the Fabric example writes: a Fabric() that takes accelerator, strategy and devices from `fabric run`,
seed_everything, the data loaded under rank_zero_first, setup_dataloaders (a DistributedSampler per loader),
setup(model, optimizer), fabric.backward, a StepLR stepped once per epoch, a torchmetrics Accuracy, the test loss
summed with all_gather, and fabric.save. It reads the four gzipped MNIST IDX files instead of downloading them,
prints the test metrics with four decimals instead of none (the tests compare them), and --no-dropout drops the
Net's two dropouts (a comparison across process counts: docs/converting_a_fabric_script.md). `diff` it with the
converted script to see the whole migration (docs/converting_a_fabric_script.md walks through it).
"""

import argparse
import gzip
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from lightning_fabric import Fabric, seed_everything
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset
from torchmetrics.classification import Accuracy

parser = argparse.ArgumentParser(description="Fabric MNIST Example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size of each process")
parser.add_argument("--epochs", type=int, default=14, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="learning rate")
parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma")
parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches between training logs")
parser.add_argument("--save-model", metavar="PATH", help="save the trained weights here")
parser.add_argument("--data-dir", required=True, help="folder with the four gzipped MNIST IDX files")
parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
parser.add_argument("--test-samples", type=int, help="test on the first N test images only")
parser.add_argument("--no-dropout", action="store_true", help="the Net without its two dropouts")


class Net(nn.Module):
    def __init__(self, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25) if dropout else nn.Identity()
        self.dropout2 = nn.Dropout(0.5) if dropout else nn.Identity()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


def load_split(data_dir, prefix, max_samples=None):
    """MNIST IDX: a 16-byte (images) or 8-byte (labels) header, then one byte per pixel or label."""

    def read(name, header_bytes):
        data = gzip.decompress((Path(data_dir) / f"{prefix}-{name}-ubyte.gz").read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images = read("images-idx3", 16).view(-1, 1, 28, 28)[:max_samples]
    labels = read("labels-idx1", 8).long()[:max_samples]
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # T.Normalize((0.1307,), (0.3081,))


def run(hparams):
    # accelerator, strategy and devices come from `fabric run` (fabric run --help)
    fabric = Fabric()

    seed_everything(hparams.seed)  # instead of torch.manual_seed(...)

    # rank 0 reads (in the example: downloads) the data first, then the others
    with fabric.rank_zero_first(local=False):
        train_dataset = load_split(hparams.data_dir, "train", hparams.train_samples)
        test_dataset = load_split(hparams.data_dir, "t10k", hparams.test_samples)

    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=hparams.batch_size)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams.batch_size)

    # a DistributedSampler for each loader, and the batches moved to the device
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net(dropout=not hparams.no_dropout)  # no .to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams.lr)

    # the model on its device and wrapped in DDP, the optimizer wrapped
    model, optimizer = fabric.setup(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=hparams.gamma)

    # torchmetrics instead of counting by hand
    test_acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device)

    for epoch in range(1, hparams.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            fabric.backward(loss)  # instead of loss.backward()

            optimizer.step()
            if (batch_idx == 0) or ((batch_idx + 1) % hparams.log_interval == 0):
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}"
                    f" ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )

        scheduler.step()

        model.eval()
        test_loss = 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_acc(output, target)

        # all_gather: every process's sum, summed
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)

        print(f"\nTest set: Average loss: {test_loss:.6f}, Accuracy: ({100 * test_acc.compute():.4f}%)\n")
        test_acc.reset()

    # fabric.save writes from the process allowed to (rank 0 under DDP)
    if hparams.save_model:
        fabric.save(hparams.save_model, model.state_dict())


if __name__ == "__main__":
    run(parser.parse_args())
