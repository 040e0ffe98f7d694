"""scripts/benchmark_data.py on a small generated folder of JPEGs: every pipeline, split and worker count
has a row with a positive rate, the outputs name no folder of this machine, and a folder without val/
is refused with one line. (No assertion on speed ratios: CI machines are shared and noisy.)"""

import json
import sys

import numpy as np
import pytest
from helpers import REPO, assert_clean_user_error, run
from PIL import Image

BENCHMARK_DATA = REPO / "scripts" / "benchmark_data.py"
PIPELINES = ("before", "reference", "decode_only", "ours")


def make_jpeg_folder(root, splits=(("train", 12), ("val", 6))):
    """ROOT/<split>/<class>/*.jpg: noisy 320x240 photos-to-be, two classes."""
    rng = np.random.default_rng(0)
    for split, per_class in splits:
        for class_name in ("cat", "dog"):
            folder = root / split / class_name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(240, 320, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    work = tmp_path_factory.mktemp("benchmark_data")
    make_jpeg_folder(work / "photos")
    # Started in `work` with relative paths, as a user types them: the record must keep them relative.
    proc = run([sys.executable, BENCHMARK_DATA, "--data_dir", "photos", "--output_dir", "out", "--num_workers", "0",
                "1", "--seconds", "0.3", "--rounds", "1", "--image_size", "64"], cwd=work)
    return work, proc, json.loads((work / "out" / "benchmark_data.json").read_text())


def test_every_pipeline_split_and_worker_count_has_a_positive_rate(benchmark):
    _, _, record = benchmark
    rows = {(r["pipeline"], r["split"], r["num_workers"]): r for r in record["rows"]}
    assert len(rows) == len(record["rows"]) == 4 * 2 * 2
    assert set(rows) == {(p, s, n) for p in PIPELINES for s in ("train", "eval") for n in (0, 1)}
    for (_, _, workers), row in rows.items():
        assert row["images_per_second"] > 0 and row["images"] > 0 and row["seconds"] >= 0.3 and row["rounds"] == 1
        assert row["images_per_second_per_core"] == pytest.approx(row["images_per_second"] / max(1, workers))
        # the one process's CPU time with 0 workers: at most its wall time, so at least its wall-clock rate
        if workers == 0:
            assert row["images_per_cpu_second"] >= row["images_per_second"] * 0.99
        else:
            assert row["images_per_cpu_second"] is None
    assert record["images_in_split"] == {"train": 24, "eval": 12}
    assert set(record["summary"]["train"]) == {"ours/before", "ours/decode_only", "reference/before"}


def test_markdown_table_and_cores_per_gpu_line(benchmark):
    work, proc, _ = benchmark
    table = (work / "out" / "benchmark_data.md").read_text()
    for name in PIPELINES:
        assert f"| {name} | train |" in table and f"| {name} | eval |" in table
    assert "| before | train |" in proc.stdout
    assert "At 3000 images/s per GPU (--target_images_per_second), the train pipeline `ours` needs " in proc.stdout


def test_the_record_names_no_folder_of_this_machine(benchmark):
    work, _, record = benchmark
    text = (work / "out" / "benchmark_data.json").read_text() + (work / "out" / "benchmark_data.md").read_text()
    assert str(work) not in text and str(REPO) not in text
    assert record["settings"]["data_dir"] == "photos"
    assert record["command"].startswith("python scripts/benchmark_data.py --data_dir photos ")


def test_a_folder_without_val_is_refused_with_one_line(tmp_path):
    make_jpeg_folder(tmp_path / "photos", splits=(("train", 2),))
    proc = run([sys.executable, BENCHMARK_DATA, "--data_dir", tmp_path / "photos", "--output_dir", tmp_path / "out"],
               check=False)
    assert proc.returncode == 2
    assert_clean_user_error(proc, "no val/ folder", "DIR/val/<class>/")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
