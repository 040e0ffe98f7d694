#!/usr/bin/env python
"""Benchmark-only training: one loop, run four ways, for scripts/benchmark.py.

    python scripts/benchmark_train.py --method plain --model resnet50 --data_on_device
    torchrun --nproc_per_node 2 scripts/benchmark_train.py --method ddp --cpu --data_dir path/to/MNIST/raw
    accelerate launch --num_processes 2 scripts/benchmark_train.py --method accelerate --model resnet18

scripts/benchmark.py times the MNIST scripts users copy (scripts/train_mnist.py and
scripts/baselines/) as they are. This file covers what they do not: torchvision ResNets on
synthetic images, and the memory-friendly fast path (--data_on_device) for datasets that
fit in device memory, as in KellerJordan/airbench: the whole set is one tensor on the
device, each process indexes its shard of a shuffle every process agrees on, no DataLoader,
no worker processes. Evaluation (MNIST only) stays exact on any number of processes.

The four methods are four classes side by side, in the order a migration takes them: Plain,
DataParallel, DDP, Accelerate, each later one saying what it changes. They share one set of
operations (start, loader, set_epoch, wrap, autocast, backward_and_step, sum_over_processes,
gather_over_processes, broadcast_buffers, close), and main() runs the same statements whatever
the method, so the methods' differences are the only differences timed.
"""

import contextlib
import logging
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # imported before any process group: see the end of main()
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.benchmark.baselines import (
    AutocastInForward,
    OptimizerStepWatch,
    autocast_dtype,
    synthetic_images,
)
from utils.data.mnist import load_mnist, to_tensor_dataset
from utils.errors import UserError, exit_with_error
from utils.files import write_json_atomically
from utils.launch.flags import build_parser, positive_int, reject_flags_the_baselines_lack
from utils.models import ConvNet, build_model
from utils.report.meters import ThroughputMeter, peak_memory_mb

logger = logging.getLogger(__name__)


class Plain:
    """Plain PyTorch: one process on one device. Its operations are those of every method."""

    def __init__(self, args, rank=0, world_size=1, device=None):
        """Start: the processes (the other methods start theirs, then call this) and this process's device."""
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        self.amp_dtype = autocast_dtype(args.mixed_precision, self.device)  # None: fp32; fp16 refused on a CPU
        self.batch_size = args.batch_size  # what one step of this process computes
        self.num_gpus, self.memory_devices = None, [self.device]  # DataParallel's GPUs; where peak memory is read
        self.compile = args.compile

    def loader(self, dataset):
        """The training batches of this process."""
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, pin_memory=self.device.type == "cuda")

    def set_epoch(self, loader, epoch):
        """Before each epoch: that epoch's shuffle (the plain DataLoader draws a new one by itself)."""

    def wrap(self, model, optimizer, lr_scheduler):
        """The model (already on the device), optimizer and schedule as this method trains them."""
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.step_watch = OptimizerStepWatch(optimizer)  # whether GradScaler stepped, without a host sync
        return (torch.compile(model) if self.compile else model), optimizer, lr_scheduler

    def autocast(self):
        """Around the forward pass and the loss: --mixed_precision."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def backward_and_step(self, loss, optimizer, lr_scheduler):
        """fp16: the loss scaled, the step skipped on overflow, and the schedule with it."""
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.step_watch.take():  # GradScaler did not skip the step
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def sum_over_processes(self, tensor):
        """The sum over all processes, on every process."""
        return tensor

    def gather_over_processes(self, rows):
        """Every process's rows, stacked in rank order, on every process."""
        return rows

    def broadcast_buffers(self, module):
        """Rank 0's buffers (BatchNorm statistics) on every process, as DDP's own forward would use them."""

    def close(self):
        """All processes done; the process group ended (release the DDP model before)."""


