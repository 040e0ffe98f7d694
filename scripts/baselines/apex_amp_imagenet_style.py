#!/usr/bin/env python
"""MNIST trained the way NVIDIA apex's examples/imagenet/main_amp.py trains ImageNet: the "before" of
scripts/converted_apex_amp_style.py.

    python -m torch.distributed.launch --nproc_per_node 8 scripts/baselines/apex_amp_imagenet_style.py \
        path/to/MNIST/raw --opt-level O1                                      # every GPU of this machine
    python -m torch.distributed.launch --nproc_per_node 2 scripts/baselines/apex_amp_imagenet_style.py \
        path/to/MNIST/raw --opt-level O0 --cpu                                # 2 CPU processes, gloo

What main_amp.py writes at its last amp.initialize version: a --local_rank flag filled in by
torch.distributed.launch, init_process_group('env://'), the learning rate scaled by the global batch / 256 with a
5-epoch warmup set at every step, amp.initialize (--opt-level, --keep-batchnorm-fp32, --loss-scale) and
amp.scale_loss, apex's DistributedDataParallel(delay_allreduce=True), a data_prefetcher that copies the next batch
on a side CUDA stream, DistributedSampler for both splits, losses and precisions averaged over the processes with
reduce_tensor, --deterministic seeding each process with its local rank, and a checkpoint dict saved by local rank
0 with a model_best copy, resumed with --resume. -b is per process. Left out: torchvision's ImageFolder and
fast_collate (the four gzipped MNIST IDX files instead), --arch (a small ConvNet), --prof, --sync_bn and the timing
columns. apex cannot be installed here: the tests run this script on the stand-in in tests/standins/apex (O0) on
the CPU. `diff` it with the converted script to see the whole migration (docs/converting_an_apex_amp_script.md).
"""

import argparse
import contextlib
import gzip
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data.distributed
from apex import amp
from apex.fp16_utils import to_python_float
from apex.parallel import DistributedDataParallel as DDP
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
    parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint")
    parser.add_argument("--deterministic", action="store_true")
    # torch.distributed.launch passes --local-rank=N since PyTorch 2.0, --local_rank=N before
    parser.add_argument("--local_rank", "--local-rank", default=0, type=int)
    parser.add_argument("--opt-level", type=str)
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
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
    if args.deterministic:
        torch.manual_seed(args.local_rank)

    args.distributed = False
    if "WORLD_SIZE" in os.environ:
        args.distributed = int(os.environ["WORLD_SIZE"]) > 1

    args.gpu = 0
    args.world_size = 1
    use_cuda = torch.cuda.is_available() and not args.cpu

    if args.distributed:
        args.gpu = args.local_rank
        if use_cuda:
            torch.cuda.set_device(args.gpu)
        torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://")
        args.world_size = torch.distributed.get_world_size()
    args.device = torch.device("cuda", args.gpu) if use_cuda else torch.device("cpu")

    model = Net().to(args.device)

    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    # Initialize Amp. Amp accepts either values or strings for the optional override arguments.
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)

    # For distributed training, wrap the model with apex.parallel.DistributedDataParallel, after amp.initialize.
    if args.distributed:
        # delay_allreduce delays all communication to the end of the backward pass.
        model = DDP(model, delay_allreduce=True)

    criterion = nn.CrossEntropyLoss()

    # Optionally resume from a checkpoint
    if args.resume:
        if os.path.isfile(args.resume):
            print("=> loading checkpoint '{}'".format(args.resume))
            checkpoint = torch.load(args.resume, map_location=args.device)
            args.start_epoch = checkpoint["epoch"]
            best_prec1 = checkpoint["best_prec1"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
            print("=> loaded checkpoint '{}' (epoch {})".format(args.resume, checkpoint["epoch"]))
        else:
            print("=> no checkpoint found at '{}'".format(args.resume))

    train_dataset = load_split(args.data, "train", args.train_samples)
    val_dataset = load_split(args.data, "t10k", args.val_samples)

    train_sampler = None
    val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset)

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=use_cuda, sampler=train_sampler)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=use_cuda, sampler=val_sampler)

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch)

        # evaluate on validation set
        prec1 = validate(val_loader, model, criterion)

        # remember best prec@1 and save checkpoint
        if args.local_rank == 0:
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            save_checkpoint({
                "epoch": epoch + 1,
                "state_dict": model.state_dict(),
                "best_prec1": best_prec1,
                "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict(),
            }, is_best)
    if args.distributed:
        # release the DDP model first: destroying the group then stops gloo's threads before Python exits
        del model
        dist.destroy_process_group()


class data_prefetcher():
    """Copies the next batch to the GPU on a side CUDA stream while the current one trains (on the CPU there is
    no copy to overlap: it hands the batches on)."""

    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream() if args.device.type == "cuda" else None
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            self.next_target = None
            return
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            self.next_input = self.next_input.to(args.device, non_blocking=True)
            self.next_target = self.next_target.to(args.device, non_blocking=True)

    def next(self):
        if self.stream:
            torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        target = self.next_target
        if self.stream and input is not None:
            input.record_stream(torch.cuda.current_stream())
            target.record_stream(torch.cuda.current_stream())
        self.preload()
        return input, target


def train(train_loader, model, criterion, optimizer, epoch):
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to train mode
    model.train()

    prefetcher = data_prefetcher(train_loader)
    input, target = prefetcher.next()
    i = 0
    while input is not None:
        i += 1
        adjust_learning_rate(optimizer, epoch, i, len(train_loader))

        # compute output
        output = model(input)
        loss = criterion(output, target)

        # compute gradient and do SGD step
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

        if i % args.print_freq == 0:
            # Measure accuracy
            prec1, prec5 = accuracy(output.data, target, topk=(1, 5))

            # Average loss and accuracy across processes for logging
            if args.distributed:
                reduced_loss = reduce_tensor(loss.data)
                prec1 = reduce_tensor(prec1)
                prec5 = reduce_tensor(prec5)
            else:
                reduced_loss = loss.data

            losses.update(to_python_float(reduced_loss), input.size(0))
            top1.update(to_python_float(prec1), input.size(0))
            top5.update(to_python_float(prec5), input.size(0))

            if args.local_rank == 0:
                print("Epoch: [{0}][{1}/{2}]\t"
                      "Loss {loss.val:.10f} ({loss.avg:.4f})\t"
                      "Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t"
                      "Prec@5 {top5.val:.3f} ({top5.avg:.3f})".format(
                          epoch, i, len(train_loader), loss=losses, top1=top1, top5=top5))
        input, target = prefetcher.next()


def validate(val_loader, model, criterion):
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to evaluate mode
    model.eval()

    prefetcher = data_prefetcher(val_loader)
    input, target = prefetcher.next()
    while input is not None:
        # compute output
        with torch.no_grad():
            output = model(input)
            loss = criterion(output, target)

        # measure accuracy and record loss
        prec1, prec5 = accuracy(output.data, target, topk=(1, 5))

        if args.distributed:
            reduced_loss = reduce_tensor(loss.data)
            prec1 = reduce_tensor(prec1)
            prec5 = reduce_tensor(prec5)
        else:
            reduced_loss = loss.data

        losses.update(to_python_float(reduced_loss), input.size(0))
        top1.update(to_python_float(prec1), input.size(0))
        top5.update(to_python_float(prec5), input.size(0))

        input, target = prefetcher.next()

    print(" * Prec@1 {top1.avg:.3f} Prec@5 {top5.avg:.3f} Loss {loss.avg:.6f} ({top1.count} images)"
          .format(top1=top1, top5=top5, loss=losses))

    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


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


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


if __name__ == "__main__":
    main()
