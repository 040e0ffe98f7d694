"""What each process holds under FSDP2 and under DDP, on CPU processes: the measurement behind docs/fsdp.md's memory
table (not a test: a launch of ResNet-50 on 2 processes takes about a minute of 2 cores and 3 GB, beyond the suite's
budget).

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml tests/fsdp_memory.py
    accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml tests/fsdp_memory.py

Each process builds the whole model (as the training scripts do), prepares it with an AdamW optimizer, trains 2 steps
on random images, and prints one JSON line: its resident memory (RSS, /proc/self/status) and the bytes of tensor
storage alive in it (every tensor the garbage collector can reach, each storage counted once: parameters, their
gradients, AdamW's moments, BatchNorm's buffers, whatever Accelerate or torch keeps) at three moments: the whole model
built, after prepare, after the steps (gradients kept). Before each reading the freed memory goes back to the system
(gc, then glibc's malloc_trim), so that RSS counts what is alive rather than what the allocator kept: the peak RSS of a
short CPU run is set by the whole model every process builds before sharding, and says nothing of what sharding saves.
"""

import argparse
import ctypes
import gc
import json
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for utils/
from utils.run.fsdp import parameter_bytes, shard_on_cpu
from utils.models import build_model

LIBC = ctypes.CDLL("libc.so.6")  # glibc: malloc_trim returns the heap's free pages to the system


def resident_mb() -> float:
    """This process's resident memory now (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status")


def live_storage_mb() -> float:
    """The bytes of every distinct tensor storage the garbage collector reaches (a DTensor through its local shard)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases (reduce_op) warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not obj.is_meta]
    for tensor in tensors:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 1e6


def reading() -> dict:
    gc.collect()
    LIBC.malloc_trim(0)
    return {"rss_mb": round(resident_mb(), 1), "tensors_mb": round(live_storage_mb(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=4, help="per process")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    shard_on_cpu(accelerator)  # under fsdp_cpu.yaml: FSDP2, as the training scripts do
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=4, image_size=args.image_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    readings = {"built": reading()}
    model, optimizer = accelerator.prepare(model, optimizer)
    readings["prepared"] = reading()
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 4, (args.batch_size,))
    for _ in range(args.steps):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        accelerator.backward(loss)
        optimizer.step()
    readings["trained"] = reading()
    local, whole = parameter_bytes(model)
    print(json.dumps({"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
                      "distributed_type": str(accelerator.distributed_type), "model": args.model,
                      "parameter_bytes_held": local, "parameter_bytes": whole, **readings,
                      "peak_rss_mb": round(peak_resident_mb(), 1)}), flush=True)
    accelerator.wait_for_everyone()
    del model, optimizer
    accelerator.end_training()


if __name__ == "__main__":
    main()