class DataParallel(Plain):
    """nn.DataParallel: one process drives every visible GPU, splitting each batch over them.
    Changed from Plain: start (every GPU, a batch per GPU), wrap and autocast."""

    def __init__(self, args):
        if args.cpu or torch.cuda.device_count() < 2:
            raise UserError(f"nn.DataParallel needs 2 or more CUDA GPUs (this machine has {torch.cuda.device_count()})")
        super().__init__(args)
        self.num_gpus = torch.cuda.device_count()
        self.batch_size = args.batch_size * self.num_gpus  # so each GPU computes what one DDP process computes
        self.memory_devices = [torch.device("cuda", i) for i in range(self.num_gpus)]  # reported: the fullest

    def wrap(self, model, optimizer, lr_scheduler):
        return super().wrap(nn.DataParallel(AutocastInForward(model, self.amp_dtype)), optimizer, lr_scheduler)

    def autocast(self):
        return contextlib.nullcontext()  # each replica's thread autocasts inside forward: see AutocastInForward


class DDP(Plain):
    """Raw torch.distributed: torchrun starts one process per device, a DistributedSampler shards the
    data, DistributedDataParallel all-reduces the gradients. Changed from Plain: all but autocast and
    backward_and_step."""

    def __init__(self, args):
        if "LOCAL_RANK" not in os.environ:
            raise UserError(
                "--method ddp: start this script with `torchrun --nproc_per_node N scripts/benchmark_train.py ...`")
        local_rank, rank, world_size = (int(os.environ[k]) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
        use_cuda = torch.cuda.is_available() and not args.cpu
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.ddp_timeout))
        super().__init__(args, rank, world_size, device)
        self.seed = args.seed

    def loader(self, dataset):
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                     seed=self.seed)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, pin_memory=self.device.type == "cuda")

    def set_epoch(self, loader, epoch):
        loader.sampler.set_epoch(epoch)

    def wrap(self, model, optimizer, lr_scheduler):
        model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return super().wrap(model, optimizer, lr_scheduler)

    def sum_over_processes(self, tensor):
        dist.all_reduce(tensor)
        return tensor

    def gather_over_processes(self, rows):
        every = [torch.zeros_like(rows) for _ in range(self.world_size)]
        dist.all_gather(every, rows)
        return torch.cat(every)

    def broadcast_buffers(self, module):
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    def close(self):
        dist.barrier()
        dist.destroy_process_group()


class Accelerate(Plain):
    """Hugging Face Accelerate: `accelerate launch` starts the processes (one, or one per device); the
    Accelerator shards the data and wraps the model (DDP on several processes, autocast, GradScaler,
    torch.compile). Changed from Plain: every operation."""

    def __init__(self, args):
        self.accelerator = Accelerator(
            cpu=args.cpu, mixed_precision=args.mixed_precision, step_scheduler_with_optimizer=False,
            dynamo_backend="inductor" if args.compile else "no",
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))],  # --ddp_timeout
        )
        # which process this is, of how many, and its device
        super().__init__(args, self.accelerator.process_index, self.accelerator.num_processes,
                         self.accelerator.device)

    def loader(self, dataset):
        return self.accelerator.prepare(super().loader(dataset))  # sharded per process

    def set_epoch(self, loader, epoch):
        loader.set_epoch(epoch)  # the prepared loader's shuffle

    def wrap(self, model, optimizer, lr_scheduler):
        return self.accelerator.prepare(model, optimizer, lr_scheduler)

    def autocast(self):
        return contextlib.nullcontext()  # the prepared model autocasts its own forward

    def backward_and_step(self, loss, optimizer, lr_scheduler):
        self.accelerator.backward(loss)  # scales fp16 losses
        optimizer.step()  # the prepared optimizer skips it on fp16 overflow
        if not self.accelerator.optimizer_step_was_skipped:
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def sum_over_processes(self, tensor):
        return self.accelerator.reduce(tensor, reduction="sum")

    def gather_over_processes(self, rows):
        return self.accelerator.gather(rows)

    def broadcast_buffers(self, module):
        broadcast(list(module.buffers()), from_process=0)  # in place

    def close(self):
        self.accelerator.wait_for_everyone()
        self.accelerator.free_memory()  # drops its references to the model
        self.accelerator.end_training()  # ends the process group


