"""--save_on_signal: remember SIGTERM/SIGUSR1/SIGINT instead of dying of it, so that the training
loop can finish its step, save a checkpoint and stop (Slurm preemption, time limits, Ctrl-C).

torchrun's agent (inside `accelerate launch` with several processes) forwards a SIGTERM it receives
to every worker's process group and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later
(default 30); the batch scripts in scripts/slurm/ rely on that. Accelerate's one-process launcher
forwards nothing: stop_with_the_launcher makes its death reach the training. A terminal's Ctrl-C
reaches every process of the job itself; without --save_on_signal, exit_interrupted says in one line
what was saved instead of a traceback per process.
"""

import ctypes
import os
import signal
import sys
from pathlib import Path

from ..run.checkpoints import newest_good_checkpoint

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def stop_with_the_launcher() -> None:
    """Under `accelerate launch` with one process: this process gets SIGTERM when the launcher dies. Its simple
    launcher (accelerate/commands/launch.py simple_launcher) waits on this process and forwards no signal, so a
    SIGTERM to the launcher alone (`kill PID`, a container's stop, a scheduler) ended the launcher with status 143
    and left the training running, and writing. torchrun, which runs several processes, forwards signals itself.
    prctl(PR_SET_PDEATHSIG) through ctypes (Linux only; elsewhere nothing changes): Python's standard library has
    no call for it, and one call is not worth a dependency."""
    if "TORCHELASTIC_RUN_ID" in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        command = Path(f"/proc/{launcher}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if is_accelerate_launch(command):  # not a shell, nohup, srun, a test: their death must not end the training
        end_with_the_launcher(launcher)


def end_with_the_launcher(launcher: int) -> None:
    """This process gets SIGTERM when its parent, the process `launcher`, dies; a Ctrl-C that reaches both then
    ignores that SIGTERM (_interrupted_before_the_launcher_ends)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell made it ignored
        signal.signal(signal.SIGINT, _interrupted_before_the_launcher_ends)
    if os.getppid() != launcher:  # it died before the prctl: as if after
        os.kill(os.getpid(), signal.SIGTERM)


def _interrupted_before_the_launcher_ends(signum, frame):
    """Ctrl-C reaches the launcher too, which exits a moment later (Popen.wait gives its child 0.25 s) and so sends
    this process SIGTERM: ignored from now on, so that the KeyboardInterrupt gets to say what was saved
    (exit_interrupted) instead of dying half-way. (--save_on_signal's handlers replace this one.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def is_accelerate_launch(command: list) -> bool:
    """`accelerate launch ...` or `python -m accelerate.commands.launch ...` (a process's argv, as bytes)."""
    names = [Path(arg.decode(errors="replace")).name for arg in command[:4]]
    return "accelerate.commands.launch" in names or any(
        name == "accelerate" and following == "launch" for name, following in zip(names, names[1:]))


def exit_interrupted(output_dir) -> None:
    """Ctrl-C without --save_on_signal (KeyboardInterrupt on every process): one line from the main process instead
    of a traceback per process, saying that nothing was saved at the interrupt and where the last checkpoint is;
    exit status 130 (128 + SIGINT), as the shell's for an interrupted command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C, or the launcher's, while this is said
    if os.environ.get("RANK", "0") == "0" and output_dir is not None:
        last = newest_good_checkpoint(output_dir)
        where = (f"the last one is {last}: continue from it with --resume_from_checkpoint latest" if last else
                 f"there is none in {output_dir}")
        sys.stderr.write(f"\nInterrupted (Ctrl-C): no checkpoint saved at the interrupt (--save_on_signal saves one); "
                         f"{where}\n")
        sys.stderr.flush()
    sys.exit(128 + signal.SIGINT)
