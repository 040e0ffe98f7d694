"""The GPU code paths. What can be shown on the CPU runs everywhere (the compile wrapper in the saved
weights, FSDP refused where it cannot shard); the rest is marked `gpu` and skips without CUDA. A GPU
owner checks the whole collection with

    python -m pytest -q -m gpu tests

(one GPU: the multi-GPU claims, DataParallel over several GPUs, NCCL across ranks, SyncBatchNorm,
stay untested there; they skip and say so)."""

import json
import math
import shutil

import pytest
import torch
import torchvision
from helpers import (
    MNIST_10K,
    REPO,
    TRAIN_MNIST,
    assert_clean_user_error,
    launcher_args,
    make_synthetic_mnist,
    requires_mnist_10k,
    results,
    run,
)
from image_data import make_split_image_folder
from safetensors.torch import load_file

from utils.data.device_input import normalise_on_device
from utils.models import ConvNet

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
FSDP_CONFIG = REPO / "accelerate_configs" / "fsdp.yaml"
DEEPSPEED_CONFIGS = {stage: REPO / "accelerate_configs" / f"deepspeed_{stage}.yaml" for stage in ("zero2", "zero3")}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")


def record_numbers(record_property, results: dict, *keys) -> None:
    """Into the junit XML (--junitxml), where tests/gpu/check.py reads them: the numbers a GPU run measured."""
    for key in keys:
        record_property(key, results.get(key))


def gpu_launch(script_args, script=TRAIN_MNIST, config_file=None, **kwargs):
    """accelerate launch on the GPU: no --cpu, one process unless the config says otherwise."""
    if config_file is not None:
        cmd = [*launcher_args(config_file=config_file), "--num_processes", "1"]
    else:
        cmd = launcher_args(1)
    return run([*cmd, script, *script_args], **kwargs)


# ---------------------------------------------------------------- shown on the CPU


def test_torch_compile_leaves_no_wrapper_in_the_saved_weights(synthetic_mnist, tmp_path):
    """The launch config's dynamo backend compiles the model (eager here: no compiler needed). The
    saved model.safetensors holds the plain ConvNet's names, not `_orig_mod.`-prefixed ones."""
    cmd = [*launcher_args(1), TRAIN_MNIST, "--cpu", "--data_dir", synthetic_mnist, "--output_dir", tmp_path,
           "--epochs", "1", "--max_train_samples", "128"]
    cmd[cmd.index("--dynamo_backend") + 1] = "eager"
    run(cmd)
    assert results(tmp_path)["compiled"] is True
    weights = load_file(tmp_path / "model.safetensors")
    assert not [name for name in weights if "_orig_mod" in name or name.startswith("module.")]
    ConvNet().load_state_dict(weights)  # strict: every name matches the plain model


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without GPUs: there FSDP needs --cpu")
def test_fsdp_launch_without_gpus_or_cpu_is_refused_in_one_line(synthetic_mnist, tmp_path):
    """Without GPUs and without --cpu the processes would form no group, each training the whole model; the scripts
    say to add --cpu instead (with it FSDP2 shards over the CPU processes: tests/test_fsdp.py)."""
    cmd = [*launcher_args(1), "--use_fsdp", TRAIN_MNIST, "--data_dir", synthetic_mnist, "--output_dir", tmp_path / "out"]
    proc = run(cmd, check=False)
    assert_clean_user_error(proc, "FSDP", "--cpu")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_cuda
@requires_mnist_10k
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_train_mnist_mixed_precision_on_gpu(precision, tmp_path, record_property):
    gpu_launch(["--data_dir", MNIST_10K, "--output_dir", tmp_path, "--mixed_precision", precision])
    r = results(tmp_path)
    record_numbers(record_property, r, "eval_accuracy", "optimizer_steps_skipped", "peak_memory_mb",
                   "train_samples_per_second")
    assert r["mixed_precision"] == precision and r["num_processes"] == 1
    assert r["eval_accuracy"] >= 0.98 and r["eval_samples"] == 2000  # the CPU floor
    assert r["grad_scaler"] is (precision == "fp16")  # loss scaling only for fp16
    assert 0 <= r["optimizer_steps_skipped"] < 10  # reported; a few at the start while the scale settles
    assert 0 < r["peak_memory_mb"] < 4096  # torch.cuda.max_memory_allocated, not the process's RSS
    print(f"train_mnist {precision}: {r['train_samples_per_second']:.0f} samples/s, "
          f"{r['peak_memory_mb']:.0f} MB, {r['optimizer_steps_skipped']} skipped steps")


