"""Which samples each process trains, by sample id (tests/sample_recording.py logs every fetch of the
training dataset per process): both scripts train each sample exactly once per epoch on 2 and 3 processes, also across a
mid-epoch resume (here onto another process count), and the last batches are padded exactly as Accelerate's
even_batches documents (train_mnist.py) or dropped (train_image_classifier.py). The same runs pin what per-step
bookkeeping would get wrong silently: the scheduler and clipping once per optimizer step, the accumulation cycle
restarted by a resume, set_epoch reaching the dataset's augmentations.

Every run here is one job of the two launches in `launches` (tests/jobs.py): the 2-process runs in one launch, the
3-process runs (the resumes among them) in the next, each process importing torch and Accelerate once.

"Global order": the batches of all processes interleaved round-robin (batch k of rank r is global batch
k * num_processes + r, as BatchSamplerShard deals them), i.e. the epoch's shuffle as the batch sampler read it.
"""

import json
from collections import Counter

import pytest
import torch
from helpers import REPO, launcher_args, results
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs

TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
N = 96  # training samples: divides every global batch below, so there is no padding in these runs
# 2 processes x 6 per batch x 2 accumulation steps = 24 per optimizer step: 4 steps per epoch, 8 batches each
COMMON = ["--epochs", "2", "--batch_size", "6", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "1"]
# every step's norm is far above 1e-6
MNIST = ["--max_train_samples", N, *COMMON, "--max_eval_samples", "30", "--max_grad_norm", "1e-6"]
# The classifier's runs: 4 more images, which no whole global batch takes (24 per optimizer step, and 12 or 24 per
# round of batches on 2 or 3 processes): drop_last leaves them out of each epoch; the same counts otherwise.
CLASSIFIER_N = N + 4
CLASSIFIER_ARGS = ["--max_train_samples", CLASSIFIER_N, *COMMON, "--model", "tests.tiny_model:tiny_cnn",
                   "--image_size", "16", "--optimizer", "adamw", "--warmup_epochs", "0"]


# Processes out of step (a bug) fail after --ddp_timeout 120; a run still going at JOB_TIMEOUT is killed. 120 s, from
# what these runs wait in a collective on 2 cores loaded to a load average of 8-15 (issue 30, stacks sampled every
# second in 4 resumed 3-process runs): at most 2 s once training, but up to 33 s at the start in main_process_first's
# barrier (rank 0 builds the datasets, the model and the metric, the others wait), then up to 37 s for rank 0 in DDP's
# parameter check while the others build theirs. At 60 s that left a margin of 1.6.
JOB_TIMEOUT = 360  # s, a run's (each was a launch of its own, with this limit)


def recorded(script, *args) -> dict:
    """A job of `launches`: SCRIPT --cpu ARGS, its training samples recorded."""
    return {"argv": [script, "--cpu", *args, "--ddp_timeout", "120"], "record_samples": True, "timeout": JOB_TIMEOUT}


def fetched(log, rank, worker=None):
    """[(epoch, index)] that one process (or one of its DataLoader workers) fetched, in order."""
    name = f"{log.name}.rank{rank}" + (f".worker{worker}" if worker is not None else "")
    path = log.with_name(name)
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def global_order(per_rank, batch_size):
    """Interleave the processes' batches round-robin; every process must have trained equally many."""
    lengths = {len(ids) for ids in per_rank}
    assert len(lengths) == 1 and lengths.pop() % batch_size == 0, [len(ids) for ids in per_rank]
    rounds = len(per_rank[0]) // batch_size
    return [i for k in range(rounds) for ids in per_rank for i in ids[k * batch_size:(k + 1) * batch_size]]


def training_state(checkpoint):
    return json.loads((checkpoint / "training_state.json").read_text())


# ---------------------------------------------------------------- train_mnist.py


