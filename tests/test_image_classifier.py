"""train_image_classifier.py launched for real through `accelerate launch`, on CPU processes,
on generated image folders (four classes of coloured shapes, 40x40 px; chance is 0.25).

Processes (the suite's time is the number of processes it starts): a run stopped by a signal is a launch of its own
(torchrun's signal to each process group is what it tests); the other runs are jobs of one launch per process count
(tests/jobs.py's launch_jobs, each launched process importing torch and
Accelerate once): on 2 processes the stopped run's resume and the accumulation pair under the DDP probe, then on 1
process the train/val run, the 1-process evaluation and the --sync_bn refusal. The 3-process evaluation and the
unused-parameter refusal (it leaves DDP's threads to its exit) are launches of their own."""

import json
import math
import shutil
import signal
import urllib.error

import pytest
import torch
from datasets import Image
from helpers import (
    REPO,
    STOPPED_BY_SIGNAL,
    assert_clean_user_error,
    launch,
    launch_in_background,
    launcher_args,
    results,
    run,
    tensorboard_scalars,
    wait_for_path,
)
from image_data import (
    CLASSES,
    ResNetWithUnusedHead,
    make_flat_image_folder,
    make_parquet_dataset,
    make_split_image_folder,
)
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.data.image_dataset import TransformedImages
from utils.data.image_loading import load_image_datasets
from utils.data.recipes import eval_transform, train_transform
from utils.errors import UserError
from utils.metrics import load_metric
from utils.models import build_model
from utils.run.ddp_diagnosis import is_unused_parameter_error, parameters_without_gradient

SCRIPT = REPO / "scripts" / "train_image_classifier.py"
PROBE = REPO / "tests" / "image_data.py"
CLASS_NAMES = sorted(CLASSES)
# Small and fast: resnet18 on 32 px crops, AdamW without warmup, images decoded in the main process; the
# ImageNet stem, which at 32 px does 1/16 of the small stem's compute (tests/test_image_recipes.py tests that one).
FAST = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
        "--warmup_epochs", "0", "--num_workers", "0", "--batch_size", "16"]


# `python with_env.py NAME=VALUE... SCRIPT ARGS`: SCRIPT ARGS with those environment variables set. The jobs of one
# launch share its environment; under the DDP probe, each job's report goes where its own $DDP_PROBE_OUT says.
WITH_ENV = """\
import os, runpy, sys
while "=" in sys.argv[1]:
    name, _, value = sys.argv.pop(1).partition("=")
    os.environ[name] = value
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def probed_job(folder, name, args, count_allreduce=False) -> list:
    """A job that runs the script under tests/image_data.py's DDP probe (its report: FOLDER/NAME.probe.RANK)."""
    with_env = folder / "with_env.py"
    with_env.write_text(WITH_ENV)
    return [with_env, f"DDP_PROBE_OUT={folder / name}.probe", f"DDP_PROBE_COUNT_ALLREDUCE={int(count_allreduce)}",
            PROBE, SCRIPT, "--cpu", *FAST, *args]


def probe_reports(folder, name, num_processes=2) -> list:
    """The DDP probe's report per rank of job NAME, which must have run to its end."""
    finished_job(folder / name, num_processes)
    return [json.loads((folder / f"{name}.probe.{rank}").read_text()) for rank in range(num_processes)]


@pytest.fixture(scope="module")
def split_folder(tmp_path_factory):
    """train/ 60 and val/ 20 images per class: 240 / 80."""
    return make_split_image_folder(tmp_path_factory.mktemp("split_folder"))


@pytest.fixture(scope="module")
def flat_folder(tmp_path_factory):
    """75 images per class in one folder per class: 300, split 240 / 60 by --val_split 0.2."""
    return make_flat_image_folder(tmp_path_factory.mktemp("flat_folder"))


# ---------------------------------------------------------------- learning, both layouts


# The model with an unused head (tests/image_data.py), for --find_unused_parameters: the flat run's, and so its
# checkpoint's in the evaluations of test_one_checkpoint_...
UNUSED_HEAD = ["--model", "tests.image_data:resnet_with_unused_head"]


