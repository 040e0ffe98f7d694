"""In-launcher restarts across machines: two machines (network namespaces, the `two_machines`
fixture of conftest.py), one process each, the c10d rendezvous with --max_restarts 1. The rank on
machine 1 is killed mid-training; both launchers restart their workers in a new rendezvous round,
resume from the newest checkpoint, and the run ends exactly as an uninterrupted one.

What two namespaces need beyond the one-machine restart test (all of it torchrun's), and one quirk:
- `--rdzv_conf is_host=1` on machine 0 (`is_host=0` on machine 1). The c10d rendezvous store lives
  at --main_process_ip:port (accelerate passes it as torchrun's --rdzv_endpoint); torchrun decides
  whether this machine hosts it by comparing that address with its host name's addresses
  (rendezvous/utils.py `_matches_machine_hostname`). Both namespaces share the host name, which
  resolves to 127.0.0.1, never to the veth address: without is_host neither hosts the store and
  both launchers fail: `RendezvousConnectionError: The connection to the C10d store has failed`.
  (Hosts whose rendezvous address is on a secondary network have the same problem.)
- `PET_LOCAL_ADDR`, each machine's own address, in the launcher's environment (torchrun's
  --local_addr, which `accelerate launch` has no flag for; torchrun reads PET_<FLAG> variables).
  With c10d the workers' MASTER_ADDR is the address the rank-0 machine gives for itself, by default
  its FQDN, here `localhost`, which machine 1 cannot reach: its workers wait forever.
- With c10d torchrun ignores --machine_rank (its warning: "node_rank is only used for static
  rdzv_backend"); it numbers the machines by sorting their addresses (then launcher pids), so
  machine 0 (the lower address) is still rank 0 here, every attempt.
"""

import os
import subprocess
import sys
import time

import psutil
from helpers import REPO, TRAIN_MNIST, launcher_args, results

# 640 samples / 16 per batch = 40 batches, 20 per process: 20 optimizer steps per epoch, 40 in all (killed after
# step 10, the restarted run resumes mid-epoch 0 and crosses an epoch boundary: a third epoch would only add work).
TRAIN_ARGS = ["--epochs", "2", "--batch_size", "16", "--checkpointing_steps", "10",
              "--resume_from_checkpoint", "latest"]
PORT = 29500  # a fresh namespace has every port free
HANG_BOUND_S = 300  # each wait ends as soon as its condition holds: a bound against a hang, sized far above load
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def machine_command(rank, prefix, address, interface, machine_0_address, data, out):
    """Machine `rank`'s launcher: the command and its environment."""
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": interface,  # gloo would announce 127.0.0.1 (see test_topologies.py)
        "OMP_NUM_THREADS": "1",  # what torchrun gives each of several processes on one machine: same bits
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # each attempt its own store (test_reliability.py)
        "PET_LOCAL_ADDR": address,  # the address this machine gives the others (module docstring)
        "LOGLEVEL": "INFO",  # torchrun's agent logs its restarts and each rendezvous' result at INFO
    }
    cmd = [*prefix, *LAUNCH, "--multi_gpu", "--num_processes", 2, "--num_machines", 2, "--machine_rank", rank,
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", machine_0_address, "--main_process_port", PORT,
           "--max_restarts", 1, "--rdzv_backend", "c10d", "--rdzv_conf", f"is_host={int(rank == 0)}",
           TRAIN_MNIST, "--cpu", "--data_dir", data, "--output_dir", out, *TRAIN_ARGS]
    return [str(c) for c in cmd], env


def read(log) -> str:
    log.seek(0)
    return log.read()


