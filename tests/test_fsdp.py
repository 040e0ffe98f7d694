"""FSDP2 on CPU processes (utils/run/fsdp.py, accelerate_configs/fsdp_cpu.yaml): both training scripts shard their model
over 2 and 3 gloo processes through the same prepare/save_state/load_state/get_state_dict/save_model calls a GPU run
makes. Proven against a DDP run of the same seed (loss per step, evaluation), with the checkpoints' shards resumed on
the same process count (the same final weights) and on another one (every sample trained once, by id), and the whole
weights out under the plain model's names; an FSDP run's ONNX export, and a damaged DCP shard found by the manifest.
Three launches in all (`launched`), one after the other as each resumes the one before: every run a forked job of
tests/jobs.py under the FSDP config (the DDP run too, its FSDP settings unset), on 2, 3, then 2 processes;
scripts/predict.py's two runs in the test process. Each test reads the jobs it is about (finished_job)."""

import ast
import contextlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torchvision
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import merge_fsdp_weights
from helpers import REPO, launcher_args, load_script, make_synthetic_mnist, results, skip_or_fail_in_ci
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.data.mnist import load_mnist_idx, normalise_mnist
from utils.errors import UserError
from utils.models import ConvNet
from utils.run.checkpoints import check_checkpoint
from utils.run.resume import resolve_checkpoint

FSDP_CPU = REPO / "accelerate_configs" / "fsdp_cpu.yaml"
TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PREDICT = REPO / "scripts" / "predict.py"
N = 144  # training digits: 2 x 24 = 3 x 16 = 48 per optimizer step, 3 steps per epoch on 2 or 3 processes, no padding
MNIST = ["--max_train_samples", N, "--epochs", "2", "--batch_size", "24", "--logging_steps", "1", "--seed", "1"]
# the losses of FSDP and DDP differ only by the order of the gradients' sums (reduce-scatter vs all-reduce)
LOSS_TOLERANCE = 1e-4
# the image classifier: a torchvision ResNet-18 with --gradient_checkpointing in bf16 on 36 generated 32 px images of 4
# classes (9 per class), 3 x 4 = 2 x 6 = 12 per step, 3 steps
CLASSIFIER_ARGS = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
                   "--num_workers", "0", "--epochs", "1", "--gradient_checkpointing", "--mixed_precision", "bf16"]
LOGGED_LOSS = re.compile(r"step (\d+): \{'loss': ([-+.e0-9]+)")
LOGGED_EPOCH = re.compile(r"INFO \[RANK 0\] epoch (\d+): (\{.*\})$", re.MULTILINE)


def fsdp_launch(num_processes: int) -> list:
    """`accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml` on N processes: its jobs run with the FSDP
    settings the launcher exports."""
    return [*launcher_args(config_file=FSDP_CPU), "--num_processes", num_processes]


def as_ddp(argv) -> dict:
    """A job of an FSDP launch without ACCELERATE_USE_FSDP and FSDP_*, all that a DDP launch's environment lacks beside
    this one's: DDP."""
    return {"argv": argv, "unset_env": ["ACCELERATE_USE_FSDP", "FSDP_"]}


def recorded(argv) -> dict:
    """A job whose training samples are logged beside it (fetched)."""
    return {"argv": argv, "record_samples": True}


def copy_checkpoint(source, destination) -> bool:
    """Copy a checkpoint where its run saved one: a run that failed fails its tests, and those of the runs that resume
    it, not the fixture."""
    if source.is_dir():
        shutil.copytree(source, destination)
    return source.is_dir()


def outcome(function, *args):
    """function(*args), or the exception it raised: for the test that reads it to raise, not every test."""
    try:
        return function(*args)
    except Exception as failure:  # noqa: BLE001 - raised again by the test about it
        return failure


def result(outcome_):
    """What outcome() returned; its exception raised here."""
    if isinstance(outcome_, Exception):
        raise outcome_
    return outcome_


def predict_here(*argv) -> subprocess.CompletedProcess:
    """scripts/predict.py's main() on `argv` in the test process, as `python scripts/predict.py --cpu ARGV` runs it
    on one process, without starting one (~4 CPU-s each); its stdout captured. Accelerate's state is reset before and
    after, so that no other test of this process meets this Accelerator, nor this one an earlier one's."""
    script = load_script(PREDICT)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            status = script.main(script.parse_args(["--cpu", *map(str, argv)]))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert status == 0, stdout.getvalue()
    return subprocess.CompletedProcess(argv, status, stdout.getvalue(), "")


