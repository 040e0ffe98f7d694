#!/usr/bin/env python
"""MNIST trained the way NVIDIA apex's examples/imagenet/main_amp.py trains ImageNet, on Accelerate: the "after" of
scripts/baselines/apex_amp_imagenet_style.py, converted with as few changes as possible, each marked `# [accelerate]`.

    accelerate launch --multi_gpu --num_processes 8 scripts/converted_apex_amp_style.py path/to/MNIST/raw --opt-level O1
    accelerate launch --multi_gpu --num_processes 2 scripts/converted_apex_amp_style.py path/to/MNIST/raw --cpu

The launcher starts the processes (no --local_rank, no init_process_group), mixed precision replaces
amp.initialize and amp.scale_loss, prepare() wraps the model in PyTorch's DDP and shards the loaders, which put
the batches on the device (no data_prefetcher), gather_for_metrics makes the evaluation exact (no reduce_tensor
of per-batch precisions), and save_state/load_state keep everything a resume needs.
docs/converting_an_apex_amp_script.md walks through the diff.
"""

import argparse
import gzip
import json  # [accelerate] progress.json
import os
import shutil
import sys  # [accelerate] the launch check's error
from pathlib import Path

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.nn as nn
import torch.utils.data
from accelerate import Accelerator, DataLoaderConfiguration  # [accelerate]
from accelerate.utils import set_seed  # [accelerate]
from torch.utils.data import TensorDataset


def parse():
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
    parser.add_argument("data", metavar="DIR", help="folder with the four gzipped MNIST IDX files")
    parser.add_argument("-j", "--workers", default=4, type=int, metavar="N", help="number of data loading workers")
    parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
    parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (on restarts)")
    parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N", help="mini-batch size per process")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                        help="Initial learning rate, scaled by <global batch size>/256, with a 5-epoch warmup")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W", help="weight decay")
    parser.add_argument("--print-freq", "-p", default=10, type=int, metavar="N", help="print frequency")
    parser.add_argument("--resume", default="", type=str, metavar="PATH", help="a checkpoint folder")  # [accelerate]
    parser.add_argument("--deterministic", action="store_true")
    # [accelerate] O0: fp32; O1, O2, O3: fp16 autocast over fp32 weights with a dynamic loss scale
    parser.add_argument("--opt-level", type=str, choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--val-samples", type=int, help="evaluate on the first N test images only")
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes (gloo), for a try without GPUs")
    return parser.parse_args()


class Net(nn.Module):
    """(Conv 3x3 -> ReLU -> MaxPool) x 2 -> Linear, for resnet18. No BatchNorm: its batch statistics are per
    process, so they would depend on which samples each process holds rather than on the global batch."""

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


def main():
    global args
    args = parse()
    print("opt_level = {}".format(args.opt_level))
    best_prec1 = 0
    # [accelerate] the processes, their group and devices come from `accelerate launch`
    accelerator = Accelerator(
        cpu=args.cpu,
        # [accelerate] amp.initialize and amp.scale_loss; without --opt-level the launch config decides
        mixed_precision={None: None, "O0": "no"}.get(args.opt_level, "fp16"),
        # [accelerate] shuffle as DistributedSampler does: its seed is 0 whatever the global seed
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
    )
    # [accelerate] without --cpu on a machine without GPUs, `accelerate launch --multi_gpu` starts lone processes
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        sys.exit(f"error: accelerate launch started {os.environ['WORLD_SIZE']} processes, but they did not form one "
                 f"group: on a machine without GPUs add --cpu to the script's flags (and --multi_gpu to the launch's)")
    if args.deterministic:
        # [accelerate] torch.manual_seed(args.local_rank): each process its own seed, as before. Safe only because
        # data_seed fixes the shuffle: without it the seedable sampler would shuffle with each process's own seed
        set_seed(accelerator.local_process_index)
    args.world_size = accelerator.num_processes  # [accelerate]
    use_cuda = accelerator.device.type == "cuda"  # [accelerate]

    model = Net()  # [accelerate] no .to(device), no DDP: prepare() does both

    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    criterion = nn.CrossEntropyLoss()

    train_dataset = load_split(args.data, "train", args.train_samples)
    val_dataset = load_split(args.data, "t10k", args.val_samples)

    # [accelerate] no DistributedSampler: prepare() shards the loaders; pin_memory makes the copies asynchronous
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=True,  # [accelerate]
        num_workers=args.workers, pin_memory=use_cuda)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=use_cuda)
    # [accelerate] DDP, devices, sharded loaders that put each batch on the device (the data_prefetcher's copy)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)

    # Optionally resume from a checkpoint
    if args.resume:
        if (Path(args.resume) / "progress.json").is_file():  # [accelerate] a folder
            print("=> loading checkpoint '{}'".format(args.resume))
            # [accelerate] model, optimizer, loss scaler and RNG states, each onto this process's device
            accelerator.load_state(args.resume)
            progress = json.loads((Path(args.resume) / "progress.json").read_text())  # [accelerate] what we add
            args.start_epoch = progress["epoch"]  # [accelerate]
            best_prec1 = progress["best_prec1"]  # [accelerate]
            print("=> loaded checkpoint '{}' (epoch {})".format(args.resume, args.start_epoch))  # [accelerate]
        else:
            print("=> no checkpoint found at '{}'".format(args.resume))

    for epoch in range(args.start_epoch, args.epochs):
        # [accelerate] a new shuffle each epoch; after a resume the loader would count epochs from 0 again
        train_loader.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, accelerator)  # [accelerate]

        # evaluate on validation set
        prec1 = validate(val_loader, model, criterion, accelerator)  # [accelerate]

        # remember best prec@1 and save checkpoint
        is_best = prec1 > best_prec1  # [accelerate] on every process: save_state is called by all of them
        best_prec1 = max(prec1, best_prec1)
        save_checkpoint(accelerator, {"epoch": epoch + 1, "best_prec1": best_prec1}, is_best)  # [accelerate]
    # [accelerate] release the DDP model first: end_training then stops gloo's threads before Python exits
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()  # [accelerate]


