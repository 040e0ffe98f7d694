"""--model_ema: an exponential moving average (EMA) of the weights, evaluated and saved beside them (timm's
--model-ema, kept with torch's AveragedModel).

Every process keeps the average of its own replica of the plain model (no DDP or compile wrapper), updated after
each optimizer step that changed the weights: not on the batches that only accumulate gradients, nor on an fp16 step
the GradScaler skipped (the average counts optimizer updates, as the learning-rate schedule does). The replicas'
weights are identical after every step, so their averages are too, without any communication.

BatchNorm's running statistics are averaged too (AveragedModel(use_buffers=True), as timm and torchvision do), and
counts such as num_batches_tracked are copied, as timm does. The statistics are the one part that differs between
processes: in training each process updates them from its own batch (DDP overwrites them with rank 0's at the next
forward), so before each evaluation the average's buffers become rank 0's (one broadcast). Checkpoints hold rank 0's
average (Accelerate saves registered objects from the main process) and every process loads it, so a resumed run
ends with the uninterrupted run's average, bit for bit.
"""

import os
from pathlib import Path

import safetensors.torch
import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, broadcast
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..errors import UserError
from ..output_files import EMA_CHECKPOINT_FILE, EMA_WEIGHTS
from ..run.fingerprints import replica_fingerprints

WARMUP_POWER = 2 / 3  # timm's ModelEmaV3 warmup (warmup_gamma 1)
logger = get_logger(__name__)


def decay_at(updates_done: int, decay: float, warmup: bool) -> float:
    """The decay of the update that follows `updates_done` updates: the average moves (1 - decay) of the way to the
    new weights. The first update copies them (decay 0: the average starts from the weights after the first optimizer
    step, not from the initial ones); then `decay`, or with --model_ema_warmup min(decay, 1 - (1 + t) ** -2/3) at
    t = `updates_done` (timm's ModelEmaV3: 0.37 at the second update, 0.95 at the 100th, 0.99 at the 1000th; 0.9998
    after about 350,000), so that early on the average spans the few steps there are."""
    if updates_done == 0:
        return 0.0
    return min(decay, 1 - (1 + updates_done) ** -WARMUP_POWER) if warmup else decay


def ema_update_fn(decay: float):
    """AveragedModel's multi_avg_fn: torch's EMA update (get_ema_multi_avg_fn) for the floating-point tensors. Integer
    buffers (BatchNorm's num_batches_tracked) are copied, as timm does: torch's would average them in floating point
    and truncate the result: a count about 1 / (1 - decay) updates behind."""
    average = get_ema_multi_avg_fn(decay)

    def update(averaged: list, current: list, num_averaged) -> None:
        if averaged[0].is_floating_point():  # AveragedModel groups the tensors by device and dtype
            average(averaged, current, num_averaged)
        else:
            for tensor, value in zip(averaged, current):
                tensor.copy_(value)

    return update


class ModelEma:
    """The moving average of `model`'s weights and buffers, on the model's device. state_dict and load_state_dict
    (for Accelerate's register_for_checkpointing) hold the averaged tensors and the number of updates."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool):
        self.model = model  # the plain model the optimizer steps
        self.decay, self.warmup = decay, warmup
        self.averaged = AveragedModel(model, use_buffers=True)  # a deep copy: the same device, layout and modes
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged weights as a model like `model`: evaluated and saved as it is."""
        return self.averaged.module

    @property
    def updates(self) -> int:
        return int(self.averaged.n_averaged)  # AveragedModel keeps the count on the CPU

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step that changed the weights."""
        self.averaged.multi_avg_fn = ema_update_fn(decay_at(self.updates, self.decay, self.warmup))
        self.averaged.update_parameters(self.model)

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(state)


def build_model_ema(accelerator, model, checkpoint, max_steps: int, model_ema: bool, decay: float, warmup: bool):
    """--model_ema (`model_ema`, with --model_ema_decay `decay` and --model_ema_warmup `warmup`): the moving average of
    the prepared `model`'s plain weights, registered for checkpointing, so it is built before `checkpoint` (if any) is
    loaded, and that must hold one; None without --model_ema (then `checkpoint` must hold none). A run of `max_steps`
    too short for the decay is warned about."""
    if checkpoint is not None:
        holds_average = (Path(checkpoint) / EMA_CHECKPOINT_FILE).is_file()
        if model_ema and not holds_average:
            raise UserError(f"{checkpoint} holds no --model_ema average (saved without --model_ema; best/ keeps one "
                            f"set of weights only); drop --model_ema to load it")
        if holds_average and not model_ema:
            raise UserError(f"{checkpoint} holds a --model_ema average: add --model_ema to load it too")
    if not model_ema:
        return None
    if accelerator.distributed_type == DistributedType.FSDP:
        raise UserError("--model_ema keeps a whole copy of the weights on every process, which FSDP shards: train "
                        "without --model_ema under FSDP")
    first_step_share = decay ** (max_steps - 1)  # of the weights after the first step, at the end
    if not warmup and first_step_share > 0.1:
        logger.warning(f"--model_ema_decay {decay} averages over about "
                       f"{round(1 / (1 - decay))} optimizer steps and this run has {max_steps}: at its "
                       f"end the weights of its first step will still make up {first_step_share:.0%} of the average; "
                       f"add --model_ema_warmup, or lower --model_ema_decay", main_process_only=True)
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)  # no DDP or compile wrapper
    ema = ModelEma(plain_model, decay, warmup)
    accelerator.register_for_checkpointing(ema)  # saved by save_state, loaded by load_state
    return ema


def update_model_ema(ema) -> None:
    """After each optimizer step that changed the weights; nothing without --model_ema (None)."""
    if ema is not None:
        ema.update()


def evaluate_model_ema(accelerator, ema, evaluate, *evaluate_args) -> dict:
    """Collective: the script's `evaluate(accelerator, model, *evaluate_args)` of the moving average, its results
    named eval_ema_* for eval_* (but eval_samples: the same set); {} without --model_ema. The average's buffers
    become rank 0's first (see the top of this file), and it runs under the launch config's autocast, which
    Accelerate put into the prepared model's forward only."""
    if ema is None:
        return {}
    if accelerator.num_processes > 1:
        broadcast(list(ema.module.buffers()), from_process=0)  # in place
    with accelerator.autocast():
        scores = evaluate(accelerator, ema.module, *evaluate_args)
    return {key.replace("eval_", "eval_ema_", 1): value for key, value in scores.items() if key != "eval_samples"}


def save_model_ema(accelerator, ema, output_dir) -> dict:
    """Collective, at the end of a training run: the main process writes the moving average to
    OUTPUT_DIR/model_ema.safetensors under the plain model's names, as model.safetensors (into a temporary file, then
    renamed: it appears only complete). Returns for results.json its settings, its number of updates and every
    process's fingerprints of it; {} without --model_ema."""
    if ema is None:
        return {}
    replicas = replica_fingerprints(accelerator, ema.module)
    if accelerator.is_main_process:
        path = Path(output_dir) / EMA_WEIGHTS
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            # made contiguous (channels-last weights), each shared tensor once, as Accelerate's save_model does
            safetensors.torch.save_model(ema.module, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # only left when writing failed
        logger.info(f"Saved the moving average of the weights ({ema.updates} updates) to {path}")
    return {"model_ema_decay": ema.decay, "model_ema_warmup": ema.warmup, "ema_updates": ema.updates,
            "ema_parameter_fingerprints": [row[0] for row in replicas],
            "ema_buffer_fingerprints": [row[1] for row in replicas]}
