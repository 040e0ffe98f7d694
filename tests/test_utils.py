"""utils/ on its own: data readers, checkpoint discovery, the offline metric, fingerprints."""

import dataclasses
import gzip
import json
import os
import shutil
import signal
import time

import numpy as np
import pytest
import torch
from helpers import make_synthetic_mnist, write_idx

from utils.data.mnist import MNIST_MEAN, MNIST_STD, load_mnist_idx, to_tensor_dataset
from utils.errors import UserError
from utils.metrics import load_metric
from utils.models import ConvNet
from utils.output_files import TRAINING_STATE
from utils.run.checkpoints import find_latest_checkpoint, list_checkpoints
from utils.run.fingerprints import fingerprint
from utils.run.progress import TrainingProgress, read_training_state
from utils.run.signals import ignore_stop_signals


@pytest.fixture(scope="module")
def gz_folder(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("gz"), num_train=50, num_test=20, gz=True)


def test_reads_gz_raw_and_torchvision_layouts_identically(gz_folder, tmp_path):
    raw = make_synthetic_mnist(tmp_path / "raw", num_train=50, num_test=20, gz=False)
    nested = tmp_path / "nested"
    shutil.copytree(gz_folder, nested / "MNIST" / "raw")
    a, b, c = load_mnist_idx(gz_folder), load_mnist_idx(raw), load_mnist_idx(nested)
    for split, n in (("train", 50), ("test", 20)):
        images, labels = a[split]
        assert images.shape == (n, 28, 28) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() <= 9
        for other in (b, c):
            assert torch.equal(other[split][0], images) and torch.equal(other[split][1], labels)


def test_tensor_dataset_is_normalised_once(gz_folder):
    images, labels = load_mnist_idx(gz_folder)["train"]
    dataset = to_tensor_dataset(images, labels, max_samples=7)
    x, y = dataset.tensors
    assert x.shape == (7, 1, 28, 28) and x.dtype == torch.float32 and torch.equal(y, labels[:7])
    assert torch.allclose(x[0, 0], (images[0].float() / 255 - MNIST_MEAN) / MNIST_STD)


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(b"not gzip at all"), "BadGzipFile"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "EOFError"),
    (lambda p: gzip.open(p, "wb").write(b"\x00\x00\x0f\x03" + b"\x00" * 40), "AssertionError"),
])
def test_corrupt_files_name_the_file(gz_folder, tmp_path, damage, reason):
    folder = shutil.copytree(gz_folder, tmp_path / "copy")
    target = folder / "train-images-idx3-ubyte.gz"
    damage(target)
    with pytest.raises(UserError, match="not a valid MNIST IDX file") as err:
        load_mnist_idx(folder)
    assert str(target) in str(err.value) and reason in str(err.value)


def test_wrong_image_size_and_label_range_are_refused(gz_folder, tmp_path):
    folder = shutil.copytree(gz_folder, tmp_path / "sizes")
    write_idx(folder / "train-images-idx3-ubyte.gz", np.zeros((50, 32, 32), np.uint8))
    with pytest.raises(UserError, match="expected 28x28 images"):
        load_mnist_idx(folder)
    folder = shutil.copytree(gz_folder, tmp_path / "labels")
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", np.full(20, 12, np.uint8))
    with pytest.raises(UserError, match="labels outside 0-9"):
        load_mnist_idx(folder)


def test_mismatched_images_and_labels_are_refused(gz_folder, tmp_path):
    folder = shutil.copytree(gz_folder, tmp_path / "mismatch")
    shutil.copy(folder / "train-labels-idx1-ubyte.gz", folder / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(UserError, match="20 images but 50 labels"):
        load_mnist_idx(folder)


def _fake_checkpoint(folder, global_step, samples_in_epoch=0, complete=True):
    folder.mkdir(parents=True)
    if complete:
        progress = TrainingProgress(global_step=global_step, samples_in_epoch=samples_in_epoch)
        (folder / TRAINING_STATE).write_text(json.dumps(dataclasses.asdict(progress)))


def test_latest_checkpoint_is_by_steps_and_ignores_incomplete_ones(tmp_path):
    assert find_latest_checkpoint(tmp_path / "missing") is None
    _fake_checkpoint(tmp_path / "step_100", 100, samples_in_epoch=6400)
    _fake_checkpoint(tmp_path / "epoch_0", 100)  # same step, end of epoch: counts as later
    _fake_checkpoint(tmp_path / "step_20", 20, samples_in_epoch=1280)  # lexically after step_100
    _fake_checkpoint(tmp_path / "step_300", 300, complete=False)  # killed during the save
    _fake_checkpoint(tmp_path / ".tmp-step_400", 400)  # the temporary name is never a checkpoint
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_20", "step_100", "epoch_0"]
    assert find_latest_checkpoint(tmp_path).name == "epoch_0"
    with pytest.raises(UserError, match="not a complete checkpoint"):
        read_training_state(tmp_path / "step_300")


def test_a_training_state_of_another_layout_is_refused_in_one_line(tmp_path):
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / TRAINING_STATE).write_text(json.dumps({"global_step": 5, "batches_in_epoch": 5}))
    with pytest.raises(UserError, match="not in this version's layout"):
        read_training_state(tmp_path / "step_5")


