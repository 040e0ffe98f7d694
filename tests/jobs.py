"""Several runs in one launch: the tests' one job runner.

A launched Python process spends 8-10 s of CPU importing torch, Accelerate and the data libraries, most of a small
run. `launch_jobs` launches this file once (`accelerate launch tests/jobs.py JOBS.json`, torchrun, or plain python):
each launched process imports those once, then forks one child per job, in the file's order, that runs the job's
`SCRIPT ARGS` as `python SCRIPT ARGS` would (as __main__; a launcher's own arguments, torch.distributed.launch's
--local-rank=N, before ARGS) and ends as a process does (atexit handlers, the exit check of tests/exit_check). A job
waits for the one before it, so it may resume from its checkpoints.

Every job's files start with its LOG path (FOLDER/NAME), one set per rank R:
    LOG.rankR.out    its stdout and stderr
    LOG.rankR.exit   its exit status, written by the launched process: negative for a signal, "timeout" when it ran
                     past its limit and was killed
    LOG.threads_left gloo worker threads alive at a process's exit (tests/exit_check), one file each
    LOG.rankR        with "record_samples": the training samples it fetched (tests/sample_recording.py)
`read_job` reads them back, rank 0 first; `finished_job` also asserts how the job ended. The launch itself exits 0
whatever its jobs did: a test reads its own job, so one broken run fails only the tests about it. (A test of the
launcher itself, where the training process must be the launched one, runs `jobs.py --alone LOG SCRIPT ARGS`: no
fork; its exit status goes to LOG.rankR.exit all the same.)

A job's own settings: "env", variables set for it only (torchrun's for ddp_mnist.py; an EXIT_CHECK_DIR of its own
where a test reads what is expected to be left, instead of LOG.threads_left); "unset_env", prefixes of the
launch's variables it runs without (an FSDP launch's ACCELERATE_USE_FSDP and FSDP_*: a DDP job); "cwd"; "path", folders
put first on sys.path (Horovod's and apex's stand-ins); "own_group" (default true): its own MASTER_PORT, so that the
children of every rank form a group of their own, false: the launcher's rendezvous store and port, as a script
launched alone has them; "timeout" (s, default 600).
"""

import faulthandler
import gc
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the scripts import that costs seconds: imported once per launched process, before any fork.
SCRIPT_IMPORTS = ["torch.distributed.nn", "torch._dynamo", "accelerate", "accelerate.utils", "torchvision", "datasets",
                  "evaluate", "safetensors.torch", "tqdm.auto"]
# Where it is installed, deepspeed too (10 s of CPU): Accelerate imports it in unwrap_model and get_state_dict, and
# the scripts before their process group (docs/ending_a_run_cleanly.md).
OPTIONAL_SCRIPT_IMPORTS = ["deepspeed"]
# evaluate and deepspeed imported as the scripts import them: without transformers' pipelines and mlflow. Read by path,
# not imported as utils.lean_imports: a package named utils preloaded would shadow a job's own (test_helpers_shadowing)
LEAN_IMPORTS = {name[len("import_"):]: function for name, function in runpy.run_path(
    str(Path(__file__).resolve().parents[1] / "utils" / "lean_imports.py")).items() if name.startswith("import_")}
JOB_TIMEOUT = 600


def launch_jobs(jobs: dict, launcher: list, folder, env=None, cwd=None, preload=SCRIPT_IMPORTS, not_preloaded=()):
    """Run `jobs` {NAME: [SCRIPT, *ARGS], or a dict with "argv" and the settings above} in one launch of this file by
    `launcher` (e.g. helpers.launcher_args(2), or [sys.executable] for one process), each job's files at FOLDER/NAME;
    `env`: the launch's variables. `preload`: the modules imported before the forks; `not_preloaded`: those it must
    leave out (asserted). Started as tests/helpers.run starts a command (tests/exit_check on PYTHONPATH), but in a
    session of its own, so that a launch still going when every job's time is up is killed with all its processes.
    Returns the launch as a finished process (the launcher's own output); read the jobs with finished_job/read_job."""
    from helpers import REPO, exit_check_env, free_consecutive_ports  # the test process's, not a launched one's

    folder = Path(folder)
    jobs = {name: job if isinstance(job, dict) else {"argv": job} for name, job in jobs.items()}
    first_port = free_consecutive_ports(len(jobs))
    manifest = folder / f"{next(iter(jobs))}.jobs.json"
    manifest.write_text(json.dumps({"preload": list(preload), "not_preloaded": list(not_preloaded), "jobs": [
        {**job, "argv": list(map(str, job["argv"])), "log": str(folder / name), "port": first_port + index,
         **({"cwd": str(job["cwd"])} if "cwd" in job else {}), "path": list(map(str, job.get("path", ())))}
        for index, (name, job) in enumerate(jobs.items())]}))
    cmd = [*map(str, launcher), __file__, str(manifest)]
    # each job's limit, and its launcher's start
    timeout = sum(job.get("timeout", JOB_TIMEOUT) for job in jobs.values()) + 120
    with tempfile.TemporaryDirectory(prefix="exit_check_") as launch_exit_check:  # each job has its own
        launch = subprocess.Popen(cmd, cwd=cwd or REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  errors="replace", env=exit_check_env(launch_exit_check, env), start_new_session=True)
        try:
            stdout, stderr = launch.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)  # the launcher and its processes
            stdout, stderr = launch.communicate()
    return subprocess.CompletedProcess(cmd, launch.returncode, stdout, stderr)


