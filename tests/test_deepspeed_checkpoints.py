"""Issue 42, checkpoints under DeepSpeed ZeRO on CPU processes: DeepSpeed's own sharded checkpoint inside our
step_N/epoch_N folders, with the manifest and its checks; a mid-epoch resume on the same processes ends where the
uninterrupted run ends (both scripts); a resume on another process count, another ZeRO stage or without DeepSpeed is
refused in one line; the whole weights out (model.safetensors under the plain model's names, predict.py and its ONNX
export on a ZeRO-3 run) and the one-command consolidation of a checkpoint that docs/checkpoints_and_resume.md gives.

Every run is a job of one DeepSpeed launch on 2 processes (tests/jobs.py: the libraries imported once,
one child forked per job, a job after the runs whose checkpoints it resumes); ZeRO-3's jobs set
ACCELERATE_DEEPSPEED_ZERO_STAGE, as `accelerate launch --zero_stage 3` exports it."""

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from helpers import REPO, TRAIN_MNIST, launcher_args, make_synthetic_mnist, results
from image_data import make_split_image_folder
from safetensors.torch import load_file
from jobs import finished_job, launch_jobs
from test_fsdp import EXPORT_PACKAGES, flip_a_byte, predict_here

from utils.errors import UserError
from utils.models import ConvNet
from utils.run.checkpoints import check_checkpoint, save_checkpoint
from utils.run.deepspeed_checkpoints import check_deepspeed_run
from utils.run.progress import TrainingProgress
from utils.run.resume import load_checkpoint, resolve_checkpoint

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
DOC = REPO / "docs" / "checkpoints_and_resume.md"
# 192 digits, 2 x 16 per optimizer step: 6 steps per epoch, 12 in all; checkpoints at steps 3, 6, 9 (mid-epoch 1), 12
N = 192
MNIST = ["--max_train_samples", N, "--epochs", "2", "--batch_size", "16", "--checkpointing_steps", "3",
         "--metric_for_best", "eval_loss"]
# 24 images (6 in each of 4 classes), 2 x 4 per step: 3 steps per epoch, 6 in all; a checkpoint at step 4 (in epoch 1)
CLASSIFIER_ARGS = ["--model", "tests.tiny_model:tiny_cnn", "--image_size", "16", "--num_workers", "0",
                   "--epochs", "2", "--batch_size", "4", "--checkpointing_steps", "4"]
ZERO_2_CPU = REPO / "accelerate_configs" / "deepspeed_zero2_cpu.yaml"
# what `accelerate launch --config_file accelerate_configs/deepspeed_zero3_cpu.yaml` exports beyond the ZeRO-2 config
ZERO_3 = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}


def launch_deepspeed_jobs(jobs: dict, root) -> dict:
    """One launch of accelerate_configs/deepspeed_zero2_cpu.yaml on 2 CPU processes of tests/jobs.py, each job
    {NAME: (ENV, [SCRIPT, *ARGS])} in turn: `SCRIPT --cpu ARGS` with ENV set, its files at ROOT/NAME.
    Returns {NAME: the job as a finished process, every rank's output in .stdout}; asserts that each exited 0."""
    launch_jobs({name: {"argv": [script, "--cpu", *args], "env": env} for name, (env, (script, *args)) in jobs.items()},
                [*launcher_args(config_file=ZERO_2_CPU), "--num_processes", "2"], root)
    return {name: finished_job(root / name, 2) for name in jobs}