def test_local_accuracy_metric_works_offline():
    metric = load_metric("accuracy")  # conftest: HF_HUB_OFFLINE=1
    metric.add_batch(predictions=[1, 2, 3], references=[1, 2, 0])
    metric.add_batch(predictions=torch.tensor([4]), references=torch.tensor([4]))
    assert metric.compute() == {"accuracy": 0.75}


def test_hub_metric_names_still_go_to_the_hub():
    # offline here, so it must fail rather than silently use something else; evaluate's "not found" error
    with pytest.raises(FileNotFoundError, match="doesn't exist on the Hugging Face Hub"):
        load_metric("f1")


def test_fingerprint_sees_every_bit():
    model = ConvNet()
    before = fingerprint(model.parameters())
    assert fingerprint(model.parameters()) == before
    with torch.no_grad():
        weight = model.fc.weight.view(-1)
        weight[0] = torch.nextafter(weight[0], torch.tensor(1.0))  # one ulp
    assert fingerprint(model.parameters()) != before
    assert 0 <= before < 2**60
    # float64 buffers too (BatchNorm's in a double model, the running loss sums): one ulp of a double
    double = torch.ones(3, dtype=torch.float64)
    nudged = double.clone()
    nudged[1] = torch.nextafter(nudged[1], torch.tensor(2.0, dtype=torch.float64))
    assert fingerprint([nudged]) != fingerprint([double])


def test_throughput_counts_only_the_batches_after_the_warm_up_and_no_paused_time(monkeypatch):
    """A clock that reads 0, 1, 2, ... s: 5 batches of 10 samples, 1 s each, the first 2 warm-up; a pause (a
    checkpoint) from 6 s to 7 s; one more batch. Training time: 7 s (all but the paused second); steady: the 4 batches
    after the warm-up, 40 samples in 5 s (the second before the pause included)."""
    from utils.report.meters import ThroughputMeter

    clock = iter(range(100))
    monkeypatch.setattr("utils.report.meters.time.perf_counter", lambda: next(clock))
    meter = ThroughputMeter(torch.device("cpu"), warmup_batches=2)
    meter.start()  # 0
    for _ in range(5):  # 1 ... 5
        meter.batch_done(10)
    with meter.paused():  # paused at 6, started again at 7
        pass
    meter.batch_done(10)  # 8: 1 s after the restart
    assert (meter.train_time_s, meter.samples) == (7, 60)  # 5 s of batches, 1 s before the pause, 1 s after
    assert (meter.steady_time_s, meter.steady_samples) == (5, 40)


def test_convnet_shapes():
    model = ConvNet()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == 16 * 25 + 16 + 32 * 16 * 25 + 32 + 2 * (16 + 32) + 7 * 7 * 32 * 10 + 10


class WorkerPids(torch.utils.data.Dataset):
    """Each item is the pid of the DataLoader worker that produced it."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.getpid()


@pytest.mark.parametrize("worker_init_fn", [None, ignore_stop_signals], ids=["default", "ignore_stop_signals"])
def test_dataloader_workers_survive_sigterm_only_with_ignore_stop_signals(worker_init_fn):
    """torchrun sends SIGTERM to a worker's whole process group. Started with `spawn` (or
    `forkserver`, Python 3.14's default) a DataLoader worker does not inherit the training
    process's handler, and dies of it unless its worker_init_fn ignores the signal."""
    loader = torch.utils.data.DataLoader(WorkerPids(), num_workers=1, multiprocessing_context="spawn",
                                         worker_init_fn=worker_init_fn)
    batches = iter(loader)
    worker_pid = int(next(batches))
    os.kill(worker_pid, signal.SIGTERM)
    time.sleep(0.5)
    if worker_init_fn is None:
        with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid\\(s\\) {worker_pid}\\) exited unexpectedly"):
            list(batches)
    else:
        assert [int(pid) for pid in batches] == [worker_pid] * 3


@pytest.mark.parametrize("num_samples", [96, 97, 100, 1003])
@pytest.mark.parametrize("num_processes, batch_size, accumulation", [(1, 8, 1), (2, 6, 2), (3, 5, 3), (2, 7, 4)])
def test_steps_per_epoch_counts_the_optimizer_steps_accelerate_takes(num_samples, num_processes, batch_size,
                                                                      accumulation):
    """Both training scripts size their schedule with TrainingProgress.steps_per_epoch: it must equal the optimizer
    steps of an epoch as Accelerate shards it (BatchSamplerShard: every process as many batches, the last ones padded)
    and syncs gradients (every `accumulation` batches and at the end of the data)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    progress = TrainingProgress().with_batch(num_processes, batch_size, accumulation)
    batches = BatchSampler(SequentialSampler(range(num_samples)), batch_size, drop_last=False)
    per_process = {len(BatchSamplerShard(batches, num_processes, rank, even_batches=True))
                   for rank in range(num_processes)}
    assert len(per_process) == 1  # even_batches: every process takes as many
    syncs = sum(1 for batch in range(1, per_process.pop() + 1)
                if batch % accumulation == 0 or batch == len(BatchSamplerShard(batches, num_processes, 0)))
    assert progress.steps_per_epoch(num_samples, batch_size, whole_global_batches=False) == syncs
    # whole global batches only (train_image_classifier): the same number on any process count
    assert progress.steps_per_epoch(num_samples, batch_size, whole_global_batches=True) == \
        num_samples // (num_processes * batch_size * accumulation)
