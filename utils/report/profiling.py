"""--profile: a torch.profiler trace of a few steady-state training steps on every process."""

import os
from pathlib import Path

import torch
from accelerate.logging import get_logger

logger = get_logger(__name__)

# Steps (batches) to leave out first: the warm-up that ThroughputMeter also leaves out (allocator,
# cuDNN autotuning, compilation); then 2 traced but discarded (the profiler's own start-up), then 5 recorded.
SKIP_FIRST, WARMUP, ACTIVE = 10, 2, 5


class StepProfiler:
    """A context around the training loop; call `step()` after each batch. Without --profile it does nothing.

    Each process writes OUTPUT_DIR/profile/rank{N}.*.pt.trace.json, a Chrome trace that Perfetto
    (ui.perfetto.dev) or TensorBoard's profiler plugin opens; the main process prints its top operators.
    """

    def __init__(self, enabled: bool, output_dir, accelerator):
        self.enabled, self.accelerator = enabled, accelerator  # enabled: --profile
        self.trace_dir = Path(output_dir) / "profile"
        self.profiler = None
        self.traced = False

    def __enter__(self):
        if self.enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.accelerator.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            if not torch.cuda.is_available():
                # A CUDA build of torch without a GPU driver: writing the trace, the profiler (kineto) asks CUDA
                # for the GPUs' properties and prints "ERROR: ... gpuGetDeviceCount failed with code 35" (no
                # driver), although CPU-only traces need none. Level 5 keeps only its USDT start/stop lines; a
                # level the user set stays.
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(skip_first=SKIP_FIRST, wait=0, warmup=WARMUP, active=ACTIVE, repeat=1),
                on_trace_ready=self._write_trace,
            )
            self.profiler.__enter__()
        return self

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def __exit__(self, *exc_info):
        if self.profiler is not None:
            self.profiler.__exit__(*exc_info)
            if not self.traced and exc_info[0] is None:
                logger.warning(f"--profile: the run had fewer than {SKIP_FIRST + WARMUP + ACTIVE} training batches "
                               f"per process, so nothing was traced; train longer", main_process_only=True)
        return False

    def _write_trace(self, profiler) -> None:
        self.traced = True
        worker = f"rank{self.accelerator.process_index}"
        torch.profiler.tensorboard_trace_handler(str(self.trace_dir), worker_name=worker)(profiler)
        if self.accelerator.is_main_process:
            sort_by = "self_cuda_time_total" if self.accelerator.device.type == "cuda" else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=sort_by, row_limit=12)
            print(f"--profile: batches {SKIP_FIRST + WARMUP + 1}-{SKIP_FIRST + WARMUP + ACTIVE} of process 0, top "
                  f"operators by {sort_by.replace('_', ' ')}; traces of every process in {self.trace_dir}\n{table}",
                  flush=True)
