#!/usr/bin/env python
"""MNIST trained the way pytorch/examples imagenet/main.py trains ImageNet, on Accelerate: the "after" of
scripts/baselines/ddp_imagenet_style.py, converted with as few changes as possible, each marked `# [accelerate]`.

    accelerate launch scripts/converted_ddp_imagenet_style.py path/to/MNIST/raw       # as `accelerate config` says
    accelerate launch --multi_gpu --num_processes 8 scripts/converted_ddp_imagenet_style.py path/to/MNIST/raw
    accelerate launch --multi_gpu --num_processes 2 scripts/converted_ddp_imagenet_style.py path/to/MNIST/raw --cpu

The launcher starts the processes (no mp.spawn, --dist-url, --world-size or --rank), prepare() shards the
loaders and wraps the model, gather_for_metrics makes the evaluation exact without a tail loader, and
save_state/load_state keep everything a resume needs. docs/converting_a_ddp_script.md walks through the diff.
"""

import argparse
import gzip
import json  # [accelerate] progress.json
import os  # [accelerate] what the launcher set
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
from accelerate import Accelerator, DataLoaderConfiguration  # [accelerate]
from accelerate.utils import set_seed  # [accelerate]
from torch import nn
from torch.utils.data import DataLoader, TensorDataset  # [accelerate] no Subset: no tail loader