@pytest.fixture(scope="module")
def launches(synthetic_mnist, tmp_path_factory):
    """Every run of this file, in 2 launches: first the 2-process runs, then the 3-process ones (the resumes).

    train_mnist.py: 2 processes, 2 epochs, a checkpoint at every step (mnist/full); then a fresh 3-process run resumes
    from step_1 (mid-epoch 0) with --batch_size 2, so the resume keeps the global batch of 24 with 4 accumulation
    steps (mnist/resumed). And 50 samples at --batch_size 8 for 1 epoch on 2 and 3 processes (mnist/padded2, padded3).

    train_image_classifier.py: 100 training images; 2 processes as above (images decoded in the main process: fetch
    order is training order), then a fresh 3-process run of 8 per batch resumes from step_1 with 2 DataLoader workers
    each. Both train 96 images per epoch: the last 4 of the shuffle are an incomplete round of batches on 2 and on 3
    processes."""
    root = tmp_path_factory.mktemp("coverage")
    mnist, classifier = root / "mnist", root / "classifier"
    mnist.mkdir()
    data = make_split_image_folder(classifier / "data", train_per_class=CLASSIFIER_N // 4, val_per_class=2)

    def padded(processes):
        return recorded(TRAIN_MNIST, "--data_dir", synthetic_mnist, "--output_dir", mnist / f"padded{processes}",
                        "--max_train_samples", "50", "--max_eval_samples", "30", "--epochs", "1", "--batch_size", "8")

    launch_jobs({
        "mnist/full": recorded(TRAIN_MNIST, "--data_dir", synthetic_mnist, "--output_dir", mnist / "full", *MNIST),
        "mnist/padded2": padded(2),
        "classifier/full": recorded(CLASSIFIER, "--data_dir", data, "--output_dir", classifier / "full",
                                    *CLASSIFIER_ARGS, "--num_workers", "0"),
    }, launcher_args(2), root)
    launch_jobs({
        "mnist/resumed": recorded(TRAIN_MNIST, "--data_dir", synthetic_mnist, "--output_dir", mnist / "resumed",
                                  *MNIST, "--batch_size", "2", "--resume_from_checkpoint", mnist / "full" / "step_1"),
        "mnist/padded3": padded(3),
        "classifier/resumed": recorded(CLASSIFIER, "--data_dir", data, "--output_dir", classifier / "resumed",
                                       *CLASSIFIER_ARGS, "--batch_size", "8", "--num_workers", "2",
                                       "--resume_from_checkpoint", classifier / "full" / "step_1"),
    }, launcher_args(3), root)
    return mnist, classifier


@pytest.fixture(scope="module")
def mnist_runs(launches):
    """train_mnist.py's runs: their folder, and (log, processes) of the 2-process run and of its 3-process resume."""
    root = launches[0]
    return root, (root / "full", 2), (root / "resumed", 3)


def test_train_mnist_trains_each_sample_once_per_epoch_on_2_processes(mnist_runs):
    root, full, _ = mnist_runs
    finished_job(*full)
    per_rank = [[index for _, index in fetched(root / "full", rank)] for rank in range(2)]
    assert [len(ids) for ids in per_rank] == [2 * 48, 2 * 48]  # 8 batches of 6 per process and epoch
    epochs = [global_order([ids[e * 48:(e + 1) * 48] for ids in per_rank], 6) for e in range(2)]
    for order in epochs:
        assert sorted(order) == list(range(N))  # a partition: every sample once, none twice, on no other process
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    r = results(root / "full")
    assert r["global_step"] == 8 and r["samples_seen"] == 2 * N


def test_train_mnist_mid_epoch_resume_on_3_processes_trains_the_rest_of_the_same_shuffle(mnist_runs):
    """The resumed run trains exactly the uninterrupted run's global order after its first optimizer step (24
    samples), then all of epoch 1 in the same order: whatever the process count, no sample twice or never."""
    root, full, resumed = mnist_runs
    finished_job(*full)
    finished_job(*resumed)
    before = [[index for _, index in fetched(root / "full", rank)] for rank in range(2)]
    uninterrupted = [global_order([ids[e * 48:(e + 1) * 48] for ids in before], 6) for e in range(2)]
    after = [[index for _, index in fetched(root / "resumed", rank)] for rank in range(3)]
    # 3 processes x 2 per batch: 16 batches each per epoch; the first 4 (24 samples) are skipped in epoch 0
    assert [len(ids) for ids in after] == [24 + 32] * 3
    resumed_epoch_0 = global_order([ids[:24] for ids in after], 2)
    resumed_epoch_1 = global_order([ids[24:] for ids in after], 2)
    assert resumed_epoch_0 == uninterrupted[0][24:]
    assert sorted(uninterrupted[0][:24] + resumed_epoch_0) == list(range(N))  # epoch 0 across the restart
    assert resumed_epoch_1 == uninterrupted[1]  # and a whole epoch on 3 processes: the same partition of the shuffle
    r = results(root / "resumed")
    assert r["num_processes"] == 3 and r["gradient_accumulation_steps"] == 4 and r["global_batch_size"] == 24
    assert r["global_step"] == 8 and r["samples_seen"] == 2 * N


@pytest.mark.parametrize("processes, padding", [(2, 14), (3, 22)])
def test_train_mnist_pads_the_last_round_with_the_epochs_first_samples(processes, padding, mnist_runs):
    """50 samples at --batch_size 8: 7 batches, the last of 2 samples. Accelerate (even_batches, drop_last False)
    gives every process as many full batches (2 processes: 4 each, 64 samples; 3: 3 each, 72): the epoch's shuffle
    once, then its first 14 (22) samples again, completing the batch of 2 and whole batches after it, and nothing
    else. What the script's docstring and docs/data_and_evaluation.md ("Uneven data") say."""
    root = mnist_runs[0]
    log = root / f"padded{processes}"
    finished_job(log, processes)
    per_rank = [[index for _, index in fetched(log, rank)] for rank in range(processes)]
    order = global_order(per_rank, 8)
    assert len(order) == 50 + padding
    assert sorted(order[:50]) == list(range(50))  # every sample once...
    assert order[50:] == order[:padding]  # ...then the padding: the first samples of the shuffle, in order
    r = results(root / f"padded{processes}")
    assert r["num_processes"] == processes
    assert r["global_step"] == (50 + padding) // (8 * processes) and r["samples_seen"] == 50 + padding  # trained


def test_train_mnist_steps_the_scheduler_once_per_optimizer_step(mnist_runs):
    """With 2 accumulation steps, a scheduler stepped per batch would be 2 steps ahead per optimizer step (OneCycleLR
    raises only once it overruns its total; these checkpoints show it from the first step)."""
    root, full, _ = mnist_runs
    for step in range(1, 9):
        checkpoint = root / "full" / f"step_{step}"
        scheduler = torch.load(checkpoint / "scheduler.bin", weights_only=True)
        assert scheduler["last_epoch"] == scheduler["_step_count"] - 1 == step, checkpoint
        optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
        assert {int(s["step"]) for s in optimizer["state"].values()} == {step}  # AdamW's own count
        assert training_state(checkpoint)["global_step"] == step
    finished_job(*full)


def test_train_mnist_clips_once_per_optimizer_step(mnist_runs):
    """--max_grad_norm 1e-6: every norm recorded exceeds it, so steps_clipped counts the norms recorded in the last
    epoch; clipping on the accumulation micro-steps too would record 8."""
    root, full, _ = mnist_runs
    finished_job(*full)
    r = results(root / "full")
    assert r["steps_clipped"] == 4  # optimizer steps per epoch
    assert r["grad_norm_max"] >= r["grad_norm_mean"] > 1e-6


def test_train_mnist_resume_starts_a_fresh_accumulation_cycle(mnist_runs):
    """step_1 was saved after 2 batches per process (Accelerate's batch count: 2). The resumed run accumulates 4: it
    must step after 4 batches, not after 2 more as the restored count 2 would make it. Its first checkpoint then
    holds one more whole global batch (24 + 24 samples of epoch 0)."""
    root, _, resumed = mnist_runs
    state = training_state(root / "resumed" / "step_2")
    assert (state["global_step"], state["samples_in_epoch"], state["samples_seen"]) == (2, 48, 48)
    finished_job(*resumed)
    r = results(root / "resumed")
    assert r["global_step"] == 8 and r["samples_seen"] == 2 * N


# ---------------------------------------------------------------- train_image_classifier.py


@pytest.fixture(scope="module")
def classifier_runs(launches):
    """train_image_classifier.py's runs (see launches): their folder, and (log, processes) of the 2-process run and of
    its 3-process resume."""
    root = launches[1]
    return root, (root / "full", 2), (root / "resumed", 3)


def test_classifier_trains_each_image_once_per_epoch_on_2_processes_with_that_epochs_augmentations(classifier_runs):
    """On 2+ processes Accelerate's set_epoch reaches the sampler only; the script's train_dataset.set_epoch is
    what makes epoch 1 draw new augmentations (the epoch each image is augmented with is the dataset's own)."""
    root, full, _ = classifier_runs
    finished_job(*full)
    records = [fetched(root / "full", rank) for rank in range(2)]
    for per_process in records:
        assert [epoch for epoch, _ in per_process] == [0] * 48 + [1] * 48
    per_rank = [[index for _, index in per_process] for per_process in records]
    epochs = [global_order([ids[e * 48:(e + 1) * 48] for ids in per_rank], 6) for e in range(2)]
    for order in epochs:  # every image trained once, on one process only (the 4 left out: the test below)
        assert len(set(order)) == len(order) == N
    assert epochs[0] != epochs[1]
    r = results(root / "full")
    assert r["global_step"] == r["lr_scheduler_steps"] == 8 and r["samples_seen"] == 2 * N


def test_classifier_mid_epoch_resume_on_3_processes_with_workers_trains_the_rest_of_the_same_shuffle(classifier_runs):
    """From the workers' logs (their interleaving is not recorded, so as sets per process): after skipping its first
    batch, rank r trains global batches 3k + r of the uninterrupted run's shuffle, each image once, augmented
    with the right epoch in the worker processes too; and on 3 processes, too, the shuffle's last 4 images (an
    incomplete round of 3 batches of 8) are left out, the same 4 as on 2 processes."""
    root, full, resumed = classifier_runs
    finished_job(*full)
    finished_job(*resumed)
    before = [[index for _, index in fetched(root / "full", rank)] for rank in range(2)]
    uninterrupted = [global_order([ids[e * 48:(e + 1) * 48] for ids in before], 6) for e in range(2)]
    for rank in range(3):
        records = [record for worker in range(2) for record in fetched(root / "resumed", rank, worker)]
        assert not fetched(root / "resumed", rank), "decoded in the main process despite --num_workers 2"
        by_epoch = Counter(epoch for epoch, _ in records)
        assert by_epoch == {0: 3 * 8, 1: 4 * 8}, by_epoch  # 12 batches of 8 per epoch over 3 processes, 1 skipped
        for epoch, first_batch in ((0, 1), (1, 0)):
            trained = Counter(index for e, index in records if e == epoch)
            expected = Counter(i for k in range(first_batch, 4)
                               for i in uninterrupted[epoch][(3 * k + rank) * 8:(3 * k + rank + 1) * 8])
            assert trained == expected, (rank, epoch)
    r = results(root / "resumed")
    assert r["num_processes"] == 3 and r["gradient_accumulation_steps"] == 1
    assert r["global_step"] == r["lr_scheduler_steps"] == 8 and r["samples_seen"] == 2 * N


@pytest.mark.parametrize("processes", [2, 3])
def test_classifier_drops_the_last_incomplete_round(processes, classifier_runs):
    """100 images: 8 full rounds of 2 batches of 6 (2 processes) or 4 rounds of 3 batches of 8 (3 processes) and 4
    images more, which drop_last leaves out: an epoch trains 96 distinct images and never the other 4 (a different 4
    each epoch), as many on each process. What the script's docstring and docs/data_and_evaluation.md ("Uneven data")
    say. Read from the runs above: epochs 0 and 1 of the 2-process run, epoch 1 of the resumed 3-process run (whole;
    its DataLoader workers' logs)."""
    root, full, resumed = classifier_runs
    finished_job(*full)
    finished_job(*resumed)
    if processes == 2:
        per_rank = [[index for _, index in fetched(root / "full", rank)] for rank in range(2)]
        epochs = [[i for ids in per_rank for i in ids[e * 48:(e + 1) * 48]] for e in range(2)]
        assert [len(ids) for ids in per_rank] == [2 * 48] * 2
    else:
        per_rank = [[index for worker in range(2) for epoch, index in fetched(root / "resumed", rank, worker)
                     if epoch == 1] for rank in range(3)]
        epochs = [[i for ids in per_rank for i in ids]]
        assert [len(ids) for ids in per_rank] == [32] * 3
    for trained in epochs:
        assert len(set(trained)) == len(trained) == N and set(trained) <= set(range(CLASSIFIER_N))  # 96 once, 4 never
    assert len({frozenset(trained) for trained in epochs}) == len(epochs)  # not the same 4 left out every epoch
    r = results(root / ("full" if processes == 2 else "resumed"))
    assert r["num_processes"] == processes and r["train_size"] == CLASSIFIER_N and r["samples_seen"] == 2 * N
    assert r["global_step"] == 2 * N // 24  # 2 epochs of 96 images, 24 per optimizer step
