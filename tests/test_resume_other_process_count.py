"""A run saved on 2 processes resumes on 1, 3 or 4 (a preemption, a smaller Slurm allocation):
every sample of every epoch is trained once, the global batch and the schedule are kept, and
where the global batch cannot be kept one `error:` line names flags that keep it. On 2 processes
again, a mid-epoch resume with gradient accumulation is bit-exact. `latest` skips a damaged checkpoint
(issue 23: its launched check is on this file's resume on 3 processes).

The runs share launches, one per process count, each run a job of tests/jobs.py (forked from processes that
imported the libraries once): on 2 processes the uninterrupted runs and the resume that follows one (which also saves
the epoch_0 the epoch-boundary resumes start from); then the resumes on 3 processes, on 4, and on 1, where the runner
runs alone (`python tests/jobs.py`, as accelerate's one-process launcher runs a script)."""

import json
import shutil
import sys

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler, SkipBatchSampler
from helpers import REPO, TRAIN_MNIST, assert_clean_user_error, launcher_args, make_synthetic_mnist, results
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs

from utils.errors import UserError
from utils.run.checkpoints import check_checkpoint
from utils.run.progress import TrainingProgress
from utils.run.resume import batches_to_skip, resolve_checkpoint

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
# 720 digits; 2 processes x 24 per batch x 3 accumulation steps = 144 samples per optimizer step:
# 5 steps per epoch, and no padding on 1, 2, 3 or 4 processes (720 is a multiple of each global batch).
MNIST_RUN = ["--epochs", "2", "--batch_size", "24", "--gradient_accumulation_steps", "3"]


@pytest.mark.parametrize("num_processes, batch_size", [(1, 24), (3, 24), (4, 18), (2, 72)])
def test_each_sample_is_trained_once_per_epoch_across_the_restart(num_processes, batch_size):
    """Accelerate's own samplers: 2 processes train 2 optimizer steps of epoch 3, then the rest of the
    epoch runs on another number of processes, skipping batches_to_skip() batches each. (1,003 samples:
    the last batches are padded with samples from the start, as Accelerate's even_batches does.)"""
    size, seed, epoch, old_batch, old_processes, steps_done = 1003, 42, 3, 24, 2, 2
    sampler = SeedableRandomSampler(range(size), data_seed=seed)
    sampler.set_epoch(epoch)
    order = list(sampler)

    def shard(batch_size, num_processes, rank):
        sampler.set_epoch(epoch)
        batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last=False)
        return BatchSamplerShard(batches, num_processes=num_processes, process_index=rank, even_batches=True)

    global_batch = old_processes * old_batch * 3
    before = [i for rank in range(old_processes)
              for batch in list(shard(old_batch, old_processes, rank))[:steps_done * 3] for i in batch]
    progress = TrainingProgress(samples_in_epoch=steps_done * global_batch, global_batch_size=global_batch)
    skip = batches_to_skip(progress, num_processes, batch_size)
    after = [i for rank in range(num_processes)
             for batch in SkipBatchSampler(shard(batch_size, num_processes, rank), skip) for i in batch]
    assert sorted(before) == sorted(order[:steps_done * global_batch])  # the first samples of the shuffle
    trained = before + after
    assert set(trained) == set(range(size))  # every sample of the epoch
    padding = len(trained) - size
    assert 0 <= padding < num_processes * batch_size  # repeats only to fill the last round of batches
    # and those repeats are samples from the start of the epoch, not from the part trained before the restart twice
    repeats = [i for i in set(trained) if trained.count(i) > 1]
    assert len(repeats) == padding and set(repeats) <= set(order[:padding + batch_size * num_processes])


def _truncate_optimizer(checkpoint):
    with open(checkpoint / "optimizer.bin", "r+b") as f:
        f.truncate(1000)  # as a full disk or a copy cut short leaves it