def test_a_rank_killed_on_machine_1_restarts_both_machines_and_the_run_matches_the_uninterrupted_one(
        two_machines, synthetic_mnist, tmp_path):
    out, reference_out = tmp_path / "restarted", tmp_path / "uninterrupted"
    machine_0_address = two_machines[0][1]
    logs = [open(tmp_path / f"{name}.log", "w+") for name in ("machine0", "machine1", "uninterrupted")]
    # The uninterrupted reference runs meanwhile, on one machine with two processes: two machines with
    # one process each give identical results bit for bit (test_topologies.py). Started together,
    # the three launchers share their start-up time (mostly imports), which is most of this test's.
    reference_cmd = [*launcher_args(2), TRAIN_MNIST, "--cpu", "--data_dir", synthetic_mnist,
                     "--output_dir", reference_out, *TRAIN_ARGS]
    jobs = [subprocess.Popen([str(c) for c in reference_cmd], cwd=REPO, stdout=logs[2], stderr=subprocess.STDOUT)]
    for rank, (prefix, address, interface) in enumerate(two_machines):
        cmd, env = machine_command(rank, prefix, address, interface, machine_0_address, synthetic_mnist, out)
        jobs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[rank], stderr=subprocess.STDOUT))
    reference, launchers = jobs[0], jobs[1:]
    try:
        # Machine 1's training process (a child of its launcher: `ip netns exec` execs the launcher
        # in place), killed as soon as a checkpoint exists, mid-epoch 0.
        # A bound against hanging, not a speed claim (the loop ends when step_10 appears): seven processes
        # start at once; measured 58 s for the whole test in the suite, over 120 s at a load average of 15.
        deadline = time.monotonic() + HANG_BOUND_S
        while not (out / "step_10").exists():
            assert all(p.poll() is None for p in launchers), "a launcher ended before step_10 appeared"
            assert time.monotonic() < deadline, f"no step_10 after {HANG_BOUND_S} s"
            time.sleep(0.02)
        (worker,) = [p for p in psutil.Process(launchers[1].pid).children(recursive=True)
                     if "LOCAL_RANK" in p.environ()]
        assert worker.environ()["RANK"] == "1"  # c10d numbered machine 1 as rank 1 (module docstring)
        worker.kill()
        for job in jobs:
            job.wait(timeout=HANG_BOUND_S)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    output = [read(log) for log in logs]
    for log in logs:
        log.close()
    for name, job, text in zip(("machine 0", "machine 1", "the uninterrupted run"), launchers + [reference], output):
        assert job.returncode == 0, f"{name}'s launcher exited {job.returncode}\n{text[-5000:]}"

    # Both agents restarted their workers. Machine 1's saw its worker die and counts a restart
    # (restart_count=1, the workers' TORCHELASTIC_RESTART_COUNT). Machine 0's saw either its worker
    # fail too (gloo's connection to the dead rank closed: a counted restart) or, first, machine 1
    # waiting in a new rendezvous round: a "membership change", which torchrun restarts for without
    # counting it (restart_count stays 0 there), so the count cannot tell that machine 0 restarted.
    failed = "[default] Worker group FAILED. 1/1 attempts left; will restart worker group"
    assert failed in output[1] and "restart_count=1" in output[1], output[1]
    membership_change = "[default] Detected 1 new nodes from group_rank=0; will restart worker group"
    assert failed in output[0] or membership_change in output[0], output[0]
    for text in output[:2]:  # two rendezvous each: the first attempt and the restarted one, as ranks 0 and 1
        assert text.count("Rendezvous complete for workers") == 2, text
    assert output[0].count("]   group_rank=0\n") == output[1].count("]   group_rank=1\n") == 2
    # Rank 0, on machine 0, started again and continued from a checkpoint.
    assert output[0].count("Resumed from ") == 1 and "Resumed from " not in output[1]

    resumed, uninterrupted = results(out), results(reference_out)
    assert resumed["resumed_from"] is not None and "step_" in resumed["resumed_from"]
    assert resumed["num_processes"] == 2
    assert resumed["global_step"] == uninterrupted["global_step"] == 2 * 20
    assert resumed["samples_seen"] == uninterrupted["samples_seen"] == 2 * 640
    assert resumed["eval_samples"] == 203
    for key in ("parameter_fingerprints", "eval_accuracy", "eval_loss"):
        assert resumed[key] == uninterrupted[key], key
    assert (out / "model.safetensors").read_bytes() == (reference_out / "model.safetensors").read_bytes()


def test_a_launcher_killed_leaves_its_processes_and_the_others_wait_in_torchs_exit_barrier():
    """In-process: what docs/troubleshooting.md says of a machine's launcher killed with `kill -9`. torchrun starts
    each training process in a session of its own (a signal to the launcher's process group misses it), and its
    agent waits for every machine's agent after its processes ended, 300 s, set by nothing a launch passes."""
    import inspect
    import signal

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    from torch.distributed.launcher.api import LaunchConfig

    handler = SubprocessHandler("sleep", ("30",), {}, None, None, local_rank_id=0, numa_options=None)
    try:
        assert os.getsid(handler.proc.pid) == handler.proc.pid != os.getsid(0)
    finally:
        handler.close(signal.SIGKILL)
    assert inspect.signature(LocalElasticAgent).parameters["exit_barrier_timeout"].default == 300
    assert not [name for name in inspect.signature(LaunchConfig).parameters if "barrier" in name]
