#!/usr/bin/env python
"""Train the classic two-block ConvNet on MNIST with Hugging Face Accelerate.

    accelerate launch scripts/train_mnist.py                          # whatever `accelerate config` chose
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_mnist.py --cpu

The same file runs on a CPU, one GPU, all GPUs of a node or several nodes: the launch
config decides. Lines marked `# [accelerate]` are what differs from a plain PyTorch script.
"""

import logging
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator  # [accelerate]
from accelerate.logging import get_logger  # [accelerate]
from accelerate.utils import DataLoaderConfiguration, set_seed  # [accelerate]
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.checkpoints import find_latest_checkpoint, read_training_state, resolve_checkpoint, save_checkpoint  # noqa: E402
from utils.data import load_mnist, to_tensor_dataset  # noqa: E402
from utils.errors import UserError, exit_with_error  # noqa: E402
from utils.launch_checks import check_accelerator, check_enough_devices  # noqa: E402
from utils.flags import build_mnist_parser, check_flag_combinations  # noqa: E402
from utils.metrics import load_metric  # noqa: E402
from utils.models import ConvNet  # noqa: E402
from utils.results import ThroughputMeter, create_output_dir, fingerprint, peak_memory_mb, write_json_atomically  # noqa: E402
from utils.signals import StopSignal  # noqa: E402

logger = get_logger(__name__)  # [accelerate] logs on the main process only, unless asked otherwise


def parse_args(argv=None):
    parser = build_mnist_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    check_flag_combinations(parser, args)
    return args


def evaluate(accelerator, model, dataloader, metric):
    """Accuracy and mean loss over exactly the eval set, whatever the number of processes."""
    model.eval()
    per_sample_losses = []
    for images, labels in dataloader:
        with torch.no_grad():
            logits = model(images)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        # [accelerate] collect every process's batch; drops the samples that were repeated
        # to give all processes equally many batches, so each sample counts exactly once.
        predictions, labels, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels, losses))
        metric.add_batch(predictions=predictions, references=labels)
        per_sample_losses.append(losses)
    losses = torch.cat(per_sample_losses).double()
    return {
        "eval_accuracy": metric.compute()["accuracy"],
        "eval_loss": losses.mean().item(),
        "eval_samples": losses.numel(),
    }


