"""DeepSpeed ZeRO through Accelerate's DeepSpeed plugin on CPU processes (utils/run/deepspeed.py,
accelerate_configs/deepspeed_zero2_cpu.yaml and deepspeed_zero3_cpu.yaml): both training scripts train under ZeRO-2
and ZeRO-3 on 2 and 3 gloo processes through the same prepare/backward/clip_grad_norm_/save_state/save_model calls a
GPU run makes. Proven against a DDP run of the same seed on as many processes (loss per step, the exact evaluation),
with each process's optimizer state (ZeRO-2 and 3) and parameters (ZeRO-3) measured at about 1/N. Two launches
(`launched`), one per process count, every run a forked job of tests/jobs.py: the other stage and DDP are the
launch's environment changed (ACCELERATE_DEEPSPEED_ZERO_STAGE; ACCELERATE_USE_DEEPSPEED and the DeepSpeed settings
unset). The in-process checks of the --cpu route, the launch checks and the refusals are tests/test_deepspeed.py."""

import re

import pytest
import torch
from helpers import REPO, assert_clean_user_error, launcher_args, make_synthetic_mnist, results
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.models import ConvNet

CONFIGS = {2: REPO / "accelerate_configs" / "deepspeed_zero2_cpu.yaml",  # the launch on 2 processes, ZeRO-2's
           3: REPO / "accelerate_configs" / "deepspeed_zero3_cpu.yaml"}  # on 3, ZeRO-3's
TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
N = 144  # training digits: 2 x 24 = 3 x 16 = 48 per optimizer step, 3 steps per epoch on 2 or 3 processes, no padding
EVAL = 203  # test digits: divisible by neither 2 nor 3 (gather_for_metrics drops the padding)
MNIST = ["--max_train_samples", N, "--epochs", "2", "--logging_steps", "1", "--seed", "1"]
# the image classifier: tiny_cnn (a convolution, BatchNorm, a linear head) on 24 generated 32 px images of 4 classes,
# 12 per step on 2 or 3 processes, 2 steps; 5 x 4 = 20 evaluation images
CLASSIFIER_ARGS = ["--model", "tests.tiny_model:tiny_cnn", "--image_size", "32", "--num_workers", "0",
                   "--epochs", "1", "--seed", "1"]
STAGES = {  # a job's environment beside the launch's: the other ZeRO stage, or DDP (what a DDP launch lacks)
    "zero2": {"env": {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}},
    "zero3": {"env": {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}},
    "ddp": {"unset_env": ["ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_",
                          "ACCELERATE_CONFIG_DS_FIELDS"]},
}
# Measured (6 steps): on 2 processes ZeRO-2's and ZeRO-3's step losses, evaluation and weights equal DDP's bit for bit.
# On 3 the step losses agree to 8e-8 and the evaluation's predictions are the same, but the weights end up to 1.8e-3
# apart and eval_loss 2.1e-4 (ZeRO-2): the mean over 3 processes is rounded otherwise than DDP's (over 2 it is exact),
# and Adam turns a near-zero gradient element's rounding into a step of about the learning rate (1e-3).
LOSS_TOLERANCE = 1e-6
WEIGHTS_TOLERANCE = {2: 0.0, 3: 4e-3}
EVAL_LOSS_TOLERANCE = {2: 0.0, 3: 1e-3}
# DeepSpeed's bf16 weights vs DDP's autocast over fp32 weights: two bf16 steps at 1.0 (it keeps 8 significant bits),
# absolute (the runs differ by their weights' rounding, carried into every loss whatever its size)
BF16_TOLERANCE = 2 * 2**-8
LOGGED_LOSS = re.compile(r"step (\d+): \{'loss': ([-+.e0-9]+)")


