"""What a run reports: results.json (training) or eval_results.json (--eval_only), the run record run.json,
training throughput, peak memory, replica fingerprints."""

import contextlib
import hashlib
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
from accelerate.utils import is_compiled_module

from utils.errors import UserError

RUN_RECORD = "run.json"  # what defines a run; in OUTPUT_DIR and in each of its checkpoints (utils/checkpoints.py)
EVAL_RESULTS = "eval_results.json"  # --eval_only's; results.json stays the training run's
# run.json keys a resume may change (utils/checkpoints.py start_output_dir records them beside the run's own; epochs,
# max_steps: train_image_classifier.py only)
RESUMABLE_KEYS = {"epochs", "max_steps", "num_processes", "batch_size_per_process", "gradient_accumulation_steps",
                  "global_batch_size"}


class ThroughputMeter:
    """Wall time of the training steps only (evaluation and checkpoint saving excluded).

    Samples/s is measured over steady state: the first `warmup_batches` of each run, where
    allocators, kernels and caches warm up, count in `train_time_s` but not in the rate.
    """

    def __init__(self, device: torch.device, warmup_batches: int = 10):
        self.device, self.warmup_batches = device, warmup_batches
        self.batches = 0
        self.train_time_s = self.steady_time_s = 0.0
        self.steady_samples = self.samples = 0
        self._last = None

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously; wait before reading the clock
        return time.perf_counter()

    def start(self):
        self._last = self._now()

    def batch_done(self, num_samples: int):
        self.batches += 1
        # Synchronise only where the steady window starts: the warm-up batches' queued GPU work
        # must not land in it, and a sync at every batch would slow the very loop being measured.
        now = self._now() if self.batches == self.warmup_batches else time.perf_counter()
        elapsed, self._last = now - self._last, now
        self.train_time_s += elapsed
        self.samples += num_samples
        if self.batches > self.warmup_batches:
            self.steady_time_s += elapsed
            self.steady_samples += num_samples

    @contextlib.contextmanager
    def paused(self):
        """`pause()` for the time of a with block (a checkpoint, an evaluation), then `start()` again."""
        self.pause()
        try:
            yield
        finally:
            self.start()

    def pause(self):
        """Call before evaluating or saving; `start()` again when training resumes."""
        if self._last is not None:
            now = self._now()
            self.train_time_s += now - self._last
            if self.batches > self.warmup_batches:
                self.steady_time_s += now - self._last
            self._last = None


class RunningLoss:
    """This process's sums of per-sample training losses and accuracies (`accuracy_credit`) and its sample count,
    and the first non-finite loss, all kept on the device: the training loop never waits for the GPU to read
    them. `take()` hands them over (to be summed over processes) and starts afresh."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.samples = torch.zeros((), dtype=torch.float64, device=device)
        self.accuracy_sum = torch.zeros((), dtype=torch.float64, device=device)
        # (optimizer step, loss) of the first non-finite loss; step -1: none yet
        self.first_nonfinite = torch.tensor([-1.0, 0.0], dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, step: int) -> None:
        """A batch's mean loss, its logits and its targets (class ids, or class weights: see accuracy_credit)."""
        loss = loss.detach().double()
        self.loss_sum += loss * len(targets)
        self.samples += len(targets)
        self.accuracy_sum += accuracy_credit(logits, targets).sum()
        first = (self.first_nonfinite[0] < 0) & ~torch.isfinite(loss)
        here = torch.stack([loss.new_tensor(float(step)), loss])
        self.first_nonfinite = torch.where(first, here, self.first_nonfinite)

    def take(self) -> torch.Tensor:
        """[loss sum, samples, first non-finite step, its loss, accuracy sum]; the sums restart from zero."""
        taken = torch.cat([torch.stack([self.loss_sum, self.samples]), self.first_nonfinite, self.accuracy_sum[None]])
        self.loss_sum.zero_(), self.samples.zero_(), self.accuracy_sum.zero_()
        return taken


