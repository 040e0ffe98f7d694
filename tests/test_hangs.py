"""A process that stops answering: the others must not wait the default 30 minutes in silence.
With --ddp_timeout the job ends within the timeout plus torchrun's grace, with one line that says
a collective timed out and at which step."""

import signal
import time

from helpers import error_lines, launch_in_background, make_synthetic_mnist, training_processes, wait_for_path

from utils.hangs import is_collective_timeout


def test_a_stopped_process_ends_the_job_with_one_line_naming_the_timeout_and_the_step(tmp_path):
    data = make_synthetic_mnist(tmp_path / "data", num_train=6000, num_test=50)
    out = tmp_path / "out"
    job = launch_in_background(["--data_dir", data, "--output_dir", out, "--epochs", "3", "--batch_size", "16",
                                "--checkpointing_steps", "10", "--ddp_timeout", "5"], num_processes=2)
    stopped = None
    try:
        wait_for_path(out / "step_10", job, timeout=180)
        (stopped,) = [p for p in training_processes(out) if p.environ().get("LOCAL_RANK") == "1"]
        stopped.send_signal(signal.SIGSTOP)  # a frozen process: alive, but never answering
        since = time.monotonic()
        output, _ = job.communicate(timeout=5 + 120)
        waited = time.monotonic() - since
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    # 5 s timeout, then torchrun gives the stopped process its shutdown grace (30 s) before SIGKILL
    assert waited < 5 + 60, waited
    lines = set(error_lines(_Output(output)))
    assert len(lines) == 1, output[-4000:]
    (line,) = lines
    assert "collective operation timed out after --ddp_timeout 5 s during optimizer step" in line, line
    step = int(line.split("optimizer step ")[1].split(":")[0])
    assert step > 10, line  # after the checkpoint that the test waited for
    assert not any(l.strip().startswith("File ") and "/scripts/" in l for l in output.splitlines()), output[-4000:]
    assert not (out / "results.json").exists()


class _Output:
    """error_lines() takes a finished process; a Popen's output is one merged string."""

    def __init__(self, text):
        self.stdout, self.stderr = text, ""


def test_timeouts_are_told_apart_from_other_runtime_errors():
    assert is_collective_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
                                              "for recv operation to complete"))
    assert is_collective_timeout(RuntimeError("[Rank 0] Watchdog caught collective operation timeout: "
                                              "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000)"))
    assert not is_collective_timeout(RuntimeError("CUDA out of memory"))
    assert not is_collective_timeout(ValueError("Timed out waiting"))  # not the backend's error type
