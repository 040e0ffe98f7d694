"""A real, small Slurm cluster on this machine for the tests: munged, slurmctld and two
slurmd daemons (`node1`, `node2`, both at 127.0.0.1 on their own ports), from Debian's
slurmctld/slurmd/slurm-client/munge packages.

Each node declares 4 GPUs backed by empty files: Slurm counts and allocates them (so
SLURM_GPUS_ON_NODE is real), nothing opens them, and the jobs train on the CPU. With
gpus_per_node=0 the cluster has no GPUs at all (no GresTypes), as a CPU-only cluster, where sbatch
refuses any GPU request. Each node
also declares this machine's CPUs, and Slurm binds every job to the CPUs it allocated
(task/affinity, as clusters that bind cores do). A second partition, `urgent`, preempts
the jobs of the default one, the way a cluster without `--signal` at preemption does it:
SIGTERM, then SIGKILL after KillWait.
Everything lives in one temporary folder but the sockets, which need a short path (SOCKET_PATH_MAX);
the daemons are stopped by their pid files.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from helpers import skip_or_fail_in_ci

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("node1", "node2")
GPUS_PER_NODE = 4
# Job states after which nothing more runs (a requeued job is PENDING again; one still ending, COMPLETING)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}
CPUS_PER_NODE = len(os.sched_getaffinity(0))  # the CPUs this machine lets us use, all of them on each node
# A Unix socket's path holds at most 107 bytes. slurmstepd's is <SlurmdSpoolDir>/<node>_<job id>.<step id>, and
# one longer kills slurmstepd at every launch (the job requeued and held, PENDING for good): under pytest-xdist's
# folders (.../pytest-2661/popen-gw0/test_the_scripts_run_on_a_clus0/cluster/spool/node1/node1_2.4294967291)
# it was 113. So the daemons' sockets live in a short folder of their own, checked against the longest such path.
SOCKET_PATH_MAX = 107
LONGEST_STEP_SOCKET = f"{NODES[0]}_67043328.4294967291"  # Slurm's largest job id (MaxJobId), the batch step's id
# PENDING reasons after which the job never starts by itself: held (a failed launch holds it, as that socket did), or
# a request these nodes can never meet. Not the passing ones (Resources, Priority, BeginTime of a requeued job).
NEVER_STARTS = ("launch_failed_requeued_held", "JobHeld", "BadConstraints", "PartitionConfig", "PartitionNodeLimit")


def skip_with_reason(reason: str):
    """Skip, and say why in pytest's warnings summary too (shown even without -rs); in CI, fail."""
    warnings.warn(f"SLURM tests skipped: {reason}", stacklevel=2)
    skip_or_fail_in_ci(f"SLURM: {reason}")


