"""Topologies beyond one machine's default, run for real on CPU processes: two machines
(two network namespaces joined by a veth pair), a busy port, a GPU subset, a sweep."""

import json
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import REPO, TRAIN_MNIST, free_consecutive_ports, load_script, results, run, wait_for_path

from utils.errors import UserError

CONFIG_DIR = REPO / "accelerate_configs"
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
TRAIN_ARGS = ["--epochs", "1", "--batch_size", "32"]


def train_args(data, output_dir):
    return [TRAIN_MNIST, "--cpu", "--data_dir", data, "--output_dir", output_dir, *TRAIN_ARGS]


@pytest.fixture
def busy_port():
    """A port some other program is listening on."""
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        yield listener.getsockname()[1]



def finish(procs, timeout=300):
    """Wait for processes started together; on a timeout stop them all (a hung rendezvous)."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"launchers still running after {timeout} s: init hangs") from None
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n{stderr[-5000:]}"
    return [stdout + stderr for stdout, stderr in outputs]


# ---------------------------------------------------------------- one machine, two jobs, one busy port


@pytest.fixture(scope="module")
def two_jobs_on_a_busy_port(synthetic_mnist, tmp_path_factory):
    """Two 2-process jobs started at the same moment, both told to use a port that is taken:
    accelerate (one machine) moves each to a free port of its own."""
    root = tmp_path_factory.mktemp("busy_port")
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        procs = [
            subprocess.Popen(
                [str(c) for c in [*LAUNCH, "--config_file", CONFIG_DIR / "cpu_2proc.yaml", "--main_process_port", port,
                                  *train_args(synthetic_mnist, root / f"job{i}")]],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for i in (0, 1)
        ]
        logs = finish(procs)
    return [root / "job0", root / "job1"], logs, port


def test_two_jobs_on_one_machine_do_not_collide_and_a_busy_port_is_replaced(two_jobs_on_a_busy_port):
    (job0, job1), logs, port = two_jobs_on_a_busy_port
    for log in logs:
        assert f"Port `{port}` is already in use" in log
    r0, r1 = results(job0), results(job1)
    assert r0["num_processes"] == r1["num_processes"] == 2
    assert r0["eval_samples"] == 203
    assert r0["parameter_fingerprints"] == r1["parameter_fingerprints"]  # same run twice, undisturbed


def test_busy_port_on_machine_0_of_several_stops_with_a_clear_message(busy_port, tmp_path):
    """With several machines the port cannot move (the others would not know): accelerate stops."""
    proc = run([*LAUNCH, "--config_file", CONFIG_DIR / "multi_node.yaml", "--num_processes", "2",
                "--mixed_precision", "no", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                "--main_process_port", busy_port, TRAIN_MNIST, "--cpu", "--output_dir", tmp_path / "out"],
               check=False, timeout=120)
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"ConnectionError: Tried to launch distributed communication on port `{busy_port}`")
    assert "another process is utilizing it" in last_line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- two machines

# (the `two_machines` fixture lives in conftest.py: tests/test_two_machine_restart.py uses it too)


def test_two_machines_form_one_group_and_match_one_machine_with_two_processes(
        two_machines, synthetic_mnist, two_jobs_on_a_busy_port, tmp_path):
    """accelerate_configs/multi_node.yaml with one process per machine, exactly as a user runs
    it on two hosts: the same command on both, --machine_rank 0 and 1, machine 0's address."""
    machine_0_address = two_machines[0][1]
    port = 29500  # a fresh namespace has every port free
    procs = []
    for rank, (prefix, _, interface) in enumerate(two_machines):
        env = {
            **os.environ,
            # gloo announces the address its host name resolves to (127.0.0.1 here), which
            # machine 1 cannot reach: name the interface, as on hosts with several networks.
            "GLOO_SOCKET_IFNAME": interface,
            # torchrun gives each of several processes per machine 1 thread but leaves a single
            # one all cores: equal threads make the results comparable bit for bit.
            "OMP_NUM_THREADS": "1",
        }
        cmd = [*prefix, *LAUNCH, "--config_file", CONFIG_DIR / "multi_node.yaml",
               "--num_processes", "2", "--mixed_precision", "no", "--machine_rank", rank,
               "--main_process_ip", machine_0_address, "--main_process_port", port,
               *train_args(synthetic_mnist, tmp_path / "two_machines")]
        procs.append(subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    finish(procs, timeout=240)

    two_machines_result = results(tmp_path / "two_machines")
    one_machine_result = results(two_jobs_on_a_busy_port[0][0])
    assert two_machines_result["num_processes"] == 2  # the total over both machines
    assert two_machines_result["eval_samples"] == 203
    assert len(set(two_machines_result["parameter_fingerprints"])) == 1
    for key in ("parameter_fingerprints", "buffer_fingerprints", "eval_accuracy", "eval_loss", "train_loss",
                "global_step", "samples_seen"):
        assert two_machines_result[key] == one_machine_result[key], key


# ---------------------------------------------------------------- a subset of the GPUs

PROBE = """\
import json, os, sys
keys = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK")
report = {key: os.environ.get(key) for key in keys}
if len(sys.argv) > 2:
    import torch
    report["device_count"] = torch.cuda.device_count()
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(report, f)
"""


def launch_probe(tmp_path, *probe_args):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run([*LAUNCH, "--config_file", CONFIG_DIR / "multi_gpu_subset.yaml", "--mixed_precision", "no",
         probe, tmp_path, *probe_args], timeout=120)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_gpu_subset_config_shows_each_process_only_gpus_2_and_3(tmp_path):
    reports = launch_probe(tmp_path)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in reports] == ["2,3", "2,3"]
    assert [r["WORLD_SIZE"] for r in reports] == ["2", "2"]
    assert [r["LOCAL_RANK"] for r in reports] == ["0", "1"]  # process i trains on cuda:i = physical GPU 2 + i


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs to select GPUs 2 and 3; CI has none")
def test_gpu_subset_config_leaves_two_gpus_visible(tmp_path):
    assert [r["device_count"] for r in launch_probe(tmp_path, "count")] == [2, 2]