def flip_a_byte(path) -> None:
    """One byte of `path` changed in the middle, its size kept: only the manifest's sha256 can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def logged_losses(proc) -> dict:
    return {int(step): float(loss) for step, loss in LOGGED_LOSS.findall(proc.stdout)}


def logged_epochs(proc) -> dict:
    """{epoch: the metrics rank 0 logged at its end}."""
    return {int(epoch): ast.literal_eval(metrics) for epoch, metrics in LOGGED_EPOCH.findall(proc.stdout)}


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


EXPORT_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every run of this module, in three FSDP launches of forked jobs (`fsdp_launch`), each after the one whose
    checkpoints it resumes (2 processes, then 3, then 2 again: one process count per launch):
    1. on 2 processes: MNIST under FSDP (a checkpoint every 2 steps), and MNIST under DDP (the FSDP settings unset);
    2. on 3: the image classifier under FSDP (checkpoint step_2); MNIST under FSDP resumed from the FSDP run's step_2
       (mid-epoch 0) with a damaged copy of its step_4 beside it ('latest' must pass over it), itself saving step_4;
    3. on 2: MNIST under FSDP resumed from the FSDP run's step_4 (mid-epoch 1); the image classifier resumed from its
       step_2 on 2. Meanwhile, in this process (`predict_here`), scripts/predict.py on the classifier's 3-process
       run, and its ONNX export of the MNIST FSDP run. Returns the folder (job NAME: ROOT/NAME) and the outcomes of
       those two (outcome())."""
    root = tmp_path_factory.mktemp("fsdp")
    data = make_synthetic_mnist(root / "data", num_train=N, num_test=203)
    args = ["--cpu", "--data_dir", data, *map(str, MNIST)]
    images = make_split_image_folder(root / "images", train_per_class=9, val_per_class=5)
    classifier = ["--cpu", *CLASSIFIER_ARGS, "--data_dir", images]
    launch_jobs({"fsdp": recorded([TRAIN_MNIST, *args, "--output_dir", root / "fsdp", "--checkpointing_steps", "2"]),
                 "ddp": as_ddp([TRAIN_MNIST, *args, "--output_dir", root / "ddp"])}, fsdp_launch(2), root)

    resumes = {}
    for name, checkpoint, batch_size in (("resized", "step_2", "16"), ("resumed", "step_4", "24")):
        copy_checkpoint(root / "fsdp" / checkpoint, root / name / checkpoint)
        resumes[name] = [TRAIN_MNIST, *args, "--output_dir", root / name, "--batch_size", batch_size,
                         "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest"]
    if copy_checkpoint(root / "fsdp" / "step_4", root / "resized" / "step_4"):
        flip_a_byte(root / "resized" / "step_4" / "pytorch_model_fsdp_0" / "__1_0.distcp")  # process 1's model shard
    launch_jobs({"on3": [CLASSIFIER, *classifier, "--batch_size", "4", "--output_dir", root / "on3",
                         "--checkpointing_steps", "2"],
                 "resized": recorded(resumes["resized"])}, fsdp_launch(3), root)

    copy_checkpoint(root / "on3" / "step_2", root / "on2" / "step_2")
    in_this_process = {}
    with ThreadPoolExecutor(1) as pool:  # the last launch, and meanwhile the predictions in this process
        last = pool.submit(launch_jobs, {"resumed": resumes["resumed"], "on2": [
            CLASSIFIER, *classifier, "--batch_size", "6", "--output_dir", root / "on2",
            "--resume_from_checkpoint", "latest"]}, fsdp_launch(2), root)
        in_this_process["predictions"] = outcome(
            predict_here, "--model_dir", root / "on3", "--data_dir", images, "--output_file", root / "predictions.csv",
            "--num_workers", "0")
        if all(importlib.util.find_spec(name) for name in EXPORT_PACKAGES):  # else its test says what is missing
            in_this_process["export"] = outcome(predict_here, "--model_dir", root / "fsdp", "--data_dir", data,
                                                "--export", "onnx", "--export_file", root / "fsdp.onnx",
                                                "--batch_size", "16")
        last.result()
    return root, in_this_process