def consolidation_command() -> str:
    """The one command docs/checkpoints_and_resume.md gives to turn a DeepSpeed checkpoint into model.safetensors."""
    commands = re.findall(r"^python (\S+/zero_to_fp32\.py .*)$", DOC.read_text(), re.MULTILINE)
    assert len(commands) == 1, commands
    return commands[0]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every run of this module, in one launch (`launch_deepspeed_jobs`), in this order:
    ZeRO-2 and ZeRO-3 MNIST runs and a ZeRO-3 image classifier, each with checkpoints; each resumed from a mid-epoch
    checkpoint of its run (MNIST's step_9, in epoch 1; the classifier's step_4, in epoch 1) into a folder of its own,
    saving epoch checkpoints; then the ZeRO-3 run's best/ evaluated by --eval_only under ZeRO-3. Meanwhile, in this
    process, nothing: the launch takes both cores."""
    root = tmp_path_factory.mktemp("deepspeed")
    data = make_synthetic_mnist(root / "data", num_train=N, num_test=101)
    images = make_split_image_folder(root / "images", train_per_class=6, val_per_class=2)
    mnist = [TRAIN_MNIST, "--data_dir", data, *MNIST]
    classifier = [CLASSIFIER, "--data_dir", images, *CLASSIFIER_ARGS]

    def resumed(args, run_name, checkpoint, name):
        return [*args, "--output_dir", root / name, "--checkpointing_steps", "epoch", "--resume_from_checkpoint",
                root / run_name / checkpoint]

    (root / "zero3_evaluated").mkdir()
    (root / "zero3_evaluated" / "best").symlink_to(root / "zero3" / "best")
    runs = launch_deepspeed_jobs({
        "zero2": ({}, [*mnist, "--output_dir", root / "zero2"]),
        "zero3": (ZERO_3, [*mnist, "--output_dir", root / "zero3"]),
        "classifier": (ZERO_3, [*classifier, "--output_dir", root / "classifier"]),
        "zero2_resumed": ({}, resumed(mnist, "zero2", "step_9", "zero2_resumed")),
        "zero3_resumed": (ZERO_3, resumed(mnist, "zero3", "step_9", "zero3_resumed")),
        "classifier_resumed": (ZERO_3, resumed(classifier, "classifier", "step_4", "classifier_resumed")),
        "zero3_evaluated": (ZERO_3, [*mnist, "--output_dir", root / "zero3_evaluated", "--eval_only",
                                     "--resume_from_checkpoint", "best"]),
    }, root)
    return root, runs


def assert_same_weights(folder, other) -> None:
    weights, others = load_file(folder / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == others.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, others[name]), name


@pytest.mark.parametrize("name", ["zero2", "zero3", "classifier"])
def test_a_mid_epoch_resume_on_the_same_processes_ends_as_the_uninterrupted_run(launched, name):
    """Bit for bit: the weights (BatchNorm's statistics included) and every metric of results.json that does not
    measure time."""
    root, runs = launched
    assert "Saved" in runs[name].stdout
    resumed = root / f"{name}_resumed"
    assert_same_weights(root / name, resumed)
    uninterrupted, after_resume = results(root / name), results(resumed)
    for key in ("eval_accuracy", "eval_loss", "train_loss", "global_step", "samples_seen"):
        assert after_resume[key] == uninterrupted[key], key
    assert uninterrupted["global_step"] == (6 if name == "classifier" else 12)


def test_eval_only_evaluates_best_under_zero_3_as_the_run_did(launched):
    """best/ holds whole weights; ZeRO-3's plain module holds empty placeholders for each process's partition, so
    they load through DeepSpeed's gathering (before: "cannot load checkpoint ... corrupt or from another model")."""
    root, _ = launched
    run = results(root / "zero3")
    evaluated = json.loads((root / "zero3_evaluated" / "eval_results.json").read_text())
    assert run["metric_for_best"] == "eval_loss" and evaluated["checkpoint_epochs_done"] == run["best_epoch"] + 1
    assert evaluated["eval_loss"] == run["best_eval_loss"]
    assert evaluated["eval_samples"] == 101 and 0 < evaluated["eval_accuracy"] <= 1


def zero_shards(zero_3: bool, processes: int) -> list:
    """DeepSpeed's files in pytorch_model/ (the launched test below checks them against a real save): ZeRO-2 the whole
    weights once (rank 0's), ZeRO-3 each process's partition of them; either, each process's optimizer shard."""
    weights = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(processes)] if zero_3 else [
        "mp_rank_00_model_states.pt"]
    return sorted(weights + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(processes)])