def free_ports(count: int) -> list:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, root: Path, gpus_per_node: int = GPUS_PER_NODE):
        self.root = root
        self.gpus_per_node = gpus_per_node
        self.conf = root / "slurm.conf"
        self.sockets = Path(tempfile.mkdtemp(prefix="slurm-"))  # short, wherever pytest's folders are
        self.spool = self.sockets / "spool"
        self.munge_socket = self.sockets / "munge.socket"
        # What every Slurm command and job needs: our slurm.conf, and the venv's accelerate
        # first on PATH (sbatch passes this environment on to the jobs).
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        for variable in list(self.env):  # a pytest run inside a Slurm job must not leak its job
            if variable.startswith(("SLURM_JOB", "SLURM_STEP", "SBATCH_", "SRUN_", "SALLOC_")):
                del self.env[variable]

    def pid_files(self) -> list:
        return [self.root / "munge" / "munged.pid", self.root / "slurmctld.pid",
                *(self.root / f"slurmd-{node}.pid" for node in NODES)]

    def write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        longest = self.spool / NODES[0] / LONGEST_STEP_SOCKET
        if len(bytes(longest)) > SOCKET_PATH_MAX:
            raise RuntimeError(f"{longest} is too long for a Unix socket ({len(bytes(longest))} bytes, at most "
                               f"{SOCKET_PATH_MAX}): set TMPDIR to a shorter folder")
        for sub in ("state", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in NODES:
            (self.spool / node).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        for i in range(self.gpus_per_node):
            (self.root / f"fake-gpu{i}").touch()
        hostname = socket.gethostname()
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        node_lines = "\n".join(  # one line per node: the two ports need not be consecutive
            f"NodeName={node} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE}{gres} State=UNKNOWN"
            for node, port in zip(NODES, node_ports)
        )
        r, nodes = self.root, ",".join(NODES)
        self.conf.write_text(f"""\
ClusterName=pytest
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
# No cgroups in a container: track job processes by process group; bind each task to its
# allocated CPUs with sched_setaffinity, which needs no cgroups.
ProctrackType=proctrack/pgid
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
# Schedule a submitted batch job at once: by default slurmctld gathers submissions for up to 3 s first
# (batch_sched_delay, for clusters that take many jobs a second), which each job of the tests waited.
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=10
# How long an ended job stays in `scontrol show job`, where wait_for_job reads its exit code
MinJobAge=60
{"GresTypes=gpu" if self.gpus_per_node else ""}
{node_lines}
# The tests run two jobs side by side on this machine's few CPUs: up to 2 jobs share a CPU
# (never a GPU). A job in `urgent` cancels the `debug` jobs in its way at once (GraceTime 0).
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2 PriorityTier=1
PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2
""")
        if self.gpus_per_node:
            (self.root / "gres.conf").write_text(
                "AutoDetect=off\n" + f"Name=gpu File={self.root}/fake-gpu[0-{self.gpus_per_node - 1}]\n"
            )

    def run(self, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def start(self) -> None:
        self.write_config()
        munge = self.root / "munge"
        self.run("mungekey", "--create", f"--keyfile={munge}/munge.key")
        # --force: pytest's temporary folders are not where munged expects to be installed
        self.run("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={munge}/munge.key",
                 f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed")
        self.run("slurmctld", "-f", self.conf, "-c")  # -c: a clean start, no saved state
        for node in NODES:
            self.run("slurmd", "-f", self.conf, "-N", node)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            # one line per node and partition
            states = set(self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.splitlines())
            if states == {f"{node} idle" for node in NODES}:
                return
            time.sleep(0.1)
        raise RuntimeError(f"nodes not idle after 30 s (sinfo: {' '.join(states)})\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        text = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = [line for line in log.read_text(errors="replace").splitlines() if "pmix" not in line][-lines:]
            text.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(text)

    def stop(self) -> None:
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.1)
        # slurmd first, munged last: the others need it to authenticate until the end
        for pid_file in reversed(self.pid_files()):
            try:
                os.kill(int(pid_file.read_text().split()[0]), 15)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                pass
        shutil.rmtree(self.sockets, ignore_errors=True)

    # ------------------------------------------------------------------ jobs

    def job_fields(self, job_id: str) -> dict:
        """`scontrol show job`'s Name=value fields; empty once the job is gone (MinJobAge after it ended)."""
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def job_ended(self, job_id: str) -> bool:
        return self.job_fields(job_id).get("JobState") in ENDED

    def wait_for_job(self, job_id: str, timeout: float) -> int:
        """The job's exit code (128 + N if signal N ended it) once it has ended for good. Not `sbatch
        --wait`: that returns at the first ended state it polls, and a preempted job is CANCELLED (and
        COMPLETING, which scontrol shows instead) from the preemption until its batch script requeues
        it, so sbatch returned 0 mid-preemption where that took the script longer than usual."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in ENDED:
                exit_code, signal_number = map(int, fields["ExitCode"].split(":"))  # ExitCode=status:signal
                return 128 + signal_number if signal_number else exit_code
            if not fields:
                raise AssertionError(f"job {job_id} is gone from scontrol; its exit code is lost\n{self.log_tail()}")
            if fields["JobState"] == "PENDING" and fields.get("Reason", "").startswith(NEVER_STARTS):
                raise AssertionError(f"job {job_id} cannot start: {fields['Reason']}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} did not end in {timeout} s ({fields['JobState']})\n{self.log_tail()}")
            time.sleep(0.2)


def start_cluster(root: Path, gpus_per_node: int = GPUS_PER_NODE) -> SlurmCluster:
    """A running cluster, or a skip that says what is missing."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        skip_with_reason(
            f"needs Debian's slurmctld, slurmd, slurm-client and munge ({', '.join(missing)} not found); "
            f".ci/run installs them with apt-get where it can"
        )
    if os.geteuid() != 0:
        skip_with_reason("slurmd must run as root to start jobs; these tests run as a regular user")
    cluster = SlurmCluster(root, gpus_per_node)
    try:
        cluster.start()
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        cluster.stop()
        skip_with_reason(f"this machine cannot run a Slurm cluster: {err}\n{cluster.log_tail()}")
    return cluster
