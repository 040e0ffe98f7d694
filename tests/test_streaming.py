"""train_image_classifier.py --streaming (utils/data/streaming.py): webdataset tar shards and parquet files of uneven
sizes, read as this process's part of a shuffled stream. Every process takes the same optimizer steps (no hang when one
process's part runs out first), each image is trained at most once per epoch, a run resumed from a checkpoint inside
an epoch ends with the uninterrupted run's weights, and evaluation stays exact.

Images: 16 px, each unique (random noise), so that the CRC-32 of its file, which tests/sample_recording.py logs, names
it.

Every run here is one job of the three launches in `runs` (tests/jobs.py): the 2-process runs in one launch, the
3-process run in another, then the 1-process ones (one refuses to resume the 2-process run's checkpoint), each process
importing torch and Accelerate once.
"""

import csv
import io
import json
import re
import shutil
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, launcher_args, load_script, results
from image_data import CLASSES, draw_example, grid_cell_png, make_split_image_folder
from jobs import finished_job, launch_jobs

TRAIN_IMAGE_CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PREDICT = REPO / "scripts" / "predict.py"
RUN = ["--streaming", "--model", "tests.tiny_model:tiny_cnn", "--image_size", "16", "--batch_size", "2",
       "--optimizer", "adamw", "--num_workers", "0", "--ddp_timeout", "60"]  # a hang: an error within a minute


def png_bytes(rng, label: int) -> bytes:
    buffer = io.BytesIO()
    draw_example(rng, list(CLASSES)[label], size=16).save(buffer, "PNG")
    return buffer.getvalue()


def write_tar_shards(root, sizes, test_size: int = 6, seed: int = 0) -> dict:
    """ROOT/train-0000i.tar of the given sizes and ROOT/test-00000.tar, webdataset-style (KEY.png, KEY.cls). Returns the
    training images' CRC-32s with their labels."""
    rng, keys = np.random.default_rng(seed), {}
    root.mkdir(parents=True)
    for split, shard_sizes in (("train", sizes), ("test", [test_size])):
        for shard, size in enumerate(shard_sizes):
            with tarfile.open(root / f"{split}-{shard:05d}.tar", "w") as tar:
                for i in range(size):
                    label = (shard + i) % len(CLASSES)
                    data = png_bytes(rng, label)
                    if split == "train":
                        keys[zlib.crc32(data)] = label
                    for ext, content in (("png", data), ("cls", str(label).encode())):
                        info = tarfile.TarInfo(f"{split}{shard}_{i:04d}.{ext}")
                        info.size = len(content)
                        tar.addfile(info, io.BytesIO(content))
    return keys


def streamed(*args) -> list:
    """A job's SCRIPT ARGS: train_image_classifier.py with RUN and `args`."""
    return [TRAIN_IMAGE_CLASSIFIER, "--cpu", *RUN, *args]


def recorded(*args) -> dict:
    """streamed(*args) as a job whose decoded training images are logged (fetched)."""
    return {"argv": streamed(*args), "record_samples": True}


def fetched(log, num_processes: int) -> dict:
    """{(epoch, rank): [image key, ...]} in fetch order."""
    by_epoch_and_rank = {}
    for rank in range(num_processes):
        for line in Path(f"{log}.rank{rank}").read_text().splitlines():
            epoch, key = map(int, line.split())
            by_epoch_and_rank.setdefault((epoch, rank), []).append(key)
    return by_epoch_and_rank


def epoch_lines(output: str) -> list:
    return [int(n) for n in re.findall(r"INFO \[RANK 0\] epoch (\d+): ", output)]


def test_a_streamed_images_augmentation_depends_on_seed_epoch_and_its_bytes_only():
    """In-process, as the map-style twin (tests/test_image_classifier.py): the same image is cropped and flipped
    the same way in the same epoch, whatever was drawn before, and anew in the next epoch."""
    import torch

    from utils.data.recipes import train_transform
    from utils.data.streaming import StreamedImages

    class Stream:  # what StreamedImages needs of a datasets stream here
        def set_epoch(self, epoch):
            pass

    data = png_bytes(np.random.default_rng(3), label=0)
    images = StreamedImages(Stream(), train_transform(16), "image", "label", seed=7)
    first = images.transformed(data)
    torch.rand(10)  # the global generator's state must not matter
    assert torch.equal(images.transformed(data), first)
    images.set_epoch(1)
    assert not torch.equal(images.transformed(data), first)
    assert not torch.equal(StreamedImages(Stream(), train_transform(16), "image", "label", seed=8).transformed(data),
                           first)