def main(args):
    # First, so that a preemption signal during start-up is remembered too.
    stop_signal = StopSignal() if args.save_on_signal else None
    check_enough_devices(args.cpu)
    # Without a GPU, gloo on the CPU; the launch config (or the flag) picks the precision.
    accelerator = Accelerator(  # [accelerate]
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # The shuffle order of epoch e depends only on (seed, e), so a resumed run sees the
        # same batches as an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # We step the scheduler ourselves, once per optimizer step. (By default Accelerate
        # steps it num_processes times per step, a frequent surprise.)
        step_scheduler_with_optimizer=False,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    check_accelerator(accelerator)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    logger.info(accelerator.state)
    set_seed(args.seed)  # [accelerate] same seed on every process: identical initial weights

    output_dir = Path(args.output_dir)

    # Data: decoded once into tensors. Only the main process downloads; the others wait, then
    # read the cache. [accelerate]
    with accelerator.main_process_first():
        splits = load_mnist(args.data_dir)
    train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
    eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
    pin_memory = accelerator.device.type == "cuda"
    train_dataloader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, pin_memory=pin_memory)
    eval_dataloader = DataLoader(eval_dataset, batch_size=args.batch_size, pin_memory=pin_memory)

    model = ConvNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)

    # [accelerate] shards the dataloaders per process and moves batches to the device.
    train_dataloader, eval_dataloader = accelerator.prepare(train_dataloader, eval_dataloader)
    # Steps per epoch are counted on the prepared (per-process) dataloader.
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_steps = steps_per_epoch * args.epochs
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.learning_rate, total_steps=max_steps, pct_start=0.15
    )
    # [accelerate] wraps the model in DDP when there are several processes, sets up mixed
    # precision (autocast, and a GradScaler for fp16), and registers all three for save_state.
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    with accelerator.main_process_first():
        metric = load_metric("accuracy")

    # Resume: weights, optimizer, scheduler, GradScaler and RNG states come back with
    # load_state; where to continue comes from training_state.json.
    global_step, starting_epoch, resume_batches, samples_seen, steps_skipped = 0, 0, 0, 0, 0
    checkpoint = resolve_checkpoint(args.resume_from_checkpoint, output_dir, args.eval_only)
    if checkpoint is None and args.resume_from_checkpoint == "latest":
        logger.info(f"No checkpoint in {output_dir} yet: starting from scratch")
    if checkpoint is not None:
        training_state = read_training_state(checkpoint)
        try:
            accelerator.load_state(str(checkpoint))  # [accelerate]
        except Exception as err:
            raise UserError(f"cannot load checkpoint {checkpoint} ({type(err).__name__}); it is corrupt or from another model") from None
        logger.info(f"Resumed from {checkpoint}: {training_state}")
        global_step, starting_epoch = training_state["global_step"], training_state["epoch"]
        resume_batches, steps_skipped = training_state["batches_in_epoch"], training_state["optimizer_steps_skipped"]
        # a mid-epoch checkpoint's count includes the partial epoch, whose sums are carried on below
        samples_seen = training_state["samples_seen"] - training_state.get("epoch_samples", 0)

    # Only now, with data, model and checkpoint all valid, does the run write anything.
    if accelerator.is_main_process:
        create_output_dir(output_dir)
    if args.with_tracking:
        hparams = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("train_mnist", config=hparams)  # [accelerate]

    results = {"train_loss": None, "train_samples_per_second": None, "train_time_s": 0.0}
    meter = ThroughputMeter(accelerator.device)
    progress_bar = tqdm(
        total=max_steps, initial=global_step, desc="train", disable=not accelerator.is_local_main_process
    )
    device = accelerator.device
    # This process's share of the epoch's loss sum and sample count (reduced over processes below).
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sample_count = torch.zeros((), dtype=torch.float64, device=device)

    def global_totals():
        """[accelerate] exact sums over all processes: loss of every sample, number of samples."""
        totals = accelerator.reduce(torch.stack([loss_sum, sample_count]), reduction="sum")
        return totals[0].item(), int(totals[1].item())

    def save_step_checkpoint():
        """Mid-epoch: where to continue, and the epoch's loss and sample sums so far."""
        epoch_loss, epoch_samples = global_totals()
        return save_checkpoint(accelerator, output_dir, f"step_{global_step}", {
            "epoch": epoch, "global_step": global_step, "batches_in_epoch": batches_in_epoch,
            "samples_seen": samples_seen + epoch_samples, "optimizer_steps_skipped": steps_skipped,
            "epoch_loss_sum": epoch_loss, "epoch_samples": epoch_samples,
        }, args.checkpoints_total_limit)

    stopping = False  # --save_on_signal: a signal arrived; every process stops after the same step
    epochs_to_run = range(starting_epoch, args.epochs) if not args.eval_only else []
    for epoch in epochs_to_run:
        model.train()
        train_dataloader.set_epoch(epoch)  # [accelerate] reshuffle per epoch, reproducibly
        batches = train_dataloader
        if epoch == starting_epoch and resume_batches:
            # [accelerate] continue mid-epoch without replaying the batches already trained on
            batches = accelerator.skip_first_batches(train_dataloader, resume_batches)
        batches_in_epoch = resume_batches if epoch == starting_epoch else 0
        loss_sum.zero_(), sample_count.zero_()
        if epoch == starting_epoch and checkpoint is not None and resume_batches:
            # rank 0 carries the sums of the part of this epoch done before the checkpoint
            if accelerator.is_main_process:
                loss_sum += training_state["epoch_loss_sum"]
                sample_count += training_state["epoch_samples"]

        meter.start()
        for images, labels in batches:
            with accelerator.accumulate(model):  # [accelerate] no DDP all-reduce on accumulation steps
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
                accelerator.backward(loss)  # [accelerate] instead of loss.backward(): scales fp16 losses
                optimizer.step()  # skipped on accumulation steps and on fp16 overflow
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.scaler is None and not torch.isfinite(loss):
                # fp16's GradScaler skips such steps; without it the weights are already lost.
                latest = find_latest_checkpoint(output_dir)
                raise UserError(
                    f"the loss became {loss.item()} at step {global_step + 1} (epoch {epoch}); last good checkpoint: "
                    f"{latest or 'none'}; lower --learning_rate and resume from it"
                )
            loss_sum += loss.detach().double() * len(labels)
            sample_count += len(labels)
            batches_in_epoch += 1
            meter.batch_done(len(labels))

            if accelerator.sync_gradients:  # [accelerate] True at the end of each accumulation cycle
                global_step += 1
                # [accelerate] fp16: the GradScaler skips steps whose gradients overflowed
                steps_skipped += accelerator.optimizer_step_was_skipped
                progress_bar.update(1)
                if args.save_on_signal:
                    if stop_signal.received:
                        accelerator.set_trigger()  # [accelerate]
                    # [accelerate] the signal reaches the processes at different moments; this
                    # all-reduce makes all of them stop after the same step.
                    stopping = accelerator.check_trigger()
                if stopping or (isinstance(args.checkpointing_steps, int) and global_step % args.checkpointing_steps == 0):
                    meter.pause()
                    saved = save_step_checkpoint()
                    meter.start()
                if stopping:
                    break
        meter.pause()
        if stopping:
            break

        epoch_loss, epoch_samples = global_totals()
        samples_seen += epoch_samples
        results["train_loss"] = epoch_loss / epoch_samples
        results.update(evaluate(accelerator, model, eval_dataloader, metric))
        logger.info(
            f"epoch {epoch}: train_loss {results['train_loss']:.4f}, eval_loss {results['eval_loss']:.4f}, "
            f"eval_accuracy {results['eval_accuracy']:.4f} ({results['eval_samples']} samples)"
        )
        if args.with_tracking:
            accelerator.log({  # [accelerate]
                "train_loss": results["train_loss"], "eval_loss": results["eval_loss"],
                "eval_accuracy": results["eval_accuracy"], "epoch": epoch,
            }, step=global_step)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, output_dir, f"epoch_{epoch}", {
                "epoch": epoch + 1, "global_step": global_step, "batches_in_epoch": 0,
                "samples_seen": samples_seen, "optimizer_steps_skipped": steps_skipped,
            }, args.checkpoints_total_limit)
    progress_bar.close()
    if stopping:
        logger.info(f"Stopped by a signal after step {global_step}: saved {saved}; "
                    f"continue with --resume_from_checkpoint latest")
        accelerator.end_training()  # [accelerate]
        return stop_signal.exit_status

    if args.eval_only:
        results.update(evaluate(accelerator, model, eval_dataloader, metric))

    # [accelerate] the throughput is the sum over processes, the time that of the slowest.
    per_process = accelerator.gather(torch.tensor(  # [accelerate] one row per process
        [[meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_memory_mb(device)]],
        dtype=torch.float64, device=device,
    )).cpu()
    if meter.steady_time_s > 0:
        results["train_samples_per_second"] = per_process[:, 0].sum().item() / per_process[:, 1].max().item()
    results["train_time_s"] = per_process[:, 2].max().item()
    results["peak_memory_mb"] = per_process[:, 3].max().item()

    # Every replica must hold the same weights; BatchNorm statistics agree after the
    # evaluation above (DDP broadcasts buffers from rank 0 at the start of each forward).
    unwrapped = accelerator.unwrap_model(model)  # [accelerate] the plain ConvNet inside DDP
    replica = torch.tensor(
        [fingerprint(unwrapped.parameters()), fingerprint(unwrapped.buffers())], device=device
    )
    replicas = accelerator.gather(replica.unsqueeze(0)).cpu().tolist()  # [accelerate]

    accelerator.wait_for_everyone()  # [accelerate] all processes done before the main one saves
    if not args.eval_only:
        accelerator.save_model(model, output_dir)  # [accelerate] model.safetensors, from the main process
    if accelerator.is_main_process:
        results.update({
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "epochs": args.epochs,
            "global_step": global_step,
            "samples_seen": samples_seen,
            "optimizer_steps_skipped": steps_skipped,
            "grad_scaler": accelerator.scaler is not None,
            "batch_size_per_process": args.batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
            "resumed_from": str(checkpoint) if checkpoint is not None else None,
            "parameter_fingerprints": [row[0] for row in replicas],
            "buffer_fingerprints": [row[1] for row in replicas],
        })
        write_json_atomically(output_dir / "results.json", results)
        logger.info(f"Wrote {output_dir / 'results.json'}")
    accelerator.end_training()  # [accelerate] closes the trackers
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(parse_args()))
    except UserError as err:
        exit_with_error(err)
