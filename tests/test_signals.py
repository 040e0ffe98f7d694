"""utils/run/signals.py at the inputs the launched tests never send: two signals one after the other (Slurm's warning,
then its time limit), and a Ctrl-C whose "Interrupted" line takes longer than the launcher waits. In this process
where it can be (signals to itself), else in processes forked from it (no interpreter to start, no imports to wait
for); tests/test_reliability.py launches the real thing."""

import contextlib
import json
import os
import signal
import sys
import time

import psutil
import pytest

from utils.run import signals
from utils.run.progress import TrainingProgress
from utils.run.signals import STOP_SIGNALS, StopSignal, end_with_the_launcher, exit_interrupted, is_accelerate_launch


@pytest.fixture
def own_handlers():
    """The test installs signal handlers in this process; pytest's are put back after it."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_first_stop_signal_wins(own_handlers):
    """Issue 43 #7: Slurm's `--signal=USR1@60` warning, then its time limit's SIGTERM: the run stopped for the first,
    128 + SIGUSR1 = 138 (a requeue script tells the warning from a kill by it), not 143."""
    stop = StopSignal()
    assert stop.received is None
    signal.raise_signal(signal.SIGUSR1)  # the handler has run when raise_signal returns (it checks for signals)
    assert stop.received == signal.SIGUSR1
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGINT)
    assert stop.received == signal.SIGUSR1 and stop.exit_status == 138


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138), (signal.SIGINT, 130)])
def test_each_stop_signal_is_remembered_and_its_shells_status_given(own_handlers, signum, status):
    stop = StopSignal()
    signal.raise_signal(signum)
    assert (stop.received, stop.exit_status) == (signum, status)


@pytest.mark.parametrize("command, launched", [
    ([b"/venv/bin/python3", b"/venv/bin/accelerate", b"launch", b"train.py", b""], True),
    ([b"accelerate", b"launch", b"--cpu", b"train.py", b""], True),
    ([b"python", b"-m", b"accelerate.commands.launch", b"train.py", b""], True),
    ([b"/venv/bin/accelerate", b"config", b""], False),
    ([b"bash", b"-c", b"accelerate launch train.py", b""], False),
    ([b"python", b"train.py", b""], False),
    ([b"srun", b"python", b"train.py", b"--launch", b""], False),
    ([b""], False),
])
def test_the_launcher_is_recognised_by_its_command_line(command, launched):
    assert is_accelerate_launch(command) is launched


def the_training(output_dir, log, hash_seconds) -> None:
    """In a process forked from the launcher: train_mnist.py's main as far as signals go, the training a loop. It ends
    with its launcher (end_with_the_launcher), and on Ctrl-C says what was saved (exit_interrupted), finding the last
    checkpoint taking `hash_seconds` (a large checkpoint's sha256). Writes its pid, then its exit status, to `log`."""
    status = 1
    try:
        sys.stderr = open(log, "a", buffering=1)  # noqa: SIM115 (this process ends with os._exit)
        for signum in STOP_SIGNALS:  # as in a fresh interpreter
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        find = signals.newest_good_checkpoint
        signals.newest_good_checkpoint = lambda folder: (time.sleep(hash_seconds), find(folder))[1]
        end_with_the_launcher(os.getppid())
        sys.stderr.write(f"pid {os.getpid()}\n")
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt:
            exit_interrupted(output_dir)
    except SystemExit as end:
        status = end.code
    finally:
        sys.stderr.write(f"exit {status}\n")
        os._exit(status)


def one_process_launch(output_dir, log, hash_seconds) -> None:
    """Forked from the test: `accelerate launch` with one process, as its simple_launcher runs it (the training its
    one child; Popen.wait, interrupted by Ctrl-C, gives the child subprocess.Popen's 0.25 s and the launcher exits),
    the whole job in a process group of its own (a terminal's foreground job)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    child = os.fork()
    if child == 0:
        the_training(output_dir, log, hash_seconds)
    try:
        os.waitpid(child, 0)
    except KeyboardInterrupt:
        time.sleep(0.25)
    os._exit(1)


def ended_(process: psutil.Process) -> bool:
    """Whether `process` has ended (its new parent, this machine's first process, may leave it a zombie)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ctrl_c_says_what_was_saved_though_the_launcher_ends_first(tmp_path):
    """Issue 43 #6: Ctrl-C reaches the one-process launch's launcher and its training; the launcher ends 0.25 s later,
    which sends the training SIGTERM (end_with_the_launcher). A training whose last checkpoint takes longer than that
    to check must still say where it is and end with 130, not be killed by that SIGTERM (143) first."""
    out, log = tmp_path / "out", tmp_path / "training.log"
    (out / "step_5").mkdir(parents=True)
    (out / "step_5" / "training_state.json").write_text(json.dumps(vars(TrainingProgress(global_step=5))))
    launcher = os.fork()
    if launcher == 0:
        try:
            one_process_launch(out, log, hash_seconds=1.0)
        finally:
            os._exit(1)
    try:
        deadline = time.monotonic() + 30
        while not (log.is_file() and log.read_text().startswith("pid ")):
            assert time.monotonic() < deadline, "the training never started"
            time.sleep(0.01)
        training = psutil.Process(int(log.read_text().split()[1]))
        os.killpg(launcher, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground process group
        assert os.waitpid(launcher, 0)[1] != 0
        ended = time.monotonic() + 30
        while not ended_(training):
            assert time.monotonic() < ended, "the training outlived its launcher"
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher, signal.SIGKILL)
    lines = log.read_text().splitlines()
    said = (f"Interrupted (Ctrl-C): no checkpoint saved at the interrupt (--save_on_signal saves one); the last one is "
            f"{out / 'step_5'}: continue from it with --resume_from_checkpoint latest")
    assert lines[1:] == ["", said, "exit 130"], lines
