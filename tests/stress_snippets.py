"""Run every two-process snippet of the migration pages of docs/ (and, with --train_mnist, two-process runs of
scripts/train_mnist.py and scripts/minimal_mnist.py) N times in a row and count the runs that failed, those
that aborted at exit ("terminate called without an active exception", SIGABRT), and those that left a gloo
worker thread alive at exit (what makes that abort possible; tests/exit_check/sitecustomize.py records it).

    python tests/stress_snippets.py --repeat 20                 # every two-process snippet, 20 times each
    python tests/stress_snippets.py --repeat 20 --train_mnist   # and the two MNIST scripts, 2 processes
    python tests/stress_snippets.py --repeat 10 --starve_gloo --only lr_after_two_steps
    python tests/stress_snippets.py --repeat 50 --only lr_after_two_steps --cores

--starve_gloo runs gloo's worker threads at SCHED_IDLE on one CPU, which turns the rare abort of a run that
keeps them alive to its exit into a likely one (7 runs in 10). --only keeps the snippets containing a string
(or "train_mnist"); --cores lets each aborted process dump core into its run's folder and keeps that folder
(read a core with `gdb python CORE`). Exit status 1 if any run failed, aborted or left a thread. Slow by
design: each run starts two Python processes that import torch.
"""

import argparse
import collections
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import EXIT_CHECK, REPO, TRAIN_MNIST, launcher_args, make_synthetic_mnist  # noqa: E402
from test_migration_guide import RUNNERS, fenced_blocks, free_port  # noqa: E402

# what std::terminate prints when, say, a std::thread still joinable is destroyed
EXIT_TIME_ABORT = "terminate called without an active exception"


def jobs(data_dir: Path, with_train_mnist: bool) -> list:
    """(name, command maker taking the run's folder, file to write or None) for each job."""
    found = []
    for name, marker, lang, code in fenced_blocks():
        launcher = (marker or "").split(" | ")[0].strip()  # "runnable: torchrun 2 | pair: ..." -> the launcher
        if lang == "python" and launcher in RUNNERS and launcher != "runnable":  # the two-process ones
            found.append((name, RUNNERS[launcher], code))
    if with_train_mnist:
        # one epoch each: train_mnist.py of 256 samples; minimal_mnist.py (no --max_train_samples) of all
        for script, flags in ((TRAIN_MNIST, ["--max_train_samples", "256"]), (REPO / "scripts" / "minimal_mnist.py", [])):
            def train(folder, script=script, flags=flags):
                return [*launcher_args(2), script, "--cpu", "--epochs", "1", *flags,
                        "--data_dir", data_dir, "--output_dir", folder / "out"]
            found.append((f"{script.stem}-2proc", train, None))
    return found


def run_once(command, code, folder: Path, cores: bool, starve_gloo: bool) -> tuple:
    """(status, seconds, output): status 'ok', 'threads_left' (ok, but a gloo thread was alive at exit),
    'abort' (at exit) or 'fail'."""
    cmd = command(folder / "snippet.py") if code is not None else command(folder)
    if code is not None:
        (folder / "snippet.py").write_text(code)
    exit_check_dir = folder / "exit_check"
    exit_check_dir.mkdir()
    env = {"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "EXIT_CHECK_DIR": str(exit_check_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(EXIT_CHECK), os.environ.get("PYTHONPATH")])),
           "STARVE_GLOO": "1" if starve_gloo else "0"}

    def allow_cores():
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    start = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], cwd=folder, capture_output=True, text=True, errors="replace",
                          timeout=300, env={**os.environ, **env},
                          preexec_fn=allow_cores if cores else None)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    if proc.returncode == 0:
        threads_left = "".join(path.read_text() for path in exit_check_dir.iterdir())
        return ("threads_left" if threads_left else "ok"), seconds, output + threads_left
    return ("abort" if EXIT_TIME_ABORT in output or "SIGABRT" in output else "fail"), seconds, output


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs of each job")
    parser.add_argument("--only", action="append", default=[], help="keep the jobs whose code (or name) has this")
    parser.add_argument("--train_mnist", action="store_true", help="also scripts/train_mnist.py, 2 processes")
    parser.add_argument("--cores", action="store_true", help="dump core on abort; keep the failed runs' folders")
    parser.add_argument("--starve_gloo", action="store_true", help="gloo's worker threads at SCHED_IDLE on one CPU")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stress_snippets_"))
    data_dir = make_synthetic_mnist(work / "mnist") if args.train_mnist or "train_mnist" in args.only else None
    selected = [job for job in jobs(data_dir, args.train_mnist or "train_mnist" in args.only)
                if not args.only or any(s in job[0] or s in (job[2] or "") for s in args.only)]
    counts = collections.defaultdict(collections.Counter)
    seconds = collections.defaultdict(float)
    for name, command, code in selected:
        for i in range(args.repeat):
            folder = work / f"{name}-{i}"
            folder.mkdir()
            status, took, output = run_once(command, code, folder, args.cores, args.starve_gloo)
            counts[name][status] += 1
            seconds[name] += took
            print(f"{name} run {i + 1}/{args.repeat}: {status} ({took:.1f} s)", flush=True)
            if status != "ok":
                (folder / "output.txt").write_text(output)
                print(output[-3000:], flush=True)
                print(f"  kept in {folder}", flush=True)
            elif not args.cores or not list(folder.glob("core*")):
                shutil.rmtree(folder)

    print(f"\n{'job':50} {'runs':>5} {'ok':>5} {'left':>5} {'abort':>6} {'fail':>5} {'s/run':>6}")
    for name, _, _ in selected:
        c = counts[name]
        print(f"{name:50} {sum(c.values()):5} {c['ok']:5} {c['threads_left']:5} {c['abort']:6} {c['fail']:5} "
              f"{seconds[name] / max(1, sum(c.values())):6.1f}")
    total = sum((counts[name] for name, _, _ in selected), collections.Counter())
    print(f"{'total':50} {sum(total.values()):5} {total['ok']:5} {total['threads_left']:5} {total['abort']:6} "
          f"{total['fail']:5}")
    sys.exit(1 if total["threads_left"] + total["abort"] + total["fail"] else 0)


if __name__ == "__main__":
    main()