def write_deepspeed_checkpoint(output_dir, step: int, zero_3: bool, processes: int = 2):
    """A checkpoint folder as save_checkpoint writes one under DeepSpeed (its files' names, their bytes made up), with
    one process and no Accelerator, as tests/test_checkpoint_integrity.py does."""
    PartialState(cpu=True)  # accelerate's logger needs it
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)

    def write_into(folder):
        (folder / "pytorch_model").mkdir(parents=True)
        for name in zero_shards(zero_3, processes):
            (folder / "pytorch_model" / name).write_bytes(bytes([step]) * 4096)
        (folder / "latest").write_text("pytorch_model")
        for name in ["scheduler.bin", *(f"random_states_{r}.pkl" for r in range(processes))]:
            (folder / name).write_bytes(bytes([step]) * 64)

    return save_checkpoint(accelerator, output_dir, f"step_{step}", TrainingProgress(global_step=step), None,
                           write_into=write_into)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeeds_checkpoint_is_inside_ours_with_its_manifest(launched, name):
    root, _ = launched
    checkpoint = root / name / "step_9"
    shards = zero_shards(name == "zero3", 2)
    assert sorted(p.name for p in (checkpoint / "pytorch_model").iterdir()) == shards
    assert (checkpoint / "latest").read_text() == "pytorch_model"
    listed = set(json.loads((checkpoint / "manifest.json").read_text())["files"])
    assert {f"pytorch_model/{shard}" for shard in shards} | {"latest", "training_state.json", "random_states_1.pkl",
                                                             "scheduler.bin"} <= listed
    assert check_checkpoint(checkpoint) is None


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_a_damaged_or_missing_zero_shard_is_refused_by_name_and_skipped_by_latest(tmp_path, damage):
    for step in (6, 9):
        write_deepspeed_checkpoint(tmp_path, step, zero_3=True)
    shard = tmp_path / "step_9" / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "flipped":
        flip_a_byte(shard)
        problem = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt differs from its sha256 when saved"
    else:
        shard.unlink()
        problem = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"
    with pytest.raises(UserError) as refused:
        resolve_checkpoint(str(tmp_path / "step_9"), tmp_path)
    assert str(refused.value) == (f"checkpoint {tmp_path / 'step_9'} is damaged ({problem}); resume from the newest "
                                  f"good one, {tmp_path / 'step_6'}")
    assert resolve_checkpoint("latest", tmp_path) == tmp_path / "step_6"


def deepspeed_accelerator(num_processes: int, zero_stage, gather_on_save=True):
    """What load_checkpoint reads of an Accelerator under a DeepSpeed launch (or, zero_stage None, without), where its
    refusals come before any collective; gather_on_save None: the setting left out (DeepSpeed's default, off)."""
    return SimpleNamespace(unwrap_model=lambda model: model,
        distributed_type=DistributedType.DEEPSPEED if zero_stage else DistributedType.MULTI_CPU,
        num_processes=num_processes, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)),
        deepspeed_config={"zero_optimization": {"stage": zero_stage, **(
            {} if gather_on_save is None else {"stage3_gather_16bit_weights_on_model_save": gather_on_save})}})


@pytest.mark.parametrize("num_processes", [1, 3])
def test_a_resume_on_another_process_count_is_refused_naming_the_one_that_saved_it(tmp_path, num_processes):
    """DeepSpeed reads each process's optimizer shard as saved and cannot re-split them (ZeRO-2 and ZeRO-3 alike)."""
    for stage in (2, 3):
        checkpoint = write_deepspeed_checkpoint(tmp_path / f"zero{stage}", 9, zero_3=stage == 3)
        check_deepspeed_run(deepspeed_accelerator(2, stage), checkpoint)  # the processes that saved it: loads
        with pytest.raises(UserError) as refused:
            check_deepspeed_run(deepspeed_accelerator(num_processes, stage), checkpoint)
        assert str(refused.value) == (
            f"checkpoint {checkpoint} holds DeepSpeed's optimizer state split over 2 processes and this run has "
            f"{num_processes}; DeepSpeed cannot re-split it: resume on 2 processes (accelerate launch "
            f"--num_processes 2)")


