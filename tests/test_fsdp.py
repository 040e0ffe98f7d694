"""FSDP2 on CPU processes (utils/run/fsdp.py, accelerate_configs/fsdp_cpu.yaml): both training scripts shard their model
over 2 and 3 gloo processes through the same prepare/save_state/load_state/get_state_dict/save_model calls a GPU run
makes. Proven against a DDP run of the same seed (loss per step, evaluation), with the checkpoints' shards resumed on
the same process count (the same final weights) and on another one (every sample trained once, by id), and the whole
weights out under the plain model's names. Six launches in all, each checking as much as it can."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import torchvision
from accelerate.utils import merge_fsdp_weights
from helpers import REPO, launch, launcher_args, make_synthetic_mnist, results, run
from image_data import make_split_image_folder
from safetensors.torch import load_file

from utils.models import ConvNet

FSDP_CPU = REPO / "accelerate_configs" / "fsdp_cpu.yaml"
RECORDER = REPO / "tests" / "sample_recorder.py"
TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PREDICT = REPO / "scripts" / "predict.py"
N = 144  # training digits: 2 x 24 = 3 x 16 = 48 per optimizer step, 3 steps per epoch on 2 or 3 processes, no padding
MNIST = ["--max_train_samples", N, "--epochs", "2", "--batch_size", "24", "--logging_steps", "1", "--seed", "1"]
# the losses of FSDP and DDP differ only by the order of the gradients' sums (reduce-scatter vs all-reduce)
LOSS_TOLERANCE = 1e-4
LOGGED_LOSS = re.compile(r"step (\d+): \{'loss': ([-+.e0-9]+)")


def launch_fsdp(script, args, num_processes, sample_log=None):
    """accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml SCRIPT --cpu ARGS on N processes; with
    `sample_log`, under tests/sample_recorder.py, which logs the index of every training sample each process fetched."""
    cmd = [*launcher_args(config_file=FSDP_CPU), "--num_processes", num_processes]
    cmd += [RECORDER, script] if sample_log else [script]
    env = {"SAMPLE_LOG": str(sample_log)} if sample_log else None
    return run([*cmd, "--cpu", *args], env=env)


def logged_losses(proc) -> dict:
    return {int(step): float(loss) for step, loss in LOGGED_LOSS.findall(proc.stderr)}


def fetched(log, rank) -> list:
    """The training-sample indices process `rank` fetched, in order (MNIST has no epoch of its own: -1)."""
    return [int(line.split()[1]) for line in log.with_name(f"{log.name}.rank{rank}").read_text().splitlines()]


def assert_sharded(r, num_processes):
    """Each process held its shard of every parameter: about 1/N of the model's bytes, together all of them."""
    assert r["num_processes"] == num_processes and r["sharded"] is True
    per_process, whole = r["parameter_bytes_per_process"], r["parameter_bytes"]
    assert len(per_process) == num_processes and sum(per_process) == whole, r
    # FSDP2 cuts each parameter into N chunks of ceil(rows / N) rows: the first processes hold a little more
    assert max(per_process) <= 1.25 * whole / num_processes, r


def assert_dcp_checkpoint(folder, num_processes):
    """A sharded checkpoint: one DCP file per process for the model and the optimizer, all in the manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    listed = json.dumps(manifest)
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        shards = sorted(p.name for p in (folder / part).iterdir() if p.suffix == ".distcp")
        assert shards == [f"__{rank}_0.distcp" for rank in range(num_processes)], shards
        assert all(f"{part}/{shard}" in listed for shard in shards), manifest


@pytest.fixture(scope="module")
def mnist_runs(tmp_path_factory):
    """DDP on 2 processes; FSDP on 2 (a checkpoint every 2 steps); FSDP on 3 resumed from the FSDP run's step_2
    (mid-epoch 0), itself saving step_4; FSDP on 2 resumed from the FSDP run's step_4 (mid-epoch 1)."""
    root = tmp_path_factory.mktemp("fsdp_mnist")
    data = make_synthetic_mnist(root / "data", num_train=N, num_test=203)
    args = ["--data_dir", data, *map(str, MNIST)]
    runs = {"ddp": launch([*args, "--output_dir", root / "ddp"], num_processes=2)}
    runs["fsdp"] = launch_fsdp(TRAIN_MNIST, [*args, "--output_dir", root / "fsdp", "--checkpointing_steps", "2"], 2,
                               sample_log=root / "samples_fsdp")
    for name, source, checkpoint, num_processes, batch_size in (("resized", "fsdp", "step_2", 3, "16"),
                                                               ("resumed", "fsdp", "step_4", 2, "24")):
        shutil.copytree(root / source / checkpoint, root / name / checkpoint)
        runs[name] = launch_fsdp(TRAIN_MNIST, [*args, "--output_dir", root / name, "--batch_size", batch_size,
                                               "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest"],
                                 num_processes, sample_log=root / f"samples_{name}")
    return root, runs


