"""train_mnist.py launched for real through `accelerate launch`, on CPU processes."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import MNIST_10K, launch, requires_mnist_10k, results, tensorboard_scalars
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
        launch(["--data_dir", MNIST_10K, "--output_dir", out, "--eval_only", "--resume_from_checkpoint",
                trained_2proc / "epoch_2"], num_processes=n)
        r = json.loads((out / "eval_results.json").read_text())  # --eval_only's own file
        assert r["num_processes"] == n
        assert r["eval_samples"] == 2000
        evaluations[n] = (r["eval_accuracy"], r["eval_loss"])
    assert evaluations[1] == evaluations[2] == evaluations[3]
    # An evaluation set that neither the process count nor the batch divides: test_eval_count_is_exact_for_uneven_sizes_on_3_processes.


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


def test_mid_epoch_resume_with_gradient_accumulation_is_bit_exact(synthetic_mnist, tmp_path):
    # 640 samples / 16 per batch = 40 batches, 20 per process, 10 optimizer steps per epoch.
    common = ["--data_dir", synthetic_mnist, "--epochs", "2", "--batch_size", "16",
              "--gradient_accumulation_steps", "2", "--checkpointing_steps", "7"]
    full = tmp_path / "full"
    launch([*common, "--output_dir", full, "--checkpoints_total_limit", "2"], num_processes=2)
    r = results(full)
    assert r["global_step"] == 20
    assert r["samples_seen"] == 2 * 640
    assert sorted(p.name for p in full.iterdir() if p.name.startswith("step_")) == ["step_14", "step_7"]

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step_7", resumed / "step_7")  # mid-epoch 0: 14 of 20 batches done
    launch([*common, "--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2)
    rr = results(resumed)
    assert (resumed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert rr["global_step"] == 20 and rr["samples_seen"] == 2 * 640
    assert rr["parameter_fingerprints"] == r["parameter_fingerprints"]
    assert rr["train_loss"] == pytest.approx(r["train_loss"], rel=1e-12)
    assert (rr["eval_accuracy"], rr["eval_loss"]) == (r["eval_accuracy"], r["eval_loss"])


def test_eval_count_is_exact_for_uneven_sizes_on_3_processes(synthetic_mnist, tmp_path):
    # 203 eval samples over 3 processes x 16: the last batches are padded, then the padding dropped.
    launch(["--data_dir", synthetic_mnist, "--output_dir", tmp_path, "--epochs", "1", "--batch_size", "16"],
           num_processes=3)
    r = results(tmp_path)
    assert r["num_processes"] == 3
    assert r["eval_samples"] == 203
    assert len(set(r["parameter_fingerprints"])) == 1 and len(r["parameter_fingerprints"]) == 3


def test_resume_latest_with_no_checkpoint_starts_from_scratch(synthetic_mnist, tmp_path):
    proc = launch(["--data_dir", synthetic_mnist, "--output_dir", tmp_path, "--epochs", "1",
                   "--resume_from_checkpoint", "latest", "--max_train_samples", "320"])
    assert "starting from scratch" in proc.stderr + proc.stdout
    r = results(tmp_path)
    assert r["resumed_from"] is None and r["samples_seen"] == 320


def test_bf16_on_cpu_learns_the_synthetic_digits(synthetic_mnist, tmp_path):
    launch(["--data_dir", synthetic_mnist, "--output_dir", tmp_path, "--epochs", "2", "--batch_size", "32",
            "--mixed_precision", "bf16"])
    r = results(tmp_path)
    assert r["mixed_precision"] == "bf16"
    assert r["eval_accuracy"] >= 0.9  # chance is 0.1
    assert math.isfinite(r["train_loss"])
