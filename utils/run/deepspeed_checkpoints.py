"""DeepSpeed ZeRO runs' checkpoints: what a step_N/epoch_N folder holds under DeepSpeed, and which process count and
ZeRO stage may resume it.

Under DeepSpeed, `save_state` writes DeepSpeed's own checkpoint into our checkpoint folder: `pytorch_model/` (each
process's ZeRO shards of the optimizer state, and under ZeRO-3 of the weights), DeepSpeed's `latest` (the tag,
pytorch_model) and its `zero_to_fp32.py`; Accelerate adds the scheduler and the RNG states beside them, and
save_checkpoint (utils/run/checkpoints.py) the manifest of them all, as for every other checkpoint.
"""

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
