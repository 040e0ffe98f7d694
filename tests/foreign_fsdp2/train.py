"""A script of another project, converted to Accelerate with FSDP2 as docs/fsdp.md says, that keeps its own utils.py
beside it and imports our shard_on_cpu under its installed name (pip install . in our clone): run by
tests/test_helpers_shadowing.py under accelerate_configs/fsdp_cpu.yaml on 2 CPU processes. Each process writes what
it held and what the two state-dict calls gave it to OUT.rank{R}.json, and the unwrapped state dict to
OUT.rank{R}.pt.

usage: train.py OUT
"""

import json
import sys

import torch
import torch.distributed.nn  # before any process group: docs/migration_guide.md, "Ending a run cleanly"
from accelerate import Accelerator
from accelerate_reference_utils.run.fsdp import complete_fsdp_model, shard_on_cpu  # ours, under its installed name
from accelerate_reference_utils.run.group_holders import import_deepspeed_if_installed
from torch.distributed.tensor import DTensor
from utils import inspect_model, whole_elements  # the project's own utils.py


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def main(out) -> None:
    import_deepspeed_if_installed()  # before the group, as torch.distributed.nn: docs/ending_a_run_cleanly.md
    accelerator = Accelerator(cpu=True)
    shard_on_cpu(accelerator)  # on CPU processes Accelerate would silently train DDP
    model = build_model()
    whole = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    complete_fsdp_model(accelerator, model)  # rank 0's buffers, and the process groups released at exit
    gathered = accelerator.get_state_dict(model)  # collective: every process calls it
    unwrapped = accelerator.unwrap_model(model).state_dict()
    record = {
        "distributed_type": accelerator.distributed_type.value,
        "elements_held": inspect_model(model) if isinstance(unwrapped["0.weight"], DTensor) else whole_elements(model),
        "whole_elements": sum(tensor.numel() for tensor in whole.values()),
        "get_state_dict": {name: {"shape": list(tensor.shape), "equal": torch.equal(tensor, whole[name])}
                           for name, tensor in gathered.items()},
        "unwrapped": {name: {"type": type(tensor).__name__, "shape": list(tensor.shape),
                             "local_shape": list(tensor.to_local().shape) if isinstance(tensor, DTensor) else None}
                      for name, tensor in unwrapped.items()},
    }
    with open(f"{out}.rank{accelerator.process_index}.json", "w") as file:
        json.dump(record, file)
    torch.save(unwrapped, f"{out}.rank{accelerator.process_index}.pt")
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
