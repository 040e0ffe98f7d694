#!/usr/bin/env python
"""MNIST trained the way Lightning Fabric's examples/fabric/image_classifier/train_fabric.py trains it, on Accelerate:
the "after" of scripts/baselines/fabric_mnist.py, converted with as few changes as possible, each marked
`# [accelerate]`.

    accelerate launch --multi_gpu --num_processes 4 scripts/converted_fabric_style.py --data-dir path/to/MNIST/raw
    accelerate launch --multi_gpu --num_processes 2 scripts/converted_fabric_style.py --data-dir MNIST/raw --cpu
    python scripts/converted_fabric_style.py --data-dir path/to/MNIST/raw     # one process

`accelerate launch` starts the processes (no `fabric run`), prepare() does what setup() and setup_dataloaders() did,
main_process_first() what rank_zero_first() did, and gather_for_metrics makes the test metrics exact: torchmetrics
is updated with every process's rows on every process, without the rows repeated to even out the shards, and
computes without syncing (Fabric's DistributedSampler counted one test image twice for 501 on 2 processes; a
torchmetrics metric updated with each process's own rows under Accelerate counts 512).
docs/converting_a_fabric_script.md walks through the diff.
"""

import argparse
import gzip
import os  # [accelerate] what the launcher set
import sys  # [accelerate] the launch check's error
from pathlib import Path

import torch
import torch.distributed.nn  # [accelerate] before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from accelerate import Accelerator  # [accelerate]
from accelerate.utils import is_deepspeed_available, set_seed  # [accelerate]
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

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
# [accelerate] `fabric run --accelerator cpu`: accelerate's examples' --cpu
parser.add_argument("--cpu", action="store_true", help="train on the CPU even where there are GPUs")


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
    # [accelerate] here, not at the top: torchmetrics imports PIL, which --help need not wait for
    from torchmetrics.classification import Accuracy

    if is_deepspeed_available():  # [accelerate] before the group too: docs/ending_a_run_cleanly.md
        import deepspeed  # noqa: F401
    # [accelerate] the processes, their group and devices come from `accelerate launch`
    accelerator = Accelerator(cpu=hparams.cpu)
    # [accelerate] without --cpu on a machine without GPUs, `accelerate launch --multi_gpu` starts lone processes
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        sys.exit(f"error: accelerate launch started {os.environ['WORLD_SIZE']} processes, but they did not form one "
                 f"group: on a machine without GPUs add --cpu to the script's flags (and --multi_gpu to the launch's)")

    set_seed(hparams.seed)  # [accelerate] seed_everything

    # [accelerate] the main process reads (in the example: downloads) the data first, then the others
    with accelerator.main_process_first():
        train_dataset = load_split(hparams.data_dir, "train", hparams.train_samples)
        test_dataset = load_split(hparams.data_dir, "t10k", hparams.test_samples)

    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=hparams.batch_size)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams.batch_size)

    model = Net(dropout=not hparams.no_dropout)  # no .to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams.lr)

    # [accelerate] setup() and setup_dataloaders() in one call: the model on its device and wrapped in DDP, the
    # optimizer wrapped, each loader sharded (whole batches per process) and moved to the device
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    # [accelerate] not prepared, as Fabric left it: prepared, each step() would step it once per process
    scheduler = StepLR(optimizer, step_size=1, gamma=hparams.gamma)

    # [accelerate] updated with every process's rows (gather_for_metrics) on every process: nothing left to sync
    test_acc = Accuracy(task="multiclass", num_classes=10, sync_on_compute=False).to(accelerator.device)

    for epoch in range(1, hparams.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            accelerator.backward(loss)  # [accelerate] instead of fabric.backward(loss)

            optimizer.step()
            if (batch_idx == 0) or ((batch_idx + 1) % hparams.log_interval == 0):
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}"
                    f" ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )

        scheduler.step()

        model.eval()
        test_loss = 0
        test_count = 0  # [accelerate]
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                # [accelerate] every process's rows, without those repeated to even out the shards
                output, target = accelerator.gather_for_metrics((output, target))
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_acc(output, target)
                test_count += len(target)  # [accelerate]

        # [accelerate] every test image summed once on every process: no all_gather
        test_loss = test_loss / test_count

        accuracy = test_acc.compute()  # [accelerate] on every process: a metric that syncs needs them all
        if accelerator.is_main_process:  # [accelerate] one line, not one per process
            print(f"\nTest set: Average loss: {test_loss:.6f}, Accuracy: ({100 * accuracy:.4f}%)"
                  f" ({test_count} images)\n")  # [accelerate]
        test_acc.reset()

    if hparams.save_model:
        # [accelerate] the whole weights without DDP's wrapper (under FSDP gathered from the shards: collective),
        # written by the main process only
        accelerator.save(accelerator.get_state_dict(model), hparams.save_model)
    # [accelerate] release the DDP model first: end_training then stops gloo's threads before Python exits
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()  # [accelerate]


if __name__ == "__main__":
    run(parser.parse_args())
