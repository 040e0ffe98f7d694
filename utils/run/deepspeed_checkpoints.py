"""DeepSpeed ZeRO runs' checkpoints: what a step_N/epoch_N folder holds under DeepSpeed, when it can be resumed, and
the BatchNorm statistics that make a resume exact.

Under DeepSpeed, `save_state` writes DeepSpeed's own checkpoint into our checkpoint folder: `pytorch_model/` (each
process's ZeRO shards of the optimizer state, and under ZeRO-3 of the weights), DeepSpeed's `latest` (the tag,
pytorch_model) and its `zero_to_fp32.py`; Accelerate adds the scheduler and the RNG states beside them, and
save_checkpoint (utils/run/checkpoints.py) the manifest of them all, as for every other checkpoint.
"""

import atexit
from pathlib import Path

from ..errors import UserError

DEEPSPEED_TAG = "pytorch_model"  # the folder (DeepSpeed's checkpoint tag) Accelerate's save_state writes the shards to


def is_deepspeed_checkpoint(checkpoint) -> bool:
    return (Path(checkpoint) / DEEPSPEED_TAG).is_dir()


def saved_processes(checkpoint) -> int:
    """How many processes saved DeepSpeed checkpoint `checkpoint`: ZeRO-2 and ZeRO-3 alike write one file of optimizer
    state per process."""
    return len(list((Path(checkpoint) / DEEPSPEED_TAG).glob("*_optim_states.pt")))


def saved_by_zero_3(checkpoint) -> bool:
    """Whether ZeRO-3 saved `checkpoint`: each process wrote its partition of the weights (ZeRO-1 and ZeRO-2 write the
    whole weights once, mp_rank_00_model_states.pt)."""
    return any((Path(checkpoint) / DEEPSPEED_TAG).glob("zero_pp_rank_*_model_states.pt"))


def check_deepspeed_run(accelerator, checkpoint) -> None:
    """Before a DeepSpeed run trains, or any run loads training checkpoint `checkpoint` (None: none): UserError unless

    - a DeepSpeed checkpoint resumes under DeepSpeed and another under anything but DeepSpeed (Accelerate's load_state
      would read neither the other way round: a missing file at best, at worst weights never loaded);
    - on as many processes as saved it, and with ZeRO-3 if ZeRO-3 saved it (DeepSpeed reads each process's shard of
      the optimizer state as saved; it cannot re-split them);
    - ZeRO-3 may gather the whole weights at the end (stage3_gather_16bit_weights_on_model_save, accelerate config's
      zero3_save_16bit_model): without it save_model stops after the whole training, with no model.safetensors."""
    from accelerate.utils import DistributedType

    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3 and not accelerator.deepspeed_config[
            "zero_optimization"].get("stage3_gather_16bit_weights_on_model_save", False):
        raise UserError("ZeRO-3 without stage3_gather_16bit_weights_on_model_save cannot write model.safetensors at "
                        "the end: set zero3_save_16bit_model: true in the launch config (accelerate launch "
                        "--zero3_save_16bit_model true; accelerate_configs/deepspeed_zero3_cpu.yaml has it)")
    if checkpoint is None:
        return
    if is_deepspeed_checkpoint(checkpoint) != deepspeed:
        saved, now = ("a DeepSpeed run", "without") if not deepspeed else ("a run without DeepSpeed", "under")
        raise UserError(f"checkpoint {checkpoint} was saved by {saved} and this run is {now} DeepSpeed; resume it "
                        f"with the launch that saved it, or start afresh in another --output_dir")
    if not deepspeed:
        return
    processes = saved_processes(checkpoint)
    if processes != accelerator.num_processes:
        raise UserError(f"checkpoint {checkpoint} holds DeepSpeed's optimizer state split over {processes} processes "
                        f"and this run has {accelerator.num_processes}; DeepSpeed cannot re-split it: resume on "
                        f"{processes} processes (accelerate launch --num_processes {processes})")
    stage = accelerator.state.deepspeed_plugin.zero_stage
    if saved_by_zero_3(checkpoint) != (stage == 3):
        saved = "ZeRO-3" if stage != 3 else "ZeRO-1 or ZeRO-2"
        raise UserError(f"checkpoint {checkpoint} was saved under {saved} and this run is ZeRO-{stage}: resume it "
                        f"under the ZeRO stage that saved it (accelerate launch --zero_stage "
                        f"{3 if stage != 3 else 2})")


def buffers_as_under_ddp(accelerator, model) -> None:
    """Under DeepSpeed, rank 0's buffers (BatchNorm's running statistics) before every forward of `model`, as DDP
    broadcasts them (collective: every process runs as many forwards, in training as in the exact evaluation).
    DeepSpeed broadcasts them once, at `prepare`; then each process updates its own copy from its own batches, so
    the processes evaluate different models, and ZeRO-1/2's save_state keeps rank 0's only (one
    mp_rank_00_model_states.pt): a resume then evaluates otherwise than the uninterrupted run (measured: ZeRO-2,
    bit-identical weights, eval_loss 0.041743 resumed vs 0.041724). And at exit DeepSpeed's process groups are
    released (_release_process_groups). Nothing to do without DeepSpeed."""
    import torch
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plain_model = accelerator.unwrap_model(model)  # DeepSpeed's engine calls its module's forward
    buffers = list(plain_model.buffers()) if accelerator.num_processes > 1 else []

    def broadcast_from_rank_0(module, inputs):
        for buffer in buffers:
            torch.distributed.broadcast(buffer, src=0)

    if buffers:
        plain_model.register_forward_pre_hook(broadcast_from_rank_0)
    atexit.register(_release_process_groups)  # after end_training; before the interpreter tears down the threads


def _release_process_groups() -> None:
    """Drop every Python reference to a process group, so that gloo's worker threads are joined now rather than left
    alive at exit, where one can abort it (docs/migration_guide.md, "Ending a run cleanly"). After end_training
    DeepSpeed still holds the world group (deepspeed.utils.groups._WORLD_GROUP), and under ZeRO-3 its engine, optimizer
    and parameters (ds_process_group) stay alive past free_memory, in a cycle through the autograd hooks on the
    parameters that the garbage collector cannot see (measured: 2 threads left under ZeRO-2, 4 under ZeRO-3; none
    after this)."""
    import gc

    from deepspeed.utils import groups
    from torch.distributed import ProcessGroup

    # DeepSpeed's module-level groups, as deepspeed.comm.destroy_process_group releases them (a module's globals may be
    # out of the walk below: gc.get_objects skips what gc.freeze froze, e.g. a launcher that imported DeepSpeed first)
    groups._release_process_group_references(group=None)
    # type(o) is dict/list, not isinstance: isinstance would also read o.__class__, which torch's deprecated
    # torch.distributed.reduce_op answers with a FutureWarning on every process (as in utils/run/fsdp.py), and a dict
    # subclass may compute its items (transformers' lazy auto-model mappings import modules, and raise at exit)
    for holder in gc.get_objects():
        try:  # some objects (pydantic's placeholders) raise on any attribute
            attributes = None if issubclass(type(holder), type) else object.__getattribute__(holder, "__dict__")
        except Exception:  # noqa: BLE001 (whatever they raise, they hold no process group)
            attributes = None
        for mapping in (attributes, holder):
            if type(mapping) is dict:
                for key in [k for k, v in mapping.items() if issubclass(type(v), ProcessGroup)]:
                    mapping[key] = None
        if type(holder) is list and any(issubclass(type(v), ProcessGroup) for v in holder):
            holder[:] = [None if issubclass(type(v), ProcessGroup) else v for v in holder]
    gc.collect()