@pytest.fixture(scope="module")
def two_process_runs(flat_folder, tmp_path_factory):
    """The 2-process runs: one of 3 epochs (7 steps each) on the flat folder in two launches, as a preempted job runs:
    a SIGTERM after epoch 0's checkpoint stops it (--save_on_signal), with its DataLoader worker alive (persistent);
    then it resumes from the checkpoint the signal saved, under the DDP probe (job "flat"), in one launch with the
    accumulation pair (launch_jobs; accumulation_jobs: "accumulated", "accumulated_resumed"). A resume trains what the
    uninterrupted run would have, bit for bit (test_gradient_accumulation_...): the finished flat run stands for a plain
    one in the tests that read it. It also carries --find_unused_parameters on a model with an unused head and the bf16
    --ddp_comm_hook (neither is part of what a resume must keep). Returns (the jobs' folder, the stopped launch's output
    and exit status)."""
    root = tmp_path_factory.mktemp("two_processes")
    out = root / "flat_out"
    args = ["--num_workers", "1", "--data_dir", flat_folder, "--output_dir", out, "--epochs", "3",
            "--checkpointing_steps", "epoch", *UNUSED_HEAD, "--find_unused_parameters", "--ddp_comm_hook", "bf16"]
    stopped = launch_in_background([*FAST, *args, "--save_on_signal"], num_processes=2, script=SCRIPT)
    # start-up, a whole epoch and its evaluation: more than the default 120 s (for a step) on a loaded machine
    wait_for_path(out / "epoch_0", stopped, timeout=300)
    stopped.send_signal(signal.SIGTERM)
    output, _ = stopped.communicate(timeout=120)
    launch_jobs({
        "flat": probed_job(root, "flat", [*args, "--resume_from_checkpoint", "latest"]),
        **accumulation_jobs(root),
    }, launcher_args(2), root)
    return root, output, stopped.returncode


@pytest.fixture(scope="module")
def stopped_and_resumed_flat_2proc(two_process_runs):
    """(the output folder, the stopped launch's output and exit status, the probe's report per rank of the resumed
    run)."""
    root, output, returncode = two_process_runs
    return root / "flat_out", output, returncode, probe_reports(root, "flat")


@pytest.fixture(scope="module")
def trained_flat_2proc(stopped_and_resumed_flat_2proc):
    return stopped_and_resumed_flat_2proc[0]


@pytest.fixture(scope="module")
def one_process_runs(split_folder, flat_folder, trained_flat_2proc, tmp_path_factory):
    """The 1-process launch (after the 2-process one, whose checkpoint it evaluates): 2 epochs on the train/val folders
    with two DataLoader workers (images decoded and augmented there) and --with_tracking ("split", into split_out/);
    --eval_only of the flat run's last checkpoint ("eval"; test_one_checkpoint_...); the --sync_bn refusal ("sync_bn").
    Returns its folder."""
    root = tmp_path_factory.mktemp("one_process")
    launch_jobs({
        "split": [SCRIPT, "--cpu", *FAST, "--data_dir", split_folder, "--output_dir", root / "split_out", "--epochs",
                  "2", "--num_workers", "2", "--with_tracking"],
        "eval": [SCRIPT, "--cpu", *FAST, *UNUSED_HEAD, "--data_dir", flat_folder, "--output_dir", root / "eval_out",
                 "--eval_only", "--resume_from_checkpoint", trained_flat_2proc / "epoch_2"],
        "sync_bn": [SCRIPT, "--cpu", *FAST, "--data_dir", split_folder, "--output_dir", root / "sync_bn_out",
                    "--sync_bn"],
    }, launcher_args(1), root)
    return root


@pytest.fixture(scope="module")
def trained_split_1proc(one_process_runs):
    finished_job(one_process_runs / "split", 1)
    return one_process_runs / "split_out"


def test_train_val_layout_one_process_learns_and_reports_everything(trained_split_1proc):
    r = results(trained_split_1proc)
    assert r["eval_accuracy"] >= 0.9  # chance is 0.25
    assert r["eval_top5_accuracy"] == 1.0  # top-5 of 4 classes
    assert r["eval_samples"] == 80 and r["train_size"] == 240
    assert r["class_names"] == CLASS_NAMES  # class id = position in the sorted folder names
    assert r["num_processes"] == 1 and r["mixed_precision"] == "no"
    # 240 images in batches of 16: 15 optimizer steps per epoch
    assert r["global_step"] == r["lr_scheduler_steps"] == 2 * 15
    assert r["samples_seen"] == 2 * 240
    assert math.isfinite(r["train_loss"]) and 0 < r["eval_loss"] < 0.5
    assert r["train_samples_per_second"] > 0 and r["peak_memory_mb"] > 100
    weights = load_file(trained_split_1proc / "model.safetensors")
    assert weights["fc.weight"].shape == (4, 512)


