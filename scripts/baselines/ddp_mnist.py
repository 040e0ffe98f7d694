#!/usr/bin/env python
"""Baseline: the MNIST ConvNet with raw torch.distributed and DistributedDataParallel.

    torchrun --nproc_per_node 4 scripts/baselines/ddp_mnist.py --data_dir path/to/MNIST/raw
    torchrun --nproc_per_node 2 scripts/baselines/ddp_mnist.py --cpu ...     # gloo on CPU processes

The "before" side of the migration, written the way the DDP tutorials write it: one process
per GPU started by torchrun, init_process_group, DistributedSampler (with set_epoch), DDP,
and metrics summed over processes with all_reduce. NCCL on GPUs, gloo on the CPU. Model,
data, hyperparameters and results.json are those of scripts/train_mnist.py; mixed precision
is torch's native AMP (autocast, plus a GradScaler for fp16), which replaced NVIDIA apex.
"""

import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # imported before the process group: see the end of main()
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # find utils/ from a plain clone
from utils.benchmark.baselines import OptimizerStepWatch, autocast_dtype
from utils.data.mnist import load_mnist, to_tensor_dataset
from utils.errors import UserError, exit_with_error
from utils.files import create_output_dir, write_json_atomically
from utils.launch.flags import build_mnist_parser, reject_flags_the_baselines_lack
from utils.models import ConvNet
from utils.report.meters import ThroughputMeter, peak_memory_mb
from utils.run.fingerprints import fingerprint

logger = logging.getLogger(__name__)


def parse_args(argv=None):
    parser = build_mnist_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    reject_flags_the_baselines_lack(parser, args)
    return args


