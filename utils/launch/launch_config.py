"""Check an accelerate launch config (YAML) before launching: one line per problem.

`accelerate launch --config_file F` answers a YAML it cannot read with a traceback, and
runs some inconsistent ones without complaint (a `MULTI_CPU` config without mpirun starts
one process, a `'NO'` config with `num_processes: 2` starts one). This names the problem:

    python -m utils.launch.launch_config accelerate_configs/*.yaml
"""

import sys
from pathlib import Path

import yaml

from ..errors import UserError, exit_with_error


def check_launch_config(path) -> str:
    """A one-line summary of the topology, or UserError naming what is wrong and the fix."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such config file; run `accelerate config --config_file {path}` to write one")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise UserError(f"{path} is not valid YAML ({where}{getattr(err, 'problem', err)}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds no `key: value` settings; compare with accelerate_configs/")
    check_value_types(path, raw)
    try:
        config = load_config_from_file(str(path))
    except (TypeError, ValueError, AttributeError) as err:  # unknown keys, bad enum values, missing fields
        reason = " ".join(str(err).split())
        raise UserError(f"{path} is not an accelerate config ({reason}); compare with accelerate_configs/") from None

    kind = config.distributed_type.value
    processes, machines, rank = config.num_processes, config.num_machines, config.machine_rank
    problems = []
    if processes < 1 or machines < 1:
        problems.append(f"num_processes ({processes}) and num_machines ({machines}) must be at least 1")
    elif processes % machines:
        problems.append(f"num_processes ({processes}) is the total over all machines: a multiple of num_machines "
                        f"({machines})")
    if not 0 <= rank < max(machines, 1):
        problems.append(f"machine_rank ({rank}) must be between 0 and num_machines - 1 ({machines - 1})")
    if kind == "NO" and processes > 1:
        problems.append(f"distributed_type 'NO' starts one process, not {processes}; use MULTI_GPU")
    if kind == "MULTI_CPU" and processes > 1 and not config.mpirun_config:
        problems.append(
            "MULTI_CPU without mpirun starts one process; for several CPU processes use distributed_type "
            "MULTI_GPU with use_cpu: true and pass --cpu to the script"
        )
    port = config.main_process_port
    if port is not None and not (port == 0 or 1024 <= port <= 65535):
        problems.append(f"main_process_port {port} is not a usable port (0 picks a free one; else 1024-65535)")
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    precision = config.mixed_precision.value if hasattr(config.mixed_precision, "value") else config.mixed_precision
    device = "CPU" if config.use_cpu else "GPU"
    summary = f"{path}: {kind}, {processes} process(es) on {machines} machine(s), {device}, mixed precision {precision}"
    if config.use_cpu or visible_gpu_count() > 0:
        return summary
    return f"{summary}; {without_gpus(kind, processes // machines, precision)}"


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def without_gpus(kind: str, processes_here: int, precision: str) -> str:
    """What a GPU config does on this machine, which has none (say, a config checked before copying it to a GPU
    node): the launcher starts its processes all the same, on the CPU, where the scripts need --cpu to form a group."""
    if kind == "FSDP":
        return "no GPU is visible on this machine: FSDP runs on GPUs only; on this one use a CPU config"
    note = f"no GPU is visible on this machine: here it starts {processes_here} CPU process" + \
        ("es" if processes_here > 1 else "")
    if processes_here > 1:
        note += ", which form one group only if the script gets --cpu (as with accelerate_configs/cpu_2proc.yaml)"
    if precision == "fp16":
        note += "; fp16 needs a GPU (the scripts stop): launch with --mixed_precision no"
    return note


INTEGER_KEYS = {"num_processes": 2, "num_machines": 1, "machine_rank": 0, "main_process_port": 29500}  # examples
BOOLEAN_KEYS = ("use_cpu", "debug", "rdzv_backend_static")


def check_value_types(path, raw: dict) -> None:
    """The values accelerate would choke on with a traceback (a string where it compares numbers)
    or accept only to refuse at launch (a precision it does not know)."""
    from accelerate.utils import DynamoBackend, PrecisionType

    problems = []
    for key, example in INTEGER_KEYS.items():
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{key}: {value!r} is not a whole number (e.g. {key}: {example})")
    for key in BOOLEAN_KEYS:
        if key in raw and not isinstance(raw[key], bool):
            problems.append(f"{key}: {raw[key]!r} must be true or false")
    precisions = [p.value for p in PrecisionType]
    if "mixed_precision" in raw and raw["mixed_precision"] not in precisions:
        problems.append(f"mixed_precision: {raw['mixed_precision']!r} is not one of {precisions} "
                        f"(full precision is 'no')")
    backend = (raw.get("dynamo_config") or {}).get("dynamo_backend")
    backends = [b.value for b in DynamoBackend]
    if backend is not None and str(backend).upper() not in backends:
        problems.append(f"dynamo_config.dynamo_backend: {backend!r} is not one of {backends}")
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))


def main(paths) -> int:
    if not paths:
        exit_with_error("usage: python -m utils.launch.launch_config CONFIG.yaml [...]", status=2)
    failed = False
    for path in paths:
        try:
            print(f"ok: {check_launch_config(path)}")
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