def test_mnist_fsdp_on_2_processes_shards_and_trains_as_ddp(launched):
    root, _ = launched
    runs = {name: finished_job(root / name, 2) for name in ("fsdp", "ddp")}
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
    # Epoch 0's evaluation follows step 3, a step after the last checkpoint's state_dict() took rank 0's buffers: only
    # the evaluation's own broadcast (complete_fsdp_model's forward pre-hook) makes it DDP's. Measured: equal to the
    # last bit (two processes' gradient sums have one order); each process's own buffers: 1.8e-4 apart.
    epochs, ddp_epochs = logged_epochs(runs["fsdp"]), logged_epochs(runs["ddp"])
    assert sorted(epochs) == sorted(ddp_epochs) == [0, 1]
    assert epochs[0]["eval_loss"] == pytest.approx(ddp_epochs[0]["eval_loss"], abs=1e-6)
    # the whole weights under the plain names, in one file: they load into the plain model, and match DDP's
    weights, ddp_weights = load_file(root / "fsdp" / "model.safetensors"), load_file(root / "ddp" / "model.safetensors")
    ConvNet().load_state_dict(weights)  # strict: every name matches
    for name, tensor in ddp_weights.items():
        assert torch.allclose(weights[name].double(), tensor.double(), atol=1e-4), name
    assert_dcp_checkpoint(root / "fsdp" / "step_2", 2)
    # docs/output_files.md: one line of ours per checkpoint, Accelerate's about its temporary folder hidden under FSDP
    # too (they were 6-8 per checkpoint); and no FutureWarning about torch's reduce_op at exit (4 a run)
    log = runs["fsdp"].stdout
    assert log.count(f"Saved {root / 'fsdp' / 'step_2'}: ") == 1, log
    for hidden in (".tmp-", "Saving FSDP", "reduce_op"):
        assert hidden not in log, hidden


def test_mnist_fsdp_resumes_mid_epoch_to_the_same_weights(launched):
    root, _ = launched
    finished_job(root / "fsdp", 2)
    finished_job(root / "resumed", 2)
    r, uninterrupted = results(root / "resumed"), results(root / "fsdp")
    assert_sharded(r, 2)
    assert r["resumed_from"].endswith("step_4") and r["global_step"] == uninterrupted["global_step"] == 6
    resumed = load_file(root / "resumed" / "model.safetensors")
    reference = load_file(root / "fsdp" / "model.safetensors")
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    assert r["eval_accuracy"] == uninterrupted["eval_accuracy"] and r["eval_loss"] == uninterrupted["eval_loss"]


def test_mnist_fsdp_resumes_on_3_processes_training_every_sample_once(launched, tmp_path):
    """The shards of 2 processes resharded onto 3 (DCP on load); the ids the processes fetched, gathered: epoch 0 is
    the 2-process run's first 2 steps and the 3-process run's last one, every digit exactly once."""
    root, _ = launched
    finished_job(root / "fsdp", 2)
    resized = finished_job(root / "resized", 3)
    r = results(root / "resized")
    assert_sharded(r, 3)
    assert r["resumed_from"].endswith("step_2") and r["global_batch_size"] == 48 and r["global_step"] == 6
    # the newer step_4 beside it had one byte of a model shard flipped: 'latest' passed over it, in one line
    skipped = [line.split(" WARNING ", 1)[1] for line in resized.stdout.splitlines()
               if "skipping damaged checkpoint" in line]
    expected = ("--resume_from_checkpoint latest: skipping damaged checkpoint step_4 (pytorch_model_fsdp_0/__1_0.distcp "
                f"differs from its sha256 when saved); resuming from {root / 'resized' / 'step_2'}")
    assert skipped == [expected], resized.stdout
    assert r["samples_seen"] == 2 * N
    before = [i for rank in range(2) for i in fetched(root / "fsdp", rank)[:2 * 24]]
    after = [fetched(root / "resized", rank) for rank in range(3)]
    assert all(len(ids) == 4 * 16 for ids in after)  # 1 step of epoch 0 and the 3 of epoch 1, 16 digits each
    assert sorted(before + [i for ids in after for i in ids[:16]]) == list(range(N))
    assert sorted(i for ids in after for i in ids[16:]) == list(range(N))
    assert_dcp_checkpoint(root / "resized" / "step_4", 3)
    # `accelerate merge-weights`' function, as docs/fsdp.md runs it: the 3 shards in one file beside the checkpoint's
    # run.json (a copy of the run's folder), which loads into the plain model and which predict.py reads
    shutil.copytree(root / "resized", tmp_path / "run")
    merge_fsdp_weights(str(tmp_path / "run" / "step_4" / "pytorch_model_fsdp_0"), str(tmp_path / "run" / "step_4"))
    ConvNet().load_state_dict(load_file(tmp_path / "run" / "step_4" / "model.safetensors"))  # strict: BatchNorm too
    predict_here("--model_dir", tmp_path / "run" / "step_4", "--data_dir", root / "data", "--max_samples", "16",
                 "--output_file", tmp_path / "predictions.csv")
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 1 + 16


