#!/usr/bin/env python
"""Baseline: the MNIST ConvNet with nn.DataParallel, one process driving every GPU.

    python scripts/baselines/dataparallel_mnist.py --data_dir path/to/MNIST/raw   # needs 2+ GPUs

The "before" side of the migration, written the way the DataParallel tutorials write it:
one line wraps the model, and each batch is split across the GPUs. It is here to be
measured, not copied: one Python process (one GIL) scatters every batch from GPU 0,
replicates the model onto every GPU at every step, and gathers all outputs back onto GPU 0,
which therefore also needs more memory than the others. DDP and Accelerate run one process
per GPU and only all-reduce gradients. Model, data, hyperparameters and results.json are
those of scripts/train_mnist.py; mixed precision is torch's native AMP, which replaced apex.
"""

import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # find utils/ from a plain clone
from utils.benchmark.baselines import AutocastInForward, OptimizerStepWatch, autocast_dtype
from utils.data.mnist import load_mnist, to_tensor_dataset
from utils.errors import UserError, exit_with_error
from utils.files import create_output_dir, write_json_atomically
from utils.launch.flags import build_mnist_parser, reject_flags_the_baselines_lack
from utils.models import ConvNet
from utils.report.meters import ThroughputMeter
from utils.run.fingerprints import fingerprint

logger = logging.getLogger(__name__)


def parse_args(argv=None):
    parser = build_mnist_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    reject_flags_the_baselines_lack(parser, args)
    return args


def evaluate(model, dataloader, device):
    """Accuracy and mean loss over the whole eval set (one process sees every sample)."""
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in dataloader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(images)
            losses = F.cross_entropy(logits.float(), labels, reduction="none")
            correct += (logits.argmax(dim=-1) == labels).sum().item()
            loss_sum += losses.double().sum().item()
            count += len(labels)
    return {"eval_accuracy": correct / count, "eval_loss": loss_sum / count, "eval_samples": count}


def main(args):
    num_gpus = torch.cuda.device_count()
    if args.cpu or num_gpus < 2:
        raise UserError(
            f"nn.DataParallel needs 2 or more CUDA GPUs (this machine has {num_gpus}"
            f"{', and --cpu was given' if args.cpu else ''}); "
            f"on one GPU or the CPU run scripts/baselines/plain_mnist.py, on several prefer scripts/train_mnist.py"
        )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    device = torch.device("cuda", 0)  # DataParallel's home GPU: batches start and outputs end here
    amp_dtype = autocast_dtype(args.mixed_precision, device)  # None: fp32
    torch.manual_seed(args.seed)
    output_dir = Path(args.output_dir)

    splits = load_mnist(args.data_dir)
    train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
    eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
    # --batch_size is per GPU, as in the other MNIST scripts (the imagenet-style pair's -b is per node):
    # DataParallel splits one batch of num_gpus x batch_size, so each GPU computes what one DDP process would.
    batch_size = args.batch_size * num_gpus
    train_dataloader = DataLoader(train_dataset, batch_size=batch_size, shuffle=True, pin_memory=True)
    eval_dataloader = DataLoader(eval_dataset, batch_size=batch_size, pin_memory=True)

    # Replicates the module onto every GPU at each forward and splits the batch between them.
    convnet = ConvNet().to(device)
    model = nn.DataParallel(AutocastInForward(convnet, amp_dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    max_steps = len(train_dataloader) * args.epochs
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.learning_rate, total_steps=max_steps, pct_start=0.15
    )
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    step_watch = OptimizerStepWatch(optimizer)  # no host sync to learn whether it stepped

    create_output_dir(output_dir)

    results = {}
    meter = ThroughputMeter(device)
    progress_bar = tqdm(total=max_steps, desc="train")
    global_step, samples_seen = 0, 0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        sample_count = 0
        meter.start()
        for images, labels in train_dataloader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(images)  # scatter, replicate, parallel forward, gather onto GPU 0
            loss = F.cross_entropy(logits.float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped when fp16 gradients overflowed
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

        samples_seen += sample_count
        results["train_loss"] = loss_sum.item() / sample_count
        results.update(evaluate(model, eval_dataloader, device))
        logger.info(
            f"epoch {epoch}: train_loss {results['train_loss']:.4f}, eval_loss {results['eval_loss']:.4f}, "
            f"eval_accuracy {results['eval_accuracy']:.4f} ({results['eval_samples']} samples)"
        )
    progress_bar.close()

    save_file(convnet.state_dict(), output_dir / "model.safetensors")
    per_gpu_mb = [torch.cuda.max_memory_allocated(i) / 2**20 for i in range(num_gpus)]
    results.update({
        "method": "dataparallel",
        "train_samples_per_second": meter.steady_samples / meter.steady_time_s if meter.steady_time_s > 0 else None,
        "train_time_s": meter.train_time_s,
        "peak_memory_mb": max(per_gpu_mb),
        "peak_memory_mb_per_gpu": per_gpu_mb,  # GPU 0 holds the gathered outputs: the largest
        "num_processes": 1,
        "num_gpus": num_gpus,
        "mixed_precision": args.mixed_precision or "no",
        "epochs": args.epochs,
        "global_step": global_step,
        "samples_seen": samples_seen,
        "batch_size_per_process": args.batch_size,  # per GPU; each step sees num_gpus x this
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "parameter_fingerprints": [fingerprint(convnet.parameters())],
        "buffer_fingerprints": [fingerprint(convnet.buffers())],
    })
    write_json_atomically(output_dir / "results.json", results)
    logger.info(f"Wrote {output_dir / 'results.json'}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