# The resumes on other process counts: (checkpoint, processes, flags, accumulation they set to keep the global batch)
RESUMES = [
    # 288 samples into epoch 0
    ("step_2", 1, [], 6), ("step_2", 3, [], 2),
    ("step_2", 4, ["--batch_size", "18", "--gradient_accumulation_steps", "2"], 2),
    # the end of epoch 0 (on 1 process OneCycleLR's restored schedule used to overrun here)
    ("epoch_0", 1, [], 6), ("epoch_0", 3, [], 2),
]
# 240 training images, 2 processes x 8 x 2 = 32 per step: 7 steps per epoch on any process count
# (whole global batches only; the 16 images left over change with each epoch's shuffle).
CLASSIFIER_RUN = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
                  "--num_workers", "0", "--epochs", "2", "--batch_size", "8", "--gradient_accumulation_steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file, in one folder each, and its job's logs in `jobs`.

    On 2 processes: the uninterrupted MNIST run, with a checkpoint every 2 optimizer steps ("steps"); its resume from
    step_2 on 2 processes again ("resumed_on_2"), which saves at each epoch's end: its epoch_0 is saved on 2 processes,
    and is the uninterrupted run's state there (the resume is bit-exact: the test below); the classifier's run
    ("classifier", a checkpoint every 3 steps). Then each of RESUMES ("{checkpoint}_on_{processes}") from a copy of its
    checkpoint with `latest`: step_2's on 3 processes with the uninterrupted run's step_4 beside it, truncated (`latest`
    skips it, and the run saves it again: --checkpointing_steps 2); on 1 process also the refused global batch
    ("refused") and the classifier's step_3 ("classifier_on_1")."""
    data = make_synthetic_mnist(tmp_path_factory.mktemp("resume_data"), num_train=720, num_test=101)
    images = make_split_image_folder(tmp_path_factory.mktemp("resume_images"))
    root, jobs = tmp_path_factory.mktemp("resume_runs"), tmp_path_factory.mktemp("resume_jobs")
    mnist = [TRAIN_MNIST, "--cpu", "--data_dir", data, *MNIST_RUN]
    launch_jobs({
        "steps": [*mnist, "--output_dir", root / "steps", "--checkpointing_steps", "2"],
        "resumed_on_2": [*mnist, "--output_dir", root / "resumed_on_2", "--checkpointing_steps", "epoch",
                         "--resume_from_checkpoint", root / "steps" / "step_2"],
        "classifier": [CLASSIFIER, "--cpu", "--data_dir", images, *CLASSIFIER_RUN, "--output_dir",
                       root / "classifier", "--checkpointing_steps", "3"],
    }, launcher_args(2), jobs)
    by_processes = {}
    for checkpoint, num_processes, flags, _ in RESUMES:
        name = f"{checkpoint}_on_{num_processes}"
        source = root / ("steps" if checkpoint.startswith("step") else "resumed_on_2") / checkpoint
        shutil.copytree(source, root / name / checkpoint)
        more = []
        if name == "step_2_on_3":
            shutil.copytree(root / "steps" / "step_4", root / name / "step_4")
            _truncate_optimizer(root / name / "step_4")
            more = ["--checkpointing_steps", "2"]
        by_processes.setdefault(num_processes, {})[name] = [
            *mnist, *flags, "--output_dir", root / name, "--resume_from_checkpoint", "latest", *more]
    shutil.copytree(root / "steps" / "step_2", root / "refused" / "step_2")
    # 144 samples on 1 process: 40 does not divide them, 36 x 4 does
    by_processes[1]["refused"] = [*mnist, "--batch_size", "40", "--output_dir", root / "refused",
                                  "--resume_from_checkpoint", "latest"]
    shutil.copytree(root / "classifier" / "step_3", root / "classifier_on_1" / "step_3")
    by_processes[1]["classifier_on_1"] = [CLASSIFIER, "--cpu", "--data_dir", images, *CLASSIFIER_RUN, "--output_dir",
                                          root / "classifier_on_1", "--resume_from_checkpoint", "latest"]
    for num_processes in (3, 4):
        launch_jobs(by_processes[num_processes], launcher_args(num_processes), jobs)
    # on 1: the runner alone, with the one thread the launcher would give
    launch_jobs(by_processes[1], [sys.executable], jobs, env={"OMP_NUM_THREADS": "1"})
    return root, jobs


