"""DeepSpeed ZeRO through Accelerate's DeepSpeed plugin: on GPUs, and on CPU processes (a gloo group) with --cpu.

Accelerate 1.15 builds the DeepSpeed plugin only when the Accelerator is not given cpu=True (accelerator.py keeps
`deepspeed_plugins` only without it), and without a GPU it chooses no process-group backend, so each CPU process sees
a world of one and DeepSpeed's batch check stops ("train_batch_size ... != ... * 1 * 2"). A gloo group named in
InitProcessGroupKwargs is all DeepSpeed's CPU accelerator needs (it falls back to gloo without oneCCL). After that,
everything is Accelerate's and DeepSpeed's own code: prepare builds the DeepSpeedEngine, backward steps it (the
prepared optimizer's step and zero_grad do nothing), clip_grad_norm_ reads the norm DeepSpeed clipped with.
"""

import atexit
from datetime import timedelta

from ..errors import UserError
from ..launch.launch_checks import deepspeed_launch


def accelerator_cpu(cpu: bool) -> bool:
    """The Accelerator's cpu argument for the scripts' --cpu: under a DeepSpeed launch False, since cpu=True would make
    Accelerate drop DeepSpeed (the processes then run on the CPU over the gloo group of process_group_kwargs)."""
    return cpu and not deepspeed_launch()


def process_group_kwargs(cpu: bool, timeout_seconds: float):
    """The Accelerator's InitProcessGroupKwargs for --cpu and --ddp_timeout: under a DeepSpeed launch with --cpu a gloo
    group of the CPU processes (Accelerate chooses no backend without a GPU: each process would be a world of one);
    otherwise the backend Accelerate picks."""
    from accelerate.utils import InitProcessGroupKwargs

    backend = {"backend": "gloo"} if cpu and deepspeed_launch() else {}
    return InitProcessGroupKwargs(**backend, timeout=timedelta(seconds=timeout_seconds))


def set_gradient_accumulation(accelerator, gradient_accumulation_steps: int, batch_size: int, max_grad_norm) -> None:
    """Before `prepare`: the Accelerator accumulates gradient_accumulation_steps batches (as resumed or fitted), and
    under DeepSpeed its config trains what the script's flags say. DeepSpeed owns the batch,
    the accumulation and the clipping (backward steps its engine), so each of its values left "auto" becomes the
    flag's: --batch_size (train_micro_batch_size_per_gpu), --gradient_accumulation_steps, --max_grad_norm
    (gradient_clipping, 0 for none; Accelerate would fill "auto" with 1.0 and clip a run that asked for no clipping).
    A value the launch set that differs, or an optimizer or scheduler block (the scripts build their own), stops here in
    one line: Accelerate would train DeepSpeed's value with a warning, or stop in a traceback."""
    from accelerate.utils import DistributedType

    accelerator.gradient_accumulation_steps = gradient_accumulation_steps
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    for block, flags in (("optimizer", "--learning_rate and the script's AdamW"), ("scheduler", "--lr_scheduler_type")):
        if block in config:
            raise UserError(f"the DeepSpeed config has its own {block} (a \"{block}\" block), but the scripts build "
                            f"theirs from {flags}: remove the block from the DeepSpeed config")
    wanted = {"train_micro_batch_size_per_gpu": (batch_size, "--batch_size"),
              "gradient_accumulation_steps": (gradient_accumulation_steps, "--gradient_accumulation_steps"),
              "gradient_clipping": (max_grad_norm or 0.0, "--max_grad_norm")}
    for key, (value, flag) in wanted.items():
        launched = config.get(key, "auto")
        if launched == "auto":
            config[key] = value
        elif float(launched) != float(value):
            raise UserError(f"the DeepSpeed launch sets {key} {launched}, but the script's {flag} is "
                            f"{value or 'unset'}: give both the same value, or let the script's flag decide (leave "
                            f"{key} out of accelerate launch's flags and config; \"auto\" in a DeepSpeed config file)")
    train_batch_size = batch_size * gradient_accumulation_steps * accelerator.num_processes
    if config.get("train_batch_size", "auto") not in ("auto", train_batch_size):
        raise UserError(f"the DeepSpeed config sets train_batch_size {config['train_batch_size']}, but --batch_size "
                        f"{batch_size} x --gradient_accumulation_steps {gradient_accumulation_steps} x "
                        f"{accelerator.num_processes} processes is {train_batch_size}: set it to \"auto\"")


def model_to_save(accelerator, model):
    """What `accelerator.save_model` gathers the whole weights from: the plain model (no DDP or compile wrapper), but
    under DeepSpeed the engine itself, whose ZeRO-3 partitions only it can gather (Accelerate's get_state_dict asks the
    engine; the plain module under ZeRO-3 holds empty placeholders)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return model
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def load_whole_weights_under_zero3(plain_model, weights: dict) -> None:
    """Collective: whole weights (a model.safetensors) into a ZeRO-3 model, whose plain module holds empty
    placeholders for the partitions each process keeps: gathered, loaded on every process (strictly, so a wrong file
    fails everywhere), partitioned again from rank 0's (DeepSpeed's own way to change ZeRO-3 parameters)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(plain_model.parameters()), modifier_rank=0):
        plain_model.load_state_dict(weights)


def all_in_model_dtype(accelerator, model) -> None:
    """Under DeepSpeed's fp16 or bf16, the model's floating-point buffers and inputs in the dtype DeepSpeed cast its
    parameters to. DeepSpeed casts the parameters alone (no autocast over fp32 weights, as Accelerate's own mixed
    precision does), so float32 images stop at the first convolution ("Input type (float) and bias type
    (c10::BFloat16) should be the same"), and BatchNorm's float32 running statistics beside its bf16 weight and bias
    ("expected scalar type BFloat16 but found Float"). Inputs are cast before every forward, as the Hugging Face
    Trainer casts them under DeepSpeed. Nothing to do without DeepSpeed or in fp32."""
    import torch
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    dtype = torch.bfloat16 if model.bfloat16_enabled() else torch.float16 if model.fp16_enabled() else None
    if dtype is None:
        return
    plain_model = accelerator.unwrap_model(model)
    for buffer in plain_model.buffers():
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype)  # in place of the tensor: the same buffer object, as hooks hold it

    def cast_inputs(module, inputs):
        return tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)

    plain_model.register_forward_pre_hook(cast_inputs)


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


def zero3(accelerator) -> bool:
    """DeepSpeed ZeRO stage 3: each process holds a partition of every parameter, as under FSDP2."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == "DEEPSPEED" else None
    return plugin is not None and plugin.zero_stage == 3