METHODS = {"plain": Plain, "dataparallel": DataParallel, "ddp": DDP, "accelerate": Accelerate}
# Flags of one kind of model, with their defaults: changed for the other kind they would mean nothing,
# so they are refused (as the flags the baselines lack: see utils/launch/flags.py).
MNIST_ONLY = {"data_dir": None, "max_train_samples": None, "max_eval_samples": None}
RESNET_ONLY = {"image_size": 224, "synthetic_samples": 2560}


def parse_args(argv=None):
    parser = build_parser(__doc__.splitlines()[0], epochs=1, batch_size=64, learning_rate=3e-3)
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--method", choices=tuple(METHODS), required=True,
                       help="plain: one process; dataparallel: nn.DataParallel; ddp: torchrun + DDP; "
                            "accelerate: accelerate launch")
    bench.add_argument("--model", choices=("convnet", "resnet18", "resnet50"), default="convnet",
                       help="convnet: the MNIST ConvNet on MNIST; resnets: synthetic 1000-class images")
    bench.add_argument("--data_dir", default=None, help="MNIST IDX files (convnet); default: ylecun/mnist")
    bench.add_argument("--image_size", type=positive_int, default=RESNET_ONLY["image_size"],
                       help="synthetic image side (resnets)")
    bench.add_argument("--synthetic_samples", type=positive_int, default=RESNET_ONLY["synthetic_samples"],
                       help="synthetic training images (resnets)")
    bench.add_argument("--data_on_device", action="store_true",
                       help="fast path: the training set as one tensor on the device, sharded by index; no DataLoader")
    bench.add_argument("--channels_last", action="store_true",
                       help="NHWC memory format (faster convolutions on tensor cores)")
    bench.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    args = parser.parse_args(argv)
    reject_flags_the_baselines_lack(parser, args)
    reject_flags_the_model_ignores(parser, args)
    return args


def reject_flags_the_model_ignores(parser, args) -> None:
    """The ConvNet trains on MNIST; the ResNets on generated images, with no evaluation (random labels)."""
    ignored = RESNET_ONLY if args.model == "convnet" else MNIST_ONLY
    for name, default in ignored.items():
        if getattr(args, name) != default:
            wanted = "resnet18 or resnet50" if args.model == "convnet" else "convnet"
            parser.error(f"--{name} means nothing for --model {args.model}: it is a flag of --model {wanted}")


class ShardsOnDevice:
    """--data_on_device, the same for every method: the whole training set moves to the device once;
    batches are index lookups there. Every process takes every world_size-th sample of the same
    permutation, padded like DistributedSampler so that all processes take equally many steps."""

    def __init__(self, dataset, method, seed):
        self.images, self.labels = (t.to(method.device) for t in dataset.tensors)
        self.rank, self.world_size, self.batch_size, self.seed = method.rank, method.world_size, method.batch_size, seed
        self.samples_per_process = math.ceil(len(self.labels) / self.world_size)

    def __len__(self):
        return math.ceil(self.samples_per_process / self.batch_size)

    def set_epoch(self, epoch):
        permutation = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed + epoch))
        padded = torch.cat([permutation, permutation[: self.samples_per_process * self.world_size - len(permutation)]])
        self.shard = padded[self.rank::self.world_size].to(self.images.device)

    def __iter__(self):
        return ((self.images[i], self.labels[i]) for i in self.shard.split(self.batch_size))