# 3 shards on 2 processes: every 2nd example of the stream each, 10 and 9: 5 and 4 batches, so 4 steps an epoch;
# 2 shards on 3 processes (one shard fewer than processes): 6, 6 and 5 images, 3, 3 and 2 batches: 2 steps
SPLITS = [(2, [7, 3, 9], [10, 9], 4, 10), (3, [6, 11], [6, 6, 5], 2, 5)]
# the integer-label runs' flags (not recorded: a linear model on the pixels, to learn the 12 classes)
INTEGER_LABEL_RUN = ["--label_column", "cls", "--model", "tests.image_data:pixel_linear", "--image_size", "16",
                     "--augmentation", "none", "--batch_size", "8", "--optimizer", "adamw", "--learning_rate", "0.02",
                     "--num_workers", "0", "--max_steps", "36"]


def write_parquet_files(root) -> list:
    """ROOT/train-0000i-of-00002.parquet (5 and 4 images) and ROOT/test-00000-of-00001.parquet (4), an image column and
    a ClassLabel of CLASSES. Returns the training images' CRC-32s."""
    import datasets

    root.mkdir()
    rng, keys = np.random.default_rng(1), []
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    for name, size in (("train-00000-of-00002", 5), ("train-00001-of-00002", 4), ("test-00000-of-00001", 4)):
        images = [png_bytes(rng, i % 4) for i in range(size)]
        keys += [zlib.crc32(data) for data in images] if name.startswith("train") else []
        rows = {"image": [{"bytes": data, "path": None} for data in images], "label": [i % 4 for i in range(size)]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(root / f"{name}.parquet"))
    return keys


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launched run of this file, as jobs of 3 launches (2 processes, 3 processes, then 1 process): the data each
    test's docstring describes, written first; returns the folder (each run's output in it: NAME, its files NAME.*)
    and the training images' keys by data set."""
    root = tmp_path_factory.mktemp("streaming")
    keys = {f"{len(sizes)}_shards": write_tar_shards(root / f"{len(sizes)}_shards", sizes)
            for _, sizes, *_ in SPLITS}
    write_tar_shards(root / "4_shards", [6, 9, 7, 10])
    folder = make_split_image_folder(root / "images", train_per_class=3, val_per_class=1)
    keys["images"] = [zlib.crc32(path.read_bytes()) for path in (folder / "train").rglob("*.png")]
    keys["parquet"] = write_parquet_files(root / "parquet")
    integer_labels = write_integer_label_shards(root / "integer_labels")

    def split(num_processes):
        _, sizes, _, _, max_steps = next(split for split in SPLITS if split[0] == num_processes)
        return recorded("--dataset", root / f"{len(sizes)}_shards", "--label_column", "cls", "--max_steps", max_steps,
                        "--output_dir", root / f"{len(sizes)}_shards_out")

    resume = resume_run_args(root / "4_shards")
    launch_jobs({
        "3_shards": split(2),
        "full": streamed(*resume, "--output_dir", root / "full"),
        "resumed": streamed(*resume, "--output_dir", root / "resumed",
                            "--resume_from_checkpoint", root / "full" / "step_4"),
        "images": recorded("--data_dir", folder, "--max_steps", 3, "--output_dir", root / "images_out"),
    }, launcher_args(2), root)
    launch_jobs({"2_shards": split(3)}, launcher_args(3), root)
    (root / "one").mkdir()  # the 2-process run's step_4 alone, resumed on 1 process
    shutil.copytree(root / "full" / "step_4", root / "one" / "step_4")
    integer_label_run = [*INTEGER_LABEL_RUN, "--dataset", integer_labels]
    launch_jobs({
        "one": streamed(*resume, "--output_dir", root / "one", "--resume_from_checkpoint", "latest"),
        "parquet": recorded("--dataset", root / "parquet", "--max_steps", 4, "--output_dir", root / "parquet_out"),
        "streamed": [TRAIN_IMAGE_CLASSIFIER, "--cpu", *integer_label_run, "--streaming", "--output_dir",
                     root / "streamed"],
        "plain": [TRAIN_IMAGE_CLASSIFIER, "--cpu", *integer_label_run, "--output_dir", root / "plain"],
        "predict": [PREDICT, "--cpu", "--model_dir", root / "streamed", "--dataset", integer_labels, "--output_file",
                    root / "predictions.csv", "--num_workers", "0"],
    }, launcher_args(1), root)
    return root, keys