def all_reduce_sum(values, device):
    """Sums over all processes, in float64 so that large counts and sums stay exact."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


def evaluate(model, dataloader, device, amp_dtype):
    """Accuracy and mean loss over exactly the eval set.

    Each process holds an unpadded shard (see main), so summing correct predictions, losses
    and counts over processes counts every sample once. `model` is the module inside DDP:
    its forward is no collective, so shards of unequal length cannot hang.
    """
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in dataloader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(images)
            losses = F.cross_entropy(logits.float(), labels, reduction="none")
            correct += (logits.argmax(dim=-1) == labels).sum().item()
            loss_sum += losses.double().sum().item()
            count += len(labels)
    correct, loss_sum, count = all_reduce_sum([correct, loss_sum, count], device)
    return {"eval_accuracy": correct / count, "eval_loss": loss_sum / count, "eval_samples": int(count)}


def main(args):
    # torchrun starts one process per GPU and tells each who it is through the environment.
    if "LOCAL_RANK" not in os.environ:
        raise UserError(
            "ddp_mnist.py was not started by torchrun; run "
            "`torchrun --nproc_per_node N scripts/baselines/ddp_mnist.py ...` (add --cpu on a machine without GPUs)"
        )
    local_rank, rank, world_size = (int(os.environ[k]) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"torchrun started more processes per node than this node has GPUs ({torch.cuda.device_count()}); "
                f"pass --nproc_per_node {torch.cuda.device_count()} or fewer"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    amp_dtype = autocast_dtype(args.mixed_precision, device)  # None: fp32
    # MASTER_ADDR/PORT etc. come from torchrun; the timeout bounds how long a collective waits for a stuck process
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.ddp_timeout))
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s", level=logging.INFO)
    if rank != 0:
        logger.setLevel(logging.WARNING)  # log once, not once per process
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    output_dir = Path(args.output_dir)

    # Only rank 0 downloads; the others wait at the barrier, then read its cache (on rank 0's machine; on the others,
    # without a shared filesystem, each process downloads its own copy).
    if rank != 0:
        dist.barrier()
    splits = load_mnist(args.data_dir)
    if rank == 0:
        dist.barrier()
    train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
    eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
    pin_memory = device.type == "cuda"
    # Each process gets every world_size-th sample of a shuffle that all processes agree on
    # (same seed); the sampler repeats a few samples so that all shards are equally long.
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dataloader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                  pin_memory=pin_memory)
    # For evaluation that padding would count some samples twice, so each process takes the
    # same strided shard as DistributedSampler, without the padding (pytorch/examples
    # imagenet handles the same tail with a second loader).
    eval_shard = Subset(eval_dataset, range(rank, len(eval_dataset), world_size))
    eval_dataloader = DataLoader(eval_shard, batch_size=args.batch_size, pin_memory=pin_memory)

    model = ConvNet().to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # averages gradients in backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    max_steps = len(train_dataloader) * args.epochs  # batches per process
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.learning_rate, total_steps=max_steps, pct_start=0.15
    )
    # Scales fp16 losses so that small gradients do not flush to zero; a no-op otherwise.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    step_watch = OptimizerStepWatch(optimizer)  # no host sync to learn whether it stepped

    if rank == 0:
        create_output_dir(output_dir)

    results = {}
    meter = ThroughputMeter(device)
    progress_bar = tqdm(total=max_steps, desc="train", disable=rank != 0)
    global_step, samples_seen = 0, 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch; without it every epoch repeats the first
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        sample_count = 0
        meter.start()
        for images, labels in train_dataloader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            scaler.scale(loss).backward()  # DDP all-reduces the gradients during backward
            scaler.step(optimizer)  # skipped when fp16 gradients overflowed (on every rank alike)
            scaler.update()
            if step_watch.take():  # GradScaler did not skip the step
                lr_scheduler.step()
            optimizer.zero_grad()
            loss_sum += loss.detach().double() * len(labels)
            sample_count += len(labels)
            global_step += 1
            meter.batch_done(len(labels))
            progress_bar.update(1)
        meter.pause()

        # Exact mean over every sample trained on, by all processes: sums and counts, reduced.
        epoch_loss, epoch_samples = all_reduce_sum([loss_sum.item(), sample_count], device)
        samples_seen += int(epoch_samples)
        results["train_loss"] = epoch_loss / epoch_samples
        # Each rank's BatchNorm running statistics moved with its own last batch; take rank 0's,
        # as DDP does at every training forward, so that every shard is evaluated by one model.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, src=0)
        results.update(evaluate(model.module, eval_dataloader, device, amp_dtype))
        logger.info(
            f"epoch {epoch}: train_loss {results['train_loss']:.4f}, eval_loss {results['eval_loss']:.4f}, "
            f"eval_accuracy {results['eval_accuracy']:.4f} ({results['eval_samples']} samples)"
        )
    progress_bar.close()

    # One row per process: throughput is the sum over processes, time that of the slowest.
    row = torch.tensor(
        [meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_memory_mb(device)],
        dtype=torch.float64, device=device,
    )
    rows = [torch.zeros_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    per_process = torch.stack(rows).cpu()
    replica = torch.tensor([fingerprint(model.module.parameters()), fingerprint(model.module.buffers())], device=device)
    replicas = [torch.zeros_like(replica) for _ in range(world_size)]
    dist.all_gather(replicas, replica)

    if rank == 0:
        save_file(model.module.state_dict(), output_dir / "model.safetensors")
        steady_time_s = per_process[:, 1].max().item()
        results.update({
            "method": "ddp",
            "train_samples_per_second": per_process[:, 0].sum().item() / steady_time_s if steady_time_s > 0 else None,
            "train_time_s": per_process[:, 2].max().item(),
            "peak_memory_mb": per_process[:, 3].max().item(),
            "num_processes": world_size,
            "mixed_precision": args.mixed_precision or "no",
            "epochs": args.epochs,
            "global_step": global_step,
            "samples_seen": samples_seen,
            "batch_size_per_process": args.batch_size,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
            "parameter_fingerprints": [r[0].item() for r in replicas],
            "buffer_fingerprints": [r[1].item() for r in replicas],
        })
        write_json_atomically(output_dir / "results.json", results)
        logger.info(f"Wrote {output_dir / 'results.json'}")
    dist.barrier()  # nobody leaves while rank 0 still writes
    # Release the DDP model first: destroying the group then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
