"""tests/jobs.py, the job runner that most launched tests share: what a launch leaves for each job, and its reader."""

import sys

import pytest
from jobs import finished_job, launch_jobs, read_job

SCRIPT = """import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "port", os.environ.get("MASTER_PORT"), flush=True)
print("set", os.environ.get("SET_HERE"), "unset", os.environ.get("UNSET_ME"), "imports", __import__("standin").NAME)
sys.exit(int(sys.argv[-1]))
"""


def test_each_job_runs_as_its_script_would_and_leaves_its_own_files(tmp_path):
    """One launch of plain python (nothing preloaded: no library import to pay): a job that exits 0, one that exits 3,
    one that the launch kills at its timeout; each job with its own arguments, folder, environment and sys.path."""
    (tmp_path / "standins").mkdir()
    (tmp_path / "standins" / "standin.py").write_text("NAME = 'the stand-in'\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(60)\n")
    job = {"argv": [tmp_path / "script.py", "0"], "cwd": tmp_path / "standins", "path": [tmp_path / "standins"],
           "env": {"SET_HERE": "yes"}, "unset_env": ["UNSET_"]}
    launch = launch_jobs({
        "passes": job,
        "fails": {**job, "argv": [tmp_path / "script.py", "3"], "own_group": False},
        "hangs": {"argv": [tmp_path / "sleeps.py"], "timeout": 1},
    }, [sys.executable], tmp_path, env={"UNSET_ME": "the launch's"}, preload=[], not_preloaded=["torch"])
    assert launch.returncode == 0, launch.stderr  # whatever the jobs did

    passed = finished_job(tmp_path / "passes")
    assert passed.returncode == 0 and passed.statuses == [0] and passed.threads_left == []
    assert f"argv ['0'] cwd {tmp_path / 'standins'} port " in passed.stdout
    assert "set yes unset None imports the stand-in" in passed.stdout
    failed = finished_job(tmp_path / "fails", fails=True)
    assert failed.returncode == 3 and "port None" in failed.stdout  # own_group False: the launcher's port, none here
    assert read_job(tmp_path / "hangs").statuses == [None]  # killed at its timeout
    with pytest.raises(AssertionError, match=r"job hangs exited \[None\]"):
        finished_job(tmp_path / "hangs")


def test_read_job_reads_every_rank_of_a_forked_job(tmp_path):
    """Each rank's own exit status and output (a rank that wrote no exit status, never started: None; "timeout":
    killed at its timeout, None too), rank 0 first, and the exit check's reports."""
    for rank, status in ((0, "0"), (1, "1"), (2, "timeout")):
        (tmp_path / f"job.rank{rank}.exit").write_text(status)
        (tmp_path / f"job.rank{rank}.out").write_text(f"rank {rank}\n")
    job = read_job(tmp_path / "job", 4)
    assert (job.statuses, job.outputs) == ([0, 1, None, None], ["rank 0\n", "rank 1\n", "rank 2\n", ""])
    assert (job.returncode, job.stdout, job.threads_left) == (1, "rank 0\nrank 1\nrank 2\n", [])


def test_finished_job_asserts_every_rank_ended_as_expected(tmp_path):
    """finished_job, which the files that launch jobs assert with: every rank ended, all with the same status,
    non-zero exactly when the job `fails`; no gloo thread left alive by a job that succeeded; every rank's output,
    rank 0 first."""
    def job(*statuses, threads_left=False):  # a job's files, as the runner leaves them; None: a rank never ended
        folder = tmp_path / ("_".join(map(str, statuses)) + ("_threads" if threads_left else ""))
        folder.mkdir(exist_ok=True)
        for rank, status in enumerate(statuses):
            if status is not None:
                (folder / f"job.rank{rank}.exit").write_text(str(status))
            (folder / f"job.rank{rank}.out").write_text(f"rank {rank}\n")
        if threads_left:
            (folder / "job.threads_left").mkdir()
            (folder / "job.threads_left" / "123.txt").write_text("2 gloo worker threads alive at the exit of x\n")
        return folder / "job"

    proc = finished_job(job(0, 0), 2)
    assert (proc.returncode, proc.stdout) == (0, "rank 0\nrank 1\n")
    assert finished_job(job(1, 1), 2, fails=True).returncode == 1
    for statuses, fails in (((0, 1), False), ((1, 0), True), ((0, None), False), ((1, None), True), ((1, 1), False),
                            ((0, 0), True), ((None, None), True)):
        with pytest.raises(AssertionError, match=r"exited \["):
            finished_job(job(*statuses), len(statuses), fails=fails)
    with pytest.raises(AssertionError, match="(?s)gloo worker threads alive .*release the DDP model"):
        finished_job(job(0, 0, threads_left=True), 2)
    assert finished_job(job(1, 1, threads_left=True), 2, fails=True).returncode == 1  # a refusal's exit: not checked
