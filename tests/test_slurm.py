"""scripts/slurm/*.sbatch submitted with `sbatch --wait` to a real Slurm cluster started on
this machine (tests/slurm_cluster.py), in CPU mode, and checked by their results.json."""

import math
import shutil
import subprocess
import time

import pytest
from helpers import REPO, make_synthetic_mnist, results
from slurm_cluster import start_cluster

from utils.checkpoints import find_latest_checkpoint

SLURM_DIR = REPO / "scripts" / "slurm"
SHELL_SCRIPTS = sorted(p.relative_to(REPO) for p in [*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])
NUM_TRAIN, NUM_TEST, BATCH_SIZE, EPOCHS = 1920, 101, 16, 2
# 1,920 samples over 2 processes in batches of 16: 60 optimizer steps per epoch, enough for
# the preemption signal to land while the job trains.
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


def finish(cluster, sbatch: subprocess.Popen, log_dir, timeout=300):
    """Wait for `sbatch --wait`; returns (job id, the job's log)."""
    try:
        stdout, stderr = sbatch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sbatch.kill()
        raise AssertionError(f"job did not finish in {timeout} s\n{cluster.log_tail()}") from None
    job_id = stdout.split()[0] if stdout.split() else "?"
    # srun forwards each node's output in chunks, not lines: one node's bytes can split a
    # multi-byte progress-bar character of the other's.
    logs = "\n".join(p.read_text(errors="replace") for p in log_dir.glob(f"*-{job_id}.out"))
    assert sbatch.returncode == 0, f"sbatch exited {sbatch.returncode}: {stderr}\n{logs[-4000:]}"
    return job_id, logs


def preempt_once_training_is_under_way(cluster, sbatch: subprocess.Popen, output_dir, timeout=180):
    """USR1 to the batch shell once the first checkpoint exists, as `--signal=B:USR1@120` sends
    it before the time limit; then lift the 2 minutes Slurm holds a requeued job."""
    job_id = sbatch.stdout.readline().split(";")[0].strip()  # --parsable prints the id when submitted
    deadline = time.monotonic() + timeout
    while find_latest_checkpoint(output_dir) is None:
        assert sbatch.poll() is None, f"job {job_id} ended before its first checkpoint\n{cluster.log_tail()}"
        assert time.monotonic() < deadline, f"job {job_id}: no checkpoint after {timeout} s\n{cluster.log_tail()}"
        time.sleep(0.05)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    while cluster.job_field(job_id, "Restarts") == "0" or cluster.job_state(job_id) != "PENDING":
        if sbatch.poll() is not None:  # finished without a requeue: the test below says so
            return
        assert time.monotonic() < deadline, f"job {job_id} was not requeued\n{cluster.log_tail()}"
        time.sleep(0.1)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


@pytest.fixture(scope="module")
def jobs(cluster, data, tmp_path_factory):
    """Both batch scripts at once, on the same data: one node with 2 GPUs, preempted while
    it trains, and two nodes with 1 GPU each, left alone."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    one_node = submit(cluster, root, 2, "submit_multigpu.sbatch",
                      script_args(data, root / "one_node", "--checkpointing_steps", "3"))
    two_nodes = submit(cluster, root, 1, "submit_multinode.sbatch", script_args(data, root / "two_nodes"))
    preempt_once_training_is_under_way(cluster, one_node, root / "one_node")
    return {"one_node": (root / "one_node", *finish(cluster, one_node, root)),
            "two_nodes": (root / "two_nodes", *finish(cluster, two_nodes, root))}


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
    # the batch script's defaults: a checkpoint every epoch, so a requeued job can resume
    assert sorted(p.name for p in output_dir.glob("epoch_*")) == ["epoch_0", "epoch_1"]


def test_preempted_job_requeued_itself_and_resumed_from_its_newest_checkpoint(jobs):
    output_dir, _, log = jobs["one_node"]
    assert "USR1" in log and "run 2," in log, f"the job was not interrupted and requeued:\n{log[-3000:]}"
    r = results(output_dir)
    assert r["resumed_from"] is not None and "step_" in r["resumed_from"], r["resumed_from"]
    resumed_at = int(r["resumed_from"].rsplit("step_", 1)[1])
    assert 3 <= resumed_at < EPOCHS * STEPS_PER_EPOCH and resumed_at % 3 == 0
    assert_complete_run(r, num_processes=2)  # step and sample counts continue across the requeue


def test_preempted_one_node_job_ends_exactly_like_the_uninterrupted_two_node_job(jobs):
    """Same world size, same data: neither the topology nor the requeue changes a bit."""
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
