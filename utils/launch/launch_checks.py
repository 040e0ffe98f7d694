"""Launch setups that would run, but not as the user meant: caught before or just after the
Accelerator is built, each ending with one `error:` line."""

import os
from pathlib import Path

from ..errors import UserError

FSDP_NEEDS_DEVICES = ("the launch asks for FSDP, but this machine has no GPUs to shard the model over; add --cpu after "
                      "the script's name to shard it over CPU processes (docs/fsdp.md)")
DEEPSPEED_NEEDS_DEVICES = ("the launch asks for DeepSpeed, but this machine has no GPUs; add --cpu after the script's "
                           "name to run DeepSpeed over CPU processes (accelerate_configs/deepspeed_zero2_cpu.yaml)")
DEEPSPEED_CPU_BESIDE_GPUS = ("--cpu with DeepSpeed on a machine with GPUs: DeepSpeed would still use the GPUs; drop "
                             "--cpu, or hide them with CUDA_VISIBLE_DEVICES= to run DeepSpeed over CPU processes")


def check_accelerator(accelerator) -> None:
    """Catch launch setups that would run, but not as the user meant."""
    # The processes that started: torchrun (accelerate's launcher for several processes) sets
    # WORLD_SIZE, and so does the Accelerator under mpirun; the one-process launcher sets nothing.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    # accelerate's multi-GPU launcher does not forward a YAML's `use_cpu: true`: on a
    # machine without GPUs, a script that does not pass cpu=True gets N lone processes.
    if accelerator.num_processes != launched:
        raise UserError(
            f"accelerate launch started {launched} processes but they did not form one group "
            f"(this one sees {accelerator.num_processes}); on a machine without GPUs add --cpu to the script's flags"
        )
    # Without --multi_gpu (or distributed_type MULTI_GPU) accelerate runs the script once, however
    # many processes were asked for: `distributed_type: MULTI_CPU` without mpirun (what `accelerate
    # config` writes for "multi-CPU"), a 'NO' config, `--num_processes 2` alone on a machine with at most one
    # GPU (with several and no config file, accelerate turns --multi_gpu on itself), or accelerate launch's --cpu.
    requested = requested_num_processes()
    if requested is not None and max(requested[0], 1) != launched:
        num_processes, source = requested
        raise UserError(
            f"accelerate launch was asked for {num_processes} processes ({source}) but started {launched}: without "
            f"--multi_gpu it runs the script once; launch with --multi_gpu --num_processes {num_processes} (or "
            f"--config_file accelerate_configs/cpu_2proc.yaml), and on CPUs put --cpu after the script name, not "
            f"before it"
        )
    # Accelerate has no fp16 autocast on the CPU: it would silently train in fp32.
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError(
            "fp16 mixed precision needs a GPU (on the CPU it would silently run in fp32); "
            "use --mixed_precision bf16 or no on the CPU"
        )


def requested_num_processes():
    """(num_processes, where it was set) that `accelerate launch` was asked for, read as accelerate
    reads it: its --num_processes, else the config's (--config_file, or `accelerate config`'s default
    file unless accelerate launch got --cpu). None when no `accelerate launch` started this process
    (python, torchrun, a notebook) or its command line cannot be read.

    accelerate passes the count to no process it starts (no ACCELERATE_NUM_PROCESSES; torchrun's
    WORLD_SIZE says what started, not what was asked), and its one-process launcher leaves only
    MASTER_ADDR / MASTER_PORT behind, which a user's or Slurm's environment may set for other
    reasons. So this reads the launcher's own command line, from the nearest ancestor process
    running `accelerate launch`, with accelerate's own argument parser.
    """
    import psutil
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        for process in psutil.Process().parents():
            launch_args = _accelerate_launch_args(process.cmdline())
            if launch_args is not None:
                launcher_dir = Path(process.cwd())
                break
        else:
            return None
        args = launch_command_parser().parse_args(launch_args)
    except (psutil.Error, SystemExit):  # a launcher gone or not ours to read, a command line we cannot parse
        return None
    if args.num_processes is not None:
        return args.num_processes, f"--num_processes {args.num_processes}"
    config_file = args.config_file
    if config_file is None and os.path.isfile(default_config_file) and not args.cpu:
        config_file = default_config_file
    if config_file is None:  # accelerate then starts one process per visible GPU (itself turning on --multi_gpu
        return None          # with two or more), one without GPUs: no count was asked for
    num_processes = load_config_from_file(str(launcher_dir / config_file)).num_processes
    if num_processes is None:
        return None
    return num_processes, f"num_processes: {num_processes} in {config_file}"


def _accelerate_launch_args(cmdline: list):
    """The arguments after `launch` in `accelerate launch ...`, `accelerate-launch ...`,
    `python -m accelerate.commands.launch ...` or `python -m accelerate.commands.accelerate_cli launch ...`;
    None for any other command line."""
    for i, word in enumerate(cmdline[:3]):  # the program itself, or after the interpreter, or after `python -m`
        if i == 2 and cmdline[1] != "-m":
            break
        name = Path(word).name
        if name in ("accelerate-launch", "accelerate.commands.launch"):
            return cmdline[i + 1:]
        if name in ("accelerate", "accelerate.commands.accelerate_cli") and cmdline[i + 1:i + 2] == ["launch"]:
            return cmdline[i + 2:]
    return None


def fsdp_launch() -> bool:
    """`accelerate launch` was asked for FSDP (--use_fsdp, or `distributed_type: FSDP` in the config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_launch() -> bool:
    """`accelerate launch` was asked for DeepSpeed (--use_deepspeed, or `distributed_type: DEEPSPEED` in the config)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_enough_devices(cpu: bool) -> None:
    """Before the Accelerator exists (it would fail inside CUDA with "invalid device ordinal"):
    one process per GPU, so a machine cannot run more local processes than it has GPUs; FSDP
    only where it can shard: on GPUs, or on CPU processes with --cpu (utils/run/fsdp.py); DeepSpeed on the GPUs, or
    with --cpu on a machine without them (utils/run/deepspeed.py)."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count()
    # Without GPUs and without --cpu the processes would form no group, each holding the whole model
    if fsdp_launch() and not cpu and gpus == 0:
        raise UserError(FSDP_NEEDS_DEVICES)
    if deepspeed_launch() and fsdp_launch():  # Accelerate would silently pick DeepSpeed
        raise UserError("the launch asks for both DeepSpeed and FSDP (ACCELERATE_USE_DEEPSPEED and "
                        "ACCELERATE_USE_FSDP); pick one: ZeRO-3 and FSDP both shard parameters, gradients and "
                        "optimizer state")
    if deepspeed_launch() and not cpu and gpus == 0:  # each process would be a DeepSpeed world of one
        raise UserError(DEEPSPEED_NEEDS_DEVICES)
    if deepspeed_launch() and cpu and gpus > 0:  # DeepSpeed picks its accelerator by what it finds, not by --cpu
        raise UserError(DEEPSPEED_CPU_BESIDE_GPUS)
    if not cpu and gpus > 0 and local_rank >= gpus:
        local_processes = os.environ.get("LOCAL_WORLD_SIZE", "more")
        raise UserError(
            f"{local_processes} processes on this machine but only {gpus} GPU(s) visible; "
            f"launch with --num_processes {gpus} per machine (or check CUDA_VISIBLE_DEVICES / gpu_ids)"
        )