class Job(subprocess.CompletedProcess):
    """A finished job as a process whose stderr went to its stdout: every rank's output, rank 0's first, in .stdout;
    its returncode 0 where every rank exited 0, else the first other status. Per rank, rank 0 first: .statuses (None:
    none written, the job killed at its timeout or never started) and .outputs; .threads_left: the exit check's
    reports of gloo threads alive at a process's exit."""

    def __init__(self, name: str, statuses: list, outputs: list, threads_left: list):
        super().__init__(name, next((status for status in statuses if status != 0), 0), "".join(outputs), "")
        self.name, self.statuses, self.outputs, self.threads_left = name, statuses, outputs, threads_left


def read_job(log, num_processes: int = 1) -> Job:
    """The files job LOG left (see the top of this file), whatever it did."""
    log = Path(log)

    def text(suffix):
        path = log.with_name(log.name + suffix)
        return path.read_text(errors="replace") if path.exists() else None

    statuses = [text(f".rank{rank}.exit") for rank in range(num_processes)]
    threads = log.with_name(f"{log.name}.threads_left")
    return Job(log.name, [None if status in (None, "timeout") else int(status) for status in statuses],
               [text(f".rank{rank}.out") or "" for rank in range(num_processes)],
               [path.read_text() for path in sorted(threads.iterdir())] if threads.exists() else [])


def finished_job(log, num_processes: int = 1, fails: bool = False) -> Job:
    """Job LOG, asserting that every rank ended (none killed at its timeout) with the same exit status, 0 unless it
    `fails`, and that no process of a job that succeeded left a gloo thread alive at its exit."""
    from helpers import threads_left_message  # the test process's, not a launched one's

    job = read_job(log, num_processes)
    statuses = job.statuses
    assert None not in statuses and len(set(statuses)) == 1 and (statuses[0] != 0) == fails, (
        f"job {job.name} exited {statuses}\n{job.stdout[-6000:]}")
    assert fails or not job.threads_left, f"job {job.name}: {threads_left_message(job.threads_left)}"
    return job


def wait_for(pid: int, timeout: float):
    """A forked child's exit code (negative: a signal), or None when it ran past `timeout` and was killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_job(job: dict, rank: str, launcher_args: list) -> None:
    """In the forked child: become `python SCRIPT LAUNCHER_ARGS ARGS` with the job's settings, and run it."""
    log = job["log"]
    os.environ.update({"EXIT_CHECK_DIR": f"{log}.threads_left", **job.get("env", {})})
    os.makedirs(os.environ["EXIT_CHECK_DIR"], exist_ok=True)
    if job.get("own_group", True):  # rank 0's child serves its group's store
        os.environ.update({"MASTER_PORT": str(job["port"]), "TORCHELASTIC_USE_AGENT_STORE": "False"})
    for name in [name for name in os.environ if name.startswith(tuple(job.get("unset_env", ())))]:
        del os.environ[name]
    with open(f"{log}.rank{rank}.out", "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    if "cwd" in job:
        os.chdir(job["cwd"])
    sys.path[:0] = job["path"]
    if job.get("record_samples"):
        from sample_recording import record_samples  # beside this file

        record_samples(log)
    # A process that the launcher stops because another one failed (e.g. a collective that timed out waiting for this
    # one) first prints where each of its Python threads was: the test's output then names where a late process stood.
    # (--save_on_signal replaces this with its own handler.)
    faulthandler.register(signal.SIGTERM, chain=True)
    script, *args = job["argv"]
    sys.argv = [script, *launcher_args, *args]
    runpy.run_path(script, run_name="__main__")


def run_alone(log, script: str, args: list) -> None:
    """`jobs.py --alone LOG SCRIPT ARGS`: SCRIPT ARGS in this process, not forked, its output where the launcher sends
    it, for a test of the launcher itself (a restart, a signal); its exit status, as it leaves the script, into
    LOG.rankR.exit, where read_job reads it."""
    faulthandler.register(signal.SIGTERM, chain=True)  # as a job's
    sys.argv = [script, *args]
    status = 1  # an exception other than SystemExit
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:  # the scripts end with sys.exit(status)
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        raise
    finally:
        Path(f"{log}.rank{os.environ.get('RANK', '0')}.exit").write_text(str(status))


def main(argv) -> int:
    if argv[0] == "--alone":
        run_alone(*argv[1:3], argv[3:])
        return 0
    *launcher_args, manifest = argv
    manifest = json.loads(Path(manifest).read_text())
    rank = os.environ.get("RANK", "0")
    optional = [module for module in OPTIONAL_SCRIPT_IMPORTS if manifest["preload"]
                and module not in manifest["not_preloaded"] and importlib.util.find_spec(module) is not None]
    for module in [*manifest["preload"], *optional]:
        if module in LEAN_IMPORTS:
            LEAN_IMPORTS[module]()
        else:
            importlib.import_module(module)
    assert not set(manifest["not_preloaded"]) & set(sys.modules), "preloaded: a job would not start as a fresh one does"
    # Out of the garbage collector's way: else every forked child walks all of torch's and Accelerate's objects in its
    # full collections (at its exit at least), about 1 s of CPU each; what a child creates is collected as before.
    gc.freeze()
    for job in manifest["jobs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # No try/finally around this: the child's exception or SystemExit ends it as it would end a script.
            run_job(job, rank, launcher_args)
            return 0
        status = wait_for(pid, job.get("timeout", JOB_TIMEOUT))
        Path(f"{job['log']}.rank{rank}.exit").write_text("timeout" if status is None else str(status))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