def accuracy_credit(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the target's weight of the predicted class (the logits' largest): with class ids 1 or 0, plain
    accuracy; with Mixup's or CutMix's class weights (utils/mixing.py) lam for the image's class, 1 - lam for its
    partner's, 0 for any other (1 when both images are of the predicted class)."""
    predicted = logits.detach().argmax(dim=-1)
    if targets.ndim == 1:
        return (predicted == targets).double()
    return torch.take_along_dim(targets, predicted[:, None], dim=1)[:, 0].double()


class GradNorms:
    """--max_grad_norm: the gradients' global norms before clipping (what clip_grad_norm_ returns), kept on the
    device like RunningLoss. Every process computes the same norm of the all-reduced gradients, so no gathering.
    `take()` gives the epoch's mean and max over the finite ones (an fp16 overflow step has an infinite norm and
    is skipped anyway), and the number of steps clipped."""

    def __init__(self, device: torch.device, max_norm):
        self.max_norm = max_norm
        self.stats = torch.zeros(4, dtype=torch.float64, device=device)  # norm sum, finite steps, max, clipped

    def add(self, norm: torch.Tensor) -> None:
        norm = norm.detach().double()
        finite = torch.isfinite(norm)
        clean = torch.where(finite, norm, torch.zeros_like(norm))
        clipped = finite & (norm > self.max_norm)
        self.stats += torch.stack([clean, finite.double(), torch.zeros_like(norm), clipped.double()])
        self.stats[2] = torch.maximum(self.stats[2], clean)

    def take(self) -> dict:
        if self.max_norm is None:
            return {}
        norm_sum, steps, norm_max, clipped = self.stats.tolist()
        self.stats.zero_()
        return {"grad_norm_mean": norm_sum / steps if steps else None, "grad_norm_max": norm_max,
                "steps_clipped": int(clipped)}


def peak_memory_mb(device: torch.device) -> float:
    """GPU: peak memory allocated by tensors. CPU: peak resident set size of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def fingerprint(tensors) -> int:
    """A 60-bit hash of the exact bytes of `tensors`: equal fingerprints mean bit-identical values."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int(digest.hexdigest()[:15], 16)


def replica_fingerprints(accelerator, module) -> list:
    """Collective: [parameters' fingerprint, buffers' fingerprint] of `module` on every process, in rank order."""
    replica = [[fingerprint(module.parameters()), fingerprint(module.buffers())]]
    return accelerator.gather(torch.tensor(replica, device=accelerator.device)).cpu().tolist()