def test_mnist_fsdp_on_2_processes_shards_and_trains_as_ddp(mnist_runs):
    root, runs = mnist_runs
    fsdp, ddp = results(root / "fsdp"), results(root / "ddp")
    assert_sharded(fsdp, 2)
    assert ddp["sharded"] is False and ddp["parameter_bytes_per_process"] == [ddp["parameter_bytes"]] * 2
    losses, reference = logged_losses(runs["fsdp"]), logged_losses(runs["ddp"])
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], abs=LOSS_TOLERANCE), step
    # the evaluation: every one of the 203 digits once (203 is odd: gather_for_metrics drops the padding), the same
    # predictions, with every process using rank 0's BatchNorm statistics as under DDP
    assert fsdp["eval_samples"] == ddp["eval_samples"] == 203
    assert fsdp["eval_accuracy"] == ddp["eval_accuracy"]
    assert fsdp["eval_loss"] == pytest.approx(ddp["eval_loss"], abs=LOSS_TOLERANCE)
    # the whole weights under the plain names, in one file: they load into the plain model, and match DDP's
    weights, ddp_weights = load_file(root / "fsdp" / "model.safetensors"), load_file(root / "ddp" / "model.safetensors")
    ConvNet().load_state_dict(weights)  # strict: every name matches
    for name, tensor in ddp_weights.items():
        assert torch.allclose(weights[name].double(), tensor.double(), atol=1e-4), name
    assert_dcp_checkpoint(root / "fsdp" / "step_2", 2)


def test_mnist_fsdp_resumes_mid_epoch_to_the_same_weights(mnist_runs):
    root, runs = mnist_runs
    r, uninterrupted = results(root / "resumed"), results(root / "fsdp")
    assert_sharded(r, 2)
    assert r["resumed_from"].endswith("step_4") and r["global_step"] == uninterrupted["global_step"] == 6
    resumed = load_file(root / "resumed" / "model.safetensors")
    reference = load_file(root / "fsdp" / "model.safetensors")
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    assert r["eval_accuracy"] == uninterrupted["eval_accuracy"] and r["eval_loss"] == uninterrupted["eval_loss"]


def test_mnist_fsdp_resumes_on_3_processes_training_every_sample_once(mnist_runs, tmp_path):
    """The shards of 2 processes resharded onto 3 (DCP on load); the ids the processes fetched, gathered: epoch 0 is
    the 2-process run's first 2 steps and the 3-process run's last one, every digit exactly once."""
    root, runs = mnist_runs
    r = results(root / "resized")
    assert_sharded(r, 3)
    assert r["resumed_from"].endswith("step_2") and r["global_batch_size"] == 48 and r["global_step"] == 6
    assert r["samples_seen"] == 2 * N
    before = [i for rank in range(2) for i in fetched(root / "samples_fsdp", rank)[:2 * 24]]
    after = [fetched(root / "samples_resized", rank) for rank in range(3)]
    assert all(len(ids) == 4 * 16 for ids in after)  # 1 step of epoch 0 and the 3 of epoch 1, 16 digits each
    assert sorted(before + [i for ids in after for i in ids[:16]]) == list(range(N))
    assert sorted(i for ids in after for i in ids[16:]) == list(range(N))
    assert_dcp_checkpoint(root / "resized" / "step_4", 3)
    # `accelerate merge-weights`' function: the 3 shards in one file that loads into the plain model
    merge_fsdp_weights(str(root / "resized" / "step_4" / "pytorch_model_fsdp_0"), str(tmp_path))
    ConvNet().load_state_dict(load_file(tmp_path / "model.safetensors"))  # strict: BatchNorm statistics too