def launch_deepspeed_jobs(jobs: dict, num_processes: int, root) -> dict:
    """One `accelerate launch --config_file accelerate_configs/deepspeed_zero{2,3}_cpu.yaml` on N processes of
    tests/jobs.py: each launched process imports torch, Accelerate and DeepSpeed once, then forks one child per job
    {NAME: (STAGE, [SCRIPT, *ARGS])} in turn, which runs `SCRIPT ARGS` with the launch's environment changed as
    STAGES[STAGE] says, its files at ROOT/NAME. Returns {NAME: the job as a finished process, every rank's output in
    .stdout}, each asserted to have exited as expected (a job whose STAGE ends in "!" must fail)."""
    launch_jobs({name: {"argv": argv, **STAGES[stage.rstrip("!")]} for name, (stage, argv) in jobs.items()},
                [*launcher_args(config_file=CONFIGS[num_processes]), "--num_processes", str(num_processes)], root)
    return {name: finished_job(root / name, num_processes, fails=stage.endswith("!"))
            for name, (stage, _) in jobs.items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every run of this module, in one launch per process count (2 under deepspeed_zero2_cpu.yaml, 3 under
    deepspeed_zero3_cpu.yaml): MNIST under DDP, ZeRO-2 and ZeRO-3 (a checkpoint at its last step), the image classifier
    under ZeRO-2 and ZeRO-3; on 2 processes also MNIST launched under DeepSpeed without --cpu (refused), and MNIST in
    bf16 under ZeRO-3 and DDP."""
    root = tmp_path_factory.mktemp("deepspeed")
    data = make_synthetic_mnist(root / "data", num_train=N, num_test=EVAL)
    images = make_split_image_folder(root / "images", train_per_class=6, val_per_class=5)
    runs = {}
    for num_processes in (2, 3):
        mnist = ["--data_dir", data, *map(str, MNIST), "--batch_size", str(48 // num_processes)]
        classifier = ["--data_dir", images, *CLASSIFIER_ARGS, "--batch_size", str(12 // num_processes)]
        jobs = {f"{stage}_{num_processes}": (stage, [TRAIN_MNIST, "--cpu", *mnist, "--output_dir",
                                                     root / f"{stage}_{num_processes}", *checkpoints])
                for stage, checkpoints in (("zero2", ["--checkpointing_steps", "6"]), ("ddp", []),
                                           ("zero3", ["--checkpointing_steps", "6"]))}
        jobs |= {f"classifier_{stage}_{num_processes}": (stage, [
            CLASSIFIER, "--cpu", *classifier, "--output_dir", root / f"classifier_{stage}_{num_processes}"])
            for stage in ("zero2", "zero3")}
        if num_processes == 2:
            jobs["without_cpu"] = ("zero2!", [TRAIN_MNIST, *mnist, "--output_dir", root / "without_cpu"])
            jobs |= {f"{stage}_bf16": (stage, [TRAIN_MNIST, "--cpu", *mnist, "--output_dir", root / f"{stage}_bf16",
                                               "--mixed_precision", "bf16"]) for stage in ("zero3", "ddp")}
        runs |= launch_deepspeed_jobs(jobs, num_processes, root)
    return root, runs


def logged_losses(proc) -> dict:
    return {int(step): float(loss) for step, loss in LOGGED_LOSS.findall(proc.stdout)}


def optimizer_state_bytes(checkpoint, num_processes) -> list:
    """Bytes of Adam's moments (exp_avg, exp_avg_sq) that each process held, from the optimizer state DeepSpeed's
    save_checkpoint wrote for it (zero_pp_rank_R_mp_rank_00_optim_states.pt: its partition, as in memory)."""
    held = []
    for rank in range(num_processes):
        (path,) = checkpoint.rglob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        state = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        # the torch optimizer's state over this process's partition: ZeRO-2 keeps it as base_optimizer_state
        moments = state.get("base_optimizer_state", state.get("optimizer_state_dict"))["state"].values()
        held.append(sum(t.nbytes for s in moments for name, t in s.items() if name in ("exp_avg", "exp_avg_sq")))
    return held


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_mnist_under_zero_trains_as_ddp_with_its_state_partitioned(launched, stage, num_processes):
    root, runs = launched
    name, reference = f"{stage}_{num_processes}", f"ddp_{num_processes}"
    r, ddp = results(root / name), results(root / reference)
    assert r["num_processes"] == ddp["num_processes"] == num_processes and r["global_step"] == ddp["global_step"] == 6
    losses, ddp_losses = logged_losses(runs[name]), logged_losses(runs[reference])
    assert sorted(losses) == sorted(ddp_losses) == list(range(1, 7))
    for step in ddp_losses:
        assert losses[step] == pytest.approx(ddp_losses[step], abs=LOSS_TOLERANCE), step
    # the evaluation: every one of the 203 digits once, the same predictions, every process using rank 0's BatchNorm
    # statistics as under DDP (each process's own: eval_loss 6e-5 apart, measured)
    assert r["eval_samples"] == ddp["eval_samples"] == EVAL
    assert r["eval_accuracy"] == ddp["eval_accuracy"]
    assert r["eval_loss"] == pytest.approx(ddp["eval_loss"], abs=EVAL_LOSS_TOLERANCE[num_processes])
    # the whole weights under the plain names, as DDP's
    weights = load_file(root / name / "model.safetensors")
    ddp_weights = load_file(root / reference / "model.safetensors")
    ConvNet().load_state_dict(weights)  # strict: every name matches
    for key, tensor in ddp_weights.items():
        assert torch.allclose(weights[key].double(), tensor.double(), rtol=0, atol=WEIGHTS_TOLERANCE[num_processes]), key
    # each process held about 1/N of Adam's moments (ZeRO-2 and 3), and under ZeRO-3 of the parameters: DeepSpeed
    # pads each to N equal partitions, a few elements per process
    whole = r["parameter_bytes"]
    moments = optimizer_state_bytes(root / name / "step_6", num_processes)
    assert all(abs(held - 2 * whole / num_processes) <= 64 * num_processes for held in moments), (moments, whole)
    per_process = r["parameter_bytes_per_process"]
    if stage == "zero3":
        assert r["sharded"] is True and all(abs(b - whole / num_processes) <= 64 for b in per_process), per_process
    else:
        assert r["sharded"] is False and per_process == [whole] * num_processes
    print(f"{name}: max |loss - DDP's| {max(abs(losses[s] - ddp_losses[s]) for s in ddp_losses):.2e}, eval_loss "
          f"{abs(r['eval_loss'] - ddp['eval_loss']):.2e}; Adam moments per process {moments} of {2 * whole}; "
          f"parameters per process {per_process} of {whole}")


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_the_image_classifier_trains_under_zero(launched, stage, num_processes):
    root, _ = launched
    r = results(root / f"classifier_{stage}_{num_processes}")
    assert r["num_processes"] == num_processes and r["global_step"] == 2 and r["sharded"] is (stage == "zero3")
    assert r["eval_samples"] == 20  # every validation image once
    weights = load_file(root / f"classifier_{stage}_{num_processes}" / "model.safetensors")
    assert not [key for key in weights if key.startswith(("module.", "_orig_mod."))], weights.keys()


def test_bf16_under_zero_3_casts_the_whole_model_and_trains_as_ddps_autocast_does(launched):
    """DeepSpeed's bf16 casts the parameters (Accelerate's autocasts over fp32 weights): BatchNorm's statistics and the
    float32 images follow them (utils/run/deepspeed.py, all_in_model_dtype; without it the first forward stops). The
    weights come out in bf16 under the plain names."""
    root, runs = launched
    r, ddp = results(root / "zero3_bf16"), results(root / "ddp_bf16")
    assert r["mixed_precision"] == ddp["mixed_precision"] == "bf16" and r["global_step"] == ddp["global_step"] == 6
    losses, ddp_losses = logged_losses(runs["zero3_bf16"]), logged_losses(runs["ddp_bf16"])
    assert sorted(losses) == sorted(ddp_losses) == list(range(1, 7))
    for step in ddp_losses:  # measured: 9e-4 to 3.5e-3 apart (losses from 2.3 down to 0.22), eval_loss 4.1e-3
        assert losses[step] == pytest.approx(ddp_losses[step], abs=BF16_TOLERANCE), step
    assert r["eval_samples"] == ddp["eval_samples"] == EVAL
    assert r["eval_loss"] == pytest.approx(ddp["eval_loss"], abs=BF16_TOLERANCE)
    weights = load_file(root / "zero3_bf16" / "model.safetensors")
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    ConvNet().load_state_dict(weights)  # strict: every name matches


def test_a_deepspeed_launch_without_cpu_or_gpus_is_refused_in_one_line(launched):
    root, runs = launched
    assert_clean_user_error(runs["without_cpu"], "asks for DeepSpeed, but this machine has no GPUs; add --cpu")
    assert not (root / "without_cpu").exists()
