"""What the training loop measures as it goes: throughput, the exact training loss and accuracy, gradient norms,
peak memory."""

import contextlib
import resource
import time

import torch


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
    accuracy; with Mixup's or CutMix's class weights (utils/data/mixing.py) lam for the image's class, 1 - lam for its
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