def test_a_damaged_dcp_shard_is_found_and_a_named_resume_refused(launched, tmp_path):
    """The manifest lists and hashes every process's .distcp file: one flipped byte in one shard of the optimizer
    makes the checkpoint damaged; named, it is refused in one line naming the file and the newest good one.
    ('latest' passing over one: the 3-process resume above.)"""
    root, _ = launched
    finished_job(root / "fsdp", 2)
    for checkpoint in ("step_2", "step_4"):
        shutil.copytree(root / "fsdp" / checkpoint, tmp_path / checkpoint)
    assert check_checkpoint(tmp_path / "step_4") is None
    flip_a_byte(tmp_path / "step_4" / "optimizer_0" / "__0_0.distcp")
    with pytest.raises(UserError) as refused:
        resolve_checkpoint(str(tmp_path / "step_4"), tmp_path)
    assert str(refused.value) == (f"checkpoint {tmp_path / 'step_4'} is damaged (optimizer_0/__0_0.distcp differs from "
                                  f"its sha256 when saved); resume from the newest good one, {tmp_path / 'step_2'}")
    assert "\n" not in str(refused.value)


def test_onnx_export_of_an_fsdp_run_matches_pytorch(launched):
    """scripts/predict.py --export onnx on the FSDP run's folder: onnxruntime's logits on the run's digits are those
    of the plain ConvNet loaded with the run's model.safetensors (as tests/test_predict.py checks a DDP run's)."""
    if not all(importlib.util.find_spec(name) for name in EXPORT_PACKAGES):
        skip_or_fail_in_ci("onnx, onnxscript or onnxruntime is not installed: pip install -r requirements-export.txt")
    import onnxruntime

    root, in_this_process = launched
    finished_job(root / "fsdp", 2)
    assert f"Wrote {root / 'fsdp.onnx'}" in result(in_this_process["export"]).stdout
    digits = load_mnist_idx(root / "data")["test"][0][:16].unsqueeze(1)  # uint8 (16, 1, 28, 28), as predict.py reads
    model = ConvNet()
    model.load_state_dict(load_file(root / "fsdp" / "model.safetensors"))
    with torch.no_grad():
        expected = model.eval()(normalise_mnist(digits)).numpy()
    session = onnxruntime.InferenceSession(str(root / "fsdp.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"images": digits.numpy()})[0]
    assert logits.shape == (16, 10) and abs(logits - expected).max() <= 1e-4, abs(logits - expected).max()


def test_image_classifier_fsdp_on_3_resumes_on_2_and_predicts(launched):
    """A torchvision ResNet-18 (32 px, 4 classes of generated images) under FSDP2 in bf16 with --gradient_checkpointing
    on 3 processes, resumed mid-epoch on 2; the whole weights load into a plain torchvision resnet18, and
    scripts/predict.py reads the 3-process run. bf16 trains only with every BatchNorm in an fp32 unit of its own
    (utils/run/fsdp.keep_batchnorm_in_fp32): under Accelerate's one bf16 policy the first backward stops."""
    root, in_this_process = launched
    finished_job(root / "on3", 3)
    finished_job(root / "on2", 2)
    result(in_this_process["predictions"])
    saved = results(root / "on3")
    assert_sharded(saved, 3)
    assert saved["mixed_precision"] == "bf16" and 0 < saved["train_loss"] < 10, saved
    assert saved["eval_samples"] == 20
    assert_dcp_checkpoint(root / "on3" / "step_2", 3)
    r = results(root / "on2")
    assert_sharded(r, 2)
    assert r["resumed_from"].endswith("step_2") and r["global_step"] == saved["global_step"] == 3
    assert r["samples_seen"] == saved["samples_seen"] == 36 and r["eval_samples"] == 20
    weights = load_file(root / "on2" / "model.safetensors")
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict(weights)  # strict: the plain torchvision names, nothing sharded or wrapped
    # scripts/predict.py on the 3-process run's folder: a row for each of the 20 evaluation images
    assert len((root / "predictions.csv").read_text().splitlines()) == 1 + 20


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
    with pytest.raises(UserError, match=re.escape(expected)):
        shard_on_cpu(accelerator)
    assert accelerator.state.distributed_type.value == "MULTI_CPU"  # left as it was


def test_auto_find_batch_size_is_refused_under_fsdp():
    from accelerate.utils import DistributedType

    from utils.errors import UserError
    from utils.run.batch_size import fit_batch_size

    with pytest.raises(UserError, match="--auto_find_batch_size .* under FSDP"):
        fit_batch_size(SimpleNamespace(distributed_type=DistributedType.FSDP), None, None, None, None, None)


def test_the_reason_batchnorm_is_kept_in_fp32_under_fsdp_still_holds():
    """utils/run/fsdp.keep_batchnorm_in_fp32's reason (docs/fsdp.md, "Mixed precision under FSDP"): for bf16
    Accelerate gives FSDP2 a policy that casts every parameter, BatchNorm's weight and bias too, to bf16, and
    batch_norm refuses bf16 weights beside its fp32 running statistics (on the CPU here; the first GPU check stopped
    the same way). When this fails, Accelerate or torch changed: the BatchNorm units may no longer be needed."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does for --mixed_precision bf16 under FSDP
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    weight, bias = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    running_mean, running_var = torch.zeros(4), torch.ones(4)  # buffers: FSDP2 leaves them in fp32
    activations = torch.randn(2, 4, 3, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        torch.nn.functional.batch_norm(activations, running_mean, running_var, weight, bias, training=True)


def test_an_fsdp2_scripts_fp32_reductions_survive_accelerates_bf16_as_the_docs_say():
    """docs/fsdp.md "Converting an FSDP2 script": the block there runs as written (the plugin keeps the example's
    fp32 reductions under mixed_precision="bf16"), and without its `mixed_precision_policy` line Accelerate's own
    policy reduces in bf16, the difference the section tells."""
    text = (REPO / "docs" / "fsdp.md").read_text()
    section = text.split("## Converting an FSDP2 script\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)[1]
    exec(compile(block, "docs/fsdp.md", "exec"), {})
    policy_line = re.search(r"^ *mixed_precision_policy=.*\n", block, flags=re.MULTILINE)[0]
    without_the_policy = block.replace(policy_line, "").replace(
        "(torch.bfloat16, torch.float32)", "(torch.bfloat16, torch.bfloat16)")
    assert without_the_policy.count("torch.bfloat16, torch.bfloat16") == 1
    exec(compile(without_the_policy, "docs/fsdp.md, without the policy", "exec"), {})


def bf16_backward_under_fsdp(batchnorm: torch.nn.Module) -> None:
    """A model with the layer `batchnorm` after a BatchNorm2d trunk, each BatchNorm unit kept in fp32 by
    keep_batchnorm_in_fp32, the rest sharded under the bf16 policy that Accelerate gives FSDP2 (the FSDP1-style units of
    a prepared model), through a forward and a backward, in this process with a gloo group of one (destroyed after; a
    child forked from a pytest worker whose torch and threads have run can hang in its first parallel operation)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard

    from utils.run.fsdp import keep_batchnorm_in_fp32

    assert not torch.distributed.is_initialized()  # a group left by another test would change what this shards over
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        plugin.set_mixed_precision("bf16")  # as AcceleratorState does for --mixed_precision bf16 under FSDP
        accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, mixed_precision="bf16",
                                      state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                                    torch.nn.Linear(2 * 4 * 4, 4), batchnorm, torch.nn.Linear(4, 3))
        keep_batchnorm_in_fp32(accelerator, model)
        fully_shard(model, mp_policy=plugin.mixed_precision_policy)
        model(torch.randn(5, 1, 6, 6)).float().sum().backward()
        assert all(parameter.grad is not None for parameter in model.parameters())
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kind", ["BatchNorm1d", "SyncBatchNorm"])
def test_a_bf16_fsdp_model_with_any_kind_of_batchnorm_gets_through_a_backward(kind):
    """Issue 43 #8: not only BatchNorm2d (every launched FSDP model's) but a BatchNorm1d head and SyncBatchNorm too
    are kept in fp32, else batch_norm refuses their bf16 weights beside the fp32 statistics. (SyncBatchNorm evaluates:
    its training forward on CPU processes with a process group refuses CPU tensors; in eval it runs as batch_norm,
    which refuses the same weights.)"""
    batchnorm = getattr(torch.nn, kind)(4)
    if kind == "SyncBatchNorm":
        batchnorm.eval()
    bf16_backward_under_fsdp(batchnorm)


def test_releasing_the_process_groups_at_exit_warns_nothing():
    """utils/run/fsdp.py's exit handler walks every object: isinstance on torch's deprecated
    torch.distributed.reduce_op warns (a FutureWarning per process, twice); the handler's type test does not."""
    from utils.run.fsdp import _release_process_groups

    assert hasattr(torch.distributed, "reduce_op")  # torch still has the alias: the reason still holds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _release_process_groups()
    assert not [w for w in caught if "reduce_op" in str(w.message)], [str(w.message) for w in caught]
