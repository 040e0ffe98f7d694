"""--save_on_signal: remember SIGTERM/SIGUSR1 instead of dying of it, so that the training
loop can finish its step, save a checkpoint and stop (Slurm preemption, time limits).

torchrun's agent (inside `accelerate launch`) forwards a SIGTERM it receives to every
worker's process group and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later
(default 30); the batch scripts in scripts/slurm/ rely on that.
"""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Installs handlers for STOP_SIGNALS; `received` is the first one that arrived, or None."""

    def __init__(self):
        self.received = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._remember)

    def _remember(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def exit_status(self) -> int:
        """128 + the signal number, the shell's status for "stopped by this signal": the run is
        not finished, so `&&` chains and schedulers must not take it for a success."""
        return 128 + (self.received or signal.SIGTERM)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: torchrun signals the whole process group, DataLoader
    workers included; they must keep serving batches until the step ends. (They stop when
    the training process exits, as always.)"""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def stop_requested(accelerator, stop_signal: StopSignal) -> bool:
    """Collective: every process calls it after the same optimizer step; True on all of them when a
    stop signal reached any. (The signal reaches the processes at different moments: Accelerate's
    trigger is an all-reduce, so they all stop after the same step.)"""
    if stop_signal.received:
        accelerator.set_trigger()
    return accelerator.check_trigger()
