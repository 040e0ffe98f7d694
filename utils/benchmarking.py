"""Helpers for the baselines and the benchmark: flag checks, synthetic images, machine facts,
summaries of repeated runs. No distribution logic in here."""

import os
import platform
import shlex
import statistics
import subprocess
import sys

import torch
from torch.utils.data import TensorDataset

from utils.errors import UserError

# Shared flags (utils/flags.py) that only scripts/train_mnist.py implements. The baselines
# refuse them instead of ignoring them, so a flag never silently means nothing.
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


def reject_flags_the_baselines_lack(parser, args) -> None:
    for name, default in FLAGS_THE_BASELINES_LACK.items():
        if getattr(args, name) != default:
            parser.error(f"--{name}: the baselines leave it out to stay short; scripts/train_mnist.py has it")


def autocast_dtype(mixed_precision, device: torch.device):
    """torch's native AMP dtype for --mixed_precision (None: full fp32), as Accelerate chooses it.

    fp16 needs a GPU: on the CPU Accelerate ignores it and trains in fp32, so the baselines
    refuse it rather than compare different things.
    """
    if mixed_precision in (None, "no"):
        return None
    if mixed_precision == "fp16" and device.type != "cuda":
        raise UserError("--mixed_precision fp16 needs a CUDA GPU; on the CPU use --mixed_precision bf16 or no")
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


class OptimizerStepWatch:
    """Whether `optimizer.step()` ran since the last look. GradScaler skips the call when fp16
    gradients overflowed; a post-hook on the optimizer knows that without reading anything off the
    GPU (the usual recipe, comparing `scaler.get_scale()` before and after, costs two host syncs a
    step). Accelerate's `optimizer_step_was_skipped` works the same way, by wrapping `step`."""

    def __init__(self, optimizer):
        self.stepped = False
        optimizer.register_step_post_hook(self._mark)

    def _mark(self, optimizer, args, kwargs):
        self.stepped = True

    def take(self) -> bool:
        stepped, self.stepped = self.stepped, False
        return stepped


class AutocastInForward(torch.nn.Module):
    """autocast is thread-local, and DataParallel runs each replica in a thread of its own,
    passing on only whether autocast is on, not its dtype (a bf16 run would compute in fp16).
    PyTorch's AMP notes for DataParallel: enter autocast inside forward."""

    def __init__(self, module: torch.nn.Module, amp_dtype):
        super().__init__()
        self.module, self.amp_dtype = module, amp_dtype

    def forward(self, x):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            return self.module(x)


def synthetic_images(num_samples: int, image_size: int, num_classes: int = 1000, seed: int = 0) -> TensorDataset:
    """Random normalised images and labels, as the classic ImageNet benchmarks use to time the
    GPU without the JPEG decoder (e.g. pytorch/examples imagenet --dummy)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return TensorDataset(images, labels)


def portable_path(path, repo) -> str:
    """An absolute path as seen from the repository root (published records must not name the
    folders of the machine they were made on); a relative one as it is."""
    return os.path.relpath(path, repo) if os.path.isabs(path) else str(path)


def portable_command(words, repo, run_dir=None) -> str:
    """A command as a reader runs it from the repository root: `python` for this interpreter,
    absolute paths relative to the repository, the run's temporary folder as RUN_DIR."""
    portable = []
    for word in map(str, words):
        if word == sys.executable:
            word = "python"
        elif run_dir is not None and (word == str(run_dir) or word.startswith(f"{run_dir}{os.sep}")):
            word = "RUN_DIR" + word[len(str(run_dir)):]
        else:
            word = portable_path(word, repo)
        portable.append(word)
    return shlex.join(portable)


def machine_facts() -> dict:
    """What a published number needs next to it: hardware and library versions."""
    import accelerate
    import torchvision

    cpu_model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu_model,
        "cpu_cores": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda if gpus else None,
        "load_average_1min_after": os.getloadavg()[0],
        "git_commit": _git_commit(),
    }


def _git_commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def summarize(values) -> dict:
    """Median (robust to one disturbed repeat), min and max of the repeats; None when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
