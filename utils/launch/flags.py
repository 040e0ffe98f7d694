"""The flags every script shares, defined once so that a flag means the same thing everywhere.

Names follow accelerate's examples (`--mixed_precision`, `--cpu`, `--output_dir`,
`--checkpointing_steps`, `--resume_from_checkpoint`, `--with_tracking`, ...).
"""

import argparse
import importlib.util
import os
from pathlib import Path

from ..errors import exit_with_error, first_line
from .launch_checks import deepspeed_launch


DEFAULT_EMA_DECAY = 0.9998  # --model_ema_decay: timm's, so that a recipe's value means the same here

# The trackers the scripts offer (Accelerate supports more); each is named as the package it needs.
TRACKERS = ("tensorboard", "mlflow", "wandb")
# --metric_for_best: which way is better (eval_ema_*: --model_ema's average, utils/run/ema.py)
HIGHER_IS_BETTER = {"eval_accuracy": True, "eval_loss": False, "eval_ema_accuracy": True, "eval_ema_loss": False}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends with one line (argparse prints usage first)."""

    def error(self, message):
        exit_with_error(f"{self.prog}: {message} (see --help)", status=2)  # 2: argparse's usage-error status


def _parse(text: str, convert, expected: str):
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def default_num_workers(most: int = 4) -> int:
    """DataLoader workers per training process that this machine can serve: the CPUs this process may
    run on, shared among the training processes on this machine (torchrun's LOCAL_WORLD_SIZE), at most
    `most`. More workers than CPUs only queue for them, and PyTorch warns about it."""
    usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(most, usable_cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    value = _parse(text, int, expected)
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def positive_float(text: str) -> float:
    return _float_where(text, lambda value: 0 < value < float("inf"), "a positive number")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "a whole number >= 0")


def non_negative_float(text: str) -> float:
    value = _parse(text, float, "a number >= 0")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _float_where(text: str, in_range, expected: str) -> float:
    """A number for which `in_range` holds (nan never does: every comparison with it is false)."""
    value = _parse(text, float, expected)
    if not in_range(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def probability(text: str) -> float:
    return _float_where(text, lambda value: 0 <= value <= 1, "a probability between 0 and 1")


def fraction(text: str) -> float:
    """Strictly between 0 and 1: --val_split (both parts of the split keep images)."""
    return _float_where(text, lambda value: 0 < value < 1, "a fraction strictly between 0 and 1")


def label_smoothing(text: str) -> float:
    """In [0, 1): --label_smoothing 1 would spread every target evenly over the classes, leaving nothing to learn."""
    return _float_where(text, lambda value: 0 <= value < 1, "a number in [0, 1)")


def seed(text: str) -> int:
    """Accelerate's set_seed also seeds numpy, whose generator takes seeds in [0, 2**32) (torch's takes larger)."""
    value = _parse(text, int, "a whole number")
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected 0 <= seed < 2**32 (numpy's range), got {value}")
    return value


def ema_decay(text: str) -> float:
    value = _parse(text, float, "a number between 0 and 1")
    if not 0 < value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a decay between 0 and 1 (exclusive), got {text}")
    return value


def checkpointing_steps(text: str):
    """'epoch' or a positive number of optimizer steps."""
    if text == "epoch":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'epoch' or a positive integer, got {text!r}") from None


def build_parser(description: str, *, epochs: int, batch_size: int, learning_rate: float) -> ArgumentParser:
    """A parser with the shared flags; defaults for the hyperparameters come from the script."""
    parser = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    hyper = parser.add_argument_group("hyperparameters")
    hyper.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    hyper.add_argument("--batch_size", type=positive_int, default=batch_size,
                       help="per process; the global batch is num_processes x batch_size x gradient_accumulation_steps")
    hyper.add_argument("--learning_rate", type=positive_float, default=learning_rate, help="peak learning rate")
    hyper.add_argument("--gradient_accumulation_steps", type=positive_int, default=1, help="batches per optimizer step")
    hyper.add_argument("--seed", type=seed, default=42, help="same on every process; 0 <= seed < 2**32")
    hyper.add_argument(
        "--max_grad_norm", type=positive_float, default=None,
        help="clip the gradients' global norm to this before each optimizer step (fp16: after unscaling)",
    )

    hardware = parser.add_argument_group("hardware")
    hardware.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
        help="overrides the launch config (accelerate config / --config_file)",
    )
    hardware.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs are present")
    hardware.add_argument(
        "--ddp_timeout", type=positive_int, default=1800, metavar="SECONDS",
        help="how long a collective waits for a process that stopped answering before the run ends (as in HF Trainer)",
    )
    hardware.add_argument(
        "--deterministic", action="store_true",
        help="GPU: deterministic cuDNN/cuBLAS kernels, so reruns and resumes repeat bit for bit where PyTorch has "
             "deterministic kernels; a warning names each one that has none (slower)",
    )
    hardware.add_argument(
        "--auto_find_batch_size", action="store_true",
        help="before training, halve --batch_size until a training step fits in memory (global batch kept if it can)",
    )

    data = parser.add_argument_group("data")
    data.add_argument("--max_train_samples", type=positive_int, default=None, help="use only the first N")
    data.add_argument("--max_eval_samples", type=positive_int, default=None, help="use only the first N")

    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--output_dir", type=Path, default=Path("outputs"),
                     help="checkpoints, model.safetensors, run.json, results.json, logs; one run per folder")
    out.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="start afresh in an --output_dir that holds another run (without it the run stops): first "
             "delete its checkpoint folders, best/, model.safetensors, model_ema.safetensors, run.json, results.json "
             "and eval_results.json (other files stay), so 'latest' can never pick them up",
    )
    out.add_argument(
        "--checkpointing_steps", type=checkpointing_steps, default=None,
        help="save a checkpoint every N optimizer steps, or 'epoch' at the end of every epoch",
    )
    out.add_argument("--checkpoints_total_limit", type=positive_int, default=None, help="keep only the newest K")
    out.add_argument(
        "--resume_from_checkpoint", default=None, metavar="{latest,best,PATH}",
        help="'latest' (newest complete checkpoint in --output_dir; starts fresh if none), a checkpoint folder, "
             "or with --eval_only 'best' (the weights --metric_for_best kept)",
    )
    out.add_argument(
        "--save_on_signal", action="store_true",
        help="on SIGTERM/SIGUSR1 (Slurm preemption) or SIGINT (Ctrl-C), finish the step, save step_N and exit with "
             "128+signal",
    )
    out.add_argument("--eval_only", action="store_true",
                     help="evaluate --resume_from_checkpoint (a checkpoint, or 'best'), print the metrics and write "
                          "them to OUTPUT_DIR/eval_results.json (results.json stays the training run's)")
    out.add_argument(
        "--metric_for_best", choices=sorted(HIGHER_IS_BETTER), default=None,
        help="keep the weights of the best evaluation (after each epoch, or every --eval_steps) in OUTPUT_DIR/best "
             "(default eval_loss with --early_stopping_patience); "
             "eval_ema_*: the moving average's (--model_ema), kept there as model.safetensors",
    )
    out.add_argument(
        "--early_stopping_patience", type=positive_int, default=None, metavar="N",
        help="stop when --metric_for_best has not improved for N evaluations (epochs, or --eval_steps' evaluations)",
    )

    track = parser.add_argument_group("tracking and profiling")
    track.add_argument(
        "--report_to", choices=[*TRACKERS, "all", "none"], default="none",
        help="Accelerate's trackers to log to; all: every one installed (mlflow, wandb: pip install -r "
             "requirements-trackers.txt)",
    )
    track.add_argument("--with_tracking", action="store_true", help="the same as --report_to tensorboard")
    track.add_argument(
        "--profile", action="store_true",
        help="torch.profiler trace of a few steady-state steps per process into OUTPUT_DIR/profile",
    )
    return parser


# utils/run/optim.py builds them; named here so that the scripts that only parse flags (sweep.py) need no torch
LR_SCHEDULER_TYPES = ("cosine", "linear", "constant_with_warmup", "onecycle", "step")


def add_lr_scheduler_flags(parser: ArgumentParser, lr_scheduler_type: str, warmup_epochs=None) -> None:
    """--lr_scheduler_type, --warmup_steps, --warmup_epochs (the HF Trainer's names), for the scripts that build their
    schedule with utils/run/optim.py (the baselines keep the one-cycle schedule the articles use)."""
    schedule = parser.add_argument_group("learning-rate schedule (counted in optimizer steps)")
    schedule.add_argument(
        "--lr_scheduler_type", choices=LR_SCHEDULER_TYPES, default=lr_scheduler_type,
        help="after the warmup: cosine or linear decay to 0, constant, a tenth after each third (step); or torch's "
             "OneCycleLR (utils/run/optim.py: build_lr_scheduler)",
    )
    warmup = schedule.add_mutually_exclusive_group()
    warmup.add_argument("--warmup_steps", type=non_negative_int, default=None,
                        help="linear warmup over this many optimizer steps")
    warmup.add_argument("--warmup_epochs", type=non_negative_float, default=warmup_epochs,
                        help="linear warmup over this many epochs; with neither: 15%% of the run (onecycle) or none")


def add_model_ema_flags(parser: ArgumentParser) -> None:
    """--model_ema, --model_ema_decay, --model_ema_warmup (timm's names and meanings), for the scripts that keep the
    average with utils/run/ema.py."""
    ema = parser.add_argument_group("moving average of the weights (utils/run/ema.py)")
    ema.add_argument(
        "--model_ema", action="store_true",
        help="keep an exponential moving average of the weights, updated after every optimizer step, evaluated each "
             "epoch beside them (eval_ema_accuracy, eval_ema_loss), saved in every checkpoint and at the end as "
             "OUTPUT_DIR/model_ema.safetensors",
    )
    ema.add_argument(
        "--model_ema_decay", type=ema_decay, default=None,
        help=f"each update moves the average (1 - decay) of the way to the weights, so it spans about 1/(1 - decay) "
             f"optimizer steps; with --model_ema {DEFAULT_EMA_DECAY} (timm's) unless given",
    )
    ema.add_argument(
        "--model_ema_warmup", action="store_true",
        help="timm's warmup of the decay: min(decay, 1 - (1 + t)^(-2/3)) at the update after t updates (0.95 at the "
             "100th, 0.99 at the 1000th), so that the average also suits runs shorter than 1/(1 - decay) steps",
    )


def add_step_flags(parser: ArgumentParser) -> None:
    """--max_steps, --eval_steps, --logging_steps (the HF Trainer's names and meanings), for the scripts that count
    their runs in optimizer steps with utils/run/steps.py."""
    steps = parser.add_argument_group("a run in optimizer steps (the Hugging Face Trainer's flags; utils/run/steps.py)")
    steps.add_argument(
        "--max_steps", type=positive_int, default=None, metavar="N",
        help="train N optimizer steps instead of --epochs: the run spans ceil(N / steps per epoch) epochs and ends "
             "right after step N, perhaps inside an epoch, with an evaluation; the learning-rate schedule and "
             "--model_ema count to N. Like --epochs, part of train_mnist.py's run (a resume keeps it), while "
             "train_image_classifier.py may resume with another",
    )
    steps.add_argument(
        "--eval_steps", type=positive_int, default=None, metavar="N",
        help="evaluate after every N optimizer steps instead of after every epoch, and after the last step if it was "
             "not one of them; --metric_for_best and --early_stopping_patience then go by these evaluations",
    )
    steps.add_argument(
        "--logging_steps", type=positive_int, default=None, metavar="N",
        help="every N optimizer steps, log the mean training loss over them (every process's samples) and the "
             "learning rate, as loss and learning_rate, to the trackers and the log",
    )


def tracker_config(args) -> dict:
    """The run's flags as hyperparameters for the trackers, which take scalars and strings only."""
    return {k: ",".join(v) if isinstance(v, list) else str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, Path, list))}


# What the DeepSpeed engine does not take from the scripts (utils/run/deepspeed.py), and why
DEEPSPEED_UNSUPPORTED = {
    "model_ema": "its average copies the plain model's parameters, which ZeRO-3 partitions into empty placeholders",
    "auto_find_batch_size": "DeepSpeed fixes the batch per process when prepare builds its engine, once",
    "compile": "Accelerate compiles DeepSpeed's engine by regions, a path these scripts have not been tested on",
    "streaming": "a stream's last batches differ between processes, and DeepSpeed's engine needs whole global batches",
}


def check_flag_combinations(parser: ArgumentParser, args) -> None:
    """Flags that are wrong together, and the normal form of the tracking flags: `args.report_to`
    becomes the list of trackers for `Accelerator(log_with=...)` (empty: no tracking)."""
    if args.eval_only and args.resume_from_checkpoint is None:
        parser.error("--eval_only needs --resume_from_checkpoint {latest,best,PATH} to know what to evaluate")
    if args.resume_from_checkpoint == "best" and not args.eval_only:
        parser.error("--resume_from_checkpoint best holds the best weights only (no optimizer state): evaluate them "
                     "with --eval_only, or resume training from 'latest' or a step_N/epoch_N folder")
    if args.overwrite_output_dir and args.resume_from_checkpoint is not None:
        parser.error("--overwrite_output_dir starts afresh and --resume_from_checkpoint continues a run: pass one")
    for flag, why in DEEPSPEED_UNSUPPORTED.items():
        if deepspeed_launch() and getattr(args, flag, False):  # a script without the flag has it off
            parser.error(f"--{flag} does not work under DeepSpeed here: {why}; drop it, or launch without DeepSpeed")
    for flag in ("eval_steps", "logging_steps"):  # a script without add_step_flags has neither
        if args.eval_only and getattr(args, flag, None) is not None:
            parser.error(f"--{flag} says when a training run does something every N optimizer steps, and --eval_only "
                         f"trains nothing: drop --{flag}")
    if getattr(args, "warmup_steps", None) is not None:
        args.warmup_epochs = None  # the script's default --warmup_epochs gives way to --warmup_steps
    if args.early_stopping_patience is not None and args.metric_for_best is None:
        args.metric_for_best = "eval_loss"  # as the HF Trainer
    if not getattr(args, "model_ema", False):  # off, or a script without add_model_ema_flags
        if (args.metric_for_best or "").startswith("eval_ema_"):
            parser.error(f"--metric_for_best {args.metric_for_best} measures --model_ema's average: add --model_ema")
        for flag in ("model_ema_decay", "model_ema_warmup"):
            if getattr(args, flag, None):
                parser.error(f"--{flag} sets up --model_ema's average: add --model_ema")
    elif args.model_ema_decay is None:
        args.model_ema_decay = DEFAULT_EMA_DECAY
    installed = [name for name in TRACKERS if importlib.util.find_spec(name)]
    if args.report_to not in (*installed, "all", "none"):
        parser.error(f"--report_to {args.report_to}: the {args.report_to} package is not installed; "
                     f"pip install -r requirements-trackers.txt")
    chosen = {"all": installed, "none": []}.get(args.report_to, [args.report_to])
    if "wandb" in chosen:
        check_wandb_login(parser, args.report_to)
    args.report_to = sorted({*chosen, *(["tensorboard"] if args.with_tracking else [])})


def check_wandb_login(parser: ArgumentParser, report_to: str) -> None:
    """W&B online without credentials: wandb.init raises its UsageError (a traceback) in init_trackers, after the
    trackers before it started their runs (an empty MLflow run left behind). Refused before anything starts, with
    wandb's own lookup (WANDB_API_KEY, its settings files, ~/.netrc; no network, no prompt)."""
    import wandb
    from wandb.sdk import wandb_setup  # the settings wandb.login reads (wandb.setup() would also start W&B's service)

    settings = wandb_setup.singleton().settings
    if settings.mode in ("offline", "dryrun", "disabled"):  # WANDB_MODE or `wandb offline`
        return
    # silent: wandb.login's "logged in as" message asks W&B's service for the user name, which starts that service
    # and reaches for the server (6 s at best; its exit hung past 120 s in CI when the server did not answer)
    was_silent, settings.silent = settings.silent, True
    try:
        logged_in, why = wandb.login(prompt=False, verify=False), "it has no API key here (not logged in)"
    except wandb.errors.Error as err:  # a malformed WANDB_API_KEY, say
        logged_in, why = False, first_line(err)
    finally:
        settings.silent = was_silent
    if not logged_in:
        parser.error(f"--report_to {report_to}: W&B cannot log online: {why}; run `wandb login` (or set "
                     f"WANDB_API_KEY), or log offline with WANDB_MODE=offline (`wandb sync` uploads it later), or "
                     f"choose another --report_to")


# Shared flags that only scripts/train_mnist.py implements: the baselines and
# scripts/benchmark_train.py refuse them rather than ignore them. (--ddp_timeout, which they keep,
# has no collective to time out on one process, as in train_mnist.py.)
FLAGS_THE_BASELINES_LACK = {
    "gradient_accumulation_steps": 1,
    "checkpointing_steps": None,
    "checkpoints_total_limit": None,
    "resume_from_checkpoint": None,
    "overwrite_output_dir": False,
    "save_on_signal": False,
    "eval_only": False,
    "with_tracking": False,
    "report_to": "none",
    "deterministic": False,
    "max_grad_norm": None,
    "metric_for_best": None,
    "early_stopping_patience": None,
    "profile": False,
    "auto_find_batch_size": False,
}


def check_streaming_flags(parser, args) -> None:
    """train_image_classifier.py --streaming: a stream has no length, so the run's length is --max_steps and an epoch
    is not known beforehand."""
    if args.max_steps is None:
        parser.error("--streaming needs --max_steps (a stream's length is unknown, so the run is counted in steps)")
    for flag in ("max_train_samples", "auto_find_batch_size"):
        if getattr(args, flag):
            parser.error(f"--{flag} does not work with --streaming (it needs a dataset of known length); drop it")
    if args.mixup_alpha or args.cutmix_alpha:
        parser.error("--mixup_alpha and --cutmix_alpha do not work with --streaming yet (each image's partner is drawn "
                     "by its index in the data set, which a stream does not have); drop them")
    if args.warmup_epochs != parser.get_default("warmup_epochs"):
        parser.error("--warmup_epochs does not work with --streaming (an epoch's length is unknown beforehand); "
                     "use --warmup_steps")
    args.warmup_epochs = None  # the default warmup of one epoch: none (--warmup_steps gives one)


def reject_flags_the_baselines_lack(parser, args) -> None:
    for name, default in FLAGS_THE_BASELINES_LACK.items():
        if getattr(args, name) != default:
            parser.error(f"--{name}: the baselines leave it out to stay short; scripts/train_mnist.py has it")


def build_mnist_parser(description: str) -> ArgumentParser:
    """The MNIST scripts (train_mnist.py and the baselines): one set of defaults, so that the
    comparisons between them compare the same training run."""
    parser = build_parser(description, epochs=3, batch_size=64, learning_rate=3e-3)
    parser.add_argument(
        "--data_dir", default=None,
        help="folder with the MNIST IDX files (raw or .gz, also DIR/MNIST/raw); default: ylecun/mnist from the Hub",
    )
    return parser