def main(args):
    method = METHODS[args.method](args)  # processes and device: the classes above
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [rank {method.rank}] %(message)s", level=logging.INFO)
    if method.rank != 0:
        logger.setLevel(logging.WARNING)  # log once, not once per process
    torch.manual_seed(args.seed)

    # Data
    if args.model == "convnet":
        splits = load_mnist(args.data_dir)
        train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
        eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
        model, num_classes = ConvNet(), 10
    else:
        train_dataset = synthetic_images(args.synthetic_samples, args.image_size, seed=args.seed)
        eval_dataset = None  # accuracy on random labels means nothing
        model, num_classes = build_model(args.model, num_classes=1000), 1000
    if args.data_on_device:
        train_batches = ShardsOnDevice(train_dataset, method, args.seed)
    else:
        train_batches = method.loader(train_dataset)

    # Model, optimizer, schedule: those of scripts/train_mnist.py
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(method.device, memory_format=memory_format)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.learning_rate, total_steps=len(train_batches) * args.epochs, pct_start=0.15
    )
    model, optimizer, lr_scheduler = method.wrap(model, optimizer, lr_scheduler)

    meter = ThroughputMeter(method.device)
    results = {"train_loss": None}
    for epoch in range(args.epochs):
        model.train()
        if args.data_on_device:
            train_batches.set_epoch(epoch)
        else:
            method.set_epoch(train_batches, epoch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=method.device)
        sample_count = 0
        meter.start()
        for images, labels in train_batches:
            images = images.to(method.device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(method.device, non_blocking=True)
            with method.autocast():
                logits = model(images)
                loss = F.cross_entropy(logits.float(), labels)  # DataParallel gathers half-precision logits
            method.backward_and_step(loss, optimizer, lr_scheduler)
            loss_sum += loss.detach().double() * len(labels)
            sample_count += len(labels)
            meter.batch_done(len(labels))
        meter.pause()
        totals = torch.tensor([loss_sum.item(), sample_count], dtype=torch.float64, device=method.device)
        totals = method.sum_over_processes(totals)
        results["train_loss"] = (totals[0] / totals[1]).item()

    if eval_dataset is not None:
        results.update(evaluate(method, model, eval_dataset))  # every process: it reduces
        logger.info(f"eval_accuracy {results['eval_accuracy']:.4f} ({results['eval_samples']} samples)")
    write_results(method, meter, results, args, num_classes)  # every process: it gathers
    # Release the DDP model first: ending the group then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    del model
    method.close()


def evaluate(method, model, eval_dataset):
    """Exact accuracy and loss; every process calls it: each takes an unpadded strided shard, the sums are
    reduced over processes."""
    module = getattr(model, "module", model)  # inside DDP/DataParallel: its forward is no collective
    module = getattr(module, "_orig_mod", module)  # inside torch.compile
    method.broadcast_buffers(module)
    module.eval()
    images, labels = (t[method.rank::method.world_size].to(method.device) for t in eval_dataset.tensors)
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for image_batch, label_batch in zip(images.split(method.batch_size), labels.split(method.batch_size)):
            with method.autocast():
                logits = module(image_batch)
            correct += (logits.argmax(dim=-1) == label_batch).sum().item()
            loss_sum += F.cross_entropy(logits.float(), label_batch, reduction="none").double().sum().item()
    totals = torch.tensor([correct, loss_sum, len(labels)], dtype=torch.float64, device=method.device)
    correct, loss_sum, count = method.sum_over_processes(totals).tolist()
    return {"eval_accuracy": correct / count, "eval_loss": loss_sum / count, "eval_samples": int(count)}


def write_results(method, meter, results, args, num_classes):
    """Every process calls it (it gathers); rank 0 writes results.json. One row per process: the
    throughput is the sum over processes, the time that of the slowest, the memory that of the
    fullest process (DataParallel's: its fullest GPU, GPU 0 as a rule, which gathers the outputs)."""
    peak_mb = max(peak_memory_mb(d) for d in method.memory_devices)
    row = torch.tensor([[meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_mb]],
                       dtype=torch.float64, device=method.device)
    per_process = method.gather_over_processes(row).cpu()
    if method.rank != 0:
        return
    steady_time_s = per_process[:, 1].max().item()
    results.update({
        "method": args.method,
        "model": args.model,
        "data_on_device": args.data_on_device,
        "train_samples_per_second": per_process[:, 0].sum().item() / steady_time_s if steady_time_s > 0 else None,
        "train_time_s": per_process[:, 2].max().item(),
        "peak_memory_mb": per_process[:, 3].max().item(),
        "peak_memory_mb_per_process": per_process[:, 3].tolist(),
        "num_processes": method.world_size,
        "num_gpus": method.num_gpus,  # DataParallel's; benchmark.py checks them against the GPUs asked for
        "mixed_precision": args.mixed_precision or "no",
        "epochs": args.epochs,
        "batch_size_per_process": args.batch_size,
        "num_classes": num_classes,
    })
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomically(Path(args.output_dir) / "results.json", results)


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
