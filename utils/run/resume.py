"""Resume planning: which checkpoint --resume_from_checkpoint means, loading it, and what a resumed run keeps (its
global batch, the batches of the epoch already trained, the epochs left)."""

import math
from pathlib import Path

from accelerate.logging import get_logger
from safetensors.torch import load_file

from ..errors import UserError
from ..output_files import BEST, TRAINING_STATE, WEIGHTS
from ..run.checkpoints import check_checkpoint, newest_good_checkpoint, warn_if_unverifiable
from ..run.deepspeed import all_in_model_dtype, buffers_as_under_ddp, load_whole_weights_under_zero3, zero3
from ..run.deepspeed_checkpoints import check_deepspeed_run
from ..run.fsdp import complete_fsdp_model
from ..run.progress import TrainingProgress, read_training_state

logger = get_logger(__name__)


def load_checkpoint(accelerator, model, checkpoint, progress: TrainingProgress, resume_from_checkpoint,
                    output_dir) -> None:
    """Collective: `accelerator.load_state` (every process reads the weights, optimizer, scheduler,
    GradScaler, the objects registered for checkpointing (--model_ema's average) and its own RNG states), with
    one clear line when the folder does not fit the run.
    The weights-only folder `best` (--eval_only) loads into `model` alone.
    No checkpoint (None): a fresh start, said so when --resume_from_checkpoint latest found none."""
    complete_fsdp_model(accelerator, model)  # under FSDP: rank 0's BatchNorm statistics as under DDP (run/fsdp.py)
    # DeepSpeed's checkpoints resume under DeepSpeed, on the processes that saved them (run/deepspeed_checkpoints.py)
    check_deepspeed_run(accelerator, None if checkpoint is None or weights_only(checkpoint) else checkpoint)
    buffers_as_under_ddp(accelerator, model)  # under DeepSpeed: rank 0's BatchNorm statistics, as DDP keeps them
    all_in_model_dtype(accelerator, model)  # under DeepSpeed's fp16/bf16: its buffers and inputs as its parameters
    if checkpoint is None:
        if resume_from_checkpoint == "latest":
            logger.info(f"No checkpoint in {output_dir} yet: starting from scratch", main_process_only=True)
        return
    try:
        if weights_only(checkpoint):
            # imported here: only this path needs it, and at the top it would cost --help and every process's start
            # about half a second (it imports torch._dynamo, which prepare() has loaded by the time it runs here)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # The plain weights, as save_model wrote them; full_state_dict: the same call loads them into an
            # FSDP-sharded model (each process keeps its shard), a DDP-wrapped or a compiled one.
            weights = load_file(Path(checkpoint) / WEIGHTS)
            if zero3(accelerator):  # DeepSpeed's partitions are not DTensors: gathered by DeepSpeed itself
                load_whole_weights_under_zero3(accelerator.unwrap_model(model), weights)
            else:
                set_model_state_dict(accelerator.unwrap_model(model), weights,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            accelerator.load_state(str(checkpoint))
    except Exception as err:  # torch.load, safetensors and shape mismatches raise many types
        raise UserError(f"cannot load checkpoint {checkpoint} ({type(err).__name__}); it is corrupt or from "
                        f"another model") from None
    logger.info(f"Resumed from {checkpoint}: epoch {progress.epoch}, step {progress.global_step}, "
                f"{progress.samples_in_epoch} samples into the epoch", main_process_only=True)


def epochs_to_train(accelerator, progress: TrainingProgress, plan, eval_only: bool):
    """The epochs left, from the checkpoint's (or 0), until `plan.max_steps` optimizer steps are done (--max_steps, or
    --epochs whole epochs) and the last epoch has ended (also one the run ended inside, so that a resume from a
    checkpoint saved at its last step still evaluates and reports it); none with --eval_only. --early_stopping_patience
    ends them once --metric_for_best has not improved for that many evaluations (also when a resume finds it so).
    The main process decides and Accelerate's trigger tells the others (one tiny all-reduce per epoch), so all
    processes stop after the same epoch even if their metrics differed in the last bit. (Inside an epoch, with
    --eval_steps, StepPlan.training_over ends it: every process counts the evaluations of the same gathered metrics.)"""
    while not eval_only:
        if progress.samples_in_epoch == 0:  # at an epoch's start (every process decides the same)
            if progress.global_step >= plan.max_steps:
                return
            if plan.early_stopping_patience is not None:
                if accelerator.is_main_process and \
                        progress.evaluations_without_improvement >= plan.early_stopping_patience:
                    accelerator.set_trigger()
                if accelerator.check_trigger():  # a collective: True everywhere if any process set it
                    logger.info(f"Stopping early: {plan.metric_for_best} has not improved for "
                                f"{progress.evaluations_without_improvement} evaluations (best: "
                                f"{progress.best_metric:.4f} after step {progress.best_step}, epoch "
                                f"{progress.best_epoch})", main_process_only=True)
                    return
        yield progress.epoch


def resume_point(resume_from_checkpoint, output_dir, eval_only: bool = False) -> tuple:
    """(checkpoint, progress): the folder `--resume_from_checkpoint {latest,best,PATH}` points at and the progress it
    saved; (None, a fresh TrainingProgress) to start afresh."""
    checkpoint = resolve_checkpoint(resume_from_checkpoint, output_dir, eval_only)
    return checkpoint, read_training_state(checkpoint) if checkpoint is not None else TrainingProgress()


def resolve_checkpoint(resume_from_checkpoint, output_dir, eval_only: bool = False):
    """What `--resume_from_checkpoint {latest,PATH}` points at: a folder, or None to start fresh.

    'latest' with nothing saved yet means a first start (one command line serves the first
    start and every restart); --eval_only has nothing to evaluate then.
    """
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == BEST:
        checkpoint = Path(output_dir) / BEST
        if not (checkpoint / TRAINING_STATE).is_file():
            raise UserError(f"--resume_from_checkpoint best: no {checkpoint} with {TRAINING_STATE}; train with "
                            f"--metric_for_best (or --early_stopping_patience) first")
        return checkpoint
    if resume_from_checkpoint == "latest":
        checkpoint = newest_good_checkpoint(output_dir, say_skipped=True)
        if checkpoint is None and eval_only:
            weights = Path(output_dir) / WEIGHTS
            fix = (f"its {weights.name} (the finished run's weights) is evaluated by scripts/predict.py --model_dir "
                   f"{output_dir}, which prints the accuracy on the run's evaluation data" if weights.is_file()
                   else "pass a checkpoint folder")
            raise UserError(f"--eval_only: no complete checkpoint in {output_dir}; {fix}")
        warn_if_unverifiable(checkpoint)
        return checkpoint
    checkpoint = Path(resume_from_checkpoint)
    if not checkpoint.is_dir():
        raise UserError(f"--resume_from_checkpoint {checkpoint}: no such folder; pass a checkpoint folder or 'latest'")
    if weights_only(checkpoint) and not eval_only:  # the literal 'best' is refused already by the flag checks
        raise UserError(f"{checkpoint} holds the best weights only (no optimizer state): evaluate them with "
                        f"--eval_only, or resume training from 'latest' or a step_N/epoch_N folder")
    problem = check_checkpoint(checkpoint)
    if problem is not None:
        good = newest_good_checkpoint(checkpoint.parent)
        fix = f"resume from the newest good one, {good}" if good else "no good checkpoint is left beside it"
        raise UserError(f"checkpoint {checkpoint} is damaged ({problem}); {fix}")
    warn_if_unverifiable(checkpoint)
    return checkpoint


def weights_only(checkpoint) -> bool:
    """Whether `checkpoint` is a --metric_for_best folder (the weights alone), however its path is spelled: relative or
    absolute, with `.` or `..` in it, a link to it under another name, or a link named best to a copy of it."""
    return BEST in (Path(checkpoint).name, Path(checkpoint).resolve().name)


def accumulation_keeping(progress, num_processes: int, batch_size: int, accumulation: int) -> int:
    """On resume: the gradient accumulation steps that keep the global batch of the checkpoint's `progress` on
    `num_processes` processes of `batch_size` samples: `accumulation` (--gradient_accumulation_steps) when it already
    does (or when there is no checkpoint to keep, `progress` None), else another number, logged.

    The learning-rate schedule and the optimizer state belong to that global batch; a different
    one would silently change the run. Raises UserError naming flags that work when none does.
    """
    if progress is None:
        return accumulation
    target = progress.global_batch_size
    if num_processes * batch_size * accumulation == target:
        return accumulation
    if target % (num_processes * batch_size) == 0:
        accumulation = target // (num_processes * batch_size)
        logger.info(f"resuming on {num_processes} processes: --gradient_accumulation_steps {accumulation} keeps the "
                    f"checkpoint's global batch of {target} samples", main_process_only=True)
        return accumulation
    if target % num_processes:
        raise UserError(f"the checkpoint's global batch of {target} samples cannot be split over {num_processes} "
                        f"processes; resume on a number of processes that divides {target}")
    per_process = target // num_processes
    keeps = max(b for b in range(1, min(batch_size, per_process) + 1) if per_process % b == 0)
    raise UserError(f"the checkpoint's global batch is {target} samples ({progress.num_processes} processes); on "
                    f"{num_processes} processes --batch_size {batch_size} cannot keep it: use --batch_size {keeps} "
                    f"--gradient_accumulation_steps {per_process // keeps}")


def batches_to_skip(progress: TrainingProgress, num_processes: int, batch_size: int) -> int:
    """Batches per process already trained on in the epoch in progress (checkpoints are saved after an
    optimizer step, so this part of the epoch is a whole number of global batches, but for the epoch's last batch,
    which on one process may be partial: rounded up, it counts as the whole batch it was). The shuffle order
    depends only on (seed, epoch) and each process takes every num_processes-th batch of it, so the
    first samples_in_epoch samples of the order are the first this-many batches of every process."""
    return math.ceil(progress.samples_in_epoch / (num_processes * batch_size))