def test_image_classifier_fsdp_on_3_resumes_on_2_and_predicts(tmp_path):
    """A torchvision ResNet-18 (32 px, 4 classes of generated images) under FSDP2 with --gradient_checkpointing on 3
    processes, resumed mid-epoch on 2; the whole weights load into a plain torchvision resnet18, and
    scripts/predict.py reads the run."""
    data = make_split_image_folder(tmp_path / "data", train_per_class=12, val_per_class=5)
    common = ["--data_dir", data, "--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer",
              "adamw", "--num_workers", "0", "--epochs", "1", "--gradient_checkpointing"]
    # 48 images: 3 x 4 = 2 x 6 = 12 per step, 4 steps
    launch_fsdp(CLASSIFIER, [*common, "--batch_size", "4", "--output_dir", tmp_path / "on3", "--checkpointing_steps",
                             "2"], 3)
    saved = results(tmp_path / "on3")
    assert_sharded(saved, 3)
    assert saved["eval_samples"] == 20
    assert_dcp_checkpoint(tmp_path / "on3" / "step_2", 3)
    shutil.copytree(tmp_path / "on3" / "step_2", tmp_path / "on2" / "step_2")
    launch_fsdp(CLASSIFIER, [*common, "--batch_size", "6", "--output_dir", tmp_path / "on2", "--resume_from_checkpoint",
                             "latest"], 2)
    r = results(tmp_path / "on2")
    assert_sharded(r, 2)
    assert r["global_step"] == 4 and r["samples_seen"] == saved["samples_seen"] == 48 and r["eval_samples"] == 20
    weights = load_file(tmp_path / "on2" / "model.safetensors")
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict(weights)  # strict: the plain torchvision names, nothing sharded or wrapped
    predictions = tmp_path / "predictions.csv"
    launch(["--model_dir", tmp_path / "on2", "--data_dir", data, "--output_file", predictions, "--num_workers", "0"],
           script=PREDICT)
    assert len(predictions.read_text().splitlines()) == 1 + 20


# ---------------------------------------------------------------- refusals, in this process (no launch)

def cpu_group(dynamo_backend="NO"):
    """What utils/fsdp.shard_on_cpu reads of an Accelerator that Accelerate 1.15 set up for a CPU group (DDP)."""
    from accelerate.utils import DistributedType, DynamoBackend

    state = SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend(dynamo_backend)),
                            distributed_type=DistributedType.MULTI_CPU)
    return SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=state, mixed_precision="no")


@pytest.mark.parametrize("env, accelerator_version, dynamo_backend, expected", [
    ({"FSDP_VERSION": "1"}, None, "NO", "needs FSDP2"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, None, "NO", "fsdp_cpu_ram_efficient_loading"),
    ({}, "1.16.0", "NO", "written for accelerate 1.15"),  # the adapter stops where it was not checked
    ({}, None, "INDUCTOR", "--compile"),
    ({}, None, "NO", "--mixed_precision bf16"),
])
def test_fsdp_on_cpu_refuses_what_it_cannot_shard_in_one_line(monkeypatch, env, accelerator_version, dynamo_backend,
                                                              expected):
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from utils.errors import UserError
    from utils.run.fsdp import shard_on_cpu

    monkeypatch.setitem(PartialState._shared_state, "distributed_type", DistributedType.MULTI_CPU)

    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **env}.items():
        monkeypatch.setenv(name, value)
    if accelerator_version:
        monkeypatch.setattr(accelerate, "__version__", accelerator_version)
    accelerator = cpu_group(dynamo_backend)
    accelerator.mixed_precision = "bf16" if "bf16" in expected else "no"
    with pytest.raises(UserError, match=re.escape(expected)):
        shard_on_cpu(accelerator)
    assert accelerator.state.distributed_type.value == "MULTI_CPU"  # left as it was


def test_auto_find_batch_size_is_refused_under_fsdp():
    from accelerate.utils import DistributedType

    from utils.errors import UserError
    from utils.run.batch_size import fit_batch_size

    with pytest.raises(UserError, match="--auto_find_batch_size .* under FSDP"):
        fit_batch_size(SimpleNamespace(distributed_type=DistributedType.FSDP), None, None, None, None, None)
