"""train_mnist.py launched for real through `accelerate launch`, on CPU processes.

The runs on 2 processes share one launch, and those on 1 another: each run a job of tests/jobs.py, forked from
processes that imported the libraries once."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    MNIST_10K,
    TRAIN_MNIST,
    launch,
    launcher_args,
    requires_mnist_10k,
    results,
    tensorboard_scalars,
)
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.data.mnist import load_mnist_idx, to_tensor_dataset
from utils.models import ConvNet


@pytest.fixture(scope="module")
def on_2_processes(tmp_path_factory):
    """One launch on 2 processes: the run on the real digits with a checkpoint at each epoch's end ("trained"), then its
    resume from its epoch_0 ("resumed")."""
    runs = tmp_path_factory.mktemp("on_2_processes")
    trained = runs / "trained"
    launch_jobs({
        "trained": [TRAIN_MNIST, "--cpu", "--data_dir", MNIST_10K, "--output_dir", trained, "--checkpointing_steps",
                    "epoch"],
        "resumed": [TRAIN_MNIST, "--cpu", "--data_dir", MNIST_10K, "--output_dir", runs / "resumed",
                    "--resume_from_checkpoint", trained / "epoch_0"],
    }, launcher_args(2), runs)
    return runs


@pytest.fixture(scope="module")
def on_1_process(tmp_path_factory, synthetic_mnist, request):
    """One launch on 1 process: on the generated digits in bf16 ("bf16"), and where the real digits are here, their run
    with --with_tracking ("trained") and --eval_only of the 2-process run's last checkpoint ("eval_only")."""
    runs = tmp_path_factory.mktemp("on_1_process")
    # --mixed_precision is the script's flag, which the Accelerator takes over the launch config's `no`
    jobs = {"bf16": [TRAIN_MNIST, "--cpu", "--data_dir", synthetic_mnist, "--output_dir", runs / "bf16", "--epochs",
                     "2", "--batch_size", "32", "--mixed_precision", "bf16"]}
    if (MNIST_10K / "train-images-idx3-ubyte.gz").is_file():
        trained_2proc = request.getfixturevalue("on_2_processes") / "trained"
        jobs["trained"] = [TRAIN_MNIST, "--cpu", "--data_dir", MNIST_10K, "--output_dir", runs / "trained",
                           "--with_tracking"]
        jobs["eval_only"] = [TRAIN_MNIST, "--cpu", "--data_dir", MNIST_10K, "--output_dir", runs / "eval_only",
                             "--eval_only", "--resume_from_checkpoint", trained_2proc / "epoch_2"]
    launch_jobs(jobs, launcher_args(1), runs)
    return runs


@pytest.fixture(scope="module")
def trained_1proc(on_1_process):
    finished_job(on_1_process / "trained", 1)
    return on_1_process / "trained"


@pytest.fixture(scope="module")
def trained_2proc(on_2_processes):
    finished_job(on_2_processes / "trained", 2)
    return on_2_processes / "trained"


@requires_mnist_10k
def test_one_process_reaches_98_percent_and_reports_everything(trained_1proc):
    r = results(trained_1proc)
    assert r["eval_accuracy"] >= 0.98
    assert r["eval_samples"] == 2000
    assert r["num_processes"] == 1
    assert r["mixed_precision"] == "no"
    assert r["epochs"] == 3
    assert r["global_step"] == 3 * math.ceil(8000 / 64) == 375
    assert r["samples_seen"] == 3 * 8000
    assert 0 < r["train_loss"] < 0.2 and 0 < r["eval_loss"] < 0.1
    assert 0.95 < r["train_accuracy"] < 1  # the last epoch's, counted like train_loss (0.992 here)
    assert r["train_samples_per_second"] > 100 and 0 < r["train_time_s"] < 120
    assert r["peak_memory_mb"] > 100
    assert (trained_1proc / "model.safetensors").is_file()


@requires_mnist_10k
def test_with_tracking_writes_tensorboard_scalars(trained_1proc):
    accuracy = tensorboard_scalars(trained_1proc / "train_mnist", "eval_accuracy")  # init_trackers' project name
    assert [step for step, _ in accuracy] == [125, 250, 375]
    assert accuracy[-1][1] == pytest.approx(results(trained_1proc)["eval_accuracy"])


