"""scripts/benchmark.py --quick on CPU processes: every combination is reported, measured or
skipped with its reason, and the numbers are sane. (No assertion on speed: CI machines are
shared and noisy; the published numbers come from repeated runs on a quiet machine.)"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import (REPO, exit_check_env, assert_clean_user_error, code_lines, launch_in_background, load_script, run,
                     training_processes)

from utils.errors import UserError
from utils.benchmark.environment import cpu_threads_source, print_cpu_threads, run_environment
from utils.benchmark.report import Combination

BENCHMARK = REPO / "scripts" / "benchmark.py"
BENCHMARK_TRAIN = REPO / "scripts" / "benchmark_train.py"
METHODS = ("plain", "ddp", "dataparallel", "accelerate")
KEY = ("model", "data_path", "method", "precision", "num_processes")


def benchmark_in_this_process(argv, cwd=REPO) -> None:
    """`python scripts/benchmark.py ARGV` started in `cwd`, run in this process: benchmark.py only starts the runs and
    writes the report, so its own process (torch and matplotlib imported again, ~10 s) is spared. Its runs are started
    as tests/helpers.run starts a process: tests/exit_check on PYTHONPATH, each checked for gloo threads alive at its
    exit. (A failing benchmark's one error line, from a process of its own: the no-steady-state test.)"""
    benchmark = load_script(BENCHMARK)
    argv = [str(word) for word in argv]
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory(prefix="exit_check_") as exit_check_dir:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [str(BENCHMARK), *argv])  # what benchmark.json records as the command typed
        for name in ("PYTHONPATH", "EXIT_CHECK_DIR"):
            patch.setenv(name, exit_check_env(exit_check_dir)[name])
        benchmark.main(benchmark.parse_args(argv))
        threads_left = [path.read_text() for path in Path(exit_check_dir).iterdir()]
    assert threads_left == []