@pytest.mark.gpu
@needs_cuda
def test_fp16_resume_is_bit_exact_with_deterministic(tmp_path):
    """--deterministic: cuDNN and cuBLAS without autotuning or atomics. Two uninterrupted runs agree,
    and a run resumed mid-epoch from a checkpoint ends with the same weights, bit for bit."""
    data = make_synthetic_mnist(tmp_path / "data", num_train=1024, num_test=101)
    common = ["--data_dir", data, "--epochs", "2", "--batch_size", "32", "--mixed_precision", "fp16",
              "--deterministic"]
    gpu_launch([*common, "--output_dir", tmp_path / "a", "--checkpointing_steps", "45"])
    gpu_launch([*common, "--output_dir", tmp_path / "b"])
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "a" / "step_45", tmp_path / "resumed" / "step_45")  # 13 batches into epoch 1
    gpu_launch([*common, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", "latest"])
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b", "resumed")}
    assert weights["a"] == weights["b"], "two identical deterministic runs differ: a kernel is not deterministic"
    assert weights["resumed"] == weights["a"]
    assert results(tmp_path / "resumed")["samples_seen"] == results(tmp_path / "a")["samples_seen"] == 2 * 1024


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("extra", [["--channels_last"], ["--channels_last", "--compile"]], ids=["eager", "compile"])
def test_resnet50_fp16_channels_last_on_gpu(extra, tmp_path, record_property):
    data = make_split_image_folder(tmp_path / "data", train_per_class=128, val_per_class=16)
    out = tmp_path / "out"
    gpu_launch(["--data_dir", data, "--output_dir", out, "--model", "resnet50", "--image_size", "128",
                "--batch_size", "64", "--epochs", "2", "--mixed_precision", "fp16", "--num_workers", "4", *extra],
               script=CLASSIFIER)
    r = results(out)
    record_numbers(record_property, r, "compiled", "train_samples_per_second", "peak_memory_mb")
    assert r["mixed_precision"] == "fp16" and r["grad_scaler"] is True and math.isfinite(r["train_loss"])
    assert r["eval_samples"] == 4 * 16 and r["samples_seen"] == 2 * (4 * 128 // 64) * 64
    model = torchvision.models.resnet50(num_classes=4)
    model.load_state_dict(load_file(out / "model.safetensors"))  # plain names, compiled or not
    print(f"resnet50 fp16 {' '.join(extra)}: {r['train_samples_per_second']:.0f} img/s")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "contiguous"])
def test_the_uint8_batch_becomes_the_mixed_precision_input_on_the_gpu_in_one_copy(dtype, channels_last):
    """The image script's device-side normalisation (utils/data/device_input.py) of a batch as the workers stack it
    (collate_images: channels-last uint8): the only new memory is the output, in the layout the model wants."""
    batch = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, device="cuda")
    batch = batch.contiguous(memory_format=torch.channels_last)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    images = normalise_on_device(batch, dtype, channels_last=channels_last)
    torch.cuda.synchronize()
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert images.dtype == dtype and images.is_contiguous(memory_format=layout)
    output_bytes = images.numel() * images.element_size()
    assert torch.cuda.max_memory_allocated() - before <= output_bytes + 64 * 1024  # + mean and std: 2 x 3 values
    torch.testing.assert_close(images.float().cpu(), normalise_on_device(batch.cpu()), rtol=0, atol=0.05)


@pytest.mark.gpu
@needs_cuda
def test_fsdp_on_one_gpu_saves_full_weights_and_resumes_from_sharded_checkpoints(tmp_path, record_property):
    """FSDP2 through accelerate_configs/fsdp.yaml on one GPU: the checkpoints hold sharded state that
    resumes; model.safetensors holds the full weights under the plain model's names."""
    data = make_synthetic_mnist(tmp_path / "data", num_train=1024, num_test=101)
    common = ["--data_dir", data, "--epochs", "2", "--batch_size", "32"]
    gpu_launch([*common, "--output_dir", tmp_path / "a", "--checkpointing_steps", "40"], config_file=FSDP_CONFIG)
    r = results(tmp_path / "a")
    record_numbers(record_property, r, "sharded", "eval_accuracy", "peak_memory_mb")
    assert r["sharded"] is True and len(r["parameter_fingerprints"]) == 1
    ConvNet().load_state_dict(load_file(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "a" / "step_40", tmp_path / "resumed" / "step_40")
    gpu_launch([*common, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", "latest"],
               config_file=FSDP_CONFIG)
    resumed = results(tmp_path / "resumed")
    assert resumed["global_step"] == r["global_step"] and resumed["samples_seen"] == r["samples_seen"]
    assert resumed["eval_accuracy"] > 0.9


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_zero_on_one_gpu_trains_fp16_and_saves_the_plain_weights(stage, tmp_path, record_property):
    """accelerate_configs/deepspeed_zero2.yaml and deepspeed_zero3.yaml as a GPU user launches them (fp16 with
    DeepSpeed's loss scaling, NCCL), on one GPU: a short train_mnist run learns, and model.safetensors holds the whole
    weights under the plain model's names (tests/test_deepspeed.py proves the CPU processes' runs against DDP)."""
    pytest.importorskip("deepspeed", reason="an optional install: pip install -r requirements-deepspeed.txt")
    data = make_synthetic_mnist(tmp_path / "data", num_train=1024, num_test=101)
    gpu_launch(["--data_dir", data, "--epochs", "2", "--batch_size", "32", "--output_dir", tmp_path / "out",
                "--checkpointing_steps", "epoch"], config_file=DEEPSPEED_CONFIGS[stage])
    r = results(tmp_path / "out")
    record_numbers(record_property, r, "eval_accuracy", "optimizer_steps_skipped", "peak_memory_mb")
    assert r["mixed_precision"] == "fp16" and r["num_processes"] == 1 and r["eval_samples"] == 101
    assert r["eval_accuracy"] > 0.9 and r["optimizer_steps_skipped"] < r["global_step"]
    ConvNet().load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))  # strict: the plain names
    assert list((tmp_path / "out" / "epoch_1").rglob("*optim_states.pt")), "DeepSpeed's own checkpoint"


@pytest.mark.gpu
@needs_cuda
def test_profile_on_gpu_traces_the_cuda_kernels_and_ranks_operators_by_gpu_time(tmp_path):
    data = make_synthetic_mnist(tmp_path / "data", num_train=1024, num_test=101)
    out = tmp_path / "out"
    proc = gpu_launch(["--data_dir", data, "--output_dir", out, "--epochs", "1", "--batch_size", "32", "--profile"])
    (trace,) = (out / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the GPU's own work, not only the CPU's launches
    assert "top operators by self cuda time total" in proc.stdout + proc.stderr