# ---------------------------------------------------------------- sweep


@pytest.fixture(scope="module")
def sweep_runs(synthetic_mnist, tmp_path_factory):
    """One sweep of two grid points on accelerate_configs/cpu.yaml, its outputs read by the tests below: killed (the
    sweep, its launcher and the training at once, as a lost machine or a job's time limit does) once the second run
    has saved its step_4, then run again (the first run is done, the second resumes from its checkpoints), then once
    more (both done). (cpu_2proc.yaml's group: two_jobs_on_a_busy_port.)"""
    root = tmp_path_factory.mktemp("sweep_runs") / "sweep"
    base_port = free_consecutive_ports(2)
    cmd = [sys.executable, REPO / "scripts" / "sweep.py", "--grid", "learning_rate=0.003,0.01",
           "--config_file", CONFIG_DIR / "cpu.yaml", "--output_dir", root, "--main_process_port", base_port,
           "--", TRAIN_MNIST, "--cpu", "--data_dir", synthetic_mnist, *TRAIN_ARGS, "--checkpointing_steps", "4"]
    interrupted_log = root.parent / "interrupted.log"
    with interrupted_log.open("w") as log:  # a file, not a pipe: nothing drains it while the test waits
        sweep = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # one process group: the sweep, its launcher, the training
    try:
        # the first run whole and the second to its step_4: twice the 240 s one run was given to reach a checkpoint
        wait_for_path(root / "learning_rate_0.01" / "step_4", sweep, timeout=480)
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()
    finished_before_the_kill = (root / "learning_rate_0.01" / "results.json").exists()
    resumed = run(cmd, timeout=300)  # 640 digits, 32 per step: 20 steps
    done = run(cmd, timeout=60)
    return SimpleNamespace(root=root, cmd=cmd, base_port=base_port, interrupted=interrupted_log.read_text(),
                           finished_before_the_kill=finished_before_the_kill, resumed=resumed, done=done)


def test_sweep_runs_each_grid_point_in_its_own_folder_and_tabulates_results(sweep_runs):
    root, cmd = sweep_runs.root, sweep_runs.cmd
    launched = [line for line in sweep_runs.interrupted.splitlines() if " accelerate launch " in line]
    assert [f"--main_process_port {sweep_runs.base_port + i} " in line for i, line in enumerate(launched)] == [True, True]
    assert all(f"--config_file {CONFIG_DIR / 'cpu.yaml'} " in line for line in launched), launched  # the argv it runs
    (relaunched,) = [line for line in sweep_runs.resumed.stdout.splitlines() if " accelerate launch " in line]
    assert relaunched.startswith("[2/2] ") and f"--main_process_port {sweep_runs.base_port + 1} " in relaunched
    rows = [line for line in sweep_runs.resumed.stdout.splitlines() if line.startswith("| 0.")]
    assert len(rows) == 2, sweep_runs.resumed.stdout
    for row, learning_rate, status in zip(rows, (0.003, 0.01), ("done before", "ok")):
        r = results(root / f"learning_rate_{learning_rate}")
        assert r["learning_rate"] == learning_rate and r["num_processes"] == 1 and r["eval_samples"] == 203
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[:2] == [str(learning_rate), f"{r['eval_accuracy']:.4f}"] and cells[-1] == status
    # the grid value reached the script: the two runs trained differently
    assert results(root / "learning_rate_0.003")["train_loss"] != results(root / "learning_rate_0.01")["train_loss"]
    assert (root / "summary.md").read_text().strip() == "\n".join(sweep_runs.done.stdout.strip().splitlines()[-4:])

    # Run again once both finished: finished runs are not repeated.
    assert "accelerate launch" not in sweep_runs.done.stdout and sweep_runs.done.stdout.count("done before") == 2

    # A changed fixed flag is another command: its finished runs are not reported as this one's, and nothing runs.
    summary = (root / "summary.md").read_text()
    other = run([("2" if arg == "1" and previous == "--epochs" else arg) for previous, arg in zip(["", *cmd], cmd)],
                check=False)
    assert other.returncode == 1 and "done before" not in other.stdout and "accelerate launch" not in other.stdout
    assert other.stderr.strip().splitlines() == [
        f"error: {root / 'learning_rate_0.003'} was run by another command (`--epochs 1` then, `--epochs 2` now): its "
        f"files belong to that run; give this sweep another --output_dir, or the command it was run with"]
    assert (root / "summary.md").read_text() == summary