def test_a_resume_under_another_zero_stage_or_without_deepspeed_is_refused_in_one_line(tmp_path):
    """Through load_checkpoint, as both scripts call it (before anything is written), in this process."""
    zero2, zero3 = (write_deepspeed_checkpoint(tmp_path / f"zero{stage}", 9, stage == 3) for stage in (2, 3))
    shutil.copytree(zero2, tmp_path / "ddp_like", ignore=shutil.ignore_patterns("pytorch_model"))  # no ZeRO shards
    other_launch = "resume it with the launch that saved it, or start afresh in another --output_dir"
    for accelerator, checkpoint, words in (
            (deepspeed_accelerator(2, 3), zero2, ("was saved under ZeRO-1 or ZeRO-2 and this run is ZeRO-3: resume it "
                                                  "under the ZeRO stage that saved it (accelerate launch --zero_stage 2)")),
            (deepspeed_accelerator(2, 2), zero3, ("was saved under ZeRO-3 and this run is ZeRO-2: "
             "resume it under the ZeRO stage that saved it (accelerate launch --zero_stage 3)")),
            (deepspeed_accelerator(2, None), zero2,
             f"was saved by a DeepSpeed run and this run is without DeepSpeed; {other_launch}"),
            (deepspeed_accelerator(2, 2), tmp_path / "ddp_like",
             f"was saved by a run without DeepSpeed and this run is under DeepSpeed; {other_launch}")):
        with pytest.raises(UserError) as refused:
            load_checkpoint(accelerator, ConvNet(), checkpoint, TrainingProgress(), str(checkpoint), tmp_path)
        assert str(refused.value) == f"checkpoint {checkpoint} {words}"


def test_zero_3_without_gathering_the_weights_at_the_end_is_refused_before_training():
    with pytest.raises(UserError, match=r"^ZeRO-3 without stage3_gather_16bit_weights_on_model_save cannot write "
                                        r"model.safetensors at the end: set zero3_save_16bit_model: true"):
        check_deepspeed_run(deepspeed_accelerator(2, 3, gather_on_save=False), None)
    with pytest.raises(UserError, match=r"^ZeRO-3 without stage3_gather_16bit_weights_on_model_save"):
        check_deepspeed_run(deepspeed_accelerator(2, 3, gather_on_save=None), None)  # left out: DeepSpeed's default
    check_deepspeed_run(deepspeed_accelerator(2, 2, gather_on_save=False), None)  # ZeRO-2 holds the whole weights


def test_the_whole_weights_load_into_the_plain_model_and_predict_and_export_from_a_zero_3_run(launched, tmp_path):
    root, _ = launched
    for name in ("zero2", "zero3"):
        ConvNet().load_state_dict(load_file(root / name / "model.safetensors"))  # strict: BatchNorm's statistics too
    predict_here("--model_dir", root / "zero3", "--data_dir", root / "data", "--max_samples", "16",
                 "--output_file", tmp_path / "predictions.csv")
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 1 + 16
    if all(importlib.util.find_spec(name) for name in EXPORT_PACKAGES):  # else test_fsdp's export test says so
        predict_here("--model_dir", root / "zero3", "--data_dir", root / "data", "--export", "onnx", "--export_file",
                     tmp_path / "zero3.onnx", "--batch_size", "16")
        assert (tmp_path / "zero3.onnx").is_file()


def test_the_documented_command_consolidates_a_checkpoint_into_the_runs_final_weights(launched, tmp_path):
    """docs/checkpoints_and_resume.md's command on the resumed ZeRO-3 run's epoch_1 (its last step): the file it
    writes holds exactly the weights the run saved at its end, under the same names."""
    root, _ = launched
    shutil.copytree(root / "zero3_resumed", tmp_path / "outputs")
    words = shlex.split(consolidation_command())
    assert words[0] == "outputs/step_4/zero_to_fp32.py", words  # the doc's example folder, here epoch_1's
    argv = [w.replace("outputs/step_4", "outputs/epoch_1") for w in words]
    subprocess.run([sys.executable, *argv], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    assert_same_weights(tmp_path / "outputs", tmp_path / argv[2])
