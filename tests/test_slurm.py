"""scripts/slurm/*.sbatch submitted with `sbatch --wait` to a real Slurm cluster started on
this machine (tests/slurm_cluster.py), in CPU mode, and checked by their results.json."""

import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, STOPPED_BY_SIGNAL, make_synthetic_mnist, results, training_processes
from slurm_cluster import start_cluster

from utils.checkpoints import find_latest_checkpoint

SLURM_DIR = REPO / "scripts" / "slurm"
SHELL_SCRIPTS = sorted(p.relative_to(REPO) for p in [*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])
NUM_TRAIN, NUM_TEST, BATCH_SIZE, EPOCHS = 1920, 101, 16, 2
# 1,920 samples over 2 processes in batches of 16: 60 optimizer steps per epoch.
STEPS_PER_EPOCH = math.ceil(NUM_TRAIN / (2 * BATCH_SIZE))


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=str)
def test_shell_scripts_pass_bash_n_and_shellcheck(script):
    syntax = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it where it can)")
    lint = subprocess.run(["shellcheck", script], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("slurm_data"), num_train=NUM_TRAIN, num_test=NUM_TEST)


def script_args(data, output_dir, *extra):
    return ["scripts/train_mnist.py", "--data_dir", data, "--output_dir", output_dir,
            "--epochs", str(EPOCHS), "--batch_size", str(BATCH_SIZE), *extra]


def submit(cluster, log_dir, gpus_per_node, batch_script, args) -> subprocess.Popen:
    """`sbatch --wait` in CPU mode, from the repository root as users submit; returns at once."""
    cmd = ["sbatch", "--wait", "--parsable", f"--gpus-per-node={gpus_per_node}", f"--output={log_dir}/%x-%j.out",
           SLURM_DIR / batch_script, *args]
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**cluster.env, "CPU": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(cluster, sbatch: subprocess.Popen, job_id: str, log_dir, timeout=300):
    """Wait for `sbatch --wait`; returns the job's log."""
    try:
        _, stderr = sbatch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sbatch.kill()
        raise AssertionError(f"job {job_id} did not finish in {timeout} s\n{cluster.log_tail()}") from None
    # srun forwards each node's output in chunks, not lines: one node's bytes can split a
    # multi-byte progress-bar character of the other's.
    logs = "\n".join(p.read_text(errors="replace") for p in log_dir.glob(f"*-{job_id}.out"))
    assert sbatch.returncode == 0, f"sbatch exited {sbatch.returncode}: {stderr}\n{logs[-4000:]}"
    return logs


