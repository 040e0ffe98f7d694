"""Where a benchmark's numbers were made (scripts/benchmark.py, scripts/benchmark_data.py): the machine's facts,
commands and paths as a reader runs them from the repository root, each benchmark run's CPU threads and visible GPUs."""

import os
import platform
import shlex
import subprocess
import sys

import torch

from ..errors import UserError


def portable_path(path, repo) -> str:
    """An absolute path as seen from the repository root (published records must not name the
    folders of the machine they were made on); a relative one as it is."""
    return os.path.relpath(path, repo) if os.path.isabs(path) else str(path)


def portable_command(words, repo, run_dir=None) -> str:
    """A command as a reader runs it from the repository root: `python` for this interpreter,
    absolute paths relative to the repository, the run's temporary folder as RUN_DIR."""
    portable = []
    for word in map(str, words):
        if word == sys.executable:
            word = "python"
        elif run_dir is not None and (word == str(run_dir) or word.startswith(f"{run_dir}{os.sep}")):
            word = "RUN_DIR" + word[len(str(run_dir)):]
        else:
            word = portable_path(word, repo)
        portable.append(word)
    return shlex.join(portable)


def machine_facts() -> dict:
    """What a published number needs next to it: hardware and library versions."""
    import accelerate
    import torchvision

    cpu_model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu_model,
        "cpu_cores": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda if gpus else None,
        "load_average_1min_after": os.getloadavg()[0],
        "git_commit": _git_commit(),
    }


def cpu_threads(num_processes: int, users_threads, cores) -> int:
    """OMP_NUM_THREADS for each of `num_processes` CPU processes: the user's OMP_NUM_THREADS (`users_threads`, None
    where unset; on a busy machine fewer threads than cores can train many times faster), else the cores shared out."""
    if users_threads is not None and not (users_threads.isdigit() and int(users_threads) > 0):
        raise UserError(f"OMP_NUM_THREADS={users_threads}: not a positive whole number; set it to the threads each "
                        f"process should use, or unset it (then the cores / processes)")
    return int(users_threads) if users_threads is not None else max(1, (cores or 1) // num_processes)


def print_cpu_threads(process_counts, users_threads, cores) -> None:
    """Before the first CPU run: the threads each process will use, per process count."""
    whose = ", yours" if users_threads is not None else ""
    print(f"CPU threads per process (OMP_NUM_THREADS{whose}): " + ", ".join(
        f"{cpu_threads(n, users_threads, cores)} on {n} processes" for n in sorted(process_counts)), flush=True)


def cpu_threads_source(users_threads) -> str:
    """benchmark.json's threads_per_process on the CPU: whose OMP_NUM_THREADS the runs took."""
    if users_threads is not None:
        return f"OMP_NUM_THREADS={users_threads} (set by the user)"
    return "cores / processes (OMP_NUM_THREADS)"


def run_environment(combo, on_cpu: bool, environ, cores, machine_gpus: int) -> dict:
    """The environment of one benchmark run: the user's (`environ`), with the same CPU threads or GPUs for every
    method; `cores` and `machine_gpus` are this machine's."""
    env = dict(environ)
    if on_cpu:
        # Every method gets the same threads (torchrun and accelerate launch would otherwise choose different counts).
        env["OMP_NUM_THREADS"] = str(cpu_threads(combo.num_processes, env.get("OMP_NUM_THREADS"), cores))
    if combo.method == "dataparallel":
        # DataParallel drives every GPU it sees: show it the first N of the GPUs the user chose
        # (CUDA_VISIBLE_DEVICES, as every other method respects it), not of the machine's.
        visible = env.get("CUDA_VISIBLE_DEVICES")
        chosen = visible.split(",") if visible is not None else [str(i) for i in range(machine_gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(chosen[:combo.num_processes])
    return env


def _git_commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