@requires_mnist_10k
def test_two_processes_reach_97_5_percent_with_identical_replicas(trained_2proc):
    r = results(trained_2proc)
    assert r["num_processes"] == 2
    assert r["eval_accuracy"] >= 0.975
    assert r["eval_samples"] == 2000
    # 8,000 samples in batches of 64 are 125 batches; each process gets 63 (one repeated batch).
    assert r["global_step"] == 3 * 63
    assert r["samples_seen"] == 3 * 63 * 2 * 64
    params, buffers = r["parameter_fingerprints"], r["buffer_fingerprints"]
    assert len(params) == len(buffers) == 2
    assert params[0] == params[1], "ranks hold different weights"
    assert buffers[0] == buffers[1], "BatchNorm statistics differ after the evaluation pass"
    assert sorted(p.name for p in trained_2proc.iterdir() if p.name.startswith("epoch_")) == [
        "epoch_0", "epoch_1", "epoch_2"
    ]


@requires_mnist_10k
def test_saved_model_evaluated_on_its_own_matches_the_reported_evaluation(trained_2proc):
    """Plain PyTorch, one process, no Accelerate: the exported weights give the same numbers."""
    model = ConvNet()
    model.load_state_dict(load_file(trained_2proc / "model.safetensors"))
    model.eval()
    images, labels = to_tensor_dataset(*load_mnist_idx(MNIST_10K)["test"]).tensors
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in images.split(64)])
    r = results(trained_2proc)
    assert (logits.argmax(-1) == labels).sum().item() == round(r["eval_accuracy"] * 2000)
    loss = F.cross_entropy(logits, labels, reduction="none").double().mean().item()
    assert loss == pytest.approx(r["eval_loss"], rel=1e-5)


@requires_mnist_10k
def test_one_checkpoint_evaluates_identically_on_1_2_3_processes(trained_2proc, on_1_process, tmp_path):
    """The 2-process evaluation is the training run's own, of the same weights as its last checkpoint; the 1-process
    one a job of the 1-process launch."""
    trained = results(trained_2proc)
    evaluations = {2: (trained["eval_accuracy"], trained["eval_loss"])}
    finished_job(on_1_process / "eval_only", 1)
    launch(["--data_dir", MNIST_10K, "--output_dir", tmp_path / "eval_3", "--eval_only", "--resume_from_checkpoint",
            trained_2proc / "epoch_2"], num_processes=3)
    for n, out in ((1, on_1_process / "eval_only"), (3, tmp_path / "eval_3")):
        r = json.loads((out / "eval_results.json").read_text())  # --eval_only's own file
        assert r["num_processes"] == n
        assert r["eval_samples"] == 2000
        evaluations[n] = (r["eval_accuracy"], r["eval_loss"])
    assert evaluations[1] == evaluations[2] == evaluations[3]
    # An evaluation set that neither the process count nor the batch divides, after training on 3 processes:
    # tests/test_resume_other_process_count.py (101 samples, 3 x 24). 'latest' with no checkpoint: test_reliability.py.


@requires_mnist_10k
def test_resume_from_first_epoch_checkpoint_is_bit_exact(on_2_processes, trained_2proc):
    out = on_2_processes / "resumed"
    finished_job(on_2_processes / "resumed", 2)
    resumed, uninterrupted = results(out), results(trained_2proc)
    assert resumed["resumed_from"].endswith("epoch_0")
    assert (out / "model.safetensors").read_bytes() == (trained_2proc / "model.safetensors").read_bytes()
    for key in ("parameter_fingerprints", "global_step", "samples_seen", "eval_accuracy", "eval_loss", "train_loss"):
        assert resumed[key] == uninterrupted[key], key


# ---------------------------------------------------------------- generated digits (always run)


def test_bf16_on_cpu_learns_the_synthetic_digits(on_1_process):
    finished_job(on_1_process / "bf16", 1)
    r = results(on_1_process / "bf16")
    assert r["mixed_precision"] == "bf16"
    assert r["eval_accuracy"] >= 0.9  # chance is 0.1
    assert math.isfinite(r["train_loss"])
