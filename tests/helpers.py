"""Run the scripts the way users do (`accelerate launch`) and read what they wrote."""

import contextlib
import gzip
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
EXIT_CHECK = REPO / "tests" / "exit_check"  # its sitecustomize.py: see run()
# Real digits shared by the workplace; a user's clone has no ../shared. $MNIST_10K_DIR: where the GPU check carried them.
MNIST_10K = Path(os.environ.get("MNIST_10K_DIR") or REPO.parent / "shared" / "data" / "mnist-10k")
requires_mnist_10k = pytest.mark.skipif(
    not (MNIST_10K / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"real-data test: {MNIST_10K} is absent (a plain clone has no ../shared); generated-data tests still run",
)


def skip_or_fail_in_ci(reason: str):
    """A test that needs something of the machine (a Slurm cluster, network namespaces): skip here,
    saying why, but fail in CI (CI=true, set by .ci/run), where it must run, so it is never silently lost."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and this cannot run: {reason}")
    pytest.skip(reason)


def launcher_args(num_processes: int = 1, config_file=None) -> list:
    """`accelerate launch` arguments for N CPU processes (or a given YAML)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        return cmd + ["--config_file", str(config_file)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_processes > 1:
        # port 0: a free port each time, so tests never collide with each other or with a user's job
        return cmd + ["--multi_gpu", "--num_processes", str(num_processes), "--main_process_port", "0"]
    return cmd + ["--num_processes", "1"]


def threads_left_message(threads_left: list) -> str:
    """What the exit check's files say, and the fix."""
    return (f"{''.join(threads_left)}release the DDP model before end_training "
            f"(docs/ending_a_run_cleanly.md)")


def exit_check_env(exit_check_dir, env=None) -> dict:
    """`env` (default: this process's) with tests/exit_check on PYTHONPATH, recording into `exit_check_dir`."""
    env = {**os.environ, **(env or {})}
    return {**env, "EXIT_CHECK_DIR": str(exit_check_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(EXIT_CHECK), env.get("PYTHONPATH")]))}


def run(cmd, *, check=True, timeout=600, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Run a command; a run that succeeds must also have left no gloo worker thread alive at the exit of any of
    its Python processes (tests/exit_check/sitecustomize.py records them): one alive there can abort the exit."""
    with tempfile.TemporaryDirectory(prefix="exit_check_") as exit_check_dir:
        env = exit_check_env(exit_check_dir, env)
        proc = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=timeout, cwd=cwd, env=env,
        )
        threads_left = [path.read_text() for path in Path(exit_check_dir).iterdir()]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert proc.returncode != 0 or not threads_left, f"{' '.join(map(str, cmd))}: {threads_left_message(threads_left)}"
    return proc


def launch(script_args, num_processes: int = 1, config_file=None, script=TRAIN_MNIST, **kwargs):
    """accelerate launch SCRIPT --cpu ARGS; returns the finished process."""
    return run([*launcher_args(num_processes, config_file), script, "--cpu", *script_args], **kwargs)


def run_alone(script_args, script=TRAIN_MNIST, **kwargs):
    """python SCRIPT --cpu ARGS: one process, without `accelerate launch` (a process of its own) around it, as
    accelerate's one-process launcher would run it. For what a script decides before it trains (a refusal, nothing
    left to train, a lock), where a launched test checks the same kind of decision, and for a one-process run whose
    launched form another test makes (the launcher adds only a process around it): half the processes. With the one
    thread per process that the launcher gives (OMP_NUM_THREADS=1): other thread counts sum in another order, and
    the last bits of a loss differ from a launched run's."""
    env = {"OMP_NUM_THREADS": "1", **(kwargs.pop("env", None) or {})}
    return run([sys.executable, script, "--cpu", *script_args], env=env, **kwargs)


def launch_in_background(script_args, num_processes: int = 1, script=TRAIN_MNIST, **popen) -> subprocess.Popen:
    """Like launch(), but returns at once; stdout and stderr together in .communicate()[0]. `popen`: more of
    Popen's arguments (start_new_session=True: a process group of its own, to signal as a terminal would)."""
    cmd = [*launcher_args(num_processes), script, "--cpu", *script_args]
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", **popen)


def wait_for_path(path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `path` exists (a checkpoint, say); fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if proc.poll() is not None:  # its output says why (stdout=PIPE, as launch_in_background starts it)
            output = proc.communicate()[0] if proc.stdout is not None else ""
            raise AssertionError(f"the job ended before {path} appeared:\n{(output or '')[-3000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_consecutive_ports(count: int) -> int:
    """The first of `count` consecutive free ports, below the kernel's ephemeral range: a port in that range next to a
    free one may be taken by then as the source port of any connection (the previous run's own, say), one below it
    only by a listener. (A sweep's run i listens on --main_process_port + i.)"""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for base in random.Random().sample(range(10000, ephemeral_low - count), 500):
        try:
            with contextlib.ExitStack() as sockets:
                for port in range(base, base + count):
                    sockets.enter_context(socket.socket()).bind(("", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports below {ephemeral_low}")


def training_processes(output_dir) -> list:
    """The training processes writing into `output_dir`, not their launchers: torchrun gives
    them a LOCAL_RANK."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(output_dir) in " ".join(proc.info["cmdline"] or []) and "LOCAL_RANK" in proc.environ():
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


# What the training scripts log when --save_on_signal stopped them.
STOPPED_BY_SIGNAL = re.compile(r"Stopped by a signal after step (\d+): saved (\S+); continue with --resume_from_checkpoint latest")


def results(output_dir) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())


def snapshot(folder) -> dict:
    """Every file under `folder`, by relative path, with its bytes: what "nothing was written" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def tensorboard_scalars(folder, tag: str) -> list:
    """(step, value) of each TensorBoard scalar `tag` a run logged into `folder` (OUTPUT_DIR/<init_trackers' name>)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def error_lines(proc) -> list:
    """Our one-line error messages (accelerate's launcher adds its own report after them)."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


def assert_clean_user_error(proc, *expected_words):
    """Non-zero exit, our one clear line, and no traceback through our code."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    lines = set(error_lines(proc))  # each process prints the same line
    assert len(lines) == 1, output
    (line,) = lines
    for word in expected_words:
        assert word in line, line
    for ours in ("scripts/", "utils/"):
        assert f'{ours}' not in "\n".join(l for l in output.splitlines() if l.strip().startswith("File ")), output


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format (big-endian header, then raw bytes), gzipped when the name ends in .gz."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 + array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def make_synthetic_mnist(folder: Path, num_train: int = 640, num_test: int = 203, gz: bool = True, seed: int = 0) -> Path:
    """Learnable fake digits: class c is a bright bar at a class-specific place, plus noise."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", num_train), ("t10k", num_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            row = 3 + 2 * int(c)
            images[i, row : row + 2, 4 + int(c) : 24] = 255
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return folder


def code_lines(source: str, function: str) -> int:
    """Non-blank, non-comment lines of the function `function` in `source` (issue 22's measure of a main)."""
    import ast

    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function]
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def load_script(path):
    """A script imported as a module (its `if __name__ == "__main__"` block does not run): to call its parse_args."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_folder_of(script, args):
    """The RunFolder that `script`'s main builds from its `args` (what check_output_dir reads)."""
    from utils.run.run_folder import RunFolder

    return RunFolder(args.output_dir, script.describe_run(args), args.epochs, args.max_steps,
                     args.early_stopping_patience, args.overwrite_output_dir, args.eval_only)
