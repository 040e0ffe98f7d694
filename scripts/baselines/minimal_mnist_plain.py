#!/usr/bin/env python
"""A small ConvNet on MNIST in plain PyTorch, on one device: the "before" of scripts/minimal_mnist.py.

    python scripts/baselines/minimal_mnist_plain.py --data_dir path/to/MNIST/raw

`diff scripts/baselines/minimal_mnist_plain.py scripts/minimal_mnist.py` is the whole migration.
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    """(Conv 5x5 -> BatchNorm -> ReLU -> MaxPool) x 2 -> Linear: 28x28 -> 14x14x16 -> 7x7x32 -> 10."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(7 * 7 * 32, 10)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


def load_split(data_dir, prefix):
    """One split of the gzipped MNIST IDX files: a 16-byte (images) or 8-byte (labels) header, then one byte
    per pixel or label. Read by hand because torchvision's IDX reader takes uncompressed files only."""

    def read(name, header_bytes):
        path = Path(data_dir) / f"{prefix}-{name}-ubyte.gz"
        if not path.is_file():  # the one likely mistake: one line, no traceback
            sys.exit(f"error: no {path}: --data_dir must be a folder with the four gzipped MNIST IDX files")
        data = gzip.decompress(path.read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images, labels = read("images-idx3", 16).view(-1, 1, 28, 28), read("labels-idx1", 8).long()
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # MNIST's mean and std


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="folder with the four MNIST IDX .gz files")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    # outputs/minimal_mnist_plain or outputs/minimal_mnist: each script of the pair its own folder
    parser.add_argument("--output_dir", default=f"outputs/{Path(__file__).stem}")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    return parser.parse_args(argv)


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.manual_seed(args.seed)

    train_dataloader = DataLoader(load_split(args.data_dir, "train"), batch_size=args.batch_size, shuffle=True)
    eval_dataloader = DataLoader(load_split(args.data_dir, "t10k"), batch_size=args.batch_size)
    model = ConvNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)

    for epoch in range(args.epochs):
        model.train()
        for step, (images, labels) in enumerate(train_dataloader):
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels) / args.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == len(train_dataloader):
                optimizer.step()
                optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for images, labels in eval_dataloader:
            images, labels = images.to(device), labels.to(device)
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            correct += (predictions == labels).sum().item()
            total += len(labels)
        print(f"epoch {epoch}: eval accuracy {correct / total:.4f} ({total} samples)")

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), Path(args.output_dir) / "model.safetensors")
    results = {"eval_accuracy": correct / total, "eval_samples": total, "num_processes": 1}
    (Path(args.output_dir) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(parse_args())
