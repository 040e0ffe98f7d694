"""FSDP2 on CPU processes (a gloo group), through the same Accelerator calls as on GPUs.

PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) and its distributed checkpoints (DCP) run on CPU
tensors over gloo; Accelerate 1.15 just never chooses them there. `AcceleratorState.__init__`
(accelerate/state.py, the branch `elif self.distributed_type in [DistributedType.MULTI_GPU, ...MULTI_NEURON]`)
switches to `DistributedType.FSDP` and keeps the FSDP plugin only for GPU-like process groups; a CPU group
(`MULTI_CPU`: `Accelerator(cpu=True)` under torchrun) keeps DDP and drops the plugin, and no setting
changes that. `shard_on_cpu` makes, once the Accelerator is built, what that branch would have done (the
distributed type, the plugin, its mixed precision policy). Everything after it is Accelerate's own FSDP2 code,
unchanged: `prepare` calls `fully_shard`, `save_state`/`load_state` write and read DCP shards, `get_state_dict`
and `save_model` gather the whole weights. Hand-written because Accelerate has no switch for it; it fails with one
line, never silently, when the Accelerate it was written against changes.
"""

from ..errors import UserError
from ..launch.launch_checks import fsdp_launch

# The Accelerate release whose AcceleratorState this adapter completes (see the module's docstring).
ADAPTED_ACCELERATE = "1.15."


