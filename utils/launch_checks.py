"""Launch setups that would run, but not as the user meant: caught before or just after the
Accelerator is built, each ending with one `error:` line."""

import os

from utils.errors import UserError

FSDP_NEEDS_GPUS = ("the launch asks for FSDP, which shards the model over GPUs, but this run has none (or --cpu, with "
                   "which Accelerate would silently train unsharded with DDP); launch FSDP on GPUs without --cpu, or "
                   "use a non-FSDP config on the CPU")


def check_accelerator(accelerator) -> None:
    """Catch launch setups that would run, but not as the user meant."""
    # accelerate's multi-GPU launcher does not forward a YAML's `use_cpu: true`: on a
    # machine without GPUs, a script that does not pass cpu=True gets N lone processes.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise UserError(
            f"accelerate launch started {launched} processes but they did not form one group "
            f"(this one sees {accelerator.num_processes}); on a machine without GPUs add --cpu to the script's flags"
        )
    # Accelerate has no fp16 autocast on the CPU: it would silently train in fp32.
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError(
            "fp16 mixed precision needs a GPU (on the CPU it would silently run in fp32); "
            "use --mixed_precision bf16 or no on the CPU"
        )


def fsdp_launch() -> bool:
    """`accelerate launch` was asked for FSDP (--use_fsdp, or `distributed_type: FSDP` in the config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_enough_devices(cpu: bool) -> None:
    """Before the Accelerator exists (it would fail inside CUDA with "invalid device ordinal"):
    one process per GPU, so a machine cannot run more local processes than it has GPUs; and FSDP
    only where it can shard (GPUs, no --cpu)."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count()
    # With cpu=True Accelerate silently turns an FSDP launch into plain DDP (every process holds
    # the whole model while the user believes it is sharded); without GPUs it fails deep inside.
    if fsdp_launch() and (cpu or gpus == 0):
        raise UserError(FSDP_NEEDS_GPUS)
    if not cpu and gpus > 0 and local_rank >= gpus:
        local_processes = os.environ.get("LOCAL_WORLD_SIZE", "more")
        raise UserError(
            f"{local_processes} processes on this machine but only {gpus} GPU(s) visible; "
            f"launch with --num_processes {gpus} per machine (or check CUDA_VISIBLE_DEVICES / gpu_ids)"
        )
