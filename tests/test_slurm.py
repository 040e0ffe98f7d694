"""scripts/slurm/*.sbatch submitted with `sbatch` to a real Slurm cluster started on this
machine (tests/slurm_cluster.py), in CPU mode, followed by their state until they ended for good,
and checked by their results.json."""

import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import REPO, STOPPED_BY_SIGNAL, make_synthetic_mnist, results, training_processes
from slurm_cluster import CPUS_PER_NODE, ENDED, GPUS_PER_NODE, NODES, start_cluster

from utils.run.checkpoints import find_latest_checkpoint

SLURM_DIR = REPO / "scripts" / "slurm"
SHELL_SCRIPTS = sorted(p.relative_to(REPO) for p in [*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])
NUM_TRAIN, NUM_TEST, BATCH_SIZE, EPOCHS = 1920, 101, 16, 3
# 1,920 samples over 2 processes in batches of 16: 60 optimizer steps per epoch. Three epochs: each job is preempted
# in its second epoch (USR1) and, requeued, in its third (SIGTERM only).
STEPS_PER_EPOCH = math.ceil(NUM_TRAIN / (2 * BATCH_SIZE))


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=str)
def test_shell_scripts_pass_bash_n_and_shellcheck(script):
    syntax = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; .ci/run installs it where it can)")
    lint = subprocess.run(["shellcheck", script], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("cpus_on_node, threads", [(8, 4), (3, 1), (1, 1)])
def test_multigpu_job_gives_each_process_its_share_of_the_nodes_cpus_as_threads(tmp_path, cpus_on_node, threads):
    """Without Slurm: the batch script run by bash as sbatch would, with an `accelerate` that prints its arguments.
    2 GPUs on the node: 2 processes, each with OMP_NUM_THREADS = CPUs // 2, at least 1: never more threads than CPUs."""
    stub = tmp_path / "bin" / "accelerate"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "OMP_NUM_THREADS=$OMP_NUM_THREADS $*"\n')
    stub.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS" and not key.startswith("SLURM")}
    env.update(PATH=f"{stub.parent}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NAME="job",
               SLURMD_NODENAME="node0", SLURM_GPUS_ON_NODE="2", SLURM_CPUS_ON_NODE=str(cpus_on_node))
    proc = subprocess.run(["bash", SLURM_DIR / "submit_multigpu.sbatch"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (launched,) = [line for line in proc.stdout.splitlines() if line.startswith("OMP_NUM_THREADS=")]
    assert launched.startswith(f"OMP_NUM_THREADS={threads} launch ") and " --num_processes 2 " in launched, launched


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


def submit(cluster, log_dir, gpus_per_node, batch_script, args, cpus_per_gpu=1, env=None) -> str:
    """`sbatch` in CPU mode, from the repository root as users submit; returns the job id.
    --cpus-per-gpu: the scripts ask for 8, more than the test nodes have."""
    cmd = ["sbatch", "--parsable", f"--gpus-per-node={gpus_per_node}", f"--cpus-per-gpu={cpus_per_gpu}",
           f"--output={log_dir}/%x-%j.out", SLURM_DIR / batch_script, *args]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env={**cluster.env, "CPU": "1", **(env or {})},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(";")[0].strip()  # --parsable: "id" or "id;cluster"


def job_log(log_dir, job_id) -> str:
    # srun forwards each node's output in chunks, not lines: one node's bytes can split a
    # multi-byte progress-bar character of the other's.
    return "\n".join(p.read_text(errors="replace") for p in log_dir.glob(f"*-{job_id}.out"))


def finish(cluster, job_id: str, log_dir, timeout=300) -> str:
    """Wait until the job has ended for good (requeues included) and succeeded; returns its log."""
    exit_code = cluster.wait_for_job(job_id, timeout)
    logs = job_log(log_dir, job_id)
    assert exit_code == 0, f"job {job_id} exited {exit_code}\n{logs[-4000:]}"
    return logs


def sigterm_in_masks(proc, *masks) -> bool:
    """SIGTERM in any of the process's signal masks in /proc (SigPnd, SigCgt...)."""
    values = [int(line.split()[1], 16) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
              if line.startswith(tuple(f"{mask}:" for mask in masks))]
    return any(value & (1 << (signal.SIGTERM - 1)) for value in values)


def sigterm_is_pending(proc) -> bool:
    """Sent to the process but not yet handled (it is stopped)."""
    return sigterm_in_masks(proc, "SigPnd", "ShdPnd")


class KillRankOnNode2:
    """For preempt_mid_epoch: at the first checkpoint, SIGKILL the training process on node2; ready once
    the launchers have started new processes on both nodes, these catch SIGTERM (--save_on_signal's
    handler) and rank 0 has resumed from epoch_0. Not earlier: processes still importing and loading
    when the preemption comes have only Slurm's KillWait (10 s) to get to a step and save, which a
    loaded 2-core machine does not always give them."""

    def __init__(self, job_log_text):
        self.job_log_text = job_log_text  # () -> the job's log so far
        self.dead = None

    def __call__(self, output_dir) -> bool:
        try:
            workers = training_processes(output_dir)
            if self.dead is None:
                if find_latest_checkpoint(output_dir) is not None:
                    (worker,) = [w for w in workers if w.environ().get("SLURMD_NODENAME") == "node2"]
                    worker.kill()
                    self.dead = {w.pid for w in workers}
                return False
            return (len(workers) == 2 and not self.dead & {w.pid for w in workers}
                    and all(sigterm_in_masks(w, "SigCgt") for w in workers)
                    and f"Resumed from {Path(output_dir) / 'epoch_0'}:" in self.job_log_text())
        except (psutil.NoSuchProcess, FileNotFoundError):  # a process of the first attempt just ended
            return False


def first_checkpoint(output_dir) -> bool:
    return find_latest_checkpoint(output_dir) is not None


def end_of_second_epoch(output_dir) -> bool:
    """epoch_1 is the newest checkpoint: the requeued run is in its third epoch."""
    latest = find_latest_checkpoint(output_dir)
    return latest is not None and latest.name == "epoch_1"


def usr1_to_batch_scripts(cluster, job_ids: dict) -> None:
    """What `--signal=B:USR1@120` sends before the time limit."""
    for job_id in job_ids.values():
        cluster.run("scancel", "--batch", "--signal=USR1", job_id)


def preempt_by_urgent_job(cluster, job_ids: dict) -> None:
    """A job of the `urgent` partition that needs every GPU: Slurm cancels the jobs in its way (GraceTime 0),
    SIGTERM to every process of theirs, batch scripts included, and SIGKILL 10 s (KillWait) later."""
    cluster.run("sbatch", "--partition=urgent", f"--nodes={len(NODES)}", f"--gpus-per-node={GPUS_PER_NODE}",
                "--output=/dev/null", "--wrap=true")


def preempt_mid_epoch(cluster, jobs: dict, preempt=usr1_to_batch_scripts, ready=None, num_processes=2, timeout=180):
    """`preempt(cluster, job_ids)` once every job's epoch_0 is saved (or `ready[name](output_dir)`).
    `jobs`: name -> (job_id, output_dir); returns the CPUs each job's training processes may run on.

    The tiny model trains an epoch in about a second, so that the signal surely lands
    mid-epoch each job's training processes are frozen (SIGSTOP) from their first checkpoint
    until the SIGTERM that the preemption becomes has reached each of them; then they go on.
    Every step of the signal's way (Slurm, batch script, launcher, training processes) is the
    real one.
    """
    job_ids = {name: job_id for name, (job_id, _) in jobs.items()}
    deadline = time.monotonic() + timeout
    frozen = {}
    next_state_check = 0
    try:
        while len(frozen) < len(jobs):
            if time.monotonic() > next_state_check:  # once a second: each look is a scontrol call
                for name, job_id in job_ids.items():
                    assert name in frozen or not cluster.job_ended(job_id), (
                        f"{name} ended before it was preempted\n{job_log(jobs[name][1].parent, job_id)[-3000:]}")
                next_state_check = time.monotonic() + 1
            for name, (_, output_dir) in jobs.items():
                if name in frozen:
                    continue
                if (ready or {}).get(name, first_checkpoint)(output_dir):
                    frozen[name] = training_processes(output_dir)
                    assert len(frozen[name]) == num_processes, frozen[name]
                    for worker in frozen[name]:
                        worker.suspend()
            assert time.monotonic() < deadline, f"{set(jobs) - set(frozen)} not ready\n{cluster.log_tail()}"
            time.sleep(0.02)
        cpus = {name: [set(worker.cpu_affinity()) for worker in group] for name, group in frozen.items()}
        preempt(cluster, job_ids)
        workers = [worker for group in frozen.values() for worker in group]
        while not all(sigterm_is_pending(worker) for worker in workers):
            assert time.monotonic() < deadline, f"no SIGTERM reached the training\n{cluster.log_tail()}"
            time.sleep(0.05)
    finally:
        for worker in (worker for group in frozen.values() for worker in group):
            worker.resume()
    return cpus


def start_when_requeued(cluster, job_ids, restarts: int, timeout=180) -> None:
    """Lift the 2 minutes Slurm holds each job requeued for the `restarts`th time, once the run before has ended on
    its nodes. All jobs in one loop: each is lifted as soon as it is requeued, not after the others."""
    deadline = time.monotonic() + timeout
    waiting = set(job_ids)
    while waiting:
        requeued = []
        for job_id in sorted(waiting):
            fields = cluster.job_fields(job_id)
            if fields.get("JobState") in ENDED:  # ended without a requeue: the tests below say so
                waiting.discard(job_id)
            elif fields.get("Restarts") == str(restarts) and fields.get("JobState") == "PENDING":
                requeued.append(job_id)
        if requeued:
            # Not in the second the run ended: the node revoked that run's credential with a time in whole
            # seconds and refuses a credential made in the same second ("Job credential revoked": the job fails).
            time.sleep(2 - time.time() % 1)
            for job_id in requeued:
                cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            waiting.difference_update(requeued)
        elif waiting:
            assert time.monotonic() < deadline, f"jobs {sorted(waiting)} were not requeued\n{cluster.log_tail()}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def jobs(cluster, data, tmp_path_factory):
    """Both batch scripts at once, on the same data, with their default flags: one node with 2 GPUs, two nodes
    with 1 GPU each. Each job is preempted twice: in its second epoch by USR1 (what `--signal=B:USR1@120` sends
    before the time limit); requeued, in its third epoch by a cluster that sends no USR1 at preemption, only
    SIGTERM (preempt_by_urgent_job); requeued again, it finishes. The two-node job asks for all CPUs of each node
    (its two nodes share this machine's cores: one thread per process, or they spin against each other), and
    after epoch_0 loses its training process on node2 (KillRankOnNode2): the launchers restart the processes of
    both nodes, and USR1 stops these. One job per batch script for every test below: each run of a job starts
    3 (one node) or 4 (two nodes) Python processes that import torch."""
    root = tmp_path_factory.mktemp("slurm_jobs")
    job_ids = {
        "one_node": submit(cluster, root, 2, "submit_multigpu.sbatch", script_args(data, root / "one_node")),
        "two_nodes": submit(cluster, root, 1, "submit_multinode.sbatch", script_args(data, root / "two_nodes"),
                            cpus_per_gpu=CPUS_PER_NODE, env={"OMP_NUM_THREADS": "1"}),
    }
    jobs = {name: (job_id, root / name) for name, job_id in job_ids.items()}
    preempt_mid_epoch(cluster, jobs, ready={"two_nodes": KillRankOnNode2(lambda: job_log(root, job_ids["two_nodes"]))})
    start_when_requeued(cluster, job_ids.values(), restarts=1)
    cpus = preempt_mid_epoch(cluster, jobs, preempt=preempt_by_urgent_job,
                             ready=dict.fromkeys(job_ids, end_of_second_epoch))
    start_when_requeued(cluster, job_ids.values(), restarts=2)
    return {name: (root / name, job_id, cpus[name], finish(cluster, job_id, root)) for name, job_id in job_ids.items()}


def runs(log) -> list:
    """The job's log cut into its runs: [run 1, run 2, ...] (the batch script's first line of each says "run N")."""
    return re.split(r", run \d+\b", log)[1:]


def assert_complete_run(r, num_processes):
    assert r["num_processes"] == num_processes
    assert r["eval_samples"] == NUM_TEST
    assert r["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert r["samples_seen"] == EPOCHS * NUM_TRAIN
    assert len(r["parameter_fingerprints"]) == num_processes
    assert len(set(r["parameter_fingerprints"])) == 1, "replicas hold different weights"
    assert r["eval_accuracy"] >= 0.9


def test_multigpu_job_takes_its_process_count_from_the_allocation(jobs):
    output_dir, _, _, log = jobs["one_node"]
    assert_complete_run(results(output_dir), num_processes=2)  # --gpus-per-node=2
    assert ": 2 processes" in log


def test_multinode_job_runs_one_machine_rank_per_node(jobs):
    output_dir, job_id, _, log = jobs["two_nodes"]
    assert_complete_run(results(output_dir), num_processes=2)  # 2 nodes x --gpus-per-node=1
    assert "2 nodes x 1 processes" in log
    # each srun task got its own rank, on its own node (not machine_rank 0 everywhere)
    assert "node1: machine_rank 0" in log and "node2: machine_rank 1" in log
    port = 15000 + int(job_id) % 15000  # below Linux's ephemeral ports, 32768 and up
    assert f"machine 0 at 127.0.0.1:{port}" in log


@pytest.mark.parametrize("name", ["one_node", "two_nodes"])
def test_preempted_job_saved_at_the_signal_requeued_and_resumed_from_there(jobs, name):
    """USR1, in the job's first run: its processes save, the job requeues itself and its second run resumes there."""
    output_dir, _, _, log = jobs[name]
    first_run, second_run, *_ = runs(log) + ["", ""]
    assert "USR1" in first_run and second_run, f"the job was not interrupted and requeued:\n{log[-3000:]}"
    stopped = STOPPED_BY_SIGNAL.search(first_run)
    assert stopped, f"no checkpoint at the signal:\n{log[-3000:]}"
    step = int(stopped[1])
    assert STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH  # in the second epoch, where it was signalled
    assert stopped[2] == str(output_dir / f"step_{step}")
    assert f"Resumed from {stopped[2]}:" in second_run, second_run[-3000:]
    assert_complete_run(results(output_dir), num_processes=2)  # step and sample counts continue across the requeues
    # the batch script's defaults: a checkpoint every epoch besides the ones at the signals
    assert sorted(p.name for p in output_dir.glob("epoch_*")) == ["epoch_0", "epoch_1", "epoch_2"]


@pytest.mark.parametrize("name", ["one_node", "two_nodes"])
def test_job_preempted_with_sigterm_only_requeues_itself_and_resumes(jobs, name):
    """No USR1, in the job's second run: the batch script, killed by that SIGTERM before, now traps it and
    requeues the job, because scontrol shows it preempted (a user's scancel is not requeued)."""
    output_dir, _, _, log = jobs[name]
    _, second_run, third_run, *_ = runs(log) + ["", "", ""]
    assert "TERM: preempted" in second_run and third_run and "USR1" not in second_run, log[-3000:]
    stopped = STOPPED_BY_SIGNAL.search(second_run)
    assert stopped, f"no checkpoint at the signal:\n{log[-3000:]}"
    step = int(stopped[1])
    assert 2 * STEPS_PER_EPOCH < step < EPOCHS * STEPS_PER_EPOCH  # in the third epoch, where it was preempted
    r = results(output_dir)
    assert r["resumed_from"] == stopped[2] == str(output_dir / f"step_{step}")
    assert_complete_run(r, num_processes=2)


def test_multinode_launchers_restart_processes_after_a_rank_on_another_node_died(jobs):
    """--max_restarts with the c10d rendezvous across Slurm nodes: inside the job's first run both
    nodes' processes started again and resumed from epoch_0 (then the preemption stopped them)."""
    output_dir, _, _, log = jobs["two_nodes"]
    first_run = runs(log)[0]
    assert f"Resumed from {output_dir / 'epoch_0'}:" in first_run, first_run[-3000:]


@pytest.mark.parametrize("name", ["one_node", "two_nodes"])
def test_training_processes_are_bound_to_all_cpus_the_job_has_on_their_node(jobs, name):
    """Slurm binds each job to its CPUs here (task/affinity). one_node: --cpus-per-gpu=1 with 2 GPUs;
    two_nodes: --cpus-per-gpu=CPUS_PER_NODE with 1 GPU per node. Before, srun ran each node's
    launcher with --cpus-per-task=1 and every process of the node shared one CPU."""
    _, _, cpus, log = jobs[name]
    every_cpu = os.sched_getaffinity(0)
    assert cpus == [every_cpu, every_cpu], cpus
    if name == "two_nodes":  # each node's srun task says where it runs
        printed = dict(re.findall(r"(node\d): machine_rank \d, CPUs ([\d,-]+)", log))
        assert {node: cpu_set(cpu_list) for node, cpu_list in printed.items()} == dict.fromkeys(NODES, every_cpu)


def cpu_set(cpu_list: str) -> set:
    """Linux's CPU list, "0-3,8", as a set."""
    cpus = set()
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def test_preempted_one_node_and_two_node_jobs_end_bit_identical(jobs):
    """Same world size, same data: neither the topology, nor where the requeues fell, nor USR1 and SIGTERM
    preemptions, nor a killed rank (two_nodes only) changes a bit."""
    one = results(jobs["one_node"][0])
    other = jobs["two_nodes"][0]
    r = results(other)
    for key in ("parameter_fingerprints", "buffer_fingerprints", "eval_accuracy", "eval_loss", "train_loss",
                "global_step", "samples_seen"):
        assert r[key] == one[key], (other, key)


def test_job_without_gpus_stops_with_one_clear_line(cluster, tmp_path):
    job_id = submit(cluster, tmp_path, 0, "submit_multigpu.sbatch", [])
    assert cluster.wait_for_job(job_id, timeout=120) == 1
    (log,) = [p.read_text(errors="replace") for p in tmp_path.glob("*.out")]
    assert log.strip() == (
        "error: the job has no GPUs; submit with --gpus-per-node=N, or set PROCESSES_PER_NODE (with CPU=1 for CPUs)"
    )


def test_multinode_job_without_an_address_for_machine_0_stops_with_one_clear_line(cluster, tmp_path):
    """`scontrol show node` with no NodeAddr in it (a scontrol shim first on the job's PATH): the
    other machines would wait for machine 0 at "" until they time out."""
    shim = tmp_path / "bin" / "scontrol"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n[ "$1 $2" = "show node" ] && exit 0\nexec {shutil.which("scontrol")} "$@"\n')
    shim.chmod(0o755)
    job_id = submit(cluster, tmp_path, 1, "submit_multinode.sbatch", [],
                    env={"PATH": f"{shim.parent}:{cluster.env['PATH']}"})
    assert cluster.wait_for_job(job_id, timeout=120) == 1
    (log,) = [p.read_text(errors="replace") for p in tmp_path.glob("*.out")]
    assert log.strip() == (
        "error: no address for the first node node1: scontrol show node gave no NodeAddr; "
        "set MAIN_PROCESS_IP to the address the other nodes reach it at"
    )


def test_multinode_fsdp_job_gives_every_node_the_fsdp_launch(cluster, data, tmp_path):
    """The README's FSDP example, submit_multinode.sbatch with ACCELERATE_CONFIG=accelerate_configs/fsdp.yaml, on
    this CPU cluster: the allocation's counts override the YAML's 1 machine x 8 processes, and the processes on both
    nodes get the FSDP launch, which with the batch script's --cpu shards over the CPU processes (utils/run/fsdp.py)
    and trains in the YAML's bf16 (BatchNorm kept in fp32: utils/run/fsdp.keep_batchnorm_in_fp32)."""
    job_id = submit(cluster, tmp_path, 1, "submit_multinode.sbatch",
                    script_args(data, tmp_path / "out", "--epochs", "1", "--max_train_samples", "256"),
                    env={"ACCELERATE_CONFIG": "accelerate_configs/fsdp.yaml", "MAX_RESTARTS": "0"})
    exit_code = cluster.wait_for_job(job_id, timeout=180)
    (log,) = [p.read_text(errors="replace") for p in tmp_path.glob("*.out")]
    assert exit_code == 0, log[-3000:]
    assert "2 nodes x 1 processes" in log and "node1: machine_rank 0" in log and "node2: machine_rank 1" in log, log
    r = results(tmp_path / "out")
    assert r["num_processes"] == 2 and r["sharded"] is True and r["mixed_precision"] == "bf16", r
    assert r["samples_seen"] == 256 and r["global_step"] == 256 // (2 * BATCH_SIZE), r


def documented_cpu_only_commands() -> list:
    """docs/slurm.md's two submissions on a cluster without GPUs: submit_multigpu's, then submit_multinode's."""
    section = (REPO / "docs" / "slurm.md").read_text().split("### On a cluster without GPUs", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, flags=re.DOTALL).group(1).strip().splitlines()


@pytest.fixture
def cluster_without_gpus(tmp_path):
    """Two nodes that declare no GPUs, and no GresTypes: what a CPU-only cluster is to sbatch."""
    cluster = start_cluster(tmp_path / "cluster", gpus_per_node=0)
    yield cluster
    cluster.stop()


def test_the_scripts_run_on_a_cluster_without_gpus_as_documented(cluster_without_gpus, data, tmp_path):
    """The scripts as they are: refused there (their #SBATCH GPU lines). docs/slurm.md's commands, which drop those
    lines as they submit: the multinode one accepted (`--test-only`), the one-node one run to its end on 2 processes."""
    cluster = cluster_without_gpus

    def bash(command):
        return subprocess.run(["bash", "-c", command], cwd=REPO, env=cluster.env, capture_output=True, text=True,
                              timeout=60, check=False)

    for script in ("submit_multigpu.sbatch", "submit_multinode.sbatch"):
        refused = bash(f"CPU=1 sbatch --test-only {SLURM_DIR / script}")
        assert refused.returncode != 0 and "Invalid generic resource (gres) specification" in refused.stderr, script
    one_node, multinode = documented_cpu_only_commands()
    accepted = bash(multinode.replace(" sbatch ", " sbatch --test-only ", 1))
    assert accepted.returncode == 0 and " to start at " in accepted.stderr, accepted.stderr
    output_dir = tmp_path / "out"
    submitted = bash(one_node.replace(" sbatch ", f" sbatch --parsable --output={tmp_path}/%x-%j.out ", 1)
                     .replace("path/to/MNIST/raw", str(data))
                     + f" --output_dir {output_dir} --epochs 1 --max_train_samples 256 --batch_size {BATCH_SIZE}")
    assert submitted.returncode == 0, submitted.stderr
    log = finish(cluster, submitted.stdout.split(";")[0].strip(), tmp_path, timeout=300)
    assert "2 processes" in log, log
    r = results(output_dir)
    assert (r["num_processes"], r["samples_seen"], r["global_step"]) == (2, 256, 256 // (2 * BATCH_SIZE)), r