def test_with_tracking_writes_tensorboard_scalars(trained_split_1proc):
    tracked = trained_split_1proc / "train_image_classifier"
    accuracy = tensorboard_scalars(tracked, "eval_accuracy")
    assert [step for step, _ in accuracy] == [15, 30]
    assert accuracy[-1][1] == pytest.approx(results(trained_split_1proc)["eval_accuracy"])
    assert tensorboard_scalars(tracked, "current_learning_rate")[-1][1] == pytest.approx(0.0, abs=1e-9)  # cosine: 0


def test_single_folder_layout_two_processes_learn_with_identical_replicas(trained_flat_2proc):
    r = results(trained_flat_2proc)
    assert r["num_processes"] == 2
    assert r["eval_accuracy"] >= 0.9
    assert r["eval_samples"] == 60 and r["train_size"] == 240  # --val_split 0.2 of 300
    assert r["class_names"] == CLASS_NAMES
    # 240 images over 2 processes x 16: 7 full batches each (drop_last), 3 epochs
    assert r["global_step"] == r["lr_scheduler_steps"] == 3 * 7
    assert r["samples_seen"] == 3 * 7 * 2 * 16
    assert len(r["parameter_fingerprints"]) == 2 and len(set(r["parameter_fingerprints"])) == 1
    assert len(set(r["buffer_fingerprints"])) == 1
    assert sorted(p.name for p in trained_flat_2proc.iterdir() if p.name.startswith("epoch_")) == [
        "epoch_0", "epoch_1", "epoch_2"
    ]


def test_val_split_is_stratified_and_the_same_every_time(flat_folder):
    first = load_image_datasets(data_dir=flat_folder, val_split=0.2)
    again = load_image_datasets(data_dir=flat_folder, val_split=0.2)
    train_a, eval_a, image_column, label_column, names = first
    assert (image_column, label_column, names) == ("image", "label", CLASS_NAMES)
    assert len(train_a) == 240 and len(eval_a) == 60
    assert sorted(eval_a[label_column]) == sorted(sum(([c] * 15 for c in range(4)), []))  # 15 per class

    def paths(dataset):
        return [image["path"] for image in dataset.cast_column(image_column, Image(decode=False))[image_column]]

    assert paths(eval_a) == paths(again[1]) and paths(train_a) == paths(again[0])
    assert not set(paths(eval_a)) & set(paths(train_a))


# ---------------------------------------------------------------- exact evaluation


