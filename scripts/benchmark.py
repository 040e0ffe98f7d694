#!/usr/bin/env python
"""Benchmark Accelerate against plain PyTorch, raw DDP and nn.DataParallel, each run in its own process.

    python scripts/benchmark.py --data_dir path/to/MNIST/raw --output_dir my_benchmark
    python scripts/benchmark.py --models resnet50 --precisions fp32,fp16,bf16 --num_processes 1,8 --channels_last
    python scripts/benchmark.py --quick --data_dir path/to/MNIST/raw      # a smoke test: 5 tiny runs

Every combination of --models x --data_paths x --methods x --precisions x --num_processes runs
as its own subprocess, launched the way users launch it (python, torchrun, accelerate launch).
The combinations run interleaved, in a new order in each of --repeats rounds, so that a slow
minute on a shared machine hurts every method alike. Combinations this machine cannot run
(fp16 on a CPU, DataParallel without 2 GPUs, more processes than GPUs) or that mean nothing
(plain PyTorch on several processes, DataParallel on one GPU) are reported as skipped, with
the reason.

What runs: MNIST with the DataLoader is timed with the scripts users copy, as they are
(scripts/train_mnist.py and scripts/baselines/*_mnist.py); ResNets on synthetic images and
the on-device fast path (--data_paths device) run scripts/benchmark_train.py, one loop that
differs between methods only where the methods differ.

Reported per combination, over its rounds: steady-state training samples/s of all processes
together (the first 10 batches of each process are warm-up and excluded; a run with none past
them fails), median, min and max; time per epoch (warm-up included), median; peak memory of the
largest process (GPU: max allocated; CPU: max resident set), the maximum; final eval accuracy
where the data is real, median; and samples/s over raw DDP's in the same setting, both as the
median, min and max of the per-round ratios and as best of N (the fastest round over DDP's
fastest). Written to OUTPUT_DIR: benchmark.csv, benchmark.json (with the machine, versions,
the command and every single run), benchmark.md (the table in Markdown), throughput.png,
scaling.png.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # find utils/ from a plain clone
from utils.data.mnist import load_mnist
from utils.errors import UserError, exit_with_error
from utils.files import create_output_dir
from utils.launch.flags import ArgumentParser, positive_int
from utils.benchmark.environment import (
    cpu_threads_source, machine_facts, portable_command, portable_path, print_cpu_threads, run_environment,
)
from utils.benchmark.report import METHODS, PRECISIONS, Combination, combination_of, write_report

MODELS = ("mnist", "resnet18", "resnet50")
DATA_PATHS = ("dataloader", "device")
MNIST_SCRIPTS = {  # the scripts users copy, timed as they are
    "plain": REPO / "scripts" / "baselines" / "plain_mnist.py",
    "ddp": REPO / "scripts" / "baselines" / "ddp_mnist.py",
    "dataparallel": REPO / "scripts" / "baselines" / "dataparallel_mnist.py",
    "accelerate": REPO / "scripts" / "train_mnist.py",
}
BENCHMARK_TRAIN = REPO / "scripts" / "benchmark_train.py"
# --quick: a smoke test, each MNIST script once on 1 and 2 processes in fp32 (on a CPU 5 runs of the grid's 20; process
# starts dominate), small enough for 2 CPU cores, long enough for steady state; other precisions are a flag away.
QUICK = dict(epochs=1, batch_size=32, max_train_samples=1024, max_eval_samples=512, repeats=1,
             image_size=32, synthetic_samples=512, precisions=["fp32"], data_paths=["dataloader"])
FULL = dict(epochs=3, batch_size=64, max_train_samples=None, max_eval_samples=None, repeats=3,
            image_size=224, synthetic_samples=2560, precisions=list(PRECISIONS), data_paths=list(DATA_PATHS))


def comma_list(choices):
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        wrong = [v for v in values if v not in choices]
        if wrong or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}; got {text!r}")
        return values
    return parse


def process_counts(text):
    try:
        return [positive_int(v) for v in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers; got {text!r}") from None


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = parser.add_argument_group("what to run")
    what.add_argument("--methods", type=comma_list(METHODS), default=list(METHODS), help=",".join(METHODS))
    what.add_argument("--precisions", type=comma_list(tuple(PRECISIONS)), default=None,
                      help=f"fp32,fp16,bf16 (default {','.join(FULL['precisions'])}; "
                           f"--quick {','.join(QUICK['precisions'])})")
    what.add_argument("--num_processes", type=process_counts, default=[1, 2],
                      help="processes per run (GPUs for DataParallel, which drives them from one process)")
    what.add_argument("--models", type=comma_list(MODELS), default=["mnist"],
                      help="mnist: the ConvNet on MNIST; resnet18/resnet50: synthetic 1000-class images")
    what.add_argument("--data_paths", type=comma_list(DATA_PATHS), default=None,
                      help="dataloader: DataLoader + sampler; device: the whole set as one tensor on the device "
                           f"(default {','.join(FULL['data_paths'])}; --quick {','.join(QUICK['data_paths'])})")
    what.add_argument("--repeats", type=positive_int, default=None,
                      help=f"rounds over all combinations (default {FULL['repeats']}; --quick {QUICK['repeats']})")
    what.add_argument("--quick", action="store_true",
                      help="a smoke test, tiny runs: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    what.add_argument("--cpu", action="store_true", help="CPU processes even if GPUs are present")

    train = parser.add_argument_group("training (the same for every run)")
    train.add_argument("--data_dir", default=None, help="MNIST IDX files; default: ylecun/mnist from the Hub")
    for name in ("epochs", "batch_size", "max_train_samples", "max_eval_samples", "image_size", "synthetic_samples"):
        train.add_argument(f"--{name}", type=positive_int, default=None,
                           help=f"default {FULL[name]}; --quick {QUICK[name]}"
                           + (" (per process)" if name == "batch_size" else ""))
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--channels_last", action="store_true", help="ResNets: NHWC memory format")
    train.add_argument("--compile", action="store_true", help="ResNets and the fast path: torch.compile")

    out = parser.add_argument_group("output")
    out.add_argument("--output_dir", default="outputs/benchmark", help="benchmark.csv, .json and .md, *.png")
    out.add_argument("--timeout", type=positive_int, default=1800, help="seconds one run may take")
    out.add_argument("--rewrite_from", default=None, metavar="BENCHMARK_JSON",
                     help="run nothing: rebuild benchmark.csv, .json and .md and the plots in --output_dir from "
                          "the runs in a benchmark.json")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def skip_reason(combo, on_cpu: bool, num_gpus: int):
    """Why `combo` is skipped: this machine cannot run it, or it means nothing; None to run it."""
    if combo.method == "plain" and combo.num_processes > 1:
        return "plain PyTorch is one process"
    if combo.method == "dataparallel":
        if on_cpu or num_gpus < 2:
            return f"nn.DataParallel needs 2 or more GPUs; this run has {0 if on_cpu else num_gpus}"
        if combo.num_processes < 2:
            return "nn.DataParallel on one GPU is plain training"
    if combo.precision == "fp16" and on_cpu:
        return "fp16 needs a CUDA GPU (on the CPU Accelerate silently trains fp32; the baselines refuse it)"
    if not on_cpu and combo.num_processes > num_gpus:
        return f"{combo.num_processes} processes need {combo.num_processes} GPUs; this machine has {num_gpus}"
    return None


def command_for(combo, args, on_cpu: bool, output_dir: Path) -> list:
    """The command line of one run: launcher, script, flags."""
    mixed_precision = PRECISIONS[combo.precision]
    if combo.model == "mnist" and combo.data_path == "dataloader":
        script, script_args = MNIST_SCRIPTS[combo.method], []
    else:
        script = BENCHMARK_TRAIN
        script_args = ["--method", combo.method, "--model", "convnet" if combo.model == "mnist" else combo.model]
        if combo.data_path == "device":
            script_args.append("--data_on_device")
        if combo.model != "mnist":
            script_args += ["--image_size", args.image_size, "--synthetic_samples", args.synthetic_samples]
            if args.channels_last:
                script_args.append("--channels_last")
        if args.compile:
            script_args.append("--compile")
    if combo.model == "mnist":
        if args.data_dir is not None:
            script_args += ["--data_dir", args.data_dir]
        for name in ("max_train_samples", "max_eval_samples"):
            if getattr(args, name) is not None:
                script_args += [f"--{name}", getattr(args, name)]
    script_args += ["--epochs", args.epochs, "--batch_size", args.batch_size, "--seed", args.seed,
                    "--mixed_precision", mixed_precision, "--output_dir", output_dir]
    if on_cpu:
        script_args.append("--cpu")

    n = combo.num_processes
    if combo.method in ("plain", "dataparallel"):
        launcher = [sys.executable]
    elif combo.method == "ddp":
        # --standalone: a rendezvous on a free local port, so runs never collide
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", n]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", 1, "--num_processes", n,
                    "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
        if n > 1:
            launcher += ["--multi_gpu", "--main_process_port", 0]  # port 0: a free port
    return [str(word) for word in (*launcher, script, *script_args)]


def ran_as_asked(combo, results: dict):
    """None, or why a finished run is not the combination asked for: DataParallel is one process
    driving N GPUs (results' num_gpus), the other methods N processes."""
    used = results["num_gpus"] if combo.method == "dataparallel" else results["num_processes"]
    unit = "GPUs" if combo.method == "dataparallel" else "processes"
    return None if used == combo.num_processes else f"ran on {used} {unit}, not {combo.num_processes}"


def run_one(combo, args, on_cpu: bool, run_dir: Path) -> dict:
    cmd = command_for(combo, args, on_cpu, run_dir / "out")
    record = {**asdict(combo), "command": portable_command(cmd, REPO, run_dir)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                              env=run_environment(combo, on_cpu, os.environ, os.cpu_count(), torch.cuda.device_count()))
    except subprocess.TimeoutExpired:
        return {**record, "status": "failed", "reason": f"timed out after {args.timeout} s"}
    (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    results_file = run_dir / "out" / "results.json"
    if proc.returncode != 0 or not results_file.is_file():
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        ours = [line for line in lines if line.startswith("error: ")]
        reason = (ours or lines or [f"exit status {proc.returncode}"])[-1]
        return {**record, "status": "failed", "reason": reason[:300]}
    results = json.loads(results_file.read_text())
    mismatch = ran_as_asked(combo, results)
    if mismatch:
        return {**record, "status": "failed", "reason": mismatch}
    if results["train_samples_per_second"] is None or results.get("train_samples_per_second_over") == "all_batches":
        # No steady state: train_mnist.py then gives the rate over all batches, the baselines none.
        return {**record, "status": "failed", "reason": "no steady state: no process trained past the 10 warm-up "
                "batches; give each more (--max_train_samples, --synthetic_samples, --batch_size)"}
    return {
        **record, "status": "ok", "reason": "",
        "samples_per_second": results["train_samples_per_second"],
        "time_per_epoch_s": results["train_time_s"] / results["epochs"],
        "peak_memory_mb": results["peak_memory_mb"],
        "eval_accuracy": results.get("eval_accuracy") if combo.model == "mnist" else None,
        "eval_samples": results.get("eval_samples") if combo.model == "mnist" else None,
        "train_loss": results.get("train_loss"),  # compared across methods by the tests: the same training
    }


def rewrite(args):
    """The outputs again from the runs recorded in a benchmark.json (e.g. after a change to the plots)."""
    try:
        report = json.loads(Path(args.rewrite_from).read_text())
        combinations = [combination_of(row) for row in report["rows"]]
        skipped = {combination_of(row): row["reason"] if row["status"] == "skipped" else None for row in report["rows"]}
        runs_by_round = [{} for _ in range(1 + max((run["round"] for run in report["runs"]), default=-1))]
        for run in report["runs"]:
            runs_by_round[run["round"]][combination_of(run)] = run
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--rewrite_from {args.rewrite_from}: not a benchmark.json written by this script "
                        f"({type(err).__name__})") from None
    create_output_dir(Path(args.output_dir))
    write_report(Path(args.output_dir), report, combinations, skipped, runs_by_round)


def main(args):
    if args.rewrite_from is not None:
        return rewrite(args)
    load_before = os.getloadavg()[0]  # a busy machine makes every number smaller: recorded with them
    # Absolute: every run starts in the repository root (cwd=REPO), wherever this was started from;
    # benchmark.json records them relative to the repository.
    args.output_dir = os.path.abspath(args.output_dir)
    if args.data_dir is not None:
        args.data_dir = os.path.abspath(args.data_dir)
    output_dir = Path(args.output_dir)
    on_cpu = args.cpu or not torch.cuda.is_available()
    num_gpus = 0 if on_cpu else torch.cuda.device_count()
    if "mnist" in args.models:
        load_mnist(args.data_dir)  # fails here, once, with the fix, if the data is missing; warms the Hub cache
    create_output_dir(output_dir)

    combinations = [
        Combination(model, data_path, method, precision, n)
        for model in args.models for data_path in args.data_paths for method in args.methods
        for precision in args.precisions for n in args.num_processes
    ]
    skipped = {c: skip_reason(c, on_cpu, num_gpus) for c in combinations}
    runnable = [c for c in combinations if skipped[c] is None]
    if on_cpu:  # the number that decides CPU throughput on a busy machine (docs/benchmarks.md)
        print_cpu_threads({c.num_processes for c in runnable}, os.environ.get("OMP_NUM_THREADS"), os.cpu_count())
    runs_by_round = []  # one {combination: run record} per round
    with tempfile.TemporaryDirectory(prefix="benchmark-") as scratch, \
            tqdm(total=len(runnable) * args.repeats, desc="benchmark", unit="run") as progress:
        for round_index in range(args.repeats):
            order = list(runnable)
            random.Random(args.seed + round_index).shuffle(order)  # interleaved, a new order every round
            runs = {}
            for k, combo in enumerate(order):
                progress.set_postfix_str(combo.label())
                run_dir = Path(scratch) / f"round{round_index}_{k}"
                run_dir.mkdir()
                runs[combo] = {**run_one(combo, args, on_cpu, run_dir), "round": round_index}
                progress.update(1)
            runs_by_round.append(runs)

    rows = write_report(output_dir, {
        "command": portable_command(["python", *sys.argv], REPO),  # as typed, in the folder it was started in
        "machine": {**machine_facts(), "load_average_1min_before": load_before},
        "device": "cpu" if on_cpu else f"{num_gpus} x {torch.cuda.get_device_name(0)}",
        "threads_per_process": cpu_threads_source(os.environ.get("OMP_NUM_THREADS")) if on_cpu else None,
        "settings": {k: portable_path(v, REPO) if isinstance(v, str) else v for k, v in vars(args).items()},
    }, combinations, skipped, runs_by_round)
    print(f"Wrote {output_dir / 'benchmark.csv'}, benchmark.json, benchmark.md, throughput.png, scaling.png")
    failed = [r for r in rows if r["status"] in ("failed", "partly failed")]
    if failed:
        raise UserError(f"{len(failed)} combination(s) failed (first: {combination_of(failed[0]).label()}: "
                        f"{failed[0]['reason']}); the reasons are in {output_dir / 'benchmark.csv'}")


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