IDX_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", metavar="DIR", help="folder with the four gzipped MNIST IDX files")
    parser.add_argument("-j", "--workers", default=2, type=int, help="data loading workers of this node")
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("-b", "--batch-size", default=128, type=int,
                        help="the batch of this node: its processes share it")
    parser.add_argument("--lr", "--learning-rate", default=0.05, type=float, dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", default=10, type=int, help="print the training loss every N steps")
    parser.add_argument("--resume", default="", metavar="PATH", help="a checkpoint folder")  # [accelerate]
    parser.add_argument("--checkpoint-dir", default="outputs/imagenet_style", metavar="DIR")
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--val-samples", type=int, help="evaluate on the first N test images only")
    parser.add_argument("--seed", default=42, type=int)
    parser.add_argument("--amp", action="store_true", help="mixed precision: fp16 on GPUs, bf16 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes (gloo) even if GPUs are present")
    return parser.parse_args(argv)


class Net(nn.Module):
    """(Conv 3x3 -> ReLU -> MaxPool) x 2 -> Linear. No BatchNorm: its batch statistics are per process,
    so they would depend on which samples each process holds rather than on the global batch."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def load_split(data_dir, prefix, max_samples=None):
    """MNIST IDX: a 16-byte (images) or 8-byte (labels) header, then one byte per pixel or label."""

    def read(name, header_bytes):
        data = gzip.decompress((Path(data_dir) / f"{prefix}-{name}-ubyte.gz").read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images = read("images-idx3", 16).view(-1, 1, 28, 28)[:max_samples]
    labels = read("labels-idx1", 8).long()[:max_samples]
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # MNIST's mean and std


def main(args):
    missing = [name for name in IDX_FILES if not (Path(args.data) / name).is_file()]
    if missing:
        sys.exit(f"error: no {Path(args.data) / missing[0]}: DIR must hold the four gzipped MNIST IDX files")
    if args.resume and not (Path(args.resume) / "progress.json").is_file():  # [accelerate] a folder
        sys.exit(f"error: no checkpoint at {args.resume} (--resume: a checkpoint folder this script saved)")

    # [accelerate] the processes, their group and devices come from `accelerate launch`
    accelerator = Accelerator(
        cpu=args.cpu,
        # [accelerate] --amp as before; without it the launch config decides
        mixed_precision=("fp16" if torch.cuda.is_available() and not args.cpu else "bf16") if args.amp else None,
        # [accelerate] our StepLR counts epochs: stepped once per call, not num_processes times
        step_scheduler_with_optimizer=False,
        # [accelerate] shuffle as DistributedSampler does: one permutation of seed + epoch, shared by all processes
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    # [accelerate] without --cpu on a machine without GPUs, `accelerate launch --multi_gpu` starts lone processes
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        sys.exit(f"error: accelerate launch started {os.environ['WORLD_SIZE']} processes, but they did not form one "
                 f"group: on a machine without GPUs add --cpu to the script's flags (and --multi_gpu to the launch's)")
    use_cuda = accelerator.device.type == "cuda"  # [accelerate]
    # [accelerate] the same seed on every process: the same initial weights and, before prepare(), the same shuffle
    set_seed(args.seed)

    model = Net()  # [accelerate] no .to(device), no DDP: prepare() does both
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # stepped once per epoch

    # -b and -j are for the whole node: each of its processes takes its share.
    processes_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # [accelerate] set by accelerate launch
    args.batch_size = int(args.batch_size / processes_per_node)  # [accelerate]
    args.workers = int((args.workers + processes_per_node - 1) / processes_per_node)  # [accelerate]
    train_dataset = load_split(args.data, "train", args.train_samples)
    val_dataset = load_split(args.data, "t10k", args.val_samples)
    # [accelerate] no DistributedSampler: prepare() shards the loaders, and evaluation gathers the shards
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=use_cuda)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, num_workers=args.workers,
                            pin_memory=use_cuda)
    # [accelerate] DDP, devices, sharded loaders; a prepared scheduler is saved and loaded by save_state/load_state
    model, optimizer, scheduler, train_loader, val_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, val_loader
    )

    best_acc1 = 0.0
    start_epoch = 0
    if args.resume:
        # [accelerate] model, optimizer, scheduler, loss scaler and RNG states, each onto this process's device
        accelerator.load_state(args.resume)
        progress = json.loads((Path(args.resume) / "progress.json").read_text())  # [accelerate] what we add
        start_epoch = progress["epoch"]  # [accelerate]
        best_acc1 = progress["best_acc1"]  # [accelerate]
        accelerator.print(f"=> loaded checkpoint '{args.resume}' (epoch {start_epoch})")  # [accelerate]

    for epoch in range(start_epoch, args.epochs):
        # [accelerate] a new shuffle each epoch; after a resume the loader would count epochs from 0 again
        train_loader.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, accelerator, args)  # [accelerate]
        acc1 = validate(val_loader, model, criterion, accelerator, args)  # [accelerate]
        scheduler.step()

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        # [accelerate] every process calls it: save_state writes each process's RNG state
        save_checkpoint(accelerator, {"epoch": epoch + 1, "best_acc1": best_acc1}, is_best, args.checkpoint_dir)
    # [accelerate] release the DDP model first: end_training then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()  # [accelerate]


def train(train_loader, model, criterion, optimizer, epoch, accelerator, args):  # [accelerate]
    losses = AverageMeter()
    model.train()
    accelerator.print(f"Epoch: [{epoch}] lr {optimizer.param_groups[0]['lr']:.6f}")  # [accelerate] once per machine
    for i, (images, target) in enumerate(train_loader):
        with accelerator.autocast():  # [accelerate] the precision of --amp or the launch config
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad()
        accelerator.backward(loss)  # [accelerate] scales an fp16 loss; the optimizer skips overflowed steps
        optimizer.step()

        if i % args.print_freq == 0 or i + 1 == len(train_loader):
            # The mean over processes is the loss of the whole global batch (apex's reduce_tensor).
            step_loss = accelerator.reduce(loss.detach(), reduction="mean")  # [accelerate]
            losses.update(step_loss.item(), len(target))
            accelerator.print(f"Epoch: [{epoch}][{i + 1}/{len(train_loader)}]\t"
                              f"Loss {losses.val:.6f} ({losses.avg:.6f})")  # [accelerate] once per machine


def validate(val_loader, model, criterion, accelerator, args):  # [accelerate]
    def run_validate(loader):
        with torch.no_grad():
            for images, target in loader:
                output = model(images)
                # [accelerate] every process's outputs, without the samples repeated to even out the shards
                output, target = accelerator.gather_for_metrics((output, target))
                loss = criterion(output, target)
                losses.update(loss.item(), len(target))
                top1.update((output.argmax(dim=1) == target).float().mean().item() * 100, len(target))

    losses, top1 = AverageMeter(), AverageMeter()
    model.eval()
    run_validate(val_loader)  # [accelerate] every sample counted once: no all_reduce, no tail loader
    # [accelerate] printed once per machine (its local main process)
    accelerator.print(f" * Acc@1 {top1.avg:.3f} Loss {losses.avg:.6f} ({top1.count} images)")
    return top1.avg


def save_checkpoint(accelerator, progress, is_best, checkpoint_dir):  # [accelerate]
    path = Path(checkpoint_dir) / "checkpoint"  # [accelerate] a folder
    accelerator.save_state(path)  # [accelerate] model, optimizer, scheduler, loss scaler, RNG states
    accelerator.wait_for_everyone()  # [accelerate] every process's files are written before the copy
    if accelerator.is_main_process:  # [accelerate] once, also where all nodes share one disk
        (path / "progress.json").write_text(json.dumps(progress))  # [accelerate]
        if is_best:
            shutil.copytree(path, path.with_name("model_best"), dirs_exist_ok=True)  # [accelerate]


class AverageMeter:
    """A running sum and count; avg is their ratio."""

    def __init__(self):
        self.val = self.sum = self.avg = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


if __name__ == "__main__":
    main(parse_args())