def train(train_loader, model, criterion, optimizer, epoch, accelerator):  # [accelerate]
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to train mode
    model.train()

    for i, (input, target) in enumerate(train_loader, 1):  # [accelerate] batches arrive on the device
        adjust_learning_rate(optimizer, epoch, i, len(train_loader))

        # compute output
        output = model(input)
        loss = criterion(output, target)

        # compute gradient and do SGD step
        optimizer.zero_grad()
        accelerator.backward(loss)  # [accelerate] scales an fp16 loss; the optimizer skips overflowed steps
        optimizer.step()

        if i % args.print_freq == 0:
            # Measure accuracy
            prec1, prec5 = accuracy(output.data, target, topk=(1, 5))

            # Average loss and accuracy across processes for logging
            # [accelerate] reduce_tensor: the mean over processes of equal full batches is the global batch's
            reduced_loss, prec1, prec5 = accelerator.reduce((loss.detach(), prec1, prec5), reduction="mean")

            losses.update(reduced_loss.item(), input.size(0))  # [accelerate] to_python_float
            top1.update(prec1.item(), input.size(0))  # [accelerate]
            top5.update(prec5.item(), input.size(0))  # [accelerate]

            if accelerator.is_local_main_process:  # [accelerate] args.local_rank == 0
                print("Epoch: [{0}][{1}/{2}]\t"
                      "Loss {loss.val:.10f} ({loss.avg:.4f})\t"
                      "Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t"
                      "Prec@5 {top5.val:.3f} ({top5.avg:.3f})".format(
                          epoch, i, len(train_loader), loss=losses, top1=top1, top5=top5))


def validate(val_loader, model, criterion, accelerator):  # [accelerate]
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to evaluate mode
    model.eval()

    for input, target in val_loader:  # [accelerate]
        # compute output
        with torch.no_grad():
            output = model(input)
            # [accelerate] every process's outputs, without the samples repeated to even out the shards
            output, target = accelerator.gather_for_metrics((output, target))
            loss = criterion(output, target)

        # measure accuracy and record loss
        prec1, prec5 = accuracy(output.data, target, topk=(1, 5))

        # [accelerate] already over all processes: no reduce_tensor of per-process means
        losses.update(loss.item(), target.size(0))
        top1.update(prec1.item(), target.size(0))
        top5.update(prec5.item(), target.size(0))

    # [accelerate] printed once; the before printed on every process
    accelerator.print(" * Prec@1 {top1.avg:.3f} Prec@5 {top5.avg:.3f} Loss {loss.avg:.6f} ({top1.count} images)"
          .format(top1=top1, top5=top5, loss=losses))

    return top1.avg


def save_checkpoint(accelerator, progress, is_best, path="checkpoint"):  # [accelerate] a folder
    accelerator.save_state(path)  # [accelerate] model, optimizer, loss scaler, every process's RNG state
    accelerator.wait_for_everyone()  # [accelerate] every process's files are written before the copy
    if accelerator.is_main_process:  # [accelerate] once, also where all nodes share one disk
        Path(path, "progress.json").write_text(json.dumps(progress))  # [accelerate]
        if is_best:
            shutil.copytree(path, "model_best", dirs_exist_ok=True)  # [accelerate]


class AverageMeter(object):
    """Computes and stores the average and current value"""

    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def adjust_learning_rate(optimizer, epoch, step, len_epoch):
    """LR schedule that should yield 76% converged accuracy with batch size 256"""
    factor = epoch // 30

    if epoch >= 80:
        factor = factor + 1

    lr = args.lr * (0.1 ** factor)

    """Warmup"""
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5. * len_epoch)

    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def accuracy(output, target, topk=(1,)):
    """Computes the precision@k for the specified values of k"""
    maxk = max(topk)
    batch_size = target.size(0)

    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))

    res = []
    for k in topk:
        correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
        res.append(correct_k.mul_(100.0 / batch_size))
    return res


if __name__ == "__main__":
    main()