def test_an_interrupted_sweep_resumes_its_unfinished_run_from_its_checkpoints(sweep_runs):
    trial = sweep_runs.root / "learning_rate_0.01"
    assert not sweep_runs.finished_before_the_kill, "the run finished before it was interrupted: interrupt it sooner"
    assert "(again: its last launch did not finish)" in sweep_runs.resumed.stdout
    log = (trial / "launch.log").read_text()
    assert "Resumed from" in log and f"{trial / 'step_'}" in log, log[-3000:]
    r = results(trial)
    assert r["learning_rate"] == 0.01 and r["num_processes"] == 1 and r["eval_samples"] == 203
    # cpu.yaml forms the process group it promises (tests/test_configs.py's claim for it, not launched there again)
    assert r["num_processes"] == yaml.safe_load((CONFIG_DIR / "cpu.yaml").read_text()).get("num_processes", 1)
    assert len(r["parameter_fingerprints"]) == 1
    assert [cell.strip() for cell in sweep_runs.resumed.stdout.strip().splitlines()[-1].strip("|").split("|")][-1] == "ok"
    # and once finished, it is done
    assert "accelerate launch" not in sweep_runs.done.stdout
    assert [line.split("|")[-2].strip() for line in sweep_runs.done.stdout.splitlines() if line.startswith("| 0.01 ")] \
        == ["done before"]


def test_sweep_refuses_a_grid_flag_that_is_not_spelled_out(tmp_path):
    """argparse would read --lr as --lr_scheduler_type (its only flag starting so) and fail late, or worse, not."""
    proc = run([sys.executable, REPO / "scripts" / "sweep.py", "--grid", "lr=1e-3", "--output_dir", tmp_path,
                "--", TRAIN_MNIST, "--cpu"], check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: --grid lr: {TRAIN_MNIST} has no flag --lr (a grid names a flag in full); "
        f"did you mean --grid lr_scheduler_type=... or --grid learning_rate=...?"]
    assert not any(tmp_path.iterdir())


def test_sweep_rejects_a_malformed_grid_with_one_line(tmp_path):
    proc = run([sys.executable, REPO / "scripts" / "sweep.py", "--grid", "learning_rate", "--output_dir", tmp_path,
                "--", TRAIN_MNIST], check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: --grid 'learning_rate': expected FLAG=VALUE[,VALUE...], e.g. --grid learning_rate=1e-3,3e-3"
    )
    assert not any(tmp_path.iterdir())


def test_sweep_reads_each_grid_flag_once_and_names_a_failed_runs_last_error_line(tmp_path):
    """In-process: a flag written with its dashes is the same flag; a flag given twice is one line (the second would
    silently replace the first's values); a failed run's status is its own `error:` line, the last one it printed."""
    sweep = load_script(REPO / "scripts" / "sweep.py")
    assert sweep.parse_grid(["--learning_rate=1e-3, 3e-3", "batch_size=32"]) == {
        "learning_rate": ["1e-3", "3e-3"], "batch_size": ["32"]}
    with pytest.raises(UserError, match="--grid learning_rate given twice"):
        sweep.parse_grid(["learning_rate=1e-3", "--learning_rate=3e-3"])
    log = tmp_path / "launch.log"
    log.write_text("error: a warning-like line from a library\nTraceback ...\nerror: the loss became nan at step 3\n")
    assert sweep.failure_reason(log, 1) == "failed: the loss became nan at step 3"
    log.write_text("Killed\n")
    assert sweep.failure_reason(log, 137) == f"failed (exit 137): see {log}"