@pytest.mark.parametrize("num_processes, shard_sizes, per_rank, steps_per_epoch, max_steps", SPLITS,
                         ids=["3_shards_2_processes", "2_shards_3_processes"])
def test_every_process_takes_the_same_steps_and_each_image_is_read_once_per_epoch(
        runs, num_processes, shard_sizes, per_rank, steps_per_epoch, max_steps):
    root, keys = runs
    name = f"{len(shard_sizes)}_shards"
    log, out = root / name, root / f"{name}_out"
    proc_output = finished_job(root / name, num_processes).outputs[0]
    epochs = -(-max_steps // steps_per_epoch)
    r = results(out)
    assert (r["global_step"], r["epochs"], r["samples_seen"]) == (max_steps, epochs, max_steps * 2 * num_processes)
    assert r["eval_samples"] == 6 and r["train_size"] is None and r["steps_per_epoch"] is None
    assert epoch_lines(proc_output) == list(range(epochs))
    reads = fetched(log, num_processes)
    for epoch in range(epochs - 1):  # a whole epoch reads every image once, on one process: its part of the stream
        parts = [reads[epoch, rank] for rank in range(num_processes)]
        assert [len(part) for part in parts] == per_rank
        assert sorted(key for part in parts for key in part) == sorted(keys[name])
    last = [key for rank in range(num_processes) for key in reads[epochs - 1, rank]]
    assert len(last) == len(set(last)) >= (max_steps - (epochs - 1) * steps_per_epoch) * 2 * num_processes
    assert reads[0, 0] != reads[1, 0]  # the shuffle is seeded per epoch


def resume_run_args(shards) -> list:
    """The next test's runs: 4 shards, 2 DataLoader workers, 2 accumulation steps, a checkpoint every 2 steps."""
    return ["--dataset", shards, "--label_column", "cls", "--max_steps", 8, "--checkpointing_steps", 2,
            "--gradient_accumulation_steps", 2, "--num_workers", 2]


def test_a_run_resumed_inside_an_epoch_ends_with_the_uninterrupted_runs_weights(runs):
    """4 shards on 2 processes with 2 DataLoader workers each: two whole shards a process, one a worker, their order
    shuffled per epoch, so the parts differ in size from epoch to epoch (each worker batches its own shard and drops
    its last odd image); the smaller part always has 6 batches of 2, 3 accumulation cycles of 2: 3 steps an epoch.
    step_4 is inside epoch 1; resumed from it (named by its path, into a new folder), the run reads epoch 1 again,
    skips its first cycle, ends the same. On 1 process (step_4 alone in a folder, resumed as `latest`): one line."""
    root, _ = runs
    full, resumed = root / "full", root / "resumed"
    assert epoch_lines(finished_job(root / "full", 2).outputs[0]) == [0, 1, 2]
    state = json.loads((full / "step_4" / "training_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (1, 8)  # one step of 2 processes x 2 batches x 2 images
    refused = finished_job(root / "one", 1, fails=True)
    assert refused.returncode != 0 and "error: a --streaming run resumes on the process count that saved its " \
        "checkpoint (2, not 1): it splits the stream" in refused.stdout
    resumed_output = finished_job(root / "resumed", 2).outputs[0]
    assert (resumed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    r, rr = results(full), results(resumed)
    for key in ("global_step", "epochs", "samples_seen", "train_loss", "eval_loss", "eval_accuracy", "eval_samples"):
        assert rr[key] == r[key], key
    assert (r["global_step"], r["epochs"], r["eval_samples"]) == (8, 3, 6)
    assert epoch_lines(resumed_output) == [1, 2]


def test_parquet_shards_and_the_refusals(runs, tmp_path, capsys):
    """Parquet files stream too (one process: each epoch reads every image once); --streaming without --max_steps or
    without an evaluation split: one line each. The flag checks stop in parse_args, before anything is read; the split
    check is the first thing the stream's loader does: both asked in this process (that a UserError of a stream's loader
    is one line of a launched run: tests/test_bad_inputs.py::test_webdataset_shards_mixing_jpg_and_png_are_one_line)."""
    from utils.data.streaming import load_image_stream
    from utils.errors import UserError

    root, keys = runs
    finished_job(root / "parquet", 1)
    r = results(root / "parquet_out")
    assert (r["global_step"], r["epochs"], r["eval_samples"], r["class_names"]) == (4, 1, 4, list(CLASSES))
    # 9 images: 4 steps of 2, the last image no batch's
    assert sorted(fetched(root / "parquet", 1)[0, 0]) == sorted(keys["parquet"])

    parquet = shutil.copytree(root / "parquet", tmp_path / "parquet")
    flags = ["--cpu", *RUN, "--dataset", str(parquet)]
    parse_args = load_script(TRAIN_IMAGE_CLASSIFIER).parse_args
    refused = (([], "--streaming needs --max_steps"),
               (["--max_steps", "2", "--warmup_epochs", "0.5"], "--warmup_epochs does not work with --streaming"))
    for extra, expected in refused:
        with pytest.raises(SystemExit) as stopped:
            parse_args([*flags, *extra])
        assert stopped.value.code != 0 and expected in capsys.readouterr().err
    (parquet / "test-00000-of-00001.parquet").unlink()
    with pytest.raises(UserError, match="--streaming needs 'train' and 'validation' or 'test'"):
        load_image_stream(dataset=str(parquet))


def test_an_image_folder_streams_split_between_processes(runs):
    """--data_dir DIR/train + DIR/val streams as one shard: each of 2 processes takes every 2nd image of the shuffled
    stream, 6 each (3 batches of 2: 3 steps an epoch); an epoch reads each of the 12 training images exactly once."""
    root, keys = runs
    finished_job(root / "images", 2)
    r = results(root / "images_out")
    assert (r["global_step"], r["epochs"], r["samples_seen"], r["eval_samples"]) == (3, 1, 12, 4)
    assert r["class_names"] == sorted(CLASSES)
    reads = fetched(root / "images", 2)
    assert [len(reads[0, rank]) for rank in range(2)] == [6, 6]
    assert sorted(reads[0, 0] + reads[0, 1]) == sorted(keys["images"])


# 12 classes, first met in this order in every shard: sorted as strings (0, 1, 10, 11, 2, ...) or in the order first
# seen, the class ids differ from the numeric order
FIRST_SEEN = [7, 11, 2, 0, 10, 5, 1, 9, 3, 8, 6, 4]


def write_integer_label_shards(root, train_per_class: int = 4, test_per_class: int = 2) -> Path:
    """ROOT/train-00000.tar and ROOT/test-00000.tar, webdataset-style: KEY.png (a bright cell of a 4x4 grid, the cell
    number the class) with KEY.cls, an integer 0..11, the labels in FIRST_SEEN's order."""
    rng = np.random.default_rng(5)
    root.mkdir(parents=True)
    for split, per_class in (("train", train_per_class), ("test", test_per_class)):
        with tarfile.open(root / f"{split}-00000.tar", "w") as tar:
            for i, label in enumerate(FIRST_SEEN * per_class):
                for ext, content in (("png", grid_cell_png(rng, label)), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{split}_{i:04d}.{ext}")
                    info.size = len(content)
                    tar.addfile(info, io.BytesIO(content))
    return root


def test_integer_labels_0_to_11_are_classes_in_numeric_order_streamed_or_not_and_in_predict(runs):
    """Webdataset .cls labels 0..11 (issue 29: streamed, training took them in numeric order and evaluation in string
    order, eval accuracy 0.167 for a train accuracy of 1.0): with and without --streaming the classes are 0..11 in
    numeric order, a linear model on the pixels learns them (INTEGER_LABEL_RUN), and predict.py, which reads the shards
    without streaming, names the classes the streamed run's outputs stand for."""
    root, _ = runs
    streamed, plain = root / "streamed", root / "plain"
    for out in (streamed, plain):
        finished_job(root / out.name, 1)
        r = results(out)
        assert r["class_names"] == [str(label) for label in range(12)], out.name
        assert (r["eval_samples"], r["global_step"]) == (24, 36)
        assert r["eval_accuracy"] >= 0.9, (out.name, r["eval_accuracy"])
    finished_job(root / "predict", 1)
    with open(root / "predictions.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert [row["label"] for row in table] == [str(label) for label in FIRST_SEEN * 2]
    correct = sum(row["class_1"] == row["label"] for row in table)
    assert correct / len(table) == results(streamed)["eval_accuracy"]
