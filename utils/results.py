"""What a run reports: results.json, training throughput, peak memory, replica fingerprints."""

import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch

from utils.errors import UserError


class ThroughputMeter:
    """Wall time of the training steps only (evaluation and checkpoint saving excluded).

    Samples/s is measured over steady state: the first `warmup_batches` of each run, where
    allocators, kernels and caches warm up, count in `train_time_s` but not in the rate.
    """

    def __init__(self, device: torch.device, warmup_batches: int = 10):
        self.device, self.warmup_batches = device, warmup_batches
        self.batches = 0
        self.train_time_s = self.steady_time_s = 0.0
        self.steady_samples = 0
        self._last = None

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously; wait before reading the clock
        return time.perf_counter()

    def start(self):
        self._last = self._now()

    def batch_done(self, num_samples: int):
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self.batches += 1
        self.train_time_s += elapsed
        if self.batches > self.warmup_batches:
            self.steady_time_s += elapsed
            self.steady_samples += num_samples

    def pause(self):
        """Call before evaluating or saving; `start()` again when training resumes."""
        if self._last is not None:
            now = self._now()
            self.train_time_s += now - self._last
            if self.batches > self.warmup_batches:
                self.steady_time_s += now - self._last
            self._last = None


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


def write_json_atomically(path, data: dict) -> None:
    """Readers see the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def create_output_dir(output_dir) -> None:
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --output_dir {output_dir} ({err.strerror}); choose a writable folder") from None