def test_mid_epoch_resume_with_gradient_accumulation_on_the_same_processes_is_bit_exact(runs):
    """step_2 is 6 of each process's 15 batches into epoch 0, accumulating over 3: resumed on 2 processes again, the
    run ends with the uninterrupted run's weights, bit for bit."""
    root, jobs = runs
    finished_job(jobs / "steps", 2)
    finished_job(jobs / "resumed_on_2", 2)
    resumed = root / "resumed_on_2"
    r, reference = results(resumed), results(root / "steps")
    assert r["num_processes"] == 2 and r["gradient_accumulation_steps"] == 3 and r["resumed_from"].endswith("step_2")
    assert r["global_step"] == reference["global_step"] == 10 and r["samples_seen"] == reference["samples_seen"] == 1440
    assert r["parameter_fingerprints"] == reference["parameter_fingerprints"]
    assert r["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-12)
    assert (r["eval_accuracy"], r["eval_loss"]) == (reference["eval_accuracy"], reference["eval_loss"])
    # last: where the weights differ, pytest's explanation of two unequal 120 kB byte strings takes many minutes
    assert (resumed / "model.safetensors").read_bytes() == (root / "steps" / "model.safetensors").read_bytes()


def test_latest_skips_a_truncated_checkpoint_and_a_named_one_is_refused(runs, tmp_path):
    root, jobs = runs
    out = root / "step_2_on_3"
    log = finished_job(jobs / "step_2_on_3", 3).stdout  # every process's output
    # one warning line, in the run's log format (time, level, message)
    skipped = [line.split(" WARNING ", 1)[1] for line in log.splitlines() if "skipping damaged checkpoint" in line]
    assert skipped == ["--resume_from_checkpoint latest: skipping damaged checkpoint step_4 (optimizer.bin has 1000 "
                       f"bytes, 241361 when saved); resuming from {out / 'step_2'}"], log
    assert f"Resumed from {out / 'step_2'}: epoch 0, step 2, 288 samples into the epoch" in log
    assert check_checkpoint(out / "step_4") is None  # saved again by the resumed run

    # Named, it is refused before anything loads. Asked in-process: the script's one line for a damaged checkpoint
    # named is launched by test_errors.py::test_resume_from_corrupt_checkpoint.
    for name in ("step_2", "step_4"):
        shutil.copytree(root / "steps" / name, tmp_path / name)
    _truncate_optimizer(tmp_path / "step_4")
    with pytest.raises(UserError) as refused:
        resolve_checkpoint(str(tmp_path / "step_4"), tmp_path)
    assert str(refused.value) == (f"checkpoint {tmp_path / 'step_4'} is damaged (optimizer.bin has 1000 bytes, 241361 "
                                  f"when saved); resume from the newest good one, {tmp_path / 'step_2'}")


@pytest.mark.parametrize("checkpoint, num_processes, flags, accumulation", RESUMES)
def test_train_mnist_resumes_on_another_number_of_processes(runs, checkpoint, num_processes, flags, accumulation):
    root, jobs = runs
    name = f"{checkpoint}_on_{num_processes}"
    proc, out = finished_job(jobs / name, num_processes), root / name
    source = root / ("steps" if checkpoint.startswith("step") else "resumed_on_2")
    r, reference = results(out), results(source)
    assert r["num_processes"] == num_processes and r["resumed_from"].endswith(checkpoint)
    assert r["gradient_accumulation_steps"] == accumulation
    assert r["global_batch_size"] == reference["global_batch_size"] == 144
    assert r["global_step"] == reference["global_step"] == 10  # the schedule's length: 2 epochs of 5 steps
    assert r["samples_seen"] == reference["samples_seen"] == 2 * 720  # each sample once per epoch
    # every sample evaluated once where neither the processes nor the batch divide 101 (the last round is padded,
    # the padding dropped), and every replica holds the same weights
    assert r["eval_samples"] == 101 and r["eval_accuracy"] > 0.9
    assert len(r["parameter_fingerprints"]) == num_processes and len(set(r["parameter_fingerprints"])) == 1
    adjusted = f"--gradient_accumulation_steps {accumulation} keeps the checkpoint's global batch" in proc.stdout
    assert adjusted == (not flags)  # said when the accumulation was changed, not when the flags already fit
    saved = json.loads((out / checkpoint / "training_state.json").read_text())
    assert saved["num_processes"] == 2 and saved["global_batch_size"] == 144


def test_a_global_batch_that_cannot_be_kept_names_the_flags_that_keep_it(runs):
    root, jobs = runs
    # refused before training: the script alone (a resume's refusal is launched by test_errors.py)
    proc = finished_job(jobs / "refused", 1, fails=True)
    # 144 samples on 1 process: 40 does not divide them, 36 x 4 does
    assert_clean_user_error(proc, "global batch is 144", "--batch_size 36 --gradient_accumulation_steps 4")
    assert not (root / "refused" / "results.json").exists()


def test_train_image_classifier_resumes_mid_epoch_on_one_process(runs):
    """240 training images, 2 processes x 8 x 2 = 32 per step: 7 steps per epoch on any process count
    (whole global batches only; the 16 images left over change with each epoch's shuffle)."""
    root, jobs = runs
    finished_job(jobs / "classifier", 2)
    finished_job(jobs / "classifier_on_1", 1)
    r, reference = results(root / "classifier_on_1"), results(root / "classifier")
    assert r["num_processes"] == 1 and r["gradient_accumulation_steps"] == 4
    assert r["global_step"] == r["lr_scheduler_steps"] == reference["global_step"] == 2 * 7
    assert r["samples_seen"] == reference["samples_seen"] == 2 * 7 * 32
