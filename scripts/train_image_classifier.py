#!/usr/bin/env python
"""Train a torchvision image classifier (ResNet-18/50, ...) on an image folder or Hub dataset with Accelerate.

    accelerate launch scripts/train_image_classifier.py --data_dir flower_photos        # DIR/<class>/*.jpg
    accelerate launch scripts/train_image_classifier.py --data_dir imagenet --model resnet50 --epochs 90
    accelerate launch scripts/train_image_classifier.py --dataset uoft-cs/cifar10 --image_size 32

The same file runs on a CPU, one GPU, all GPUs of a node or several nodes: the launch
config decides. Its marks (`# [collective]`, `# shared:`): README.md, "Marks in the scripts".

When the training set does not divide into global batches (--batch_size x processes), an epoch trains the whole
global batches only and leaves the rest out (drop_last: a batch of one image would break BatchNorm): 52 images at
--batch_size 8 train 48 on 2 or 3 processes, each once, and 4 never, other ones each epoch
(docs/migration_guide.md, "Uneven data"; tests/test_sample_coverage.py checks it by sample id).
"""

import logging
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed.nn  # imported before the process group: see the end of main()
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.data.device_decoding import (
    EncodedImages,
    collate_encoded,
    decoding_first,
    device_decoding_refusal,
)
from utils.data.device_input import device_normaliser, model_input_dtype
from utils.data.image_dataset import TransformedImages, collate_images
from utils.data.image_loading import load_image_datasets
from utils.data.mixing import MixedImages
from utils.data.recipes import default_hflip, eval_transform, resolve_augmentation, train_transform
from utils.data.streaming import (
    StreamedImages,
    StreamLoader,
    epoch_batches,
    load_image_stream,
    stream_for_this_process,
)
from utils.errors import UserError, exit_with_error
from utils.launch.flags import (
    add_lr_scheduler_flags,
    add_model_ema_flags,
    add_step_flags,
    build_parser,
    check_flag_combinations,
    check_streaming_flags,
    default_num_workers,
    fraction,
    label_smoothing,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    tracker_config,
)
from utils.launch.launch_checks import check_accelerator, check_enough_devices
from utils.metrics import load_metric
from utils.models import build_model, stem_of, use_gradient_checkpointing
from utils.report.meters import GradNorms, RunningLoss, ThroughputMeter
from utils.report.profiling import StepProfiler
from utils.report.results import report_evaluation, report_run
from utils.run.batch_size import fit_batch_size
from utils.run.checkpoints import save_checkpoint, step_checkpoint_due
from utils.run.ddp_diagnosis import unused_parameters_named
from utils.run.deepspeed import (
    accelerator_cpu,
    model_to_save,
    process_group_kwargs,
    set_gradient_accumulation,
)
from utils.run.ema import build_model_ema, evaluate_model_ema, save_model_ema, update_model_ema
from utils.run.fsdp import keep_batchnorm_in_fp32, shard_on_cpu
from utils.run.group_holders import import_deepspeed_if_installed
from utils.run.hangs import collective_timeouts_named
from utils.run.optim import DEFAULT_LEARNING_RATE, DEFAULT_WEIGHT_DECAY, build_lr_scheduler, build_optimizer
from utils.run.reproducibility import make_deterministic
from utils.run.resume import (
    accumulation_keeping,
    batches_to_skip,
    epochs_to_train,
    load_checkpoint,
    resume_point,
)
from utils.run.run_folder import (
    RunFolder,
    check_output_dir,
    nothing_left_to_train,
    one_training_at_a_time,
    start_output_dir,
)
from utils.run.signals import (
    StopSignal,
    exit_interrupted,
    ignore_stop_signals,
    stop_requested,
    stop_with_the_launcher,
)
from utils.run.steps import StepPlan, TrainingEvents, after_step, at_epoch_end, gather_running_loss

logger = get_logger(__name__)  # logs on the main process only, unless asked otherwise


