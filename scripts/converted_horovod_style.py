#!/usr/bin/env python
"""MNIST trained the way Horovod's examples/pytorch/pytorch_mnist.py trains it, on Accelerate: the "after" of
scripts/baselines/horovod_mnist.py, converted with as few changes as possible, each marked `# [accelerate]`.

    accelerate launch --multi_gpu --num_processes 4 scripts/converted_horovod_style.py --data-dir path/to/MNIST/raw
    accelerate launch --multi_gpu --num_processes 2 scripts/converted_horovod_style.py --data-dir MNIST/raw --no-cuda

The launcher starts the processes (no horovodrun), prepare() shards the loaders and wraps the model in DDP, which
broadcasts the weights and averages the gradients (no broadcast_parameters, no DistributedOptimizer), and
gather_for_metrics makes the test metrics exact (no metric_average). docs/converting_a_horovod_script.md walks
through the diff.
"""

import argparse
import gzip
import math  # [accelerate] the shard sizes DistributedSampler computed
import os  # [accelerate] what the launcher set
import sys  # [accelerate] the launch check's error
from pathlib import Path

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
from accelerate import Accelerator, DataLoaderConfiguration  # [accelerate]
from accelerate.utils import (  # [accelerate]
    DDPCommunicationHookType, DistributedDataParallelKwargs, is_deepspeed_available, set_seed,
)
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import TensorDataset

# Training settings
parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                    help="input batch size for training (per worker)")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate of one worker")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches between training logs")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                    help="use mixed precision for training")
parser.add_argument("--data-dir", required=True, help="folder with the four gzipped MNIST IDX files")
parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
parser.add_argument("--test-samples", type=int, help="test on the first N test images only")
parser.add_argument("--save-model", metavar="PATH", help="save the trained weights here (rank 0)")


class Net(nn.Module):
    """Horovod's Net without its two dropouts: masks drawn in each process would make a comparison on two
    processes depend on which process holds which sample."""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def load_split(data_dir, prefix, max_samples=None):
    """MNIST IDX: a 16-byte (images) or 8-byte (labels) header, then one byte per pixel or label."""

    def read(name, header_bytes):
        data = gzip.decompress((Path(data_dir) / f"{prefix}-{name}-ubyte.gz").read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images = read("images-idx3", 16).view(-1, 1, 28, 28)[:max_samples]
    labels = read("labels-idx1", 8).long()[:max_samples]
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # transforms.Normalize((0.1307,), (0.3081,))


def train(args):
    def train_mixed_precision(epoch):  # [accelerate] the Accelerator holds the scaler
        model.train()
        # [accelerate] a new shuffle each epoch, as sampler.set_epoch
        train_loader.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            with accelerator.autocast():  # [accelerate]
                output = model(data)
                loss = F.nll_loss(output, target)

            # [accelerate] scales the loss; DDP averages the gradients during backward: nothing to synchronize()
            accelerator.backward(loss)
            # [accelerate] unscales, skips a step whose gradients overflowed, updates the scale
            optimizer.step()

            if batch_idx % args.log_interval == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\tLoss Scale: {}".format(
                    epoch, batch_idx * len(data), samples_per_process,  # [accelerate]
                    100. * batch_idx / len(train_loader), loss.item(), accelerator.scaler.get_scale()))

    def train_epoch(epoch):
        model.train()
        # [accelerate] a new shuffle each epoch, as sampler.set_epoch
        train_loader.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            accelerator.backward(loss)  # [accelerate] DDP averages the gradients over the processes
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch, batch_idx * len(data), samples_per_process,  # [accelerate]
                    100. * batch_idx / len(train_loader), loss.item()))

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        test_count = 0  # [accelerate]
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                # [accelerate] every process's rows, without those repeated to even out the shards
                output, target = accelerator.gather_for_metrics((output, target))
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()
                test_count += len(target)  # [accelerate]

        # [accelerate] sums over every test sample once: no per-process means to average (metric_average)
        test_loss /= test_count
        test_accuracy /= test_count

        if accelerator.is_main_process:  # [accelerate]
            print("\nTest set: Average loss: {:.6f}, Accuracy: {:.4f}% ({} samples)\n".format(
                test_loss, 100. * test_accuracy, test_count))  # [accelerate]

    if is_deepspeed_available():  # [accelerate] before the group too: docs/ending_a_run_cleanly.md
        import deepspeed  # noqa: F401
    # [accelerate] the processes, their group and devices come from `accelerate launch`
    accelerator = Accelerator(
        cpu=args.no_cuda,
        mixed_precision="fp16" if args.use_mixed_precision else None,  # [accelerate] autocast + GradScaler
        # [accelerate] --fp16-allreduce: gradients travel as fp16, as with hvd.Compression.fp16
        kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)]
        if args.fp16_allreduce else None,
        # [accelerate] shuffle as DistributedSampler does: its seed is 0 whatever manual_seed said
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
    )
    # [accelerate] without --no-cuda on a machine without GPUs, `accelerate launch --multi_gpu` starts lone processes
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        sys.exit(f"error: accelerate launch started {os.environ['WORLD_SIZE']} processes, but they did not form one "
                 f"group: on a machine without GPUs add --no-cuda to the script's flags "
                 f"(and --multi_gpu to the launch's)")
    set_seed(args.seed)  # [accelerate] torch.manual_seed and torch.cuda.manual_seed
    if args.use_mixed_precision and not args.cuda:
        raise ValueError("Mixed precision is only supported with cuda enabled.")

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    train_dataset = load_split(args.data_dir, "train", args.train_samples)
    # [accelerate] no DistributedSampler: prepare() shards the loaders
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=True, **kwargs)
    samples_per_process = math.ceil(len(train_dataset) / accelerator.num_processes)  # [accelerate] len(train_sampler)

    test_dataset = load_split(args.data_dir, "t10k", args.test_samples)
    # [accelerate] at most one batch per process: prepare() pads the shards to whole batches, so a batch larger than
    # a shard would evaluate a full batch on every process
    test_batch_size = min(args.test_batch_size, math.ceil(len(test_dataset) / accelerator.num_processes))
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=test_batch_size, **kwargs)  # [accelerate]

    model = Net()

    # [accelerate] --lr is one process's: the global batch grows with the processes, so does the lr (lr * hvd.size())
    lr_scaler = accelerator.num_processes

    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # [accelerate] DDP broadcasts rank 0's weights and averages the gradients; devices; sharded loaders
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    for epoch in range(1, args.epochs + 1):
        if args.use_mixed_precision:
            train_mixed_precision(epoch)  # [accelerate]
        else:
            train_epoch(epoch)
        # Keep test in full precision since computation is relatively light.
        test()

    if args.save_model:
        # [accelerate] written by the main process only; without DDP's "module." prefix
        accelerator.save(accelerator.unwrap_model(model).state_dict(), args.save_model)
    # [accelerate] release the DDP model first: end_training then stops gloo's threads before Python exits
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()  # [accelerate]


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    train(args)