@pytest.fixture(scope="module")
def quick(synthetic_mnist, tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    # 640 generated digits in batches of 16: 20 batches per process on 2 processes, 10 past warm-up.
    # Two processes only, to keep CI short (test_baselines.py runs the scripts on one). Started outside
    # the repository with paths relative to there, as a user may: the runs start in the repository root.
    benchmark_in_this_process(["--quick", "--cpu", "--data_dir", synthetic_mnist.name, "--batch_size", "16",
                               "--methods", ",".join(METHODS), "--precisions", "fp32,fp16", "--num_processes", "2",
                               "--data_paths", "dataloader,device", "--output_dir", out.name], cwd=out.parent)
    assert synthetic_mnist.parent == out.parent
    with open(out / "benchmark.csv") as f:
        rows = {tuple(row[k] for k in KEY): row for row in csv.DictReader(f)}
    return out, rows, json.loads((out / "benchmark.json").read_text())


def number(text):
    return float(text) if text != "" else None


def test_every_combination_has_a_row_measured_or_skipped_with_its_reason(quick):
    _, rows, _ = quick
    expected = {("mnist", path, method, precision, str(n)) for path in ("dataloader", "device") for method in METHODS
                for precision in ("fp32", "fp16") for n in (2,)}
    assert set(rows) == expected
    for key, row in rows.items():
        _, path, method, precision, n = key
        if method == "dataparallel":
            assert row["status"] == "skipped" and "2 or more GPUs" in row["reason"], row
        elif method == "plain":
            assert row["status"] == "skipped" and "one process" in row["reason"], row
        elif precision == "fp16":
            assert row["status"] == "skipped" and "fp16 needs a CUDA GPU" in row["reason"], row
        else:
            assert row["status"] == "ok" and row["runs"] == "1" and row["reason"] == "", row
    measured = [k for k, r in rows.items() if r["status"] == "ok"]
    assert len(measured) == 2 * 2  # per data path: ddp and accelerate, fp32


def test_measured_rows_hold_sane_numbers(quick):
    _, rows, _ = quick
    for key, row in rows.items():
        if row["status"] != "ok":
            assert row["samples_per_second"] == row["ratio_to_ddp"] == "", row
            continue
        speed, low, high = (number(row[f"samples_per_second{end}"]) for end in ("", "_min", "_max"))
        assert 0 < low <= speed <= high < 1e7, row
        assert 0 < number(row["time_per_epoch_s"]) < 300, row
        assert 50 < number(row["peak_memory_mb"]) < 20_000, row  # CPU: resident set of a torch process
        assert 0.5 <= number(row["eval_accuracy"]) <= 1.0, row  # the generated digits are easy; chance is 0.1
        assert row["eval_samples"] == "203", row  # exact on 2 processes (203 is odd)
        if row["method"] == "accelerate":  # one round: the ratio is this row's speed over DDP's, same settings
            ddp = rows[(*key[:2], "ddp", *key[3:])]
            expected = number(row["samples_per_second"]) / number(ddp["samples_per_second"])
            assert number(row["ratio_to_ddp"]) == pytest.approx(expected, rel=1e-9), row
        # published records name no folder of the machine they were made on
        assert row["command"].startswith("python ") and "--cpu" in row["command"], row
        assert not re.search(r"(^|\s)/", row["command"]) and "RUN_DIR/out" in row["command"], row
    # The scripts users copy are what is timed on the DataLoader path.
    assert "scripts/train_mnist.py" in rows[("mnist", "dataloader", "accelerate", "fp32", "2")]["command"]
    assert "torch.distributed.run" in rows[("mnist", "dataloader", "ddp", "fp32", "2")]["command"]
    assert "baselines/ddp_mnist.py" in rows[("mnist", "dataloader", "ddp", "fp32", "2")]["command"]
    assert "--data_on_device" in rows[("mnist", "device", "accelerate", "fp32", "2")]["command"]


def test_on_device_path_trains_the_same_model_with_ddp_and_accelerate(quick):
    """Same seed, initial weights, shuffle and shards: on the fast path the two methods compute
    the same training, bit for bit on the CPU, so the epoch's exact training loss is equal, not only
    the accuracy on the easy generated digits; they differ in speed only."""
    _, _, report = quick
    runs = {run["method"]: run for run in report["runs"] if run["data_path"] == "device"}
    ddp, accelerate = runs["ddp"], runs["accelerate"]
    assert ddp["train_loss"] == accelerate["train_loss"] and 0 < ddp["train_loss"] < 2.3  # chance: ln 10
    assert ddp["eval_accuracy"] == accelerate["eval_accuracy"]


def test_json_records_machine_versions_command_and_every_run(quick, synthetic_mnist):
    out, rows, report = quick
    assert report["machine"]["torch"] == torch.__version__
    assert report["machine"]["accelerate"] and report["machine"]["cpu_cores"] >= 1
    assert report["device"] == "cpu"
    # The command as typed, the interpreter and the script named as from the repository root; the
    # settings and every run's command with paths relative to the repository, wherever it was started.
    assert report["command"].startswith(f"python scripts/benchmark.py --quick --cpu --data_dir {synthetic_mnist.name} ")
    data_dir = os.path.relpath(synthetic_mnist, REPO)
    assert report["settings"]["data_dir"] == data_dir and report["settings"]["output_dir"] == os.path.relpath(out, REPO)
    assert all(f"--data_dir {data_dir} " in run["command"] for run in report["runs"])
    assert len(report["rows"]) == len(rows)
    assert len(report["runs"]) == 4 and all(run["status"] == "ok" for run in report["runs"])
    assert report["settings"]["epochs"] == 1 and report["settings"]["repeats"] == 1


def test_markdown_table_lists_measured_rows_then_skipped_ones_with_reasons(quick):
    out, rows, _ = quick
    text = (out / "benchmark.md").read_text()
    measured = [line for line in text.splitlines() if line.startswith("| mnist |")]
    assert len(measured) == sum(r["status"] == "ok" for r in rows.values()) == 4
    assert "mnist/device/dataparallel/fp32/2p: skipped, nn.DataParallel needs 2 or more GPUs" in text


def test_rewrite_from_json_rebuilds_the_same_table_without_running_anything(quick, tmp_path):
    out, _, _ = quick
    benchmark = load_script(BENCHMARK)  # in this process: a rewrite starts no process
    benchmark.main(benchmark.parse_args(["--rewrite_from", str(out / "benchmark.json"), "--output_dir", str(tmp_path)]))
    assert (tmp_path / "benchmark.csv").read_text() == (out / "benchmark.csv").read_text()
    assert (tmp_path / "benchmark.md").read_text() == (out / "benchmark.md").read_text()
    assert (tmp_path / "throughput.png").is_file() and (tmp_path / "scaling.png").is_file()


def test_plots_are_pngs_with_content(quick):
    out, _, _ = quick
    import matplotlib.image

    for name in ("throughput.png", "scaling.png"):
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 300 and image.shape[1] >= 600, name
        assert image[..., :3].std() > 0.05, f"{name} is blank"


def test_resnet_on_synthetic_images_in_plain_pytorch(tmp_path):
    """The ResNet path: a torchvision model on synthetic 1000-class images, in plain PyTorch.
    16-pixel images and 12 batches keep it short (ResNet's global pooling takes any size)."""
    benchmark_in_this_process(["--quick", "--cpu", "--models", "resnet18", "--methods", "plain", "--precisions", "fp32",
                               "--num_processes", "1", "--data_paths", "device", "--image_size", "16",
                               "--synthetic_samples", "192", "--batch_size", "16", "--output_dir", tmp_path])
    with open(tmp_path / "benchmark.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["model"], row["method"], row["precision"], row["status"]) == ("resnet18", "plain", "fp32", "ok"), row
    assert number(row["samples_per_second"]) > 0
    assert row["eval_accuracy"] == "" and row["eval_samples"] == ""  # random labels: no accuracy reported
    assert number(row["ratio_to_ddp"]) is None  # no DDP run to compare with


def test_quick_is_a_smoke_test_of_five_runs_on_a_cpu():
    """--quick (tiny runs) runs each MNIST script once on 1 and on 2 processes, in fp32 with the DataLoader: 5 runs on
    a CPU, where the whole grid at that size is 20 (522 s on 2 cores, each run mostly its processes' start). Without
    --quick the whole grid is the default, and each part of it stays a flag away from --quick."""
    benchmark = load_script(BENCHMARK)

    def measured(argv):
        args = benchmark.parse_args(argv)
        combinations = [benchmark.Combination(model, data_path, method, precision, n)
                        for model in args.models for data_path in args.data_paths for method in args.methods
                        for precision in args.precisions for n in args.num_processes]
        return sorted(f"{c.data_path}/{c.method}/{c.precision}/{c.num_processes}p" for c in combinations
                      if benchmark.skip_reason(c, on_cpu=True, num_gpus=0) is None)

    assert measured(["--quick"]) == ["dataloader/accelerate/fp32/1p", "dataloader/accelerate/fp32/2p",
                                     "dataloader/ddp/fp32/1p", "dataloader/ddp/fp32/2p", "dataloader/plain/fp32/1p"]
    assert len(measured([])) == 20
    assert len(measured(["--quick", "--precisions", "fp32,bf16", "--data_paths", "dataloader,device"])) == 20


def test_bad_selection_is_one_clear_line(tmp_path, capsys):
    # parse_args refuses it, in this process (benchmark.py's error line from a process of its own: the next test)
    with pytest.raises(SystemExit) as stopped:
        load_script(BENCHMARK).parse_args(["--methods", "horovod", "--output_dir", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2
    assert stderr.strip().startswith("error: ") and "plain, ddp, dataparallel, accelerate" in stderr
    assert not (tmp_path / "out").exists()


def test_a_run_without_steady_state_fails_with_the_reason_instead_of_crashing_the_report(synthetic_mnist, tmp_path):
    """160 samples in batches of 16: every batch is warm-up. ddp_mnist.py then reports no samples/s, train_mnist.py
    the rate over all batches (warm-up included); neither is what the table compares, so both runs fail, saying
    why (before, the report crashed on the missing number, after all the runs, and wrote nothing)."""
    proc = run([sys.executable, BENCHMARK, "--quick", "--cpu", "--data_dir", synthetic_mnist, "--max_train_samples",
                "160", "--batch_size", "16", "--methods", "ddp,accelerate", "--precisions", "fp32", "--num_processes",
                "1", "--data_paths", "dataloader", "--output_dir", tmp_path], check=False)
    assert_clean_user_error(proc, "2 combination(s) failed", "no steady state: no process trained past the 10 warm-up")
    assert proc.returncode == 1
    with open(tmp_path / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["status"], r["samples_per_second"]) for r in rows] == [("ddp", "failed", ""),
                                                                                  ("accelerate", "failed", "")]
    assert all(r["reason"].startswith("no steady state: ") for r in rows)


# ---------------------------------------------------------------- the scripts read like train_mnist.py


def file_lines(text: str) -> int:
    """As `wc -l` counts them."""
    return text.count("\n")


def test_benchmark_train_main_and_benchmark_py_stay_short():
    """Issue 22: benchmark_train.py's main at most 60 code lines, benchmark.py at most 320 lines."""
    assert code_lines(BENCHMARK_TRAIN.read_text(), "main") <= 60
    assert file_lines(BENCHMARK.read_text()) <= 320
    # the counts can fail: 61 statements between comments and blank lines, a file one line too long
    longer = "def main(args):\n" + "".join(f"    # step {i}\n\n    x = {i}\n" for i in range(60))
    assert code_lines(longer, "main") == 61
    assert file_lines("x = 1\n" * 321) == 321


# ---------------------------------------------------------------- every flag means something


def test_a_flag_of_the_other_model_is_refused_with_one_line(synthetic_mnist, tmp_path, capsys):
    """The ResNets train on generated images and are not evaluated: --max_train_samples, --max_eval_samples
    and --data_dir would mean nothing for them (before, they were ignored: the run trained on all
    --synthetic_samples images). Nor do --image_size and --synthetic_samples for the MNIST ConvNet."""
    proc = run([sys.executable, BENCHMARK_TRAIN, "--method", "plain", "--cpu", "--model", "resnet18",
                "--max_train_samples", "64", "--image_size", "16", "--synthetic_samples", "64",
                "--output_dir", tmp_path / "resnet"], check=False)
    assert_clean_user_error(proc, "--max_train_samples means nothing for --model resnet18")
    assert proc.returncode == 2 and not (tmp_path / "resnet").exists()
    # the same refusal in parse_args the other way round, in this process (a process of its own cost 6 s)
    with pytest.raises(SystemExit) as stopped:
        load_script(BENCHMARK_TRAIN).parse_args(["--method", "plain", "--cpu", "--data_dir", str(synthetic_mnist),
                                                 "--image_size", "32", "--output_dir", str(tmp_path / "convnet")])
    (line,) = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith("error: ")
    assert "--image_size means nothing for --model convnet" in line
    assert not (tmp_path / "convnet").exists()


def test_every_model_flag_is_checked_for_the_other_model(capsys):
    """The same check, in-process, for each flag of one model given to the other; each model's own flags pass."""
    benchmark_train = load_script(BENCHMARK_TRAIN)
    assert {"data_dir", "max_train_samples"} <= set(benchmark_train.MNIST_ONLY)  # the loop below checks each one
    assert {"image_size", "synthetic_samples"} <= set(benchmark_train.RESNET_ONLY)
    for model, flags in (("resnet50", benchmark_train.MNIST_ONLY), ("convnet", benchmark_train.RESNET_ONLY)):
        for name in flags:
            with pytest.raises(SystemExit) as stopped:
                benchmark_train.parse_args(["--method", "plain", "--model", model, f"--{name}", "7"])
            (line,) = capsys.readouterr().err.splitlines()
            assert stopped.value.code == 2 and line.startswith("error: ")
            assert f"--{name} means nothing for --model {model}: it is a flag of --model " in line
    args = benchmark_train.parse_args(["--method", "plain", "--model", "resnet18", "--image_size", "16"])
    assert (args.image_size, args.synthetic_samples) == (16, 2560)
    args = benchmark_train.parse_args(["--method", "plain", "--max_train_samples", "64", "--data_dir", "d"])
    assert (args.max_train_samples, args.data_dir) == (64, "d")


def rank_of(output_dir, job, rank: int):
    """The process of `rank` in the job writing into `output_dir`, as soon as it exists."""
    deadline = time.monotonic() + 120
    while True:
        assert job.poll() is None, "the job ended before its processes were found"
        assert time.monotonic() < deadline, f"no rank {rank} after 120 s"
        found = [p for p in training_processes(output_dir) if p.environ().get("RANK") == str(rank)]
        if found:
            return found[0]
        time.sleep(0.1)


def wait_for_the_group(rank_0, rank_1, job):
    """Until gloo has connected the two ranks to each other (a TCP connection between their processes, besides
    each one's to the launcher's store): both are past their start-up, which under load takes longer than the
    timeout itself, and rank 1 stopped from then on leaves rank 0 waiting in a collective."""
    deadline = time.monotonic() + 120
    while True:
        assert job.poll() is None, "the job ended before its two ranks connected"
        assert time.monotonic() < deadline, "the two ranks not connected after 120 s"
        ends_0 = {(c.laddr, c.raddr) for c in rank_0.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED}
        ends_1 = {(c.raddr, c.laddr) for c in rank_1.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED}
        if ends_0 & ends_1:
            return
        time.sleep(0.1)


# How long rank 0 may take past the 5 s timeout to reach its collective, give up and exit (measured 4.3 s at a load of 3).
EXIT_SLACK = 20


def test_accelerate_method_honours_ddp_timeout(synthetic_mnist, tmp_path):
    """--ddp_timeout reaches Accelerate's process group (before, --method accelerate ignored it: the backend's
    default applied, 30 minutes on gloo): when one process stops answering, the other gives up after 5 s.
    Rank 0's own exit is timed; then the test kills the frozen rank 1 itself, as torchrun's agent would only
    after its fixed 30 s grace (see test_hangs.py), which the suite need not sit through."""
    out = tmp_path / "out"
    job = launch_in_background(["--method", "accelerate", "--data_dir", synthetic_mnist, "--data_on_device",
                                "--epochs", "1000", "--batch_size", "16", "--ddp_timeout", "5", "--output_dir", out],
                               num_processes=2, script=BENCHMARK_TRAIN)
    stopped = None
    try:
        stopped = rank_of(out, job, 1)
        rank_0 = rank_of(out, job, 0)
        wait_for_the_group(rank_0, stopped, job)
        stopped.send_signal(signal.SIGSTOP)  # a frozen process: alive, but never answering
        since = time.monotonic()
        try:
            rank_0.wait(timeout=5 + EXIT_SLACK)
        except psutil.TimeoutExpired:
            pass  # still waiting: the assertion below says so, once the job is ended
        waited = time.monotonic() - since
        stopped.kill()
        output, _ = job.communicate(timeout=120)
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
        if job.poll() is None:
            job.kill()
    # the 5 s timeout and rank 0's exit
    assert waited < 5 + EXIT_SLACK, f"rank 0 still waited after {waited:.0f} s"
    assert job.returncode != 0 and not (out / "results.json").exists()
    timed_out = ("Timed out waiting 5000ms", "wait timeout after 5000ms")  # gloo's, the store's (utils/run/hangs.py)
    assert any(message in output for message in timed_out), output[-3000:]


# ---------------------------------------------------------------- GPU-path logic, shown on the CPU


def test_a_dataparallel_row_counts_gpus_not_processes():
    """DataParallel is one process driving N GPUs: a 2-GPU run is what was asked for, even though
    results.json says one process (before the fix every such row was marked failed)."""
    benchmark = load_script(BENCHMARK)
    combo = benchmark.Combination("mnist", "device", "dataparallel", "fp16", 2)
    assert benchmark.ran_as_asked(combo, {"num_processes": 1, "num_gpus": 2}) is None
    assert benchmark.ran_as_asked(combo, {"num_processes": 1, "num_gpus": 1}) == "ran on 1 GPUs, not 2"
    ddp = benchmark.Combination("mnist", "device", "ddp", "fp16", 2)
    assert benchmark.ran_as_asked(ddp, {"num_processes": 2, "num_gpus": None}) is None
    assert "ran on 1 processes" in benchmark.ran_as_asked(ddp, {"num_processes": 1, "num_gpus": None})


def test_dataparallel_respects_the_users_gpu_selection():
    """DataParallel sees the first N of the GPUs the user chose, as torchrun's and accelerate's
    processes take the first N of them; without a choice, the first N of the machine's (here 4)."""
    dataparallel = Combination("mnist", "device", "dataparallel", "fp16", 2)
    ddp = Combination("mnist", "device", "ddp", "fp16", 2)

    def visible(combo, environ):
        return run_environment(combo, False, environ, 8, 4).get("CUDA_VISIBLE_DEVICES")

    assert visible(dataparallel, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2,3"
    assert visible(ddp, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2,3"
    assert visible(dataparallel, {"CUDA_VISIBLE_DEVICES": "5,2,3"}) == "5,2"
    assert visible(dataparallel, {}) == "0,1"
    assert visible(ddp, {}) is None


def test_cpu_runs_get_the_users_omp_num_threads_or_the_cores_shared_out(capsys):
    """On a busy machine 2 threads per process trained 16x slower than 1: the user's OMP_NUM_THREADS, where set, is
    every CPU run's (else the cores / processes), printed before the first run and recorded in benchmark.json; a value
    OpenMP cannot take is one error line, not a traceback."""
    one, two = (Combination("mnist", "dataloader", "accelerate", "fp32", n) for n in (1, 2))
    assert [run_environment(c, True, {}, 8, 0)["OMP_NUM_THREADS"] for c in (one, two)] == ["8", "4"]
    assert [run_environment(c, True, {"OMP_NUM_THREADS": "1"}, 8, 0)["OMP_NUM_THREADS"] for c in (one, two)] == [
        "1", "1"]
    print_cpu_threads({2, 1}, None, 8)
    print_cpu_threads({1, 2}, "1", 8)
    assert capsys.readouterr().out == ("CPU threads per process (OMP_NUM_THREADS): 8 on 1 processes, 4 on 2 processes\n"
                                       "CPU threads per process (OMP_NUM_THREADS, yours): 1 on 1 processes, "
                                       "1 on 2 processes\n")
    assert cpu_threads_source("1") == "OMP_NUM_THREADS=1 (set by the user)"
    assert cpu_threads_source(None) == "cores / processes (OMP_NUM_THREADS)"
    for bad in ("0", "two", "-1", ""):
        with pytest.raises(UserError, match=f"OMP_NUM_THREADS={bad}: not a positive whole number"):
            run_environment(one, True, {"OMP_NUM_THREADS": bad}, 8, 0)


def forward_as_a_replica(module, x):
    """module(x) the way nn.DataParallel runs each replica (torch/nn/parallel/parallel_apply.py):
    in a new thread, which re-enters autocast with the caller's on/off switch but not its dtype
    (autocast state is thread-local, so the thread starts from the device's default dtype)."""
    enabled, output = torch.is_autocast_enabled(x.device.type), {}

    def worker():
        with torch.autocast(x.device.type, enabled=enabled):
            output["dtype"] = module(x).dtype

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return output["dtype"]


def test_autocast_reaches_the_replica_threads_with_its_dtype():
    """The defect, on the CPU: autocast entered around the DataParallel call reaches the replicas
    with the default dtype, not the one asked for (bf16 on the CPU here; on CUDA the default is
    fp16, so a bf16 run computed in fp16). AutocastInForward enters it inside each replica."""
    from utils.benchmark.baselines import AutocastInForward

    x = torch.randn(2, 4)
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # the default a replica thread starts from
    with torch.autocast("cpu", dtype=torch.float16):  # the old way: autocast around the call
        assert forward_as_a_replica(torch.nn.Linear(4, 4), x) == torch.bfloat16  # not fp16
    for dtype in (torch.bfloat16, torch.float16):
        # benchmark_train.py's way: nothing around the call, autocast inside forward
        assert forward_as_a_replica(AutocastInForward(torch.nn.Linear(4, 4), dtype), x) == dtype
    assert forward_as_a_replica(AutocastInForward(torch.nn.Linear(4, 4), None), x) == torch.float32  # fp32 runs


def test_the_step_watch_sees_gradscaler_skip_a_step_without_reading_the_scale():
    from utils.benchmark.baselines import OptimizerStepWatch

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    watch = OptimizerStepWatch(optimizer)
    for gradient, steps in ((torch.ones(3), True), (torch.tensor([1.0, float("inf"), 1.0]), False)):
        scaler.scale((weight * gradient).sum()).backward()  # an overflowing gradient the second time
        scaler.step(optimizer)
        optimizer.zero_grad()
        scaler.update()
        assert watch.take() is steps and watch.take() is False


# A folder of a machine: absolute (/scratch/me/...) or climbing out of the repository to one (../../scratch/...).
MACHINE_PATH = re.compile(r"(?<![\w./-])(?:/|(?:\.\./)+)(?:work|root|home|tmp|Users|mnt|scratch)/\S*")


def test_committed_docs_name_no_folder_of_the_machine_they_were_made_on():
    assert MACHINE_PATH.search("--data_dir /scratch/data/x") and MACHINE_PATH.search("'../../scratch/run-1/out'")
    assert not MACHINE_PATH.search("--data_dir ../shared/data/mnist-10k --output_dir docs/benchmarks/tmp/x")
    files = subprocess.run(["git", "ls-files", "docs", "README.md"], capture_output=True, text=True, cwd=REPO,
                           check=True).stdout.split()
    assert len(files) > 5
    offenders = [(name, match.group(0)) for name in files if not name.endswith(".png")
                 for match in MACHINE_PATH.finditer((REPO / name).read_text())]
    assert offenders == []


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")
def test_dataparallel_replicas_compute_in_the_dtype_asked_for():
    """The real thing: torch's parallel_apply runs two replicas in threads (on one GPU here, as
    DataParallel does on two), and with nn.DataParallel itself where there are 2+ GPUs."""
    from torch.nn.parallel import parallel_apply

    from utils.benchmark.baselines import AutocastInForward

    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    x = torch.randn(8, 4, device="cuda")
    replicas = [torch.nn.Linear(4, 4).cuda() for _ in range(2)]
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the old way: the replicas lose the dtype
        assert {y.dtype for y in parallel_apply(replicas, [(x,), (x,)], devices=[0, 0])} == {torch.float16}
    wrapped = [AutocastInForward(replica, torch.bfloat16) for replica in replicas]
    assert {y.dtype for y in parallel_apply(wrapped, [(x,), (x,)], devices=[0, 0])} == {torch.bfloat16}
    if torch.cuda.device_count() >= 2:
        model = torch.nn.DataParallel(AutocastInForward(torch.nn.Linear(4, 4).cuda(), torch.bfloat16))
        assert model(x).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU grid needs a CUDA GPU; CI has none")
def test_quick_gpu_grid(synthetic_mnist, tmp_path):
    """The benchmark's tiny --quick runs over every method and process count on this machine's GPUs, in the
    precision only a GPU has (fp16 with its loss scaler; bf16 is train_mnist's GPU tests') on the data path
    the GPU adds (the set held on the device; the DataLoader path is train_mnist's GPU tests'): every
    combination the GPUs allow succeeds (DataParallel, checked by the GPUs it drove, where there are 2+), the
    rest is skipped for the right reason, and peak memory is the GPU's. On the first GPU check (one H100)
    each run took over 18 s, 12 of them importing evaluate: 18 and then 9 runs did not end in 150 s."""
    num_gpus = torch.cuda.device_count()
    proc = run([sys.executable, BENCHMARK, "--quick", "--data_dir", synthetic_mnist, "--batch_size", "16",
                "--precisions", "fp16", "--num_processes", "1,2", "--data_paths", "device",
                "--output_dir", tmp_path], check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "benchmark.csv") as f:
        rows = {tuple(row[k] for k in KEY): row for row in csv.DictReader(f)}
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["device"].startswith(f"{num_gpus} x ")
    assert len(rows) == 4 * 2  # methods x process counts (1, 2)
    for (_, _, method, precision, n), row in rows.items():
        if method == "plain" and n == "2":
            assert row["status"] == "skipped", row
        elif method == "dataparallel" and (num_gpus < 2 or n == "1"):
            assert row["status"] == "skipped" and "DataParallel" in row["reason"], row
        elif int(n) > num_gpus:
            assert row["status"] == "skipped" and f"this machine has {num_gpus}" in row["reason"], row
        else:
            assert row["status"] == "ok" and row["runs"] == "1", row
            assert 0 < number(row["peak_memory_mb"]) < total_gpu_memory_mb(), row  # max allocated on the GPU
            assert 0.5 <= number(row["eval_accuracy"]) <= 1.0, row
    assert sum(row["status"] == "ok" for row in rows.values()) == (3 if num_gpus < 2 else 6)
    runs = {tuple(run[k] for k in KEY[:4]) + (str(run["num_processes"]),): run for run in report["runs"]}
    losses = [runs[("mnist", "device", method, "fp16", "1")]["train_loss"]  # the same training, one process
              for method in ("plain", "ddp", "accelerate")]
    assert max(losses) - min(losses) < 1e-2 * max(losses), losses


def total_gpu_memory_mb():
    return torch.cuda.get_device_properties(0).total_memory / 2**20
