#!/usr/bin/env python
"""Benchmark-only training: one loop, distributed three ways, for scripts/benchmark.py.

    python scripts/benchmark_train.py --method plain --model resnet50 --data_on_device
    torchrun --nproc_per_node 2 scripts/benchmark_train.py --method ddp --cpu --data_dir path/to/MNIST/raw
    accelerate launch --num_processes 2 scripts/benchmark_train.py --method accelerate --model resnet18

scripts/benchmark.py times the MNIST scripts users copy (scripts/train_mnist.py and
scripts/baselines/) as they are. This file covers what they do not: torchvision ResNets on
synthetic images, and the memory-friendly fast path (--data_on_device) for datasets that
fit in device memory, as in KellerJordan/airbench: the whole set is one tensor on the
device, each process indexes its shard of a shuffle every process agrees on, no DataLoader,
no worker processes. Evaluation (MNIST only) stays exact on any number of processes.
Apart from --method, every run executes the same statements, so the methods' differences
are the only differences timed. Lines marked `# [accelerate]` are Accelerate's.
"""

import contextlib
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # imported before the process group: see the end of main()
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.benchmarking import (  # noqa: E402
    AutocastInForward, OptimizerStepWatch, autocast_dtype, reject_flags_the_baselines_lack, synthetic_images,
)
from utils.data import load_mnist, to_tensor_dataset  # noqa: E402
from utils.errors import UserError, exit_with_error  # noqa: E402
from utils.flags import build_parser, positive_int  # noqa: E402
from utils.models import ConvNet  # noqa: E402
from utils.results import ThroughputMeter, peak_memory_mb, write_json_atomically  # noqa: E402

logger = logging.getLogger(__name__)
METHODS = ("plain", "ddp", "dataparallel", "accelerate")


def parse_args(argv=None):
    parser = build_parser(__doc__.splitlines()[0], epochs=1, batch_size=64, learning_rate=3e-3)
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--method", choices=METHODS, required=True,
                       help="plain: one process; ddp: torchrun + DDP; dataparallel: nn.DataParallel; "
                            "accelerate: accelerate launch")
    bench.add_argument("--model", choices=("convnet", "resnet18", "resnet50"), default="convnet",
                       help="convnet: the MNIST ConvNet on MNIST; resnets: synthetic 1000-class images")
    bench.add_argument("--data_dir", default=None, help="MNIST IDX files for --model convnet; default: ylecun/mnist")
    bench.add_argument("--image_size", type=positive_int, default=224, help="synthetic image side (resnets)")
    bench.add_argument("--synthetic_samples", type=positive_int, default=2560,
                       help="synthetic training images (resnets)")
    bench.add_argument("--data_on_device", action="store_true",
                       help="fast path: the training set as one tensor on the device, sharded by index; no DataLoader")
    bench.add_argument("--channels_last", action="store_true",
                       help="NHWC memory format (faster convolutions on tensor cores)")
    bench.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    args = parser.parse_args(argv)
    reject_flags_the_baselines_lack(parser, args)
    return args