def sigterm_is_pending(proc) -> bool:
    """Sent to the process but not yet handled (it is stopped): /proc's pending-signal masks."""
    masks = [int(line.split()[1], 16) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


def preempt_mid_epoch(cluster, jobs: dict, num_processes=2, timeout=180) -> dict:
    """USR1 to each job's batch shell once its epoch_0 is saved, as `--signal=B:USR1@120`
    sends it before the time limit. `jobs`: name -> (sbatch, output_dir); returns the job ids.

    The tiny model trains an epoch in about a second, so that the signal surely lands
    mid-epoch each job's training processes are frozen (SIGSTOP) from just before the USR1
    until the SIGTERM that its batch script makes of it has reached each of them; then
    they go on. Every step of the signal's way (Slurm, batch script, launcher, training
    processes) is the real one.
    """
    # --parsable prints the id when the job is submitted
    job_ids = {name: sbatch.stdout.readline().split(";")[0].strip() for name, (sbatch, _) in jobs.items()}
    deadline = time.monotonic() + timeout
    frozen = {}
    try:
        while len(frozen) < len(jobs):
            for name, (sbatch, output_dir) in jobs.items():
                if name in frozen:
                    continue
                assert sbatch.poll() is None, f"{name} ended before its first checkpoint\n{cluster.log_tail()}"
                if find_latest_checkpoint(output_dir) is not None:
                    frozen[name] = training_processes(output_dir)
                    assert len(frozen[name]) == num_processes, frozen[name]
                    for worker in frozen[name]:
                        worker.suspend()
                    cluster.run("scancel", "--batch", "--signal=USR1", job_ids[name])
            assert time.monotonic() < deadline, f"no checkpoint after {timeout} s\n{cluster.log_tail()}"
            time.sleep(0.02)
        workers = [worker for group in frozen.values() for worker in group]
        while not all(sigterm_is_pending(worker) for worker in workers):
            assert time.monotonic() < deadline, f"no SIGTERM reached the training\n{cluster.log_tail()}"
            time.sleep(0.05)
    finally:
        for worker in (worker for group in frozen.values() for worker in group):
            worker.resume()
    return job_ids


def start_when_requeued(cluster, sbatch: subprocess.Popen, job_id, timeout=180) -> None:
    """Lift the 2 minutes Slurm holds a requeued job."""
    deadline = time.monotonic() + timeout
    while cluster.job_field(job_id, "Restarts") == "0" or cluster.job_state(job_id) != "PENDING":
        if sbatch.poll() is not None:  # finished without a requeue: the tests below say so
            return
        assert time.monotonic() < deadline, f"job {job_id} was not requeued\n{cluster.log_tail()}"
        time.sleep(0.1)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


@pytest.fixture(scope="module")
def jobs(cluster, data, tmp_path_factory):
    """Both batch scripts at once, on the same data, with their default flags: one node
    with 2 GPUs, two nodes with 1 GPU each; both preempted in their second epoch."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    submitted = {
        "one_node": submit(cluster, root, 2, "submit_multigpu.sbatch", script_args(data, root / "one_node")),
        "two_nodes": submit(cluster, root, 1, "submit_multinode.sbatch", script_args(data, root / "two_nodes")),
    }
    job_ids = preempt_mid_epoch(cluster, {name: (sbatch, root / name) for name, sbatch in submitted.items()})
    for name, sbatch in submitted.items():
        start_when_requeued(cluster, sbatch, job_ids[name])
    return {name: (root / name, job_ids[name], finish(cluster, sbatch, job_ids[name], root))
            for name, sbatch in submitted.items()}


def assert_complete_run(r, num_processes):
    assert r["num_processes"] == num_processes
    assert r["eval_samples"] == NUM_TEST
    assert r["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert r["samples_seen"] == EPOCHS * NUM_TRAIN
    assert len(r["parameter_fingerprints"]) == num_processes
    assert len(set(r["parameter_fingerprints"])) == 1, "replicas hold different weights"
    assert r["eval_accuracy"] >= 0.9


def test_multigpu_job_takes_its_process_count_from_the_allocation(jobs):
    output_dir, _, log = jobs["one_node"]
    assert_complete_run(results(output_dir), num_processes=2)  # --gpus-per-node=2
    assert ": 2 processes" in log


def test_multinode_job_runs_one_machine_rank_per_node(jobs):
    output_dir, job_id, log = jobs["two_nodes"]
    assert_complete_run(results(output_dir), num_processes=2)  # 2 nodes x --gpus-per-node=1
    assert "2 nodes x 1 processes" in log
    # each srun task got its own rank, on its own node (not machine_rank 0 everywhere)
    assert "node1: machine_rank 0" in log and "node2: machine_rank 1" in log
    port = 20000 + int(job_id) % 20000
    assert f"machine 0 at 127.0.0.1:{port}" in log


@pytest.mark.parametrize("name", ["one_node", "two_nodes"])
def test_preempted_job_saved_at_the_signal_requeued_and_resumed_from_there(jobs, name):
    output_dir, _, log = jobs[name]
    assert "USR1" in log and ", run 2" in log, f"the job was not interrupted and requeued:\n{log[-3000:]}"
    stopped = STOPPED_BY_SIGNAL.search(log)
    assert stopped, f"no checkpoint at the signal:\n{log[-3000:]}"
    step = int(stopped[1])
    assert STEPS_PER_EPOCH < step < EPOCHS * STEPS_PER_EPOCH  # in the second epoch, where it was signalled
    r = results(output_dir)
    assert r["resumed_from"] == stopped[2] == str(output_dir / f"step_{step}")
    assert_complete_run(r, num_processes=2)  # step and sample counts continue across the requeue
    # the batch script's defaults: a checkpoint every epoch besides the one at the signal
    assert sorted(p.name for p in output_dir.glob("epoch_*")) == ["epoch_0", "epoch_1"]


def test_preempted_one_node_and_two_node_jobs_end_bit_identical(jobs):
    """Same world size, same data: neither the topology nor where the requeue fell changes a bit."""
    one, two = results(jobs["one_node"][0]), results(jobs["two_nodes"][0])
    for key in ("parameter_fingerprints", "buffer_fingerprints", "eval_accuracy", "eval_loss", "train_loss",
                "global_step", "samples_seen"):
        assert one[key] == two[key], key


def test_job_without_gpus_stops_with_one_clear_line(cluster, tmp_path):
    proc = subprocess.run(
        ["sbatch", "--wait", "--gpus-per-node=0", f"--output={tmp_path}/%x-%j.out",
         str(SLURM_DIR / "submit_multigpu.sbatch")],
        cwd=REPO, env={**cluster.env, "CPU": "1"}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    (log,) = [p.read_text(errors="replace") for p in tmp_path.glob("*.out")]
    assert log.strip() == (
        "error: the job has no GPUs; submit with --gpus-per-node=N, or set PROCESSES_PER_NODE (with CPU=1 for CPUs)"
    )
