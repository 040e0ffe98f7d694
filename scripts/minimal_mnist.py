#!/usr/bin/env python
"""A small ConvNet on MNIST with Accelerate, on any number of processes: the "after" of minimal_mnist_plain.py.

    accelerate launch scripts/minimal_mnist.py --data_dir path/to/MNIST/raw

`diff scripts/baselines/minimal_mnist_plain.py scripts/minimal_mnist.py` is the whole migration.
"""

import argparse
import gzip
import json
import os  # [accelerate] the launch check reads the launcher's environment
import sys
from pathlib import Path

import torch
import torch.distributed.nn  # [accelerate] imported before the process group: see the end of main()
import torch.nn.functional as F
from accelerate import Accelerator  # [accelerate]
from accelerate.utils import is_deepspeed_available, set_seed  # [accelerate]
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
    if is_deepspeed_available():  # [accelerate] before the group too, as torch.distributed.nn: see the end of main()
        import deepspeed  # noqa: F401
    # [accelerate] the device, the processes and the precision (fp16/bf16) come from `accelerate config` / launch
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)  # [accelerate]
    # [accelerate] refuse launches that would run, but not as asked (utils/launch/launch_checks.py: the exact check)
    started = int(os.environ.get("WORLD_SIZE", 1))  # [accelerate] set by torchrun, accelerate's multi-process launcher
    if accelerator.num_processes != started:  # [accelerate] without --cpu, CPU processes train alone
        sys.exit(f"error: {started} processes started but formed no group; add --cpu after the script name")
    if started == 1 and "MASTER_ADDR" in os.environ:  # [accelerate] set for several processes, yet one started
        sys.exit("error: accelerate launch was asked for several processes but started one; add --multi_gpu to it")
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # [accelerate] would run fp32
        sys.exit("error: fp16 needs a GPU (the CPU silently trains fp32); launch with --mixed_precision no or bf16")

    train_dataloader = DataLoader(load_split(args.data_dir, "train"), batch_size=args.batch_size, shuffle=True)
    eval_dataloader = DataLoader(load_split(args.data_dir, "t10k"), batch_size=args.batch_size)
    model = ConvNet()  # [accelerate] no .to(device): prepare() places it
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    # [accelerate] DDP across processes, each dataloader sharded per process, batches moved to the device
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    for epoch in range(args.epochs):
        model.train()
        for images, labels in train_dataloader:
            with accelerator.accumulate(model):  # [accelerate] steps every N batches, no all-reduce in between
                loss = F.cross_entropy(model(images), labels)
                accelerator.backward(loss)  # [accelerate] divides by N; scales the fp16 loss
                optimizer.step()
                optimizer.zero_grad()

        model.eval()
        correct = total = 0
        for images, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            # [accelerate] every process's predictions, without the samples repeated to even out the shards
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            total += len(labels)
        # [accelerate] printed once per machine (its local main process)
        accelerator.print(f"epoch {epoch}: eval accuracy {correct / total:.4f} ({total} samples)")

    accelerator.save_model(model, args.output_dir)  # [accelerate] the unwrapped weights, from the main process
    if accelerator.is_main_process:  # [accelerate]
        results = {"eval_accuracy": correct / total, "eval_samples": total, "num_processes": accelerator.num_processes}
        (Path(args.output_dir) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    model, optimizer = accelerator.free_memory(model, optimizer)  # [accelerate] release the DDP model, then
    accelerator.end_training()  # [accelerate] end the process group: no gloo thread is left to abort the exit


if __name__ == "__main__":
    main(parse_args())
