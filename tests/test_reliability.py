"""Jobs die: a killed rank, an interrupted save, a diverging loss. What survives, and how."""

import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (
    REPO,
    STOPPED_BY_SIGNAL,
    TRAIN_MNIST,
    assert_clean_user_error,
    launch,
    launch_in_background,
    launcher_args,
    make_synthetic_mnist,
    results,
    run,
    run_alone,
    training_processes,
    wait_for_path,
)
from jobs import finished_job, launch_jobs, read_job

from utils.errors import UserError
from utils.launch.launch_checks import check_enough_devices
from utils.run.checkpoints import TMP_PREFIX
from utils.run.run_folder import one_training_at_a_time

RESTART = REPO / "scripts" / "restart_on_failure.sh"
JOBS = REPO / "tests" / "jobs.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("reliability_data"), num_train=1024, num_test=101)


# 1,024 samples / 16 per batch = 64 batches, 32 per process: 32 optimizer steps per epoch.
COMMON = ["--epochs", "3", "--batch_size", "16", "--checkpointing_steps", "10"]


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    launch(["--data_dir", data, "--output_dir", out, *COMMON], num_processes=2)
    return out


@pytest.fixture(scope="module")
def one_process_runs(data, tmp_path_factory):
    """One process, uninterrupted ("full"), then resumed from its step_45 (13 batches into epoch 1, "resumed"), and a
    run whose loss diverges ("diverging"). The uninterrupted run is started with --resume_from_checkpoint latest too,
    into an empty folder, as a job script's every attempt is. Jobs of tests/jobs.py, which runs alone (`python
    tests/jobs.py`, as accelerate's one-process launcher runs a script: the launched one-process runs are
    test_one_training_per_folder_...'s), each forked from the one process that imported the libraries."""
    runs = tmp_path_factory.mktemp("one_process")
    args = ["--data_dir", data, "--epochs", "2", "--batch_size", "32", "--checkpointing_steps", "45"]
    jobs = {
        "full": [*args, "--output_dir", runs / "full", "--resume_from_checkpoint", "latest"],
        "resumed": [*args, "--output_dir", runs / "resumed", "--resume_from_checkpoint", runs / "full" / "step_45"],
        "diverging": ["--data_dir", data, "--output_dir", runs / "diverging", "--learning_rate", "1e30", "--batch_size",
                      "16", "--checkpointing_steps", "1"],
    }
    launch_jobs({name: [TRAIN_MNIST, "--cpu", *argv] for name, argv in jobs.items()}, [sys.executable], runs,
                env={"OMP_NUM_THREADS": "1"})  # the one thread per process that the launcher gives
    return runs


def test_one_process_mid_epoch_resume_is_bit_exact(one_process_runs):
    for name in ("full", "resumed"):
        finished_job(one_process_runs / name)
    full, resumed = results(one_process_runs / "full"), results(one_process_runs / "resumed")
    assert resumed["resumed_from"] == str(one_process_runs / "full" / "step_45")
    assert (one_process_runs / "resumed" / "model.safetensors").read_bytes() == \
        (one_process_runs / "full" / "model.safetensors").read_bytes()
    assert resumed["global_step"] == full["global_step"] == 64
    assert resumed["samples_seen"] == full["samples_seen"] == 2 * 1024


def test_resume_latest_with_no_checkpoint_starts_from_scratch(one_process_runs):
    proc = finished_job(one_process_runs / "full")
    assert "starting from scratch" in proc.stdout
    r = results(one_process_runs / "full")
    assert r["resumed_from"] is None and r["samples_seen"] == 2 * 1024


def _kill_rank_once_saved(launcher: subprocess.Popen, output_dir, step: int = 10, rank: int = 1) -> int:
    """SIGKILL the worker with LOCAL_RANK=rank as soon as step_{step} exists (step_10: mid-epoch 0)."""
    wait_for_path(output_dir / f"step_{step}", launcher)
    (worker,) = [p for p in training_processes(output_dir) if p.environ().get("LOCAL_RANK") == str(rank)]
    worker.kill()
    return worker.pid


