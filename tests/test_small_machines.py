"""The image classifier on a laptop-sized machine: as many DataLoader workers as the cores can serve,
and a throughput also for a run shorter than the warm-up that the steady-state rate leaves out."""

import os

import pytest
from helpers import REPO, results, run_alone
from image_data import make_flat_image_folder

from utils.launch.flags import default_num_workers

IMAGE_CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"


@pytest.mark.parametrize("cpus, local_processes, workers", [
    (2, 1, 2),   # a 2-core laptop: 4 workers there made PyTorch warn (twice: training and evaluation)
    (2, 2, 1),   # the same laptop, cpu_2proc.yaml: one each
    (1, 2, 0),   # fewer cores than processes: each process loads its own batches
    (16, 2, 4),  # a GPU node: the cap
])
def test_default_workers_share_the_usable_cpus_among_this_machines_processes(cpus, local_processes, workers,
                                                                              monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))  # torchrun's processes on this machine
    assert default_num_workers() == workers


def test_a_short_run_with_the_default_workers_reports_its_throughput(tmp_path):
    """4 classes x 10 images, 32 of them to train: 8 batches of 4, all warm-up; the default --num_workers. One
    process, run as accelerate's one-process launcher runs it (it sets no LOCAL_WORLD_SIZE either): the launcher's
    own process would add 5 s and nothing this test checks."""
    data = make_flat_image_folder(tmp_path / "images", per_class=10)
    out = tmp_path / "out"
    proc = run_alone(["--data_dir", data, "--image_size", "32", "--batch_size", "4", "--epochs", "1",
                      "--output_dir", out], script=IMAGE_CLASSIFIER)
    log = proc.stdout + proc.stderr
    assert "worker processes in total" not in log, "more DataLoader workers than this machine's cores"
    r = results(out)
    assert r["train_size"] == 32 and r["global_step"] == 8
    assert r["train_samples_per_second_over"] == "all_batches" and r["train_samples_per_second"] > 0
