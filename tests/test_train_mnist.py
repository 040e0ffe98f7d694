"""train_mnist.py launched for real through `accelerate launch`, on CPU processes."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import MNIST_10K, launch, requires_mnist_10k, results, run_alone, tensorboard_scalars
from safetensors.torch import load_file

from utils.data.mnist import load_mnist_idx, to_tensor_dataset
from utils.models import ConvNet

# ---------------------------------------------------------------- real digits (mnist-10k)


@pytest.fixture(scope="module")
def trained_1proc(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_1proc")
    launch(["--data_dir", MNIST_10K, "--output_dir", out, "--with_tracking"], num_processes=1)
    return out


@pytest.fixture(scope="module")
def trained_2proc(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_2proc")
    launch(["--data_dir", MNIST_10K, "--output_dir", out, "--checkpointing_steps", "epoch"], num_processes=2)
    return out


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
def test_one_checkpoint_evaluates_identically_on_1_2_3_processes(trained_2proc, tmp_path):
    """The 2-process evaluation is the training run's own, of the same weights as its last checkpoint."""
    trained = results(trained_2proc)
    evaluations = {2: (trained["eval_accuracy"], trained["eval_loss"])}
    for n in (1, 3):
        out = tmp_path / f"eval_{n}"
        args = ["--data_dir", MNIST_10K, "--output_dir", out, "--eval_only", "--resume_from_checkpoint",
                trained_2proc / "epoch_2"]
        if n == 1:  # the script alone, as accelerate's one-process launcher runs it (launched: trained_1proc)
            run_alone(args)
        else:
            launch(args, num_processes=n)
        r = json.loads((out / "eval_results.json").read_text())  # --eval_only's own file
        assert r["num_processes"] == n
        assert r["eval_samples"] == 2000
        evaluations[n] = (r["eval_accuracy"], r["eval_loss"])
    assert evaluations[1] == evaluations[2] == evaluations[3]
    # An evaluation set that neither the process count nor the batch divides, after training on 3 processes:
    # tests/test_resume_other_process_count.py (101 samples, 3 x 24). 'latest' with no checkpoint: test_reliability.py.


@requires_mnist_10k
def test_resume_from_first_epoch_checkpoint_is_bit_exact(trained_2proc, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained_2proc / "epoch_0", out / "epoch_0")
    launch(["--data_dir", MNIST_10K, "--output_dir", out, "--resume_from_checkpoint", "latest"], num_processes=2)
    resumed, uninterrupted = results(out), results(trained_2proc)
    assert resumed["resumed_from"].endswith("epoch_0")
    assert (out / "model.safetensors").read_bytes() == (trained_2proc / "model.safetensors").read_bytes()
    for key in ("parameter_fingerprints", "global_step", "samples_seen", "eval_accuracy", "eval_loss", "train_loss"):
        assert resumed[key] == uninterrupted[key], key


# ---------------------------------------------------------------- generated digits (always run)


def test_bf16_on_cpu_learns_the_synthetic_digits(synthetic_mnist, tmp_path):
    # the script alone: --mixed_precision is the script's flag, which the Accelerator takes over the launch config's
    run_alone(["--data_dir", synthetic_mnist, "--output_dir", tmp_path, "--epochs", "2", "--batch_size", "32",
               "--mixed_precision", "bf16"])
    r = results(tmp_path)
    assert r["mixed_precision"] == "bf16"
    assert r["eval_accuracy"] >= 0.9  # chance is 0.1
    assert math.isfinite(r["train_loss"])