def test_one_checkpoint_evaluates_identically_on_1_2_3_processes(flat_folder, trained_flat_2proc, one_process_runs,
                                                                  tmp_path):
    checkpoint = trained_flat_2proc / "epoch_2"
    trained = results(trained_flat_2proc)  # the 2-process evaluation of the same weights
    evaluations = {2: trained}
    for n in (1, 3):
        if n == 1:  # a job of the 1-process launch
            finished_job(one_process_runs / "eval", 1)
            out = one_process_runs / "eval_out"
        else:
            out = tmp_path / f"eval_{n}"
            launch([*FAST, *UNUSED_HEAD, "--data_dir", flat_folder, "--output_dir", out, "--eval_only",
                    "--resume_from_checkpoint", checkpoint], num_processes=n, script=SCRIPT)
        r = json.loads((out / "eval_results.json").read_text())  # --eval_only's own file
        assert r["num_processes"] == n
        assert r["eval_samples"] == 60  # 60 over 3 x 16 leaves a padded last batch: dropped again
        evaluations[n] = r
    # The same samples, counted once each: identical accuracies whatever the number of processes.
    assert {(r["eval_accuracy"], r["eval_top5_accuracy"]) for r in evaluations.values()} == {
        (trained["eval_accuracy"], trained["eval_top5_accuracy"])
    }
    # The loss agrees to float32 rounding only: the last batch is padded to 16 images on some
    # processes and holds 12 on others, and the CPU matrix multiply of the final Linear layer
    # rounds differently for different batch sizes (every convolution here is batch-size invariant).
    for r in evaluations.values():
        assert r["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)


# ---------------------------------------------------------------- accumulation, resume, checkpointing, Hub-style data


def accumulation_jobs(root) -> dict:
    """Jobs of the 2-process launch: a dataset loaded by `datasets.load_dataset` (here a local parquet folder, as the
    Hub serves them) with CIFAR-100-like columns "img" / "fine_label" and a test split, 128 images to train, on 2
    processes with --gradient_accumulation_steps 2, the fp16 --ddp_comm_hook, --channels_last and the step schedule,
    gradient all-reduces counted by the probe ("accumulated", into accumulated/full); then the same run resumed from
    its step 3 with --gradient_checkpointing ("accumulated_resumed", into accumulated/resumed). (One pair of runs for
    accumulation, resume, checkpointing, the schedule, the Hub-style columns and the fp16 hook.)"""
    data = make_parquet_dataset(root / "accumulated" / "parquet", train_per_class=32)
    # 128 images / (2 processes x 8) = 8 batches per process and epoch = 4 optimizer steps; 1 warmup epoch
    common = ["--dataset", data, "--max_eval_samples", "33", "--batch_size", "8", "--epochs", "2",
              "--gradient_accumulation_steps", "2", "--ddp_comm_hook", "fp16", "--channels_last",
              "--learning_rate", "0.002", "--lr_scheduler_type", "step", "--warmup_epochs", "1"]
    out, resumed = root / "accumulated" / "full", root / "accumulated" / "resumed"
    return {
        # two persistent DataLoader workers per process: they must see set_epoch(1) for the second epoch
        "accumulated": probed_job(root, "accumulated", [*common, "--output_dir", out, "--checkpointing_steps", "3",
                                                        "--num_workers", "2"], count_allreduce=True),
        # Resume mid-epoch 0 (step 3 = 6 of 8 batches), loading in the main process this time: the augmentations are
        # seeded per (seed, epoch, sample), so the result is bit-identical anyway; with --gradient_checkpointing, which
        # changes no gradient nor BatchNorm statistic (test_gradient_checkpointing.py), so bit-identical still.
        "accumulated_resumed": probed_job(root, "accumulated_resumed", [
            *common, "--output_dir", resumed, "--resume_from_checkpoint", out / "step_3", "--gradient_checkpointing"],
            count_allreduce=True),
    }


@pytest.fixture(scope="module")
def accumulated_and_resumed(two_process_runs):
    """(the full run's folder, its reports, the resumed run's folder, its reports): accumulation_jobs'."""
    root = two_process_runs[0]
    return (root / "accumulated" / "full", probe_reports(root, "accumulated"),
            root / "accumulated" / "resumed", probe_reports(root, "accumulated_resumed"))


def test_gradient_accumulation_steps_once_per_2_batches_without_allreduce_in_between(accumulated_and_resumed):
    out, reports, resumed, resumed_reports = accumulated_and_resumed
    r = results(out)
    assert r["global_step"] == r["lr_scheduler_steps"] == 2 * 4
    assert r["samples_seen"] == 2 * 128
    # 16 backward passes per process, gradients all-reduced on 8 of them only
    assert [rep["synced_backward_passes"] for rep in reports] == [8, 8]
    # the optimizer's own step counter (AdamW keeps one) and the scheduler's, at step 6 = 12 batches
    optimizer_state = torch.load(out / "step_6" / "optimizer.bin", weights_only=True)
    assert {int(s["step"]) for s in optimizer_state["state"].values()} == {6}
    assert torch.load(out / "step_6" / "scheduler.bin", weights_only=True)["last_epoch"] == 6
    assert len(set(r["parameter_fingerprints"])) == 1

    rr = results(resumed)
    assert rr["resumed_from"].endswith("step_3")
    assert [rep["synced_backward_passes"] for rep in resumed_reports] == [5, 5]  # steps 4 to 8
    assert (resumed / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert rr["global_step"] == rr["lr_scheduler_steps"] == 8 and rr["samples_seen"] == 2 * 128
    assert rr["parameter_fingerprints"] == r["parameter_fingerprints"]
    assert rr["train_loss"] == pytest.approx(r["train_loss"], rel=1e-12)
    assert (rr["eval_accuracy"], rr["eval_loss"]) == (r["eval_accuracy"], r["eval_loss"])


def test_ddp_training_with_gradient_checkpointing_ends_with_the_weights_of_training_without_it(
        accumulated_and_resumed):
    """(test_gradient_checkpointing.py's DDP claim, on this module's resumed run: steps 4 to 8 with it.)"""
    out, _, resumed, _ = accumulated_and_resumed
    plain, checkpointed = results(out), results(resumed)
    assert checkpointed["num_processes"] == 2 and checkpointed["gradient_checkpointing"] is True
    assert plain["gradient_checkpointing"] is False
    assert plain["global_step"] == checkpointed["global_step"] == 2 * 128 // 32
    assert checkpointed["parameter_fingerprints"] == plain["parameter_fingerprints"]  # both ranks, bit for bit
    assert checkpointed["buffer_fingerprints"] == plain["buffer_fingerprints"]  # BatchNorm statistics too
    assert checkpointed["eval_loss"] == plain["eval_loss"]


def test_train_image_classifier_step_schedule_ends_at_a_hundredth(accumulated_and_resumed):
    """(test_lr_schedules.py's claim, on this module's accumulation pair.) 128 images, 2 processes x 8 x 2 accumulated:
    4 steps per epoch, 8 in 2 epochs; 1 warmup epoch, then a tenth after each third of the other 4 steps: the last
    step's rate is a hundredth of the peak."""
    out, _, resumed, _ = accumulated_and_resumed
    for folder in (out, resumed):
        r = results(folder)
        assert r["num_processes"] == 2 and r["global_step"] == r["lr_scheduler_steps"] == 8, folder
        # after 8 steps: 4 of warmup, then 4 more (3 * 4 // 4 = 3 thirds passed; the decay stops at a hundredth)
        assert r["current_learning_rate"] == pytest.approx(0.002 / 100), folder
        assert json.loads((folder / "run.json").read_text())["lr_scheduler_type"] == "step", folder


def test_hub_style_dataset_with_other_column_names_is_detected(accumulated_and_resumed):
    out = accumulated_and_resumed[0]
    r = results(out)
    assert r["eval_samples"] == 33 and r["train_size"] == 128
    assert r["class_names"] == list(CLASSES)  # the ClassLabel's own order, not re-sorted
    assert r["global_step"] == 2 * 128 // (2 * 8 * 2)


# ---------------------------------------------------------------- DDP switches (2 CPU processes)


# No launch of their own (a launch of 2 processes costs ~20 s of start-up): fp16 with --channels_last is the
# accumulation run's (its hook counted by the probe as it runs), bf16 the flat run's. Per run: its steps, evaluated
# samples, first conv.
@pytest.mark.parametrize("precision, channels_last", [("fp16", True), ("bf16", False)])
def test_ddp_comm_hook_compresses_gradients_on_gloo_and_channels_last_reaches_the_convolutions(
        precision, channels_last, request):
    if precision == "bf16":
        out, _, _, reports = request.getfixturevalue("stopped_and_resumed_flat_2proc")
        steps, eval_samples, first_conv = 3 * 7, 60, "backbone.conv1.weight"
    else:
        out, reports, _, _ = request.getfixturevalue("accumulated_and_resumed")
        steps, eval_samples, first_conv = 2 * 128 // 32, 33, "conv1.weight"
    assert [rep["comm_hook"] for rep in reports] == [f"{precision}_compress_hook"] * 2  # as DDP itself reports it
    for rep in reports:  # the weights, and the train and eval batches
        assert rep["weights_channels_last"] == channels_last and rep["inputs_channels_last"] == [channels_last]
    r = results(out)
    assert r["global_step"] == steps and math.isfinite(r["train_loss"]) and r["eval_samples"] == eval_samples
    assert len(set(r["parameter_fingerprints"])) == 1  # the compressed all-reduce still leaves identical replicas
    # saved weights are plain contiguous tensors, loadable without channels_last
    assert load_file(out / "model.safetensors")[first_conv].is_contiguous()


def test_find_unused_parameters_trains_a_model_with_an_unused_head(stopped_and_resumed_flat_2proc):
    out, _, _, reports = stopped_and_resumed_flat_2proc
    assert [rep["find_unused_parameters"] for rep in reports] == [True, True]
    r = results(out)
    assert r["global_step"] == 3 * 7 and len(set(r["parameter_fingerprints"])) == 1
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["unused_head.weight"], torch.full((4, 512), 0.5))  # never updated
    assert not torch.equal(weights["backbone.fc.bias"], torch.zeros(4))


def test_unused_parameter_without_the_flag_names_the_parameters(split_folder, tmp_path):
    """A launch of its own: the refusal comes from a step of DDP, whose threads it leaves to the exit (a job of the
    2-process launch would fail that launch's exit check, which a launch that fails skips)."""
    proc = launch([*FAST, "--data_dir", split_folder, "--output_dir", tmp_path, "--epochs", "1", "--max_train_samples",
                   "64", *UNUSED_HEAD], num_processes=2, script=SCRIPT, check=False)
    assert_clean_user_error(proc, "unused_head.weight, unused_head.bias", "--find_unused_parameters")
    assert "backbone" not in [line for line in proc.stderr.splitlines() if line.startswith("error: ")][0]


def test_sigterm_with_dataloader_workers_saves_the_step_and_resume_continues_the_counts(stopped_and_resumed_flat_2proc):
    """torchrun signals each worker's whole process group: the DataLoader workers must not die of it."""
    out, output, returncode, _ = stopped_and_resumed_flat_2proc
    stopped = STOPPED_BY_SIGNAL.search(output)
    assert returncode != 0 and stopped, output[-3000:]
    assert "DataLoader worker" not in output, output[-3000:]
    step = int(stopped[1])
    # signalled once epoch_0 (step 7) was saved; 21 steps in all
    assert 7 < step < 21 and (out / f"step_{step}" / "training_state.json").is_file()
    r = results(out)  # the resumed launch's
    assert r["resumed_from"] == str(out / f"step_{step}")
    assert r["global_step"] == 21 and r["samples_seen"] == 3 * 7 * 2 * 16
    assert len(set(r["parameter_fingerprints"])) == 1


def test_sync_bn_on_cpu_stops_before_training_with_one_line(one_process_runs):
    # one process: the refusal comes before any collective (--sync_bn on 2 GPUs: the GPU tests)
    proc = finished_job(one_process_runs / "sync_bn", 1, fails=True)
    assert_clean_user_error(proc, "--sync_bn", "GPU")
    assert not (one_process_runs / "sync_bn_out").exists()


# ---------------------------------------------------------------- units (no launch)


def test_data_errors_are_one_line_user_errors(tmp_path, flat_folder):
    with pytest.raises(UserError, match="no such directory"):
        load_image_datasets(data_dir=tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    for i in range(3):
        shutil.copy(next((flat_folder / CLASS_NAMES[0]).iterdir()), tmp_path / "flat" / f"{i}.jpg")
    with pytest.raises(UserError, match="fewer than 2 class folders"):
        load_image_datasets(data_dir=tmp_path / "flat")
    data = make_parquet_dataset(tmp_path / "parquet", train_per_class=2, test_per_class=1)
    with pytest.raises(UserError, match="no column 'picture'.*--image_column"):
        load_image_datasets(dataset=str(data), image_column="picture")


def test_plain_string_labels_become_sorted_class_ids(tmp_path):
    data = make_parquet_dataset(tmp_path / "parquet", train_per_class=3, test_per_class=2, string_labels=True)
    with pytest.raises(UserError, match="cannot tell which column holds the labels.*--label_column"):
        load_image_datasets(dataset=str(data))  # no ClassLabel column to find
    train_split, eval_split, image_column, label_column, names = load_image_datasets(
        dataset=str(data), label_column="fine_label"
    )
    assert (image_column, label_column, names) == ("img", "fine_label", CLASS_NAMES)
    assert [names[i] for i in eval_split[label_column]] == eval_split["note"]  # the same ids in both splits
    assert [names[i] for i in train_split[label_column]] == train_split["note"]


def test_augmentation_depends_only_on_seed_epoch_and_index(split_folder):
    train_split, _, image_column, label_column, _ = load_image_datasets(data_dir=split_folder)
    dataset = TransformedImages(train_split, train_transform(32), image_column, label_column, seed=7)
    first, label = dataset[5]
    assert first.shape == (3, 32, 32) and first.dtype == torch.uint8 and label == train_split[5]["label"]
    torch.rand(10)  # global RNG consumption must not matter
    assert torch.equal(dataset[5][0], first)
    dataset.set_epoch(1)
    assert not torch.equal(dataset[5][0], first)
    evaluation = TransformedImages(train_split, eval_transform(32), image_column, label_column)
    assert torch.equal(evaluation[5][0], evaluation[5][0])


def test_topk_accuracy_metric():
    metric = load_metric("topk_accuracy")
    metric.add_batch(predictions=[[0, 1, 2], [2, 1, 0], [1, 2, 0]], references=[0, 0, 3])
    scores = metric.compute()
    assert scores["accuracy"] == pytest.approx(1 / 3)
    assert scores["top_k_accuracy"] == pytest.approx(2 / 3) and scores["k"] == 3


@pytest.mark.filterwarnings("ignore:The default weight initialization of GoogleNet")
def test_build_model_by_name_and_pretrained_head_swap(monkeypatch):
    assert build_model("resnet18", num_classes=7).fc.out_features == 7
    with pytest.raises(UserError, match="not a torchvision classification model"):
        build_model("resnet19", num_classes=7)
    googlenet = build_model("googlenet", num_classes=7).train()  # auxiliary heads dropped: one output, all used
    assert googlenet(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    assert parameters_without_gradient(googlenet, torch.randn(2, 3, 64, 64)) == []

    import torchvision.models._api as api

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    with pytest.raises(UserError, match="could not fetch the torchvision weights of resnet18"):
        build_model("resnet18", num_classes=7, pretrained=True)

    imagenet_weights = build_model("resnet18", num_classes=1000).state_dict()
    monkeypatch.setattr(api, "load_state_dict_from_url", lambda *args, **kwargs: imagenet_weights)
    model = build_model("resnet18", num_classes=7, pretrained=True)
    assert model.fc.out_features == 7
    assert torch.equal(model.conv1.weight, imagenet_weights["conv1.weight"])


def test_unused_parameter_diagnosis_names_exactly_the_unused_ones():
    model = ResNetWithUnusedHead(num_classes=4)
    assert parameters_without_gradient(model, torch.randn(2, 3, 32, 32)) == ["unused_head.weight", "unused_head.bias"]
    assert all(p.grad is None for p in model.parameters())  # the original model is untouched
    assert parameters_without_gradient(build_model("resnet18", 4), torch.randn(2, 3, 32, 32)) == []
    assert is_unused_parameter_error(RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
        "that your module has parameters that were not used in producing loss."))
    assert not is_unused_parameter_error(RuntimeError("CUDA out of memory"))


# ---------------------------------------------------------------- GPU only (skipped in CI)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="SyncBatchNorm across ranks needs 2+ GPUs; CPU DDP refuses SyncBatchNorm and CI has no GPU")
def test_sync_bn_statistics_come_from_the_global_batch(split_folder, tmp_path):
    """Step k's global batch holds the same 16 images for 1 process x 16 and for 2 processes x 8
    (seedable sampler, per-sample augmentation seeds). With --sync_bn, 2 x 8 computes BatchNorm
    statistics over all 16, as 1 x 16 does; without it, each process uses only its own 8."""
    common = [*FAST, "--data_dir", split_folder, "--epochs", "1", "--max_train_samples", "64"]

    def first_running_mean(name, num_processes, batch_size, *flags):
        out, probe_out = tmp_path / name, tmp_path / f"probe_{name}"
        script = [PROBE, SCRIPT] if num_processes > 1 else [SCRIPT]
        run([*launcher_args(num_processes), *script, *common, "--batch_size", batch_size, "--output_dir", out, *flags],
            env={"DDP_PROBE_OUT": str(probe_out), "DDP_PROBE_COUNT_ALLREDUCE": "0"})
        if num_processes > 1:
            reports = [json.loads(probe_out.with_name(f"{probe_out.name}.{rank}").read_text()) for rank in range(2)]
            assert [rep["has_sync_bn"] for rep in reports] == [bool(flags)] * 2  # as DDP itself reports it
        assert results(out)["num_processes"] == num_processes
        return load_file(out / "model.safetensors")["bn1.running_mean"].double()

    single = first_running_mean("single", 1, 16)
    synced = first_running_mean("sync", 2, 8, "--sync_bn")
    local = first_running_mean("local", 2, 8)
    assert (synced - single).abs().max() * 10 < (local - single).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="fp16/bf16 ResNet-50 throughput needs a CUDA GPU; CI has none")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resnet50_mixed_precision_on_gpu(precision, tmp_path):
    data = make_split_image_folder(tmp_path / "data", train_per_class=256, val_per_class=16)
    out = tmp_path / "out"
    run([*launcher_args(1), SCRIPT, "--data_dir", data, "--output_dir", out, "--model", "resnet50",
         "--image_size", "224", "--batch_size", "64", "--epochs", "2", "--mixed_precision", precision,
         "--channels_last", "--num_workers", "4"])
    r = results(out)
    assert r["mixed_precision"] == precision and math.isfinite(r["train_loss"])
    print(f"resnet50 {precision}: {r['train_samples_per_second']:.0f} img/s")
