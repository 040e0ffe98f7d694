"""A process that stops answering: the others must not wait the default 30 minutes in silence.
With --ddp_timeout the job ends within the timeout plus torchrun's grace, with one line that says
a collective timed out and at which step."""

import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import REPO, error_lines, launch_in_background, make_synthetic_mnist, training_processes, wait_for_path

from utils.run.hangs import collective_failure

# Once a process has failed, torchrun's agent sends the others SIGTERM and, this many seconds later,
# SIGKILL (a SIGSTOPped process only dies of that). Fixed in torch 2.14's agent (_stop_workers):
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT only sets the grace after a signal to the launcher.
SHUTDOWN_GRACE = 30


# Under a loaded CI machine the start-up's legitimate waits reach 5 s (measured: rank 1 waits 5.0 s at
# main_process_first's barrier while rank 0 imports torchvision and evaluate, beside 3 busy loops on 2 cores);
# a 5 s timeout ended such runs before their first checkpoint. 20 s: four times that wait.
DDP_TIMEOUT = 20


def test_a_stopped_process_ends_the_job_with_one_line_naming_the_timeout_and_the_step(tmp_path):
    data = make_synthetic_mnist(tmp_path / "data", num_train=6000, num_test=50)
    out = tmp_path / "out"
    job = launch_in_background(["--data_dir", data, "--output_dir", out, "--epochs", "3", "--batch_size", "16",
                                "--checkpointing_steps", "10", "--ddp_timeout", str(DDP_TIMEOUT)], num_processes=2)
    stopped = None
    try:
        wait_for_path(out / "step_10", job, timeout=180)
        (stopped,) = [p for p in training_processes(out) if p.environ().get("LOCAL_RANK") == "1"]
        stopped.send_signal(signal.SIGSTOP)  # a frozen process: alive, but never answering
        since = time.monotonic()
        output, _ = job.communicate(timeout=DDP_TIMEOUT + SHUTDOWN_GRACE + 120)
        waited = time.monotonic() - since
        assert not stopped.is_running(), "the launcher ended but left the stopped process behind"
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    # the timeout, rank 0's exit, the shutdown grace for the stopped process, its SIGKILL (measured: 37 s with 5 s)
    assert waited < DDP_TIMEOUT + SHUTDOWN_GRACE + 15, waited
    lines = set(error_lines(_Output(output)))
    assert len(lines) == 1, output[-4000:]
    (line,) = lines
    assert f"a collective operation timed out after --ddp_timeout {DDP_TIMEOUT} s, with " in line, line
    assert "another process stopped answering" in line and "raise --ddp_timeout" in line, line
    steps = int(line.split(", with ")[1].split(" optimizer steps done")[0])
    assert steps >= 10, line  # the test waited for the checkpoint of step 10
    assert not any(l.strip().startswith("File ") and "/scripts/" in l for l in output.splitlines()), output[-4000:]
    assert not (out / "results.json").exists()


class _Output:
    """error_lines() takes a finished process; a Popen's output is one merged string."""

    def __init__(self, text):
        self.stdout, self.stderr = text, ""


def _collectives_against(rank, port, errors):
    """Rank 0 all-reduces three times with rank 1, which joins in none: first it does not answer (past the
    first group's timeout), then rank 0 tries that group again (gloo closed its connections at the timeout),
    then rank 1 exits (within the second group's timeout)."""
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    hangs = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    exits = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    if rank == 1:
        time.sleep(2)
        os._exit(0)
    for group in (hangs, hangs, exits):
        try:
            dist.all_reduce(torch.ones(1), group=group)
            errors.put(("no error", ""))
        except Exception as err:  # sent back as its type's name and message: the parent classifies it
            errors.put((type(err).__name__, str(err)))
    errors.close()
    errors.join_thread()  # the queue's feeder thread has sent both
    os._exit(0)  # gloo's threads may still wait for the peer; do not join them


def test_what_this_torch_raises_is_told_apart():
    """The messages come from the installed torch (gloo): a torch upgrade that rewords them fails here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    errors = context.Queue()
    processes = [context.Process(target=_collectives_against, args=(rank, port, errors)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        raised = [errors.get(timeout=120) for _ in range(3)]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(name in ("RuntimeError", "DistBackendError") for name, _ in raised), raised
    # What DDP's next collective met in CI after another one had timed out: the closed connection, not the timeout
    assert raised[1][1] == "Application timeout caused pair closure", raised
    kinds = [collective_failure(RuntimeError(message)) for _, message in raised]
    assert kinds == ["timeout", "timeout", "peer gone"], raised


def test_other_errors_pass_through():
    assert collective_failure(RuntimeError("[Rank 0] Watchdog caught collective operation timeout: "
                                           "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000)")) == "timeout"
    assert collective_failure(RuntimeError("CUDA out of memory")) is None
    assert collective_failure(ValueError("Timed out waiting")) is None  # not the backend's error type


def test_a_timeout_outside_the_training_loop_is_one_line_naming_the_phase():
    """Both scripts run main() inside collective_timeouts_named(args.ddp_timeout): loading a checkpoint, --eval_only's
    evaluation and the final save hang in collectives too."""

    import pytest

    from utils.errors import UserError
    from utils.run.hangs import collective_timeouts_named

    with pytest.raises(UserError, match=r"timed out after --ddp_timeout 5 s, outside the training loop \(starting, "
                                        r"loading a checkpoint, evaluating or saving\): another process"):
        with collective_timeouts_named(5):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                               "5000ms for recv operation to complete")
    for script in ("train_mnist.py", "train_image_classifier.py"):
        assert main_runs_inside_collective_timeouts_named(REPO / "scripts" / script), script


def main_runs_inside_collective_timeouts_named(script) -> bool:
    """The script's `if __name__ == "__main__":` block calls main(args) inside a `with` that holds
    collective_timeouts_named(args.ddp_timeout) (alone or beside other context managers, as one_training_at_a_time)."""
    import ast

    def is_call(node, name, args) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
                and [ast.unparse(arg) for arg in node.args] == [args])

    (main_block,) = [node for node in ast.parse(Path(script).read_text()).body
                     if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
    return any(isinstance(node, ast.With)
               and any(is_call(item.context_expr, "collective_timeouts_named", "args.ddp_timeout") for item in node.items)
               and any(is_call(inner, "main", "args") for statement in node.body for inner in ast.walk(statement))
               for node in ast.walk(main_block))
