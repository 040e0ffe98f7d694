#!/usr/bin/env python
"""MNIST trained the way pytorch/examples imagenet/main.py trains ImageNet: the "before" of
scripts/converted_ddp_imagenet_style.py.

    python scripts/baselines/ddp_imagenet_style.py path/to/MNIST/raw                  # one process
    python scripts/baselines/ddp_imagenet_style.py path/to/MNIST/raw --multiprocessing-distributed \
        --world-size 1 --rank 0 --dist-url tcp://127.0.0.1:23456                     # every GPU of this node
    python scripts/baselines/ddp_imagenet_style.py path/to/MNIST/raw --multiprocessing-distributed \
        --world-size 1 --rank 0 --dist-url tcp://127.0.0.1:23456 --cpu --cpu-processes 2   # 2 CPU processes, gloo

What the classic DDP tutorials write: mp.spawn of one process per GPU, init_process_group from
--dist-url/--world-size/--rank, DistributedSampler with set_epoch, evaluation summed with all_reduce
(and the imagenet example's second loader for the tail that a drop_last sampler leaves out),
torch.save of a checkpoint dict with a model_best copy, --resume with map_location, a per-epoch
StepLR, and torch.amp where the articles used apex. `diff` it with the converted script to see the
whole migration (docs/converting_a_ddp_script.md walks through it).
"""

import argparse
import gzip
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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
    parser.add_argument("--resume", default="", metavar="PATH", help="a checkpoint.pth.tar to continue from")
    parser.add_argument("--checkpoint-dir", default="outputs/imagenet_style", metavar="DIR")
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--val-samples", type=int, help="evaluate on the first N test images only")
    parser.add_argument("--seed", default=42, type=int)
    parser.add_argument("--amp", action="store_true", help="mixed precision: fp16 on GPUs, bf16 on the CPU")
    parser.add_argument("--world-size", default=1, type=int, help="number of nodes (machines)")
    parser.add_argument("--rank", default=0, type=int, help="this node's rank, 0 to world size - 1")
    parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", help="node 0's address and a free port")
    parser.add_argument("--multiprocessing-distributed", action="store_true",
                        help="start one process per GPU (per --cpu-processes with --cpu) on this node")
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes (gloo) even if GPUs are present")
    parser.add_argument("--cpu-processes", default=1, type=int, help="with --cpu: processes per node")
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
    # Checked here, before mp.spawn: in a spawned worker sys.exit becomes the parent's traceback.
    missing = [name for name in IDX_FILES if not (Path(args.data) / name).is_file()]
    if missing:
        sys.exit(f"error: no {Path(args.data) / missing[0]}: DIR must hold the four gzipped MNIST IDX files")
    if args.resume and not Path(args.resume).is_file():
        sys.exit(f"error: no checkpoint at {args.resume} (--resume)")

    use_cuda = torch.cuda.is_available() and not args.cpu
    ngpus_per_node = torch.cuda.device_count() if use_cuda else args.cpu_processes  # processes per node
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size  # from nodes to processes
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, use_cuda, args))
    else:
        main_worker(0, ngpus_per_node, use_cuda, args)


def main_worker(gpu, ngpus_per_node, use_cuda, args):
    if args.distributed:
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu  # from the node's rank to this process's global rank
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # Seeded in each worker: mp.spawn starts fresh interpreters, which do not inherit the parent's seed.
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    model = Net().to(device)
    if args.distributed:
        model = DistributedDataParallel(model, device_ids=[gpu] if use_cuda else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # stepped once per epoch
    amp_dtype = torch.float16 if use_cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and amp_dtype == torch.float16)

    if args.multiprocessing_distributed:
        # -b and -j are for the whole node: each of its processes takes its share.
        args.batch_size = int(args.batch_size / ngpus_per_node)
        args.workers = int((args.workers + ngpus_per_node - 1) / ngpus_per_node)
    train_dataset = load_split(args.data, "train", args.train_samples)
    val_dataset = load_split(args.data, "t10k", args.val_samples)
    if args.distributed:
        # The same shuffle on every process (seed + epoch), each taking every world_size-th sample.
        train_sampler = DistributedSampler(train_dataset, seed=args.seed)
        # drop_last: no padded duplicates in the evaluation; validate() adds the samples it leaves out.
        val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = val_sampler = None
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=train_sampler is None,
                              num_workers=args.workers, pin_memory=use_cuda, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, num_workers=args.workers,
                            pin_memory=use_cuda, sampler=val_sampler)

    best_acc1 = 0.0
    start_epoch = 0
    if args.resume:
        # map_location: the tensors were saved from rank 0's device; each process loads onto its own.
        checkpoint = torch.load(args.resume, map_location=device)
        start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        if args.rank == 0:
            print(f"=> loaded checkpoint '{args.resume}' (epoch {start_epoch})")

    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first
        train(train_loader, model, criterion, optimizer, scaler, epoch, device, amp_dtype, args)
        acc1 = validate(val_loader, model, criterion, device, args)
        scheduler.step()

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank % ngpus_per_node == 0:  # once per node
            save_checkpoint({
                "epoch": epoch + 1,
                "state_dict": model.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
            }, is_best, args.checkpoint_dir)
    if args.distributed:
        # release the DDP model first: destroying the group then stops gloo's threads before Python exits
        # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
        del model
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, scaler, epoch, device, amp_dtype, args):
    losses = AverageMeter()
    model.train()
    if args.rank == 0:
        print(f"Epoch: [{epoch}] lr {optimizer.param_groups[0]['lr']:.6f}")
    for i, (images, target) in enumerate(train_loader):
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            output = model(images)
            loss = criterion(output, target)

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        if i % args.print_freq == 0 or i + 1 == len(train_loader):
            # The mean over processes is the loss of the whole global batch (apex's reduce_tensor).
            step_loss = loss.detach().clone()
            if args.distributed:
                dist.all_reduce(step_loss)
                step_loss /= args.world_size
            losses.update(step_loss.item(), len(target))
            if args.rank == 0:
                print(f"Epoch: [{epoch}][{i + 1}/{len(train_loader)}]\tLoss {losses.val:.6f} ({losses.avg:.6f})")


def validate(val_loader, model, criterion, device, args):
    def run_validate(loader):
        with torch.no_grad():
            for images, target in loader:
                images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
                output = model(images)
                loss = criterion(output, target)
                losses.update(loss.item(), len(target))
                top1.update((output.argmax(dim=1) == target).float().mean().item() * 100, len(target))

    losses, top1 = AverageMeter(), AverageMeter()
    model.eval()
    run_validate(val_loader)
    if args.distributed:
        losses.all_reduce(device)
        top1.all_reduce(device)
        # The sampler dropped the last len(dataset) % world_size samples: every process evaluates
        # them itself, after the all_reduce, so each is counted once (imagenet's aux_val_loader).
        tail = range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset))
        if len(tail) > 0:
            run_validate(DataLoader(Subset(val_loader.dataset, tail), batch_size=args.batch_size))
    if args.rank == 0:
        print(f" * Acc@1 {top1.avg:.3f} Loss {losses.avg:.6f} ({top1.count} images)")
    return top1.avg


def save_checkpoint(state, is_best, checkpoint_dir):
    path = Path(checkpoint_dir) / "checkpoint.pth.tar"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, path.with_name("model_best.pth.tar"))


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

    def all_reduce(self, device):
        """Sum and count over all processes (float64: counts stay exact beyond 2**24)."""
        total = torch.tensor([self.sum, self.count], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        self.sum, self.count = total[0].item(), int(total[1].item())
        self.avg = self.sum / self.count


if __name__ == "__main__":
    main(parse_args())
