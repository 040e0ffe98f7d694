"""--auto_find_batch_size: the largest per-process batch (halving from --batch_size) whose training step fits."""

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, find_executable_batch_size
from torch.utils.data import default_collate

from ..errors import UserError
from ..run.resume import accumulation_keeping

logger = get_logger(__name__)


def fit_batch_size(accelerator, model, optimizer, dataset, batch_size: int, accumulation: int, keep_progress=None,
                   model_input=None) -> tuple:
    """Collective; call before the DataLoaders are built and before `prepare`. Returns the largest of `batch_size`
    (--batch_size), half of it, a quarter... with which one training step (forward under the run's autocast,
    backward, optimizer step) on real samples does not run out of memory on every process, and the gradient
    accumulation steps that keep the global batch: `keep_progress`'s (a resumed run's checkpoint: it must, or
    one error line names flags that do), else that of `batch_size` x `accumulation` where a whole number of steps
    does. Logs what it chose.
    The probe's step is undone: weights, BatchNorm statistics and optimizer state are restored.

    Each process probes alone, on the unwrapped model (no DDP), then all agree on the smallest fitting size. With
    --sync_bn the probe is collective all the same: SyncBatchNorm all-gathers in every training forward once the
    process group exists, so a process that runs out of memory can leave the others waiting until --ddp_timeout.
    DDP's gradient buckets (one more copy of the gradients) are not in the probe: leave that much headroom.
    `model_input`: what the run does to a batch on the device before the model sees it (the image script
    normalises its uint8 images there).
    """
    if accelerator.distributed_type == DistributedType.FSDP:
        raise UserError("--auto_find_batch_size probes a training step of the whole, unsharded model on each process, "
                        "which says nothing of what fits under FSDP: give --batch_size without it under FSDP")
    requested = batch_size
    model.to(accelerator.device)
    saved_weights = {name: tensor.to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    tried = []

    def halve():
        return tried[-1] // 2

    @find_executable_batch_size(starting_batch_size=requested, reduce_batch_size_fn=halve)
    def one_training_step(batch_size):
        tried.append(batch_size)
        images, labels = default_collate([dataset[i % len(dataset)] for i in range(batch_size)])
        images, labels = images.to(accelerator.device), labels.to(accelerator.device)
        if model_input is not None:
            images = model_input(images)
        try:
            with accelerator.autocast():  # the precision the run trains in
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()  # allocates the optimizer state (Adam: two more copies of the weights)
        finally:
            optimizer.zero_grad(set_to_none=True)
            del images, labels
        return batch_size

    try:
        fits = one_training_step()
    except RuntimeError as err:
        if "No executable batch size found" not in str(err):
            raise
        raise UserError("--auto_find_batch_size: even a batch of 1 runs out of memory; use a smaller model, "
                        "--mixed_precision bf16/fp16, or a device with more memory") from None
    finally:
        model.load_state_dict(saved_weights)
        optimizer.state.clear()  # no moments or step counts from the probe's step
    # the smallest size that fits on every process, so all train with the same batch
    fits = int(accelerator.gather(torch.tensor([fits], device=accelerator.device)).min().item())
    num_processes = accelerator.num_processes
    if fits == requested:
        logger.info(f"--auto_find_batch_size: --batch_size {requested} fits", main_process_only=True)
        return fits, accumulation
    if keep_progress is not None:
        accumulation = accumulation_keeping(keep_progress, num_processes, fits, accumulation)
    elif (requested * accumulation) % fits == 0:  # where it can, keep the global batch the flags asked for
        accumulation = requested * accumulation // fits
    logger.info(f"--auto_find_batch_size: --batch_size {requested} runs out of memory, {fits} fits (tried "
                f"{tried}); with --gradient_accumulation_steps {accumulation} the global batch is "
                f"{num_processes * fits * accumulation}", main_process_only=True)
    return fits, accumulation