def report_run(accelerator, model, meter: ThroughputMeter, progress, args, results: dict, checkpoint, plan) -> None:
    """Collective: every process calls it once, after training. Completes `results` with what the
    run measured and the main process writes results.json. `plan`: the run's length (utils/steps.py StepPlan).

    Throughput is the samples of all processes over the slowest one's steady-state time (over all its
    batches when it had no more than the warm-up's, as `train_samples_per_second_over` says). Every
    replica must hold the same weights: each process adds the fingerprints of its parameters and buffers
    (BatchNorm statistics agree after an evaluation: DDP broadcasts rank 0's buffers before each forward that
    follows a synced training forward, so before the evaluation's first batch). Under FSDP each process holds a
    shard, so the full weights are fingerprinted once.
    """
    device = accelerator.device
    per_process = accelerator.gather(torch.tensor(
        [[meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_memory_mb(device), meter.samples]],
        dtype=torch.float64, device=device,
    )).cpu()
    slowest, slowest_in_all = per_process[:, 1].max().item(), per_process[:, 2].max().item()
    if slowest > 0:
        results["train_samples_per_second"] = per_process[:, 0].sum().item() / slowest
        results["train_samples_per_second_over"] = "steady_state"
    elif slowest_in_all > 0:  # no more batches than the warm-up: all count, warm-up included (a lower bound)
        results["train_samples_per_second"] = per_process[:, 4].sum().item() / slowest_in_all
        results["train_samples_per_second_over"] = "all_batches"
    else:  # nothing trained (--eval_only, or a resume with no step left)
        results["train_samples_per_second"], results["train_samples_per_second_over"] = None, "no_batches"
    results["train_time_s"] = slowest_in_all
    results["peak_memory_mb"] = per_process[:, 3].max().item()
    if accelerator.is_fsdp2:
        full_weights = accelerator.get_state_dict(model)  # gathers the shards (collective)
        replicas = [[fingerprint(full_weights.values()), 0]] if accelerator.is_main_process else []
    else:
        replicas = replica_fingerprints(accelerator, accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        results.update({
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "grad_scaler": accelerator.scaler is not None,
            "sharded": accelerator.is_fsdp2,
            "compiled": is_compiled_module(model),  # torch.compile, by --compile or the launch config's dynamo backend
            # --epochs, or those --max_steps spans (the last one perhaps cut short); --streaming: the epochs gone through,
            # of lengths that vary and are not known beforehand (utils/streaming.py)
            "epochs": progress.epoch if getattr(args, "streaming", False) else plan.epochs,
            "max_steps": plan.max_steps,
            "steps_per_epoch": None if getattr(args, "streaming", False) else plan.steps_per_epoch,
            "global_step": progress.global_step,
            "samples_seen": progress.samples_seen,
            "optimizer_steps_skipped": progress.optimizer_steps_skipped,
            "batch_size_per_process": args.batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "global_batch_size": progress.global_batch_size,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
            "resumed_from": str(checkpoint) if checkpoint is not None else None,
            "max_grad_norm": args.max_grad_norm,
            "parameter_fingerprints": [row[0] for row in replicas],
            "buffer_fingerprints": [row[1] for row in replicas],
        })
        if args.metric_for_best is not None:
            results.update({"metric_for_best": args.metric_for_best, "best_epoch": progress.best_epoch,
                            "best_step": progress.best_step, f"best_{args.metric_for_best}": progress.best_metric,
                            "stopped_early": progress.global_step < plan.max_steps})
        write_json_atomically(Path(args.output_dir) / "results.json", results)
        print(f"Wrote {Path(args.output_dir) / 'results.json'}", flush=True)


def read_run_record(folder):
    """The run.json in `folder` (a checkpoint), or None where there is none (saved before runs were recorded)."""
    path = Path(folder) / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({type(err).__name__}); use another checkpoint") from None


def report_evaluation(accelerator, results: dict, checkpoint, progress, output_dir) -> None:
    """--eval_only: the main process prints the metrics and writes OUTPUT_DIR/eval_results.json (never
    results.json, which belongs to the run that trained), describing the checkpoint evaluated: its path,
    how far it had trained and the run it comes from (its run.json, with that run's --epochs)."""
    if not accelerator.is_main_process:
        return
    metrics = {key: value for key, value in results.items() if key != "train_loss"}  # nothing was trained
    record = {
        **metrics,
        "checkpoint": str(checkpoint),
        "checkpoint_epochs_done": progress.epoch,  # whole epochs trained when it was saved
        "checkpoint_global_step": progress.global_step,
        "checkpoint_samples_seen": progress.samples_seen,
        "run": read_run_record(checkpoint),  # null for a checkpoint saved before runs were recorded
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
    }
    path = Path(output_dir) / EVAL_RESULTS
    write_json_atomically(path, record)
    scores = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()
                       if key.startswith("eval_") and isinstance(value, float))
    print(f"Evaluated {checkpoint} (after {progress.epoch} epochs, step {progress.global_step}): {scores} "
          f"on {metrics['eval_samples']} samples; wrote {path}", flush=True)


def write_json_atomically(path, data: dict) -> None:
    """Readers see the old file or the new one, never half of one."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomically(path, text: str) -> None:
    """Into a temporary file beside `path`, renamed over it once complete: readers see the old file or the new
    one, never half of one, and a crash or Ctrl-C while writing leaves no `path` that looks finished."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when writing failed


def check_writable_file(path, flag: str) -> None:
    """Before any work: `path` can be written (its folder exists or can be made, and takes a new file)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "it is a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise UserError(f"cannot write {flag} {path} ({err.strerror or type(err).__name__}); choose a file in a "
                        f"writable folder") from None


def create_output_dir(output_dir) -> None:
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --output_dir {output_dir} ({err.strerror}); choose a writable folder") from None
