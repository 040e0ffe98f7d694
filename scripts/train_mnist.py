#!/usr/bin/env python
"""Train the classic two-block ConvNet on MNIST with Hugging Face Accelerate: the complete script.

    accelerate launch scripts/train_mnist.py                          # whatever `accelerate config` chose
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_mnist.py --cpu

scripts/minimal_mnist.py is the same model and data in one short file (Adam at a fixed learning
rate, no checkpoints). This one adds what a real run needs: a one-cycle learning-rate schedule,
checkpoints and resume (also on another number of processes), preemption, the exact training
loss, tracking and results.json. The same file runs on a CPU, one GPU, all GPUs of a
node or several nodes: the launch config decides. Calls that every process must make together are marked
`# [collective]`; each block from a `# shared:` line to the next blank line is identical
in train_image_classifier.py (README.md, "Marks in the scripts").

When the training set does not divide into global batches (--batch_size x processes), an epoch also trains the
samples Accelerate repeats to give every process equally many full batches: 50 samples at --batch_size 8 train
64 on 2 processes (the first 14 of the epoch's shuffle twice) and 72 on 3 (22 twice), and samples_seen counts
them. To train each sample exactly once, use a --max_train_samples that divides (docs/migration_guide.md,
"Uneven data"; tests/test_sample_coverage.py checks it by sample id).
"""

import logging
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed.nn  # imported before the process group: see the end of main()
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.data.mnist import load_mnist, to_tensor_dataset
from utils.errors import UserError, exit_with_error
from utils.launch.flags import (
    add_lr_scheduler_flags,
    add_model_ema_flags,
    add_step_flags,
    build_mnist_parser,
    check_flag_combinations,
    tracker_config,
)
from utils.launch.launch_checks import check_accelerator, check_enough_devices
from utils.metrics import load_metric
from utils.models import ConvNet
from utils.report.meters import GradNorms, RunningLoss, ThroughputMeter
from utils.report.profiling import StepProfiler
from utils.report.results import report_evaluation, report_run
from utils.run.batch_size import fit_batch_size
from utils.run.checkpoints import save_checkpoint, step_checkpoint_due
from utils.run.deepspeed import (
    accelerator_cpu,
    model_to_save,
    process_group_kwargs,
    set_gradient_accumulation,
)
from utils.run.ema import build_model_ema, evaluate_model_ema, save_model_ema, update_model_ema
from utils.run.fsdp import keep_batchnorm_in_fp32, shard_on_cpu
from utils.run.group_holders import import_deepspeed_if_installed
from utils.run.hangs import collective_timeouts_named
from utils.run.optim import build_lr_scheduler
from utils.run.reproducibility import make_deterministic
from utils.run.resume import (
    accumulation_keeping,
    batches_to_skip,
    epochs_to_train,
    load_checkpoint,
    resume_point,
)
from utils.run.run_folder import (
    RunFolder,
    check_output_dir,
    nothing_left_to_train,
    one_training_at_a_time,
    start_output_dir,
)
from utils.run.signals import StopSignal, exit_interrupted, stop_requested, stop_with_the_launcher
from utils.run.steps import StepPlan, TrainingEvents, after_step, at_epoch_end, gather_running_loss

logger = get_logger(__name__)  # logs on the main process only, unless asked otherwise


def parse_args(argv=None):
    parser = build_mnist_parser(__doc__.splitlines()[0])
    add_lr_scheduler_flags(parser, lr_scheduler_type="onecycle")
    add_model_ema_flags(parser)
    add_step_flags(parser)
    args = parser.parse_args(argv)
    check_flag_combinations(parser, args)
    return args


def describe_run(args) -> dict:
    """What defines this run and cannot change when it resumes (the process count can): recorded as run.json
    with its checkpoints and compared on --resume_from_checkpoint (utils/run/run_folder.py)."""
    return {
        "script": Path(__file__).name,
        # OneCycleLR spans exactly --epochs (or --max_steps), and a resume restores its length with its state
        "epochs": args.epochs, "max_steps": args.max_steps,
        "model": "ConvNet",
        "data": str(Path(args.data_dir).resolve()) if args.data_dir else "ylecun/mnist",
        "max_train_samples": args.max_train_samples,
        "seed": args.seed,
        "optimizer": "adamw",
        "learning_rate": args.learning_rate,  # a resume restores the checkpoint's with the optimizer state
        "lr_scheduler_type": args.lr_scheduler_type, "warmup_steps": args.warmup_steps,
        "warmup_epochs": args.warmup_epochs,
        # --model_ema: its average is part of the run (and of its checkpoints); no keys without it
        **({"model_ema_decay": args.model_ema_decay, "model_ema_warmup": args.model_ema_warmup}
           if args.model_ema else {}),
    }