def main(args):
    # Processes and device: the only part that differs by method, with the step further down.
    accelerator = None
    if args.method == "accelerate":
        from accelerate import Accelerator  # [accelerate]

        accelerator = Accelerator(  # [accelerate]
            cpu=args.cpu, mixed_precision=args.mixed_precision, step_scheduler_with_optimizer=False,
            dynamo_backend="inductor" if args.compile else "no",
        )
        device, rank, world_size = accelerator.device, accelerator.process_index, accelerator.num_processes
    elif args.method == "ddp":
        if "LOCAL_RANK" not in os.environ:
            raise UserError(
                "--method ddp: start this script with `torchrun --nproc_per_node N scripts/benchmark_train.py ...`")
        local_rank, rank, world_size = (int(os.environ[k]) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
        use_cuda = torch.cuda.is_available() and not args.cpu
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.ddp_timeout))
    else:  # plain and dataparallel: one process
        rank, world_size = 0, 1
        device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        if args.method == "dataparallel" and (device.type != "cuda" or torch.cuda.device_count() < 2):
            raise UserError(f"nn.DataParallel needs 2 or more CUDA GPUs (this machine has {torch.cuda.device_count()})")
    distributed = dist.is_available() and dist.is_initialized()
    amp_dtype = autocast_dtype(args.mixed_precision, device)
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s", level=logging.INFO)
    if rank != 0:
        logger.setLevel(logging.WARNING)  # log once, not once per process
    torch.manual_seed(args.seed)
    # DataParallel drives every visible GPU from this one process and splits each batch over them:
    # num_gpus x --batch_size, so each GPU computes what one DDP process computes.
    num_gpus = torch.cuda.device_count() if args.method == "dataparallel" else None
    batch_size = args.batch_size * (num_gpus or 1)

    # Data
    if args.model == "convnet":
        splits = load_mnist(args.data_dir)
        train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
        eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
        model, num_classes = ConvNet(), 10
    else:
        from utils.models import build_model

        train_dataset = synthetic_images(args.synthetic_samples, args.image_size, seed=args.seed)
        eval_dataset = None  # accuracy on random labels means nothing
        model, num_classes = build_model(args.model, num_classes=1000), 1000
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    if args.data_on_device:
        # The whole training set moves to the device once; batches are index lookups there.
        train_images, train_labels = (t.to(device) for t in train_dataset.tensors)
        train_dataloader = None
        # Every process gets every world_size-th sample of the same permutation, padded like
        # DistributedSampler so that all processes take equally many steps.
        samples_per_process = -(-len(train_labels) // world_size)
        steps_per_epoch = -(-samples_per_process // batch_size)
    else:
        pin_memory = device.type == "cuda"
        if args.method == "ddp":
            sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                         seed=args.seed)
            train_dataloader = DataLoader(train_dataset, batch_size=batch_size, sampler=sampler, pin_memory=pin_memory)
        else:
            train_dataloader = DataLoader(train_dataset, batch_size=batch_size, shuffle=True, pin_memory=pin_memory)
        if accelerator is not None:
            train_dataloader = accelerator.prepare(train_dataloader)  # [accelerate] sharded per process
        steps_per_epoch = len(train_dataloader)

    # Model, optimizer, schedule: those of scripts/train_mnist.py
    model = model.to(device, memory_format=memory_format)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.learning_rate, total_steps=steps_per_epoch * args.epochs, pct_start=0.15
    )
    if accelerator is not None:
        # [accelerate] DDP when several processes, autocast in forward, GradScaler for fp16
        model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
        autocast = contextlib.nullcontext  # the prepared model autocasts its own forward
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        step_watch = OptimizerStepWatch(optimizer)  # whether GradScaler stepped, without a host sync
        if args.method == "ddp":
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        elif args.method == "dataparallel":
            model = nn.DataParallel(AutocastInForward(model, amp_dtype))  # see AutocastInForward
        if args.compile:
            model = torch.compile(model)

        def autocast():
            if args.method == "dataparallel":  # the replicas' threads autocast inside forward
                return contextlib.nullcontext()
            return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    meter = ThroughputMeter(device)
    results = {"train_loss": None}
    for epoch in range(args.epochs):
        model.train()
        if args.data_on_device:
            permutation = torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(args.seed + epoch))
            padded = torch.cat([permutation, permutation[: samples_per_process * world_size - len(permutation)]])
            shard = padded[rank::world_size].to(device)
            batches = ((train_images[i], train_labels[i]) for i in shard.split(batch_size))
        else:
            if args.method == "ddp":
                train_dataloader.sampler.set_epoch(epoch)
            elif accelerator is not None:
                train_dataloader.set_epoch(epoch)  # [accelerate]
            batches = train_dataloader
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        sample_count = 0
        meter.start()
        for images, labels in batches:
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            with autocast():
                logits = model(images)
                loss = F.cross_entropy(logits.float(), labels)  # DataParallel gathers half-precision logits
            if accelerator is not None:
                accelerator.backward(loss)  # [accelerate] scales fp16 losses
                optimizer.step()
                if not accelerator.optimizer_step_was_skipped:  # [accelerate] fp16 overflow
                    lr_scheduler.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if step_watch.take():  # GradScaler did not skip the step
                    lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().double() * len(labels)
            sample_count += len(labels)
            meter.batch_done(len(labels))
        meter.pause()
        totals = torch.tensor([loss_sum.item(), sample_count], dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(totals)
        results["train_loss"] = (totals[0] / totals[1]).item()

    if eval_dataset is not None:
        results.update(evaluate(model, eval_dataset, batch_size, device, rank, world_size, distributed, autocast))
        logger.info(f"eval_accuracy {results['eval_accuracy']:.4f} ({results['eval_samples']} samples)")

    # One row per process: the throughput is the sum over processes, the time that of the slowest.
    # DataParallel's memory: that of its fullest GPU (GPU 0, which gathers the outputs, as a rule).
    devices = [torch.device("cuda", i) for i in range(num_gpus)] if num_gpus else [device]
    peak_mb = max(peak_memory_mb(d) for d in devices)
    row = torch.tensor([[meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_mb]],
                       dtype=torch.float64, device=device)
    if distributed:
        rows = [torch.zeros_like(row) for _ in range(world_size)]
        dist.all_gather(rows, row)
        row = torch.cat(rows)
    per_process = row.cpu()
    if rank == 0:
        steady_time_s = per_process[:, 1].max().item()
        results.update({
            "method": args.method,
            "model": args.model,
            "data_on_device": args.data_on_device,
            "train_samples_per_second": per_process[:, 0].sum().item() / steady_time_s if steady_time_s > 0 else None,
            "train_time_s": per_process[:, 2].max().item(),
            "peak_memory_mb": per_process[:, 3].max().item(),
            "peak_memory_mb_per_process": per_process[:, 3].tolist(),
            "num_processes": world_size,
            "num_gpus": num_gpus,  # DataParallel's; benchmark.py checks them against the GPUs asked for
            "mixed_precision": args.mixed_precision or "no",
            "epochs": args.epochs,
            "batch_size_per_process": args.batch_size,
            "num_classes": num_classes,
        })
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomically(Path(args.output_dir) / "results.json", results)
    if distributed:
        dist.barrier()
    # Release the DDP model first: destroying the group then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    del model
    if accelerator is not None:
        accelerator.free_memory()  # [accelerate] its references to the model
        accelerator.end_training()  # [accelerate]
    elif distributed:
        dist.destroy_process_group()


def evaluate(model, eval_dataset, batch_size, device, rank, world_size, distributed, autocast):
    """Exact accuracy and loss: each process takes an unpadded strided shard, sums are reduced."""
    module = getattr(model, "module", model)  # inside DDP/DataParallel: its forward is no collective
    module = getattr(module, "_orig_mod", module)  # inside torch.compile
    if distributed:
        for buffer in module.buffers():  # BatchNorm statistics: rank 0's, as DDP's own forward would use
            dist.broadcast(buffer, src=0)
    module.eval()
    images, labels = (t[rank::world_size].to(device) for t in eval_dataset.tensors)
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for image_batch, label_batch in zip(images.split(batch_size), labels.split(batch_size)):
            with autocast():
                logits = module(image_batch)
            correct += (logits.argmax(dim=-1) == label_batch).sum().item()
            loss_sum += F.cross_entropy(logits.float(), label_batch, reduction="none").double().sum().item()
    totals = torch.tensor([correct, loss_sum, len(labels)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(totals)
    correct, loss_sum, count = totals.tolist()
    return {"eval_accuracy": correct / count, "eval_loss": loss_sum / count, "eval_samples": int(count)}


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