def parse_args(argv=None):
    parser = build_parser(__doc__.splitlines()[0], epochs=10, batch_size=64, learning_rate=0.1)
    parser.set_defaults(learning_rate=None)  # depends on --optimizer, see DEFAULT_LEARNING_RATE
    add_lr_scheduler_flags(parser, lr_scheduler_type="cosine", warmup_epochs=1.0)
    add_model_ema_flags(parser)
    add_step_flags(parser)

    data = parser.add_argument_group("image data (one of --data_dir, --dataset)")
    source = data.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data_dir", help="image folder: DIR/<class>/* (split by --val_split), or DIR/train/<class>/* + DIR/val/..."
    )
    source.add_argument("--dataset", help="Hugging Face Hub dataset with image and label columns, e.g. uoft-cs/cifar10")
    data.add_argument("--dataset_config", default=None, help="configuration name of --dataset, if it has several")
    data.add_argument("--streaming", action="store_true",
                      help="read the training split as a stream (datasets' IterableDataset), never all of it in memory "
                           "or a cache: --dataset (a Hub name, or a folder of parquet or webdataset .tar shards) or "
                           "--data_dir with a val split; needs --max_steps. docs/image_classification.md, Streaming")
    data.add_argument("--image_column", default=None, help="default: the dataset's Image column")
    data.add_argument("--label_column", default=None, help="default: the dataset's ClassLabel column")
    data.add_argument("--val_split", type=fraction, default=0.2, help="fraction held out when there is no val split")
    data.add_argument("--image_size", type=positive_int, default=224, help="side of the square crops fed to the model")
    data.add_argument(
        "--augmentation", choices=["auto", "imagenet", "small", "none"], default="auto",
        help="training recipe; auto: imagenet (random resized crops) from 128 px up, below it small (whole image, "
             "mild scale jitter, padded random crop); none: resize only. Evaluation crops only in the imagenet recipe",
    )
    flips = data.add_mutually_exclusive_group()
    flips.add_argument("--hflip", action="store_true", default=None,
                       help="random horizontal flips; default: on in the imagenet recipe (photos), off otherwise")
    flips.add_argument("--no_hflip", dest="hflip", action="store_false",
                       help="no flips, where orientation matters: digits, text, icons")
    data.add_argument("--num_workers", type=non_negative_int, default=None,
                      help="DataLoader processes per process (decode, augment); default: the CPUs this process may use "
                           "divided by the training processes on this machine, at most 4")
    data.add_argument("--decode_on_device", action="store_true",
                      help="for nodes short of CPU cores: the workers read the JPEGs and draw their crops and flips, "
                           "the GPU decodes them (nvJPEG), crops, resizes and flips. CUDA only; --augmentation "
                           "imagenet or none. docs/image_classification.md, Decoding on the GPU")

    model = parser.add_argument_group("model and optimisation")
    model.add_argument("--model", default="resnet18", help="torchvision model name, or module:function(num_classes)")
    model.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    model.add_argument(
        "--stem", choices=["auto", "imagenet", "small"], default="auto",
        help="ResNets' first layers; small: 3x3 stride-1 conv, no max-pool (fresh weights); auto: small up to 64 px "
             "unless --pretrained",
    )
    model.add_argument(
        "--optimizer", choices=["sgd", "adamw"], default="sgd",
        help="sgd (momentum): lr 0.1, weight decay 1e-4; adamw: lr 1e-3, weight decay 0.05 (unless given)",
    )
    model.add_argument("--momentum", type=non_negative_float, default=0.9, help="SGD momentum")
    model.add_argument("--weight_decay", type=non_negative_float, default=None, help="default depends on --optimizer")
    model.add_argument("--label_smoothing", type=label_smoothing, default=0.0, help="0.1 in torchvision's recipes")
    model.add_argument("--mixup_alpha", type=non_negative_float, default=0.0,
                       help="Mixup: a training image blended with another, lam ~ Beta(alpha, alpha) of it, and their "
                            "classes alike; 0: off (timm's recipes: 0.8)")
    model.add_argument("--cutmix_alpha", type=non_negative_float, default=0.0,
                       help="CutMix: a box of another training image pasted in, leaving lam ~ Beta(alpha, alpha) of "
                            "the area, the classes weighted by area; 0: off (timm's recipes: 1.0). With both on, each "
                            "mixed image gets one of the two, half and half")
    model.add_argument("--mix_prob", type=probability, default=None,
                       help="the probability that a training image is mixed (--mixup_alpha, --cutmix_alpha); default 1")

    dist = parser.add_argument_group("distributed and performance switches")
    dist.add_argument("--sync_bn", action="store_true", help="BatchNorm statistics over the global batch (GPUs only)")
    dist.add_argument("--find_unused_parameters", action="store_true", help="for parameters without gradient (slower)")
    dist.add_argument(
        "--ddp_comm_hook", choices=["fp16", "bf16", "power_sgd"], default=None,
        help="compress gradients for the all-reduce: fp16/bf16 halve the bytes; power_sgd is low-rank after 1000 steps",
    )
    dist.add_argument("--channels_last", action="store_true", help="NHWC memory format: faster convolutions on GPUs")
    dist.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    dist.add_argument("--gradient_checkpointing", action="store_true",
                      help="ResNets and ViTs: keep each block's input only and run the block again in the backward "
                           "pass: about half the activation memory for a third more compute, the same gradients")
    args = parser.parse_args(argv)
    check_flag_combinations(parser, args)
    if args.streaming:
        check_streaming_flags(parser, args)
    if args.num_workers is None:  # e.g. 2 on a 2-core laptop, 1 each for 2 processes there, 4 on a GPU node
        args.num_workers = default_num_workers()
    if args.mixup_alpha or args.cutmix_alpha:
        args.mix_prob = 1.0 if args.mix_prob is None else args.mix_prob
    elif args.mix_prob is not None:
        parser.error("--mix_prob says how often --mixup_alpha and --cutmix_alpha mix: set one of them above 0")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATE[args.optimizer]
    if args.weight_decay is None:
        args.weight_decay = DEFAULT_WEIGHT_DECAY[args.optimizer]
    args.augmentation = resolve_augmentation(args.augmentation, args.image_size)
    if args.hflip is None:
        args.hflip = default_hflip(args.augmentation)
    if args.decode_on_device:
        check_decode_on_device_flags(parser, args)
    return args


def check_decode_on_device_flags(parser, args) -> None:
    """--decode_on_device: the GPU does a region resized and flips, on JPEG bytes the workers read whole."""
    if args.augmentation == "small":
        parser.error("--decode_on_device does the imagenet and none recipes on the GPU, not small (the recipe below "
                     "128 px): pass --augmentation imagenet or none, or drop --decode_on_device")
    for flag, value in (("streaming", args.streaming), ("mixup_alpha", args.mixup_alpha),
                        ("cutmix_alpha", args.cutmix_alpha), ("auto_find_batch_size", args.auto_find_batch_size)):
        if value:
            parser.error(f"--{flag} does not work with --decode_on_device (it needs the images decoded in the "
                         f"workers); drop one of them")


def describe_run(args) -> dict:
    """What defines this run and cannot change when it resumes (--epochs, --max_steps and the process count can):
    recorded as run.json with its checkpoints and compared on --resume_from_checkpoint (utils/run/run_folder.py)."""
    return {
        "script": Path(__file__).name,
        "model": args.model, "pretrained": args.pretrained, "stem": args.stem,
        "data": str(Path(args.data_dir).resolve()) if args.data_dir else args.dataset,
        "dataset_config": args.dataset_config, "image_column": args.image_column, "label_column": args.label_column,
        "val_split": args.val_split, "max_train_samples": args.max_train_samples,
        "image_size": args.image_size, "augmentation": args.augmentation, "hflip": args.hflip,
        "seed": args.seed,
        # a resume restores the learning rate, momentum and weight decay with the optimizer state
        "optimizer": args.optimizer, "learning_rate": args.learning_rate, "momentum": args.momentum,
        "weight_decay": args.weight_decay, "label_smoothing": args.label_smoothing,
        "lr_scheduler_type": args.lr_scheduler_type, "warmup_steps": args.warmup_steps,
        "warmup_epochs": args.warmup_epochs,
        # --model_ema: its average is part of the run (and of its checkpoints); no keys without it
        **({"model_ema_decay": args.model_ema_decay, "model_ema_warmup": args.model_ema_warmup}
           if args.model_ema else {}),
        # --mixup_alpha, --cutmix_alpha, --mix_prob: the images trained on. None without mixing, as the keys read in a
        # run.json saved before they existed, so that its checkpoints resume, and no resume adds or drops mixing
        **{key: getattr(args, key) if args.mixup_alpha or args.cutmix_alpha else None
           for key in ("mixup_alpha", "cutmix_alpha", "mix_prob")},
        # --streaming: the worker count decides which worker reads which shards, so the order of the batches
        **({"streaming": True, "num_workers": args.num_workers} if args.streaming else {}),
    }


def build_datasets(args, accelerator, progress):
    """The training and evaluation images (decoded later, in the DataLoader workers, or on the GPU with
    --decode_on_device) and the class names. `accelerator`: its device, for --decode_on_device; with `progress` (the
    process's index and count, the checkpoint's), for --streaming."""
    if args.decode_on_device and (refusal := device_decoding_refusal(accelerator.device)):
        raise UserError(refusal)  # a CUDA device and torchvision's batched nvJPEG decode, before any data is read
    if args.streaming:  # the training images as this process's part of a stream
        return build_stream_datasets(args, accelerator, progress)
    train_split, eval_split, image_column, label_column, class_names = load_image_datasets(
        args.data_dir, args.dataset, args.dataset_config, args.image_column, args.label_column, args.val_split
    )
    if args.max_train_samples is not None:
        train_split = train_split.select(range(min(args.max_train_samples, len(train_split))))
    if args.max_eval_samples is not None:
        eval_split = eval_split.select(range(min(args.max_eval_samples, len(eval_split))))
    columns = (image_column, label_column)
    train_transforms = train_transform(args.image_size, args.augmentation, args.hflip)  # --augmentation, --hflip
    # --decode_on_device: the workers hand over JPEG bytes and their crops and flips (utils/data/device_decoding.py)
    images = EncodedImages if args.decode_on_device else TransformedImages
    train_dataset = images(train_split, train_transforms, *columns, seed=args.seed)
    if args.mixup_alpha or args.cutmix_alpha:  # mixed in the workers too, each pair chosen by (seed, epoch, index)
        train_dataset = MixedImages(train_dataset, len(class_names), args.mixup_alpha, args.cutmix_alpha,
                                    args.mix_prob, seed=args.seed)
    eval_dataset = images(eval_split, eval_transform(args.image_size, args.augmentation), *columns)
    return train_dataset, eval_dataset, class_names


def build_stream_datasets(args, accelerator, progress):
    """--streaming: this process's part of the training stream, shuffled per epoch (utils/data/streaming.py), and the
    evaluation split in memory (map-style: evaluated exactly as without --streaming)."""
    num_processes = accelerator.num_processes  # they split the stream: a checkpoint's epoch goes on
    if progress.global_step and progress.num_processes != num_processes:  # on as many processes only
        raise UserError(f"a --streaming run resumes on the process count that saved its checkpoint "
                        f"({progress.num_processes}, not {num_processes}): it splits the stream")
    train_stream, eval_split, image_column, label_column, class_names, label_ids = load_image_stream(
        args.data_dir, args.dataset, args.dataset_config, args.image_column, args.label_column)
    train_stream = stream_for_this_process(train_stream, args.seed, accelerator.process_index, num_processes)
    train_transforms = train_transform(args.image_size, args.augmentation, args.hflip)  # --augmentation, --hflip
    train_dataset = StreamedImages(train_stream, train_transforms, image_column, label_column, args.seed, label_ids)
    eval_transforms = eval_transform(args.image_size, args.augmentation)
    eval_dataset = TransformedImages(eval_split, eval_transforms, image_column, label_column)
    return train_dataset, eval_dataset, class_names


def build_loaders(args, accelerator, train_dataset, eval_dataset) -> tuple:
    """The training and evaluation DataLoaders: --batch_size (per process); --num_workers processes that stay up between
    epochs and ignore --save_on_signal's signals (the training processes handle them); uint8 batches stacked
    channels-last, as the workers resize them (collate_images); pinned memory for faster copies to a GPU. drop_last: a
    last batch of one image would break BatchNorm in training. A stream's training loader is this process's own."""
    pin_memory = accelerator.device.type == "cuda"
    options = {"batch_size": args.batch_size, "num_workers": args.num_workers,
               "collate_fn": collate_encoded if args.decode_on_device else collate_images,
               "persistent_workers": args.num_workers > 0, "pin_memory": pin_memory,
               "worker_init_fn": ignore_stop_signals if args.save_on_signal else None}
    if args.streaming:
        train_dataloader = StreamLoader(DataLoader(train_dataset, drop_last=True, **options))
    else:
        train_dataloader = DataLoader(train_dataset, shuffle=True, drop_last=True, **options)
    return train_dataloader, DataLoader(eval_dataset, **options)


def step_plan(args, progress, train_dataset) -> StepPlan:
    """--max_steps (else --epochs), --eval_steps, --logging_steps, --early_stopping_patience of --metric_for_best, in
    epochs of whole global batches only, the same number on any number of processes (so that a run resumed on another
    number keeps its schedule); the rest of the shuffle is left out. A stream's epoch ends where a process's part runs
    out (utils/data/streaming.py), unknown beforehand: --max_steps stands for its length."""
    steps_per_epoch = args.max_steps if args.streaming else progress.steps_per_epoch(
        len(train_dataset), args.batch_size, whole_global_batches=True)
    return StepPlan.of(steps_per_epoch, args.epochs, args.max_steps, args.eval_steps, args.logging_steps,
                       args.early_stopping_patience, args.metric_for_best, args.streaming)


def build_model_input(args, accelerator):
    """What the training loop and evaluation apply to each batch: the uint8 batch cast to the autocast dtype,
    normalised, channels-last with --channels_last, in one copy on the device; with --decode_on_device its JPEGs
    decoded by nvJPEG, cropped, resized and flipped there first (utils/data/device_decoding.py)."""
    model_input = device_normaliser(model_input_dtype(accelerator.mixed_precision), args.channels_last)
    if args.decode_on_device:
        return decoding_first(model_input, accelerator.device, args.image_size)
    return model_input


def ddp_options(args):
    """--find_unused_parameters and --ddp_comm_hook, for the DistributedDataParallel that Accelerate builds."""
    return DistributedDataParallelKwargs(
        find_unused_parameters=args.find_unused_parameters,
        comm_hook=DDPCommunicationHookType(args.ddp_comm_hook or "no"),
    )


def build_image_model(args, num_classes: int, device):
    """--model with --pretrained weights and --stem, changed as --gradient_checkpointing, --sync_bn and --channels_last
    ask: before DDP wraps it."""
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync_bn needs GPUs: PyTorch's SyncBatchNorm only works with GPU modules; drop it on the CPU")
    model = build_model(args.model, num_classes, args.pretrained, args.image_size, args.stem)
    if args.gradient_checkpointing:
        use_gradient_checkpointing(model, args.model)
    if args.sync_bn:  # BatchNorm statistics from the global batch, not from each GPU's slice
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def describe_model(args, accelerator, model, class_names, train_dataset) -> dict:
    """What predict.py needs to rebuild the model, and the recipe --augmentation auto chose: for results.json."""
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)  # no DDP or compile wrapper
    return {
        "model": args.model, "image_size": args.image_size, "augmentation": args.augmentation, "hflip": args.hflip,
        "stem": stem_of(plain_model),  # ResNets: small or imagenet
        "gradient_checkpointing": args.gradient_checkpointing,
        "class_names": class_names,  # class id i is class_names[i]
        "train_size": None if args.streaming else len(train_dataset),  # a stream's is unknown
    }


def evaluate(accelerator, model, dataloader, metric, model_input, ema=None):
    """Top-1/top-5 accuracy and mean loss over exactly the eval set, whatever the number of processes; with
    --model_ema also those of the moving average `ema`, evaluated the same way, as eval_ema_accuracy, ..."""
    model.eval()
    per_sample_losses = []
    for images, labels in dataloader:
        with torch.no_grad():
            logits = model(model_input(images))
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        top_k = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        # [collective] every process's batch, without the samples repeated to give all processes equally many
        top_k, labels, losses = accelerator.gather_for_metrics((top_k, labels, losses))
        metric.add_batch(predictions=top_k, references=labels)
        per_sample_losses.append(losses)
    losses = torch.cat(per_sample_losses).double()
    scores = metric.compute()
    scores = {
        "eval_accuracy": scores["accuracy"],
        "eval_top5_accuracy": scores["top_k_accuracy"],  # k = min(5, number of classes)
        "eval_loss": losses.mean().item(),
        "eval_samples": losses.numel(),
    }
    # [collective] --model_ema: this evaluation of the moving average too (utils/run/ema.py)
    return scores | evaluate_model_ema(accelerator, ema, evaluate, dataloader, metric, model_input)


def main(args):
    # shared: start-up
    stop_signal = StopSignal() if args.save_on_signal else None  # first: a signal during start-up counts too
    check_enough_devices(args.cpu)
    make_deterministic(args.deterministic)

    accelerator = Accelerator(
        # --report_to: TensorBoard, MLflow, W&B; project_dir: where TensorBoard writes
        # --cpu under a DeepSpeed launch: not cpu=True (Accelerate would drop DeepSpeed) but a gloo group of the CPU
        # processes (utils/run/deepspeed.py)
        cpu=accelerator_cpu(args.cpu), mixed_precision=args.mixed_precision, log_with=args.report_to or None,
        project_dir=args.output_dir, gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Seedable sampler: epoch e's shuffle depends only on (seed, e), so a resumed run sees the same
        # batches. non_blocking: host-to-GPU copies of the pinned batches overlap with compute.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        # step_scheduler_with_optimizer: we step it once per optimizer step (by default: once per process)
        # dynamo_backend None: as the launch config says
        step_scheduler_with_optimizer=False, dynamo_backend="inductor" if args.compile else None,
        # options of what Accelerate builds: DistributedDataParallel (see ddp_options) and the process group
        kwargs_handlers=[ddp_options(args), process_group_kwargs(args.cpu, args.ddp_timeout)])
    # shared: after the Accelerator
    check_accelerator(accelerator)
    shard_on_cpu(accelerator)  # an FSDP launch with --cpu: FSDP2 over the CPU processes, as on GPUs (utils/run/fsdp.py)
    logger.info(accelerator.state)
    set_seed(args.seed)  # same seed on every process: identical initial weights

    # shared: resume or not
    checkpoint, progress = resume_point(args.resume_from_checkpoint, args.output_dir, args.eval_only)
    folder = RunFolder(args.output_dir, describe_run(args), args.epochs, args.max_steps, args.early_stopping_patience,
                       args.overwrite_output_dir, args.eval_only)
    check_output_dir(folder, checkpoint, args.resume_from_checkpoint)  # never two runs in one --output_dir
    resuming = checkpoint is not None and not args.eval_only
    if nothing_left_to_train(folder, progress, checkpoint, args.metric_for_best):
        accelerator.end_training()
        return 0
    # a resume keeps the checkpoint's global batch (on any number of processes): its schedule and optimizer state
    args.gradient_accumulation_steps = accumulation_keeping(
        progress if resuming else None, accelerator.num_processes, args.batch_size, args.gradient_accumulation_steps)

    # [collective] the main process fills the caches first (datasets, --pretrained weights, the metric's module); then
    # the others read them
    with accelerator.main_process_first():
        train_dataset, eval_dataset, class_names = build_datasets(args, accelerator, progress)
        model = build_image_model(args, len(class_names), accelerator.device)  # the device: for --sync_bn's check
        metric = load_metric("topk_accuracy")
    keep_batchnorm_in_fp32(accelerator, model)  # FSDP + bf16/fp16: BatchNorm in fp32, as FSDP1 did (utils/run/fsdp.py)
    optimizer = build_optimizer(model, args.optimizer, args.learning_rate, args.weight_decay, args.momentum)
    # the workers hand over uint8 batches (a quarter of float32's bytes to copy); the device normalises them
    model_input = build_model_input(args, accelerator)

    # shared: the global batch
    if args.auto_find_batch_size:
        args.batch_size, args.gradient_accumulation_steps = fit_batch_size(  # [collective]
            accelerator, model, optimizer, train_dataset, args.batch_size, args.gradient_accumulation_steps,
            progress if resuming else None, model_input)
    # as resumed or fitted; under DeepSpeed, which owns the batch, the accumulation and the clipping, its config's too
    set_gradient_accumulation(accelerator, args.gradient_accumulation_steps, args.batch_size, args.max_grad_norm)
    progress = progress.with_batch(accelerator.num_processes, args.batch_size, args.gradient_accumulation_steps)

    train_dataloader, eval_dataloader = build_loaders(args, accelerator, train_dataset, eval_dataset)
    plan = step_plan(args, progress, train_dataset)
    lr_scheduler = build_lr_scheduler(optimizer, args.lr_scheduler_type, plan, args.warmup_steps, args.warmup_epochs)
    # shards the dataloaders per process and moves batches to the device; DDP on several
    # processes, mixed precision (autocast; fp16: a GradScaler), all saved by save_state.
    train_dataloader, eval_dataloader, model, optimizer, lr_scheduler = accelerator.prepare(
        train_dataloader, eval_dataloader, model, optimizer, lr_scheduler)

    # shared: resume, then the first write
    # --model_ema: a moving average of the plain weights on every process, kept in each checkpoint (utils/run/ema.py)
    ema = build_model_ema(accelerator, model, checkpoint, plan.max_steps, args.model_ema, args.model_ema_decay,
                          args.model_ema_warmup)
    # [collective] load_state, if there is a checkpoint
    load_checkpoint(accelerator, model, checkpoint, progress, args.resume_from_checkpoint, args.output_dir)
    # load_state restored the saving run's count of batches in the accumulation cycle; a checkpoint is
    # always saved at the end of a cycle, so the next one starts afresh
    accelerator.step = 0
    if accelerator.is_main_process:  # only now, with data, model and checkpoint valid, does it write
        # --overwrite_output_dir deletes the old run first; then run.json
        start_output_dir(folder, progress, args.batch_size, args.gradient_accumulation_steps)
    accelerator.init_trackers(Path(__file__).stem, config=tracker_config(args))
    results = {"train_loss": None}  # the last epoch's training metrics and the last evaluation's
    meter, running_loss = ThroughputMeter(accelerator.device), RunningLoss(accelerator.device)
    grad_norms = GradNorms(accelerator.device, args.max_grad_norm)  # the norms before --max_grad_norm clips them
    steps_bar = tqdm(total=plan.max_steps, initial=progress.global_step, disable=not accelerator.is_local_main_process)
    stopping = False  # --save_on_signal: a signal arrived; every process stops after the same step

    # the logs and evaluations that --logging_steps and --eval_steps ask for between steps (utils/run/steps.py)
    evaluation = partial(evaluate, accelerator, model, eval_dataloader, metric, model_input, ema)
    events = TrainingEvents(plan, evaluation, model, ema, args.output_dir, results, running_loss, meter, lr_scheduler)

    # the progress bar is closed when training ends, also by an error
    with (collective_timeouts_named(args.ddp_timeout, progress), steps_bar,
          StepProfiler(args.profile, args.output_dir, accelerator) as profiler):
        # [collective] --early_stopping_patience
        for epoch in epochs_to_train(accelerator, progress, plan, args.eval_only):
            model.train()
            train_dataloader.set_epoch(epoch)
            train_dataset.set_epoch(epoch)  # new augmentations per epoch, reproducibly
            skip = batches_to_skip(progress, accelerator.num_processes, args.batch_size)
            # [collective] a loader that starts after the batches the checkpoint's run trained in this epoch; a
            # stream's ends where a process's part does, on every process (utils/data/streaming.py)
            batches = epoch_batches(accelerator, train_dataloader, skip, args.gradient_accumulation_steps)
            meter.start()
            for images, labels in batches:
                # whole global batches only (see above); --max_steps done or early stopping: the epoch ends here
                if progress.global_step == (epoch + 1) * plan.steps_per_epoch or plan.training_over(progress):
                    break
                images = model_input(images)
                # accumulate: no DDP all-reduce on accumulation steps; DDP's unused-parameter error named
                with accelerator.accumulate(model), unused_parameters_named(accelerator, model, images):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
                    # shared: the optimizer step
                    accelerator.backward(loss)
                    if args.max_grad_norm is not None and accelerator.sync_gradients:
                        # clip_grad_norm_ unscales fp16 gradients first (and is FSDP-aware)
                        grad_norms.add(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                    optimizer.step()  # skipped on accumulation steps and on fp16 overflow
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()
                        update_model_ema(ema)
                    optimizer.zero_grad()
                # shared: after each batch
                running_loss.add(loss, logits, labels, step=progress.global_step + 1)
                meter.batch_done(len(labels))
                profiler.step()
                if accelerator.sync_gradients:  # True at the end of each accumulation cycle
                    progress.global_step += 1
                    progress.optimizer_steps_skipped += accelerator.optimizer_step_was_skipped
                    steps_bar.update(1)
                    # [collective] Accelerate's set_trigger/check_trigger: all processes stop after the same step
                    stopping = args.save_on_signal and stop_requested(accelerator, stop_signal)
                    # [collective] the logs and evaluation due after this step: before its checkpoint, which holds them
                    after_step(accelerator, events, progress, epoch)
                    if stopping or step_checkpoint_due(args.checkpointing_steps, progress.global_step):
                        with meter.paused():  # saving is not training time
                            gather_running_loss(accelerator, running_loss, progress, args.output_dir)  # [collective]
                            saved = save_checkpoint(accelerator, args.output_dir, f"step_{progress.global_step}",
                                                    progress, args.checkpoints_total_limit)  # [collective]
                    if stopping:
                        logger.info(f"Stopped by a signal after step {progress.global_step}: saved {saved}; continue "
                                    f"with --resume_from_checkpoint latest")
                        break
            meter.pause()
            if stopping:
                break

            gather_running_loss(accelerator, running_loss, progress, args.output_dir)  # [collective]
            # [collective] the epoch's exact mean training loss and the evaluation due, logged, best/ kept
            at_epoch_end(accelerator, events, progress, epoch, **progress.end_epoch(), **grad_norms.take())
            if args.checkpointing_steps == "epoch":
                # [collective] every process writes its part
                save_checkpoint(accelerator, args.output_dir, f"epoch_{epoch}", progress, args.checkpoints_total_limit)

    if args.eval_only:
        results.update(evaluate(accelerator, model, eval_dataloader, metric, model_input, ema))  # [collective]
    results.update(describe_model(args, accelerator, model, class_names, train_dataset))
    # shared: the end
    if not stopping:
        accelerator.wait_for_everyone()  # [collective] all processes done before the main one saves
        if args.eval_only:  # eval_results.json, beside the training run's results.json
            report_evaluation(accelerator, results, checkpoint, progress, args.output_dir)
        else:  # the plain model's weights
            # [collective] no DDP or compile wrapper; FSDP's shards, ZeRO-3's partitions gathered into the whole weights
            accelerator.save_model(model_to_save(accelerator, model), args.output_dir)
            results.update(save_model_ema(accelerator, ema, args.output_dir))  # [collective] model_ema.safetensors
            # [collective] results.json
            report_run(accelerator, model, meter, progress, results, checkpoint, plan, args.output_dir, args.batch_size,
                       args.gradient_accumulation_steps, args.learning_rate, args.seed, args.max_grad_norm)
    # release the DDP model first: end_training then stops gloo's threads before Python exits
    # (one left at exit can abort it; docs/migration_guide.md, "Ending a run cleanly")
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()
    return stop_signal.exit_status if stopping else 0


if __name__ == "__main__":
    args = None
    try:
        args = parse_args()
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
        stop_with_the_launcher()  # a SIGTERM to a one-process `accelerate launch` stops the training too
        import_deepspeed_if_installed()  # before main() creates the process group: utils/run/group_holders.py
        # one training at a time in --output_dir (a lock); --ddp_timeout outside the training loop: one line too
        with one_training_at_a_time(args.output_dir, args.eval_only), collective_timeouts_named(args.ddp_timeout):
            sys.exit(main(args))
    except UserError as err:
        exit_with_error(err)
    except KeyboardInterrupt:  # Ctrl-C without --save_on_signal: one line saying what was saved, not a traceback
        exit_interrupted(args.output_dir if args else None)