def shard_on_cpu(accelerator) -> None:
    """Under an FSDP launch on CPU processes (the scripts' --cpu), turn the Accelerator's DDP setup into FSDP2, as
    it would be on GPUs. Does nothing on GPUs, without an FSDP launch, or where Accelerate chose FSDP itself."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, DynamoBackend, FullyShardedDataParallelPlugin

    if not fsdp_launch() or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    adapted = accelerate.__version__.startswith(ADAPTED_ACCELERATE) and "distributed_type" in PartialState._shared_state
    if not adapted:
        raise UserError(
            f"FSDP on CPU processes goes through utils/run/fsdp.py, written for accelerate {ADAPTED_ACCELERATE}x, but "
            f"this is accelerate {accelerate.__version__}; install the tested one (pip install -c constraints.txt "
            f"accelerate), or launch FSDP on GPUs")
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise UserError("--compile (a dynamo backend) with FSDP on CPU processes has not been tested here; train "
                        "without --compile, or with FSDP on GPUs")
    plugin = FullyShardedDataParallelPlugin()  # from the launch's FSDP_* settings, as the Accelerator built its own
    if plugin.fsdp_version != 2:
        raise UserError(f"FSDP on CPU processes needs FSDP2 (fully_shard); this launch asks for fsdp_version "
                        f"{plugin.fsdp_version}: set fsdp_version: 2 (accelerate_configs/fsdp_cpu.yaml)")
    if plugin.cpu_ram_efficient_loading:
        # accelerate 1.15's fsdp2_load_full_state_dict treats every state_dict entry as a sharded parameter and
        # fails on buffers, which BatchNorm has (on GPUs too)
        raise UserError("fsdp_cpu_ram_efficient_loading fails for models with buffers (BatchNorm's statistics) in "
                        "accelerate 1.15: set fsdp_cpu_ram_efficient_loading: false")
    if accelerator.mixed_precision != "no":  # bf16 (fp16 is refused on the CPU: utils/launch/launch_checks.py)
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def keep_batchnorm_in_fp32(accelerator, model) -> None:
    """Under FSDP with --mixed_precision bf16 or fp16, before the optimizer and `prepare`: every BatchNorm layer of
    `model` becomes an FSDP2 unit of its own whose weights stay fp32, as FSDP1's MixedPrecision kept them
    (`_module_classes_to_ignore`); `prepare` then shards the rest of the model around these units. Accelerate 1.15
    gives FSDP2 one policy that casts every parameter to the autocast dtype, and batch_norm refuses 16-bit weights
    beside its fp32 running statistics: the first GPU check stopped at the first backward ("Expected running_mean
    to have type BFloat16 but got Float"), CPU processes stop the same way. The layer's input keeps the autocast
    dtype, as under DDP. Before the optimizer: fully_shard replaces the parameters the optimizer would hold."""
    import torch
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if accelerator.distributed_type != DistributedType.FSDP or accelerator.mixed_precision == "no":
        return
    plugin, mesh = accelerator.state.fsdp_plugin, getattr(accelerator, "torch_device_mesh", None)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            fully_shard(module, mp_policy=fp32, reshard_after_forward=plugin.reshard_after_forward,
                        offload_policy=plugin.cpu_offload,  # as Accelerate's own units, on its mesh
                        mesh=mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None)


def complete_fsdp_model(accelerator, model) -> None:
    """What a prepared FSDP `model` needs beyond Accelerate, on GPUs as on CPUs (nothing without FSDP):

    - its buffers (BatchNorm's running statistics) mean what they mean under DDP: rank 0's. FSDP shards parameters
      only, and each process updates its own copy of the buffers from its own batches; DDP broadcasts rank 0's
      before each forward, so every process evaluates the same model, the one model.safetensors holds. Here every
      process takes rank 0's buffers before its first evaluation forward after training, and before each
      state_dict() (else save_state's DCP files keep each buffer from whichever process DCP's planner picks, and a
      resume would differ from the uninterrupted run). Collective, as evaluating and saving are.
    - its process groups end with the run: torch's DTensor caches (sharding propagation, redistribution plans, mesh
      topology) keep the device mesh, and with it the gloo group, alive after end_training, and a gloo worker
      thread alive at exit can abort it (docs/migration_guide.md, "Ending a run cleanly"). At exit every mesh lets go
      of its groups, which are then freed.
    """
    import atexit

    import torch
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    keep_rank_0_buffers(model)
    if not all(hasattr(parameter.device_mesh, "_pg_registry") for parameter in model.parameters()):
        raise RuntimeError(f"utils/run/fsdp.py: torch {torch.__version__}'s DeviceMesh has no _pg_registry to release")
    atexit.register(_release_process_groups)  # runs before the interpreter tears down the threads


def keep_rank_0_buffers(model) -> None:
    """Every process takes rank 0's buffers (BatchNorm's running statistics) before its first evaluation forward after
    training and before each state_dict(), as DDP's broadcast before each forward would have given it: where each
    process updates its own copy (FSDP, DeepSpeed), every process then evaluates and saves the one model."""
    import torch

    in_sync = {"buffers": False}

    def broadcast_from_rank_0():
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)
        in_sync["buffers"] = True

    def before_forward(module, inputs):
        if module.training:
            in_sync["buffers"] = False
        elif not in_sync["buffers"]:
            broadcast_from_rank_0()

    model.register_forward_pre_hook(before_forward)
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: broadcast_from_rank_0())


def _release_process_groups() -> None:
    """Make every DeviceMesh let go of its process groups (torch's DTensor caches keep meshes, and copies of them,
    alive past end_training), so that the groups are freed and their worker threads joined now."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    # issubclass(type(o)): isinstance would also read o.__class__, which torch's deprecated
    # torch.distributed.reduce_op answers with a FutureWarning on every process
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        mesh._pg_registry.clear()
    gc.collect()


def parameter_bytes(model) -> tuple:
    """(bytes of the parameters this process holds, bytes of the whole model's): under FSDP a process holds its
    shard of each parameter (a DTensor's local tensor), under DeepSpeed ZeRO-3 its partition (`ds_tensor`, padded to
    N equal parts; the parameter itself is an empty placeholder outside a forward), each about 1/N of the model;
    under DDP and ZeRO-2 the whole model."""
    from torch.distributed.tensor import DTensor

    def held(p):
        if hasattr(p, "ds_tensor"):
            return p.ds_tensor.nbytes
        return p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes

    local = sum(held(p) for p in model.parameters())
    return local, sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