def build_loaders(args, accelerator, train_dataset, eval_dataset) -> tuple:
    """The training and evaluation DataLoaders: --batch_size per process, pinned memory for a GPU."""
    pin_memory = accelerator.device.type == "cuda"
    return (DataLoader(train_dataset, args.batch_size, shuffle=True, pin_memory=pin_memory),
            DataLoader(eval_dataset, args.batch_size, pin_memory=pin_memory))


def step_plan(args, progress, train_dataset) -> StepPlan:
    """--max_steps (else --epochs), --eval_steps, --logging_steps, --early_stopping_patience of --metric_for_best, in
    epochs that train every sample at least once: on several processes Accelerate pads the last batches with samples
    from the start of the shuffle, so that all processes take as many."""
    steps_per_epoch = progress.steps_per_epoch(len(train_dataset), args.batch_size, whole_global_batches=False)
    return StepPlan.of(steps_per_epoch, args.epochs, args.max_steps, args.eval_steps, args.logging_steps,
                       args.early_stopping_patience, args.metric_for_best)


def evaluate(accelerator, model, dataloader, metric, ema=None):
    """Accuracy and mean loss over exactly the eval set, whatever the number of processes; with --model_ema also those
    of the moving average `ema`, evaluated the same way, as eval_ema_accuracy and eval_ema_loss."""
    model.eval()
    per_sample_losses = []
    for images, labels in dataloader:
        with torch.no_grad():
            logits = model(images)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        # [collective] every process's batch, without the samples repeated to give all processes equally many
        predictions, labels, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels, losses))
        metric.add_batch(predictions=predictions, references=labels)
        per_sample_losses.append(losses)
    losses = torch.cat(per_sample_losses).double()
    scores = {
        "eval_accuracy": metric.compute()["accuracy"],
        "eval_loss": losses.mean().item(),
        "eval_samples": losses.numel(),
    }
    # [collective] --model_ema: this evaluation of the moving average too (utils/run/ema.py)
    return scores | evaluate_model_ema(accelerator, ema, evaluate, dataloader, metric)