@pytest.fixture
def another_job_on_port_29400():
    """Another job's rendezvous store on torchrun's default c10d port, 29400: without a rendezvous address
    of its own, a one-machine c10d launch would join that store instead of hosting one."""
    with socket.socket() as listener:
        try:
            listener.bind(("", 29400))
        except OSError:
            yield  # already taken, by something else on this machine: the case holds all the same
            return
        listener.listen()
        yield


def test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run(data, uninterrupted, tmp_path):
    """The restart wrapper runs the same command again after its first attempt was stopped by SIGTERM to rank 1's PID
    alone (one node's share of a preempted job, a `kill` by hand), with --save_on_signal: Accelerate's trigger tells
    rank 0, so both save the same step and exit with 128 + 15, at once. (A per-process stop would leave rank 0
    training while rank 1 waits in the save's barrier until --ddp_timeout.) The folder also holds a save killed
    half-way, `.tmp-step_30` without training_state.json (planted before the first attempt): neither attempt resumes
    from it, the first starts from scratch, the second from the signal's checkpoint, and the save of step_30 replaces
    it; --checkpoints_total_limit 2 leaves the two newest. (A rank SIGKILLed, restarted by the launcher:
    test_ctrl_c_saves_a_checkpoint_at_that_step_and_the_launcher_restarts_the_resumed_run_exactly.)"""
    out, exits = tmp_path / "killed", tmp_path / "exits"
    out.mkdir()
    half_written = shutil.copytree(uninterrupted / "step_30", out / ".tmp-step_30")
    (half_written / "training_state.json").unlink()
    (half_written / "model.safetensors").write_bytes(b"\x00" * 10)
    # jobs.py --alone runs the script unchanged and writes each process's exit status to exits.rank{N}.exit
    command = ["bash", RESTART, "1", *launcher_args(2), JOBS, "--alone", exits, TRAIN_MNIST, "--cpu",
               "--data_dir", data, "--output_dir", out, *COMMON, "--resume_from_checkpoint", "latest",
               "--checkpoints_total_limit", "2", "--save_on_signal"]  # a stop that hangs: the 120 s below
    log = tmp_path / "restarts.log"
    with log.open("w") as output:  # a file, not a pipe: read while the job runs, drained by nothing
        job = subprocess.Popen([str(c) for c in command], cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        # rank 1 found before its step_10, so that the signal lands at once: the run must not end first (96 steps)
        deadline = time.monotonic() + 120
        while not (rank_1 := [p for p in training_processes(out) if p.environ().get("LOCAL_RANK") == "1"]):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        wait_for_path(out / "step_10", job)
        signalled = time.monotonic()
        rank_1[0].send_signal(signal.SIGTERM)
        deadline = signalled + 120
        while not (first_exit := re.search(r"attempt 1 of 2 exited with status (\d+)", log.read_text(errors="replace"))):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.02)
        took = time.monotonic() - signalled
        # the first attempt's state, read before the second attempt's processes end (and rewrite the exit files)
        exit_statuses = read_job(exits, 2).statuses
        first_attempt = log.read_text(errors="replace")
        stopped = STOPPED_BY_SIGNAL.search(first_attempt)  # logged by rank 0, which got no signal
        assert stopped, first_attempt[-3000:]
        step = int(stopped[1])
        saved = out / f"step_{step}"
        saved_state = json.loads((saved / "training_state.json").read_text())
        random_states = {p.name for p in saved.glob("random_states_*.pkl")}
        temporary, finished = sorted(p.name for p in out.glob(".tmp-*")), (out / "results.json").exists()
        job.wait(timeout=300)
    finally:
        if job.poll() is None:  # the wrapper, its launcher, the agent and the workers: one session
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = log.read_text(errors="replace")
    assert took < 30, f"{took:.0f} s: ended by a timeout, not by the trigger"
    assert exit_statuses == [143, 143]
    assert first_exit[1] != "0"  # the launcher reports its workers' failure
    assert stopped[2] == str(saved) and saved_state["global_step"] == step
    assert random_states == {"random_states_0.pkl", "random_states_1.pkl"}
    assert temporary == [half_written.name] and not finished  # the signal's save left no temporary folder of its own

    assert job.returncode == 0, output[-4000:]
    assert "starting from scratch" in output.split("attempt 1 of 2 exited")[0], "the first attempt: no good checkpoint"
    resumed, reference = results(out), results(uninterrupted)
    assert resumed["resumed_from"] == str(saved) and TMP_PREFIX not in resumed["resumed_from"]
    assert f"Resumed from {resumed['resumed_from']}" in output
    assert not half_written.exists(), "the next save of step_30 replaced the half-written folder"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", TMP_PREFIX))) == ["step_80", "step_90"]
    # Resume is deterministic, so the result is exact, not merely close.
    assert (out / "model.safetensors").read_bytes() == (uninterrupted / "model.safetensors").read_bytes()
    for key in ("global_step", "samples_seen", "eval_accuracy", "eval_loss", "parameter_fingerprints"):
        assert resumed[key] == reference[key], key
    assert resumed["global_step"] == 3 * 32 and resumed["samples_seen"] == 3 * 1024