def main(args):
    # shared: start-up
    stop_signal = StopSignal() if args.save_on_signal else None  # first: a signal during start-up counts too
    check_enough_devices(args.cpu)
    make_deterministic(args.deterministic)

    accelerator = Accelerator(
        # --report_to: TensorBoard, MLflow, W&B; project_dir: where TensorBoard writes
        # --cpu under a DeepSpeed launch: not cpu=True (Accelerate would drop DeepSpeed) but a gloo group of the CPU
        # processes (utils/run/deepspeed.py)
        cpu=accelerator_cpu(args.cpu), mixed_precision=args.mixed_precision, log_with=args.report_to or None,
        project_dir=args.output_dir, gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Seedable sampler: epoch e's shuffle depends only on (seed, e), so a resumed run sees the same
        # batches. non_blocking: host-to-GPU copies of the pinned batches overlap with compute.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        # step_scheduler_with_optimizer: we step it once per optimizer step (by default: once per process)
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[process_group_kwargs(args.cpu, args.ddp_timeout)])  # --ddp_timeout
    # shared: after the Accelerator
    check_accelerator(accelerator)
    shard_on_cpu(accelerator)  # an FSDP launch with --cpu: FSDP2 over the CPU processes, as on GPUs (utils/run/fsdp.py)
    logger.info(accelerator.state)
    set_seed(args.seed)  # same seed on every process: identical initial weights

    # shared: resume or not
    checkpoint, progress = resume_point(args.resume_from_checkpoint, args.output_dir, args.eval_only)
    folder = RunFolder(args.output_dir, describe_run(args), args.epochs, args.max_steps, args.early_stopping_patience,
                       args.overwrite_output_dir, args.eval_only)
    check_output_dir(folder, checkpoint, args.resume_from_checkpoint)  # never two runs in one --output_dir
    resuming = checkpoint is not None and not args.eval_only
    if nothing_left_to_train(folder, progress, checkpoint, args.metric_for_best):
        accelerator.end_training()
        return 0
    # a resume keeps the checkpoint's global batch (on any number of processes): its schedule and optimizer state
    args.gradient_accumulation_steps = accumulation_keeping(
        progress if resuming else None, accelerator.num_processes, args.batch_size, args.gradient_accumulation_steps)

    # [collective] the main process downloads MNIST and the metric's module first; then the others read its caches
    with accelerator.main_process_first():
        splits = load_mnist(args.data_dir)
        metric = load_metric("accuracy")
    train_dataset = to_tensor_dataset(*splits["train"], max_samples=args.max_train_samples)
    eval_dataset = to_tensor_dataset(*splits["test"], max_samples=args.max_eval_samples)
    model = ConvNet()
    keep_batchnorm_in_fp32(accelerator, model)  # FSDP + bf16/fp16: BatchNorm in fp32, as FSDP1 did (utils/run/fsdp.py)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model_input = None  # the batches are the model's input as they are (train_image_classifier normalises them)

    # shared: the global batch
    if args.auto_find_batch_size:
        args.batch_size, args.gradient_accumulation_steps = fit_batch_size(  # [collective]
            accelerator, model, optimizer, train_dataset, args.batch_size, args.gradient_accumulation_steps,
            progress if resuming else None, model_input)
    # as resumed or fitted; under DeepSpeed, which owns the batch, the accumulation and the clipping, its config's too
    set_gradient_accumulation(accelerator, args.gradient_accumulation_steps, args.batch_size, args.max_grad_norm)
    progress = progress.with_batch(accelerator.num_processes, args.batch_size, args.gradient_accumulation_steps)

    train_dataloader, eval_dataloader = build_loaders(args, accelerator, train_dataset, eval_dataset)
    plan = step_plan(args, progress, train_dataset)
    lr_scheduler = build_lr_scheduler(optimizer, args.lr_scheduler_type, plan, args.warmup_steps, args.warmup_epochs)
    # shards the dataloaders per process and moves batches to the device; DDP on several
    # processes, mixed precision (autocast; fp16: a GradScaler), all saved by save_state.
    train_dataloader, eval_dataloader, model, optimizer, lr_scheduler = accelerator.prepare(
        train_dataloader, eval_dataloader, model, optimizer, lr_scheduler)

    # shared: resume, then the first write
    # --model_ema: a moving average of the plain weights on every process, kept in each checkpoint (utils/run/ema.py)
    ema = build_model_ema(accelerator, model, checkpoint, plan.max_steps, args.model_ema, args.model_ema_decay,
                          args.model_ema_warmup)
    # [collective] load_state, if there is a checkpoint
    load_checkpoint(accelerator, model, checkpoint, progress, args.resume_from_checkpoint, args.output_dir)
    # load_state restored the saving run's count of batches in the accumulation cycle; a checkpoint is
    # always saved at the end of a cycle, so the next one starts afresh
    accelerator.step = 0
    if accelerator.is_main_process:  # only now, with data, model and checkpoint valid, does it write
        # --overwrite_output_dir deletes the old run first; then run.json
        start_output_dir(folder, progress, args.batch_size, args.gradient_accumulation_steps)
    accelerator.init_trackers(Path(__file__).stem, config=tracker_config(args))
    results = {"train_loss": None}  # the last epoch's training metrics and the last evaluation's
    meter, running_loss = ThroughputMeter(accelerator.device), RunningLoss(accelerator.device)
    grad_norms = GradNorms(accelerator.device, args.max_grad_norm)  # the norms before --max_grad_norm clips them
    steps_bar = tqdm(total=plan.max_steps, initial=progress.global_step, disable=not accelerator.is_local_main_process)
    stopping = False  # --save_on_signal: a signal arrived; every process stops after the same step

    # the logs and evaluations that --logging_steps and --eval_steps ask for between steps (utils/run/steps.py)
    evaluation = partial(evaluate, accelerator, model, eval_dataloader, metric, ema)
    events = TrainingEvents(plan, evaluation, model, ema, args.output_dir, results, running_loss, meter, lr_scheduler)

    # the progress bar is closed when training ends, also by an error
    with (collective_timeouts_named(args.ddp_timeout, progress), steps_bar,
          StepProfiler(args.profile, args.output_dir, accelerator) as profiler):
        # [collective] --early_stopping_patience
        for epoch in epochs_to_train(accelerator, progress, plan, args.eval_only):
            model.train()
            train_dataloader.set_epoch(epoch)
            skip = batches_to_skip(progress, accelerator.num_processes, args.batch_size)
            # on a resume: a loader that starts after the batches the checkpoint's run trained in this epoch
            batches = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
            meter.start()
            for images, labels in batches:
                if plan.training_over(progress):
                    break
                with accelerator.accumulate(model):  # no DDP all-reduce on accumulation steps
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)
                    # shared: the optimizer step
                    accelerator.backward(loss)
                    if args.max_grad_norm is not None and accelerator.sync_gradients:
                        # clip_grad_norm_ unscales fp16 gradients first (and is FSDP-aware)
                        grad_norms.add(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                    optimizer.step()  # skipped on accumulation steps and on fp16 overflow
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()
                        update_model_ema(ema)
                    optimizer.zero_grad()
                # shared: after each batch
                running_loss.add(loss, logits, labels, step=progress.global_step + 1)
                meter.batch_done(len(labels))
                profiler.step()
                if accelerator.sync_gradients:  # True at the end of each accumulation cycle
                    progress.global_step += 1
                    progress.optimizer_steps_skipped += accelerator.optimizer_step_was_skipped
                    steps_bar.update(1)
                    # [collective] Accelerate's set_trigger/check_trigger: all processes stop after the same step
                    stopping = args.save_on_signal and stop_requested(accelerator, stop_signal)
                    # [collective] the logs and evaluation due after this step: before its checkpoint, which holds them
                    after_step(accelerator, events, progress, epoch)
                    if stopping or step_checkpoint_due(args.checkpointing_steps, progress.global_step):
                        with meter.paused():  # saving is not training time
                            gather_running_loss(accelerator, running_loss, progress, args.output_dir)  # [collective]
                            saved = save_checkpoint(accelerator, args.output_dir, f"step_{progress.global_step}",
                                                    progress, args.checkpoints_total_limit)  # [collective]
                    if stopping:
                        logger.info(f"Stopped by a signal after step {progress.global_step}: saved {saved}; continue "
                                    f"with --resume_from_checkpoint latest")
                        break
            meter.pause()
            if stopping:
                break

            gather_running_loss(accelerator, running_loss, progress, args.output_dir)  # [collective]
            # [collective] the epoch's exact mean training loss and the evaluation due, logged, best/ kept
            at_epoch_end(accelerator, events, progress, epoch, **progress.end_epoch(), **grad_norms.take())
            if args.checkpointing_steps == "epoch":
                # [collective] every process writes its part
                save_checkpoint(accelerator, args.output_dir, f"epoch_{epoch}", progress, args.checkpoints_total_limit)

    if args.eval_only:
        results.update(evaluate(accelerator, model, eval_dataloader, metric, ema))  # [collective]
    # shared: the end
    if not stopping:
        accelerator.wait_for_everyone()  # [collective] all processes done before the main one saves
        if args.eval_only:  # eval_results.json, beside the training run's results.json
            report_evaluation(accelerator, results, checkpoint, progress, args.output_dir)
        else:  # the plain model's weights
            # [collective] no DDP or compile wrapper; FSDP's shards, ZeRO-3's partitions gathered into the whole weights
            accelerator.save_model(model_to_save(accelerator, model), args.output_dir)
            results.update(save_model_ema(accelerator, ema, args.output_dir))  # [collective] model_ema.safetensors
            # [collective] results.json
            report_run(accelerator, model, meter, progress, results, checkpoint, plan, args.output_dir, args.batch_size,
                       args.gradient_accumulation_steps, args.learning_rate, args.seed, args.max_grad_norm)
    # release the DDP model first: end_training then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()
    return stop_signal.exit_status if stopping else 0


if __name__ == "__main__":
    args = None
    try:
        args = parse_args()
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
        stop_with_the_launcher()  # a SIGTERM to a one-process `accelerate launch` stops the training too
        import_deepspeed_if_installed()  # before main() creates the process group: utils/run/group_holders.py
        # one training at a time in --output_dir (a lock); --ddp_timeout outside the training loop: one line too
        with one_training_at_a_time(args.output_dir, args.eval_only), collective_timeouts_named(args.ddp_timeout):
            sys.exit(main(args))
    except UserError as err:
        exit_with_error(err)
    except KeyboardInterrupt:  # Ctrl-C without --save_on_signal: one line saying what was saved, not a traceback
        exit_interrupted(args.output_dir if args else None)