def test_ctrl_c_saves_a_checkpoint_at_that_step_and_the_launcher_restarts_the_resumed_run_exactly(
        data, uninterrupted, tmp_path, another_job_on_port_29400):
    """Ctrl-C in a terminal: SIGINT to every process of the job (the launcher, torchrun's agent, which passes it on
    too, the workers). With --save_on_signal it stops as SIGTERM does (Slurm's preemption through the batch scripts:
    torchrun's agent forwards a SIGTERM sent to the launcher, tests/test_image_classifier.py): every process finishes
    the same step and saves it, no traceback through our code.
    The same command then resumes it under in-launcher restarts (--max_restarts with the c10d rendezvous), and a rank
    of the resumed run is killed at its next checkpoint: the restarted attempt continues from a checkpoint, and the
    run matches the uninterrupted one bit for bit. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh
    store; with the agent's shared store the restarted workers read the dead attempt's gloo addresses and fail
    (Connection refused). PET_RDZV_ENDPOINT=localhost:0 puts the rendezvous store on a free port: port 29400 is taken
    during this run."""
    out = tmp_path / "out"
    job = launch_in_background(["--data_dir", data, "--output_dir", out, *COMMON, "--save_on_signal"], num_processes=2,
                               start_new_session=True, preexec_fn=sigint_as_a_terminal_leaves_it)
    try:
        wait_for_path(out / "step_10", job)
        os.killpg(job.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground process group
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0, "a run stopped early must not look finished"
    stopped = STOPPED_BY_SIGNAL.search(output)
    assert stopped, output[-3000:]
    assert f'File "{REPO}' not in output, output[-6000:]
    step, saved = int(stopped[1]), stopped[2]
    assert 10 < step < 3 * 32 and saved == str(out / f"step_{step}")  # the step at the signal, not step_10
    assert json.loads((out / f"step_{step}" / "training_state.json").read_text())["global_step"] == step
    assert not (out / "results.json").exists() and not list(out.glob(".tmp-*"))

    cmd = [*launcher_args(2), "--max_restarts", "1", "--rdzv_backend", "c10d", TRAIN_MNIST, "--cpu",
           "--data_dir", data, "--output_dir", out, *COMMON, "--resume_from_checkpoint", "latest"]
    job = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                           "PET_RDZV_ENDPOINT": "localhost:0"}, start_new_session=True)
    next_save = (step // 10 + 1) * 10
    try:
        _kill_rank_once_saved(job, out, next_save)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:  # a failed wait: the launcher, its agent and the workers, one session
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, output[-4000:]
    # the first attempt continues from the Ctrl-C's checkpoint, the restarted one from a checkpoint of its own
    (first, restarted) = re.findall(r"^.*Resumed from (\S+):", output, flags=re.MULTILINE)
    assert first == saved and restarted.startswith(str(out / "step_")), output[-4000:]
    assert int(restarted[len(str(out / "step_")):]) >= next_save
    resumed, reference = results(out), results(uninterrupted)
    assert resumed["resumed_from"] == restarted and resumed["samples_seen"] == reference["samples_seen"]
    assert (out / "model.safetensors").read_bytes() == (uninterrupted / "model.safetensors").read_bytes()
    for key in ("global_step", "samples_seen", "eval_accuracy", "eval_loss", "parameter_fingerprints"):
        assert resumed[key] == reference[key], key


def sigint_as_a_terminal_leaves_it() -> None:
    """Popen's preexec_fn for a job a test sends Ctrl-C (os.killpg(pid, SIGINT)): SIGINT at its default, as a terminal
    starts a foreground job. A suite started by a script with `&` (a shell without job control) runs with SIGINT
    ignored; an ignored signal stays ignored through exec, Python keeps it so, and the Ctrl-C would do nothing.
    (preexec_fn, unsafe with threads where it takes a lock: this one only calls sigaction.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def hold_the_lock(output_dir, held) -> None:
    """In a child process: takes --output_dir's lock as a training's main process does, then waits to be killed."""
    with one_training_at_a_time(output_dir, eval_only=False):
        held.set()
        time.sleep(600)


def test_one_training_per_folder_and_a_one_process_launch_stops_on_sigterm_or_says_what_ctrl_c_saved(data, tmp_path):
    """One process, as `accelerate launch` runs it itself (no torchrun). A lock holder SIGKILLed leaves no lock behind;
    a second training into a folder in use is refused, naming the first; Ctrl-C without --save_on_signal says in one
    line where the last checkpoint is; SIGTERM to the launcher alone (which forwards no signal) stops the training
    with a checkpoint."""
    out = tmp_path / "out"
    args = ["--data_dir", data, "--output_dir", out, "--epochs", "100", "--batch_size", "16", "--checkpointing_steps",
            "5", "--resume_from_checkpoint", "latest"]  # 100 epochs: it cannot finish before the signals land
    jobs = []

    def start(*more) -> subprocess.Popen:
        """accelerate launch, its output into a file, not a pipe: nothing must drain it while the test waits."""
        log = tmp_path / f"launch_{len(jobs)}.log"
        with log.open("w") as output:
            jobs.append(subprocess.Popen([str(c) for c in [*launcher_args(1), TRAIN_MNIST, "--cpu", *args, *more]],
                                         cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=sigint_as_a_terminal_leaves_it))  # noqa: PLW1509
        jobs[-1].log = log
        return jobs[-1]

    def trainer(job) -> psutil.Process:
        (child,) = psutil.Process(job.pid).children()  # the launcher runs the training as its one child
        return child

    def output_at_the_end(job, training: psutil.Process, what: str) -> str:
        """The job's output once the launcher and the training it ran have both ended."""
        job.wait(timeout=60)
        assert psutil.wait_procs([training], timeout=30)[1] == [], f"the training outlived {what}"
        return job.log.read_text(errors="replace")

    def newest_step() -> int:
        return max(int(path.name[len("step_"):]) for path in out.glob("step_*"))

    # a fork of this process (no imports to wait for) holds the lock, SIGKILLed: no handler runs, the kernel drops it
    held = multiprocessing.get_context("fork").Event()
    killed = multiprocessing.get_context("fork").Process(target=hold_the_lock, args=(out, held))
    killed.start()
    held_it = held.wait(timeout=30)
    killed.kill()
    killed.join()
    assert held_it, "the holder never took the lock"
    assert (out / "run.lock").read_text().startswith(f"pid {killed.pid} on "), "the holder's name, left behind"
    try:
        first = start()  # takes the folder all the same
        deadline = time.monotonic() + 120
        while holder_pid(out) in (None, killed.pid):  # until the first training's main process holds it
            assert first.poll() is None, f"the first training ended: {first.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"after 120 s, {out / 'run.lock'} names no training"
            time.sleep(0.02)
        holder = trainer(first)
        assert holder_pid(out) == holder.pid
        # a restart while the first runs: the script itself (the lock is the same under a launcher, which would
        # only add its own start-up)
        second = run_alone(args, check=False)
        assert_clean_user_error(second, f"--output_dir {out} is in use by another training",
                                f"pid {holder.pid} on {socket.gethostname()}")
        assert "Resumed from" not in second.stdout + second.stderr and not (out / "results.json").exists()

        wait_for_path(out / "step_5", first)
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C
        output = output_at_the_end(first, holder, "Ctrl-C")
        assert first.returncode != 0 and f'File "{REPO}' not in output, output[-6000:]
        interrupted_at = newest_step()
        said = re.findall(r"^Interrupted \(Ctrl-C\): no checkpoint saved at the interrupt \(--save_on_signal saves "
                          r"one\); the last one is (\S+): continue from it with --resume_from_checkpoint latest$",
                          output, flags=re.MULTILINE)
        assert said == [str(out / f"step_{interrupted_at}")], output[-3000:]
        assert not (out / "results.json").exists()

        third = start("--save_on_signal")
        wait_for_path(out / f"step_{(interrupted_at // 5 + 1) * 5}", third)
        training = trainer(third)
        third.send_signal(signal.SIGTERM)  # to the launcher alone: `kill PID`, a container's stop
        output = output_at_the_end(third, training, "its launcher")
        stopped = STOPPED_BY_SIGNAL.search(output)
        assert stopped and f"Resumed from {out / f'step_{interrupted_at}'}" in output, output[-3000:]
        assert int(stopped[1]) > interrupted_at and stopped[2] == str(out / f"step_{newest_step()}")
        assert not (out / "results.json").exists()
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def holder_pid(output_dir) -> int | None:
    """The pid that OUTPUT_DIR/run.lock names ("pid P on HOST since TIME"), or None while it names none."""
    found = re.match(r"pid (\d+) on ", (Path(output_dir) / "run.lock").read_text())
    return int(found[1]) if found else None


def test_diverging_loss_stops_with_the_step_and_last_good_checkpoint(one_process_runs):
    proc = finished_job(one_process_runs / "diverging", fails=True)
    output, out = proc.stdout, one_process_runs / "diverging"
    assert proc.returncode == 1, output[-6000:]
    (line,) = [l for l in output.splitlines() if l.startswith("error: ")]
    assert "the loss became nan at step 2" in line and str(out / "step_1") in line, line
    assert "Traceback" not in output
    assert not (out / "results.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 loss scaling needs a CUDA GPU (Accelerate has no "
                    "GradScaler on the CPU); CI has none")
def test_fp16_overflow_steps_are_counted(data, tmp_path):
    # A learning rate this large makes the scaled gradients overflow; the GradScaler skips those steps.
    run([*launcher_args(1), TRAIN_MNIST, "--data_dir", data, "--output_dir", tmp_path, "--epochs", "1",
         "--mixed_precision", "fp16", "--learning_rate", "10"])
    r = results(tmp_path)
    assert r["grad_scaler"] is True and r["mixed_precision"] == "fp16"
    assert r["optimizer_steps_skipped"] >= 1  # at least the first step at scale 65536


def test_more_local_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(UserError, match="4 processes on this machine but only 2 GPU"):
        check_enough_devices(cpu=False)
    check_enough_devices(cpu=True)  # CPU processes are not bound to GPUs
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_enough_devices(cpu=False)


def test_restart_wrapper_gives_up_after_max_restarts(tmp_path):
    proc = run(["bash", RESTART, "2", "false"], check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("exited with status 1") == 3 and "giving up after 3 attempts" in proc.stderr
    assert run(["bash", RESTART, "x", "true"], check=False).returncode == 2
