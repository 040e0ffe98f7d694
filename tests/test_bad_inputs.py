"""Inputs a user can get wrong end with one `error:` line naming the input and the fix, a non-zero
exit, no traceback through our code, and nothing written: the table grows with every case found."""

import io
import shutil
import sys
import tarfile

import numpy as np
import pytest
from helpers import REPO, TRAIN_MNIST, assert_clean_user_error, error_lines, launch, load_script, run, run_alone
from image_data import make_split_image_folder

from utils.errors import UserError
from utils.models import build_model

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
SMALL = ["--image_size", "32", "--num_workers", "0", "--batch_size", "8", "--epochs", "1", "--optimizer", "adamw"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_split_image_folder(tmp_path_factory.mktemp("bad_inputs_images"), train_per_class=8, val_per_class=2)


MODEL_EMA_FLAGS = [  # --model_ema in both training scripts
    (["--model_ema", "--model_ema_decay", "1"], ["--model_ema_decay", "between 0 and 1", "got 1"]),
    (["--model_ema", "--model_ema_decay", "0"], ["--model_ema_decay", "between 0 and 1"]),
    (["--model_ema", "--model_ema_decay", "nan"], ["--model_ema_decay", "between 0 and 1"]),
    (["--model_ema", "--model_ema_decay", "high"], ["--model_ema_decay", "a number between 0 and 1"]),
    (["--model_ema_decay", "0.99"], ["--model_ema_decay sets up --model_ema's average: add --model_ema"]),
    (["--model_ema_warmup"], ["--model_ema_warmup sets up --model_ema's average: add --model_ema"]),
    (["--metric_for_best", "eval_ema_accuracy"], ["--metric_for_best eval_ema_accuracy", "add --model_ema"]),
]

STEP_FLAGS = [  # --max_steps, --eval_steps, --logging_steps in both training scripts
    (["--max_steps", "0"], ["--max_steps", "expected a positive integer, got 0"]),
    (["--eval_steps", "-3"], ["--eval_steps", "expected a positive integer, got -3"]),
    (["--logging_steps", "often"], ["--logging_steps", "expected a positive integer, got 'often'"]),
    (["--eval_only", "--resume_from_checkpoint", "latest", "--eval_steps", "5"],
     ["--eval_steps says when a training run", "--eval_only trains nothing: drop --eval_steps"]),
    (["--eval_only", "--resume_from_checkpoint", "latest", "--logging_steps", "5"],
     ["--logging_steps says when a training run", "drop --logging_steps"]),
]


@pytest.mark.parametrize("script, flags, words", [
    *[(script, flags, words) for script in (TRAIN_MNIST, CLASSIFIER) for flags, words in MODEL_EMA_FLAGS],
    *[(script, flags, words) for script in (TRAIN_MNIST, CLASSIFIER) for flags, words in STEP_FLAGS],
    (TRAIN_MNIST, ["--seed", "-1"], ["--seed", "0 <= seed < 2**32"]),
    (TRAIN_MNIST, ["--seed", str(2**32)], ["--seed", "0 <= seed < 2**32"]),
    (TRAIN_MNIST, ["--seed", "abc"], ["--seed", "whole number"]),
    (TRAIN_MNIST, ["--ddp_timeout", "0"], ["--ddp_timeout", "positive integer"]),
    (CLASSIFIER, ["--warmup_epochs", "nan"], ["--warmup_epochs", "finite number >= 0"]),
    (CLASSIFIER, ["--warmup_epochs", "inf"], ["--warmup_epochs", "finite number >= 0"]),
    (CLASSIFIER, ["--momentum", "nan"], ["--momentum", "finite number >= 0"]),
    (CLASSIFIER, ["--weight_decay", "-0.1"], ["--weight_decay", "finite number >= 0"]),
    (CLASSIFIER, ["--mixup_alpha", "-0.2"], ["--mixup_alpha", "finite number >= 0", "got -0.2"]),
    (CLASSIFIER, ["--cutmix_alpha", "nan"], ["--cutmix_alpha", "finite number >= 0"]),
    (CLASSIFIER, ["--cutmix_alpha", "1", "--mix_prob", "1.5"], ["--mix_prob", "probability between 0 and 1", "1.5"]),
    (CLASSIFIER, ["--cutmix_alpha", "1", "--mix_prob", "nan"], ["--mix_prob", "probability between 0 and 1"]),
    (CLASSIFIER, ["--mix_prob", "0.5"], ["--mix_prob says how often --mixup_alpha and --cutmix_alpha mix"]),
    (CLASSIFIER, ["--mixup_alpha", "0", "--mix_prob", "0.5"], ["--mix_prob", "set one of them above 0"]),
    (CLASSIFIER, ["--val_split", "1"], ["--val_split", "a fraction strictly between 0 and 1, got 1"]),
    (CLASSIFIER, ["--val_split", "0"], ["--val_split", "a fraction strictly between 0 and 1, got 0"]),  # issue 43
    (CLASSIFIER, ["--val_split", "-0.0"], ["--val_split", "a fraction strictly between 0 and 1, got -0.0"]),
    (CLASSIFIER, ["--learning_rate", "inf"], ["--learning_rate", "expected a positive number, got inf"]),
    (CLASSIFIER, ["--max_grad_norm", "inf"], ["--max_grad_norm", "expected a positive number, got inf"]),
    (CLASSIFIER, ["--val_split", "nan"], ["--val_split", "a fraction strictly between 0 and 1"]),
    (CLASSIFIER, ["--label_smoothing", "1"], ["--label_smoothing", "expected a number in [0, 1), got 1"]),
    (CLASSIFIER, ["--label_smoothing", "-0.1"], ["--label_smoothing", "expected a number in [0, 1)"]),
    # the same flag, the same check, in every script that has it
    *[(script, ["--num_workers", "-1"], ["--num_workers", "expected a whole number >= 0, got -1"])
      for script in (CLASSIFIER, REPO / "scripts" / "predict.py", REPO / "scripts" / "benchmark_data.py")],
    (CLASSIFIER, ["--streaming", "--max_steps", "4", "--mixup_alpha", "0.2"],
     ["--mixup_alpha and --cutmix_alpha do not work with --streaming", "drop them"]),
])
def test_bad_flag_values(script, flags, words, capsys):
    """Parsed in-process, by the parser the script uses: fast, and the same one line."""
    with pytest.raises(SystemExit) as exit_info:
        load_script(script).parse_args(["--cpu", "--data_dir", "d", *flags])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("name, words", [
    ("torch.nn:Linear", ["--model torch.nn:Linear", "Linear(num_classes=4) failed", "takes num_classes"]),
    (":resnet18", ["--model :resnet18", "package.module:function"]),
    ("no_such_module:f", ["--model no_such_module:f", "cannot import it"]),
    ("vit_b_16", ["--model vit_b_16 cannot take --image_size 32", "224"]),
])
def test_bad_models(name, words):
    with pytest.raises(UserError) as err:
        build_model(name, num_classes=4, image_size=32)
    for word in words:
        assert word in str(err.value), err.value


def test_a_model_that_cannot_take_the_image_size_stops_before_writing(images, tmp_path):
    """End to end, once: the script, not only build_model."""
    proc = run([sys.executable, CLASSIFIER, "--cpu", "--data_dir", images, "--output_dir", tmp_path / "out", *SMALL,
                "--model", "vit_b_16"], check=False)
    assert_clean_user_error(proc, "--model vit_b_16 cannot take --image_size 32")
    assert not (tmp_path / "out").exists()


def test_fewer_images_than_one_global_batch_stop_before_writing(images, tmp_path):
    """8 images per class x 4 classes = 32 training images; a global batch of 8 x 5 accumulation steps = 40."""
    proc = run([sys.executable, CLASSIFIER, "--cpu", "--data_dir", images, "--output_dir", tmp_path / "out", *SMALL,
                "--gradient_accumulation_steps", "5"], check=False)
    assert_clean_user_error(proc, "32 training samples are fewer than one global batch (40)", "--batch_size")
    assert not (tmp_path / "out").exists()


# Decoded in the main process (the script alone: what it prints is the same under a launcher, which the other case
# shows); in a DataLoader worker on one of two launched processes, whose partner stops with a note.
@pytest.mark.parametrize("num_workers, num_processes", [("0", 1), ("1", 2)])
def test_a_corrupt_image_names_its_file(tmp_path, num_workers, num_processes):
    folder = make_split_image_folder(tmp_path / "images", train_per_class=8, val_per_class=2)
    broken = sorted((folder / "train").rglob("*.png"))[3]
    broken.write_bytes(broken.read_bytes()[:60])  # truncated: a valid PNG header, then nothing
    flags = [f if f != "0" else num_workers for f in SMALL]
    script_args = ["--data_dir", folder, "--output_dir", tmp_path / "out", *flags]
    if num_processes == 1:
        proc = run_alone(script_args, script=CLASSIFIER, check=False)
    else:
        proc = launch(script_args, num_processes=num_processes, script=CLASSIFIER, check=False)
    assert_clean_user_error(proc, broken.name, "cannot be decoded", "replace it with a good copy, or delete it")
    # issue 29: the line named --resume_from_checkpoint latest, though this run saved no checkpoint
    assert "checkpoint" not in error_lines(proc)[0]
    # a DataLoader worker wraps the error in its own traceback ("Original Traceback ..."): none of it is printed
    assert "Original Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()


def _empty_class_folder(root):
    (root / "train" / "unlabelled_yet").mkdir()


def _class_only_in_val(root):
    (root / "val" / "circle_red").rename(root / "val" / "hexagon_black")


def _stray_image_at_the_root(root):
    """ROOT/train alone as a DIR/<class>/* folder, one image beside its class folders."""
    flat = root / "train"
    shutil.copy(next((flat / "circle_red").iterdir()), flat / "stray.png")
    return flat


def _stray_image_beside_the_class_folders_in_train(root):
    shutil.copy(next((root / "train" / "circle_red").iterdir()), root / "train" / "stray.png")


# Image folders that `imagefolder` reads as something else than they look: one line each, streamed or not (issue 29:
# an empty class folder was dropped, 3 classes and not 4; a val/-only class became one no image trains; a stray image
# gave "found fewer than 2 class folders")
FOLDER_LAYOUTS = [
    (_empty_class_folder, ["class folder(s) unlabelled_yet", "hold no images", "add the class's images, or delete"]),
    (_class_only_in_val, ["class(es) hexagon_black have images in", "none in", "cannot learn them"]),
    (_stray_image_at_the_root, ["stray.png lie directly in", "beside its class folders (circle_red, cross_yellow",
                                "move each image into its class's folder"]),
    (_stray_image_beside_the_class_folders_in_train, ["stray.png lie directly in", "train, beside its class folders"]),
]


@pytest.mark.parametrize("spoil, words", FOLDER_LAYOUTS, ids=[spoil.__name__[1:] for spoil, _ in FOLDER_LAYOUTS])
@pytest.mark.parametrize("streaming", [False, True], ids=["map_style", "streamed"])
def test_image_folders_that_read_as_something_else_are_one_line(tmp_path, spoil, words, streaming):
    from utils.data.image_loading import load_image_datasets
    from utils.data.streaming import load_image_stream

    root = make_split_image_folder(tmp_path / "images", train_per_class=2, val_per_class=1)
    data_dir = spoil(root) or root
    with pytest.raises(UserError) as err:
        (load_image_stream if streaming else load_image_datasets)(data_dir=data_dir)
    for word in words:
        assert word in str(err.value), err.value


def test_a_class_only_in_val_stops_the_script_before_writing(tmp_path):
    """End to end, once: the script's one line."""
    root = make_split_image_folder(tmp_path / "images", train_per_class=2, val_per_class=1)
    _class_only_in_val(root)
    proc = run([sys.executable, CLASSIFIER, "--cpu", "--data_dir", root, "--output_dir", tmp_path / "out", *SMALL],
               check=False)
    assert_clean_user_error(proc, "hexagon_black have images in", "cannot learn them")
    assert not (tmp_path / "out").exists()


def write_shards(root, extensions_by_shard: dict) -> None:
    """ROOT/NAME.tar for each NAME: extensions, webdataset-style: sample i is KEY.EXT (EXT the i-th extension, an
    image of 16 px encoded as its extension says) with KEY.cls (i % 4)."""
    from PIL import Image

    root.mkdir()
    rng = np.random.default_rng(0)
    for name, extensions in extensions_by_shard.items():
        with tarfile.open(root / f"{name}.tar", "w") as tar:
            for i, ext in enumerate(extensions):
                image = io.BytesIO()
                pixels = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(image, ext.replace("jpg", "jpeg"))
                for member, content in ((ext, image.getvalue()), ("cls", str(i % 4).encode())):
                    info = tarfile.TarInfo(f"{name}_{i:04d}.{member}")
                    info.size = len(content)
                    tar.addfile(info, io.BytesIO(content))


def test_webdataset_shards_mixing_jpg_and_png_are_one_line(tmp_path):
    """`datasets` gives the samples whose extension is not the first samples' no image (or, streaming some shards,
    refuses them in a line that does not say what to do): map-style, one line when loading; streamed, one line when
    such a sample comes, also in a DataLoader worker (issue 29: a TypeError and 129 lines)."""
    from utils.data.image_loading import load_image_datasets
    from utils.data.recipes import eval_transform
    from utils.data.streaming import StreamedImages, load_image_stream

    write_shards(tmp_path / "mixed", {"train-00000": ["jpg", "png"] * 4, "test-00000": ["jpg"] * 4})
    with pytest.raises(UserError) as err:
        load_image_datasets(dataset=str(tmp_path / "mixed"), label_column="cls")
    assert "the training split has 4 row(s) without an image in its column 'jpg'" in str(err.value), err.value
    assert "webdataset shards must store every sample's image under one extension" in str(err.value)
    stream, _, image_column, label_column, _, label_ids = load_image_stream(dataset=str(tmp_path / "mixed"),
                                                                            label_column="cls")
    with pytest.raises(UserError) as err:
        list(StreamedImages(stream, eval_transform(16, "none"), image_column, label_column, label_ids=label_ids))
    assert "a sample has no image in the image column; webdataset shards must" in str(err.value), err.value
    apart = {"train-00000": ["jpg"] * 8, "train-00001": ["png"] * 8, "test-00000": ["jpg"] * 4}
    write_shards(tmp_path / "apart", apart)
    # the script alone (test_a_corrupt_image_names_its_file launches a worker's error on two processes)
    proc = run_alone(["--streaming", "--dataset", tmp_path / "apart", "--label_column", "cls", "--max_steps", "8",
                      "--output_dir", tmp_path / "out", "--model", "tests.tiny_model:tiny_cnn", "--image_size",
                      "16", "--batch_size", "2", "--optimizer", "adamw", "--num_workers", "1"], script=CLASSIFIER,
                     check=False)
    assert_clean_user_error(proc, "a sample has no image in the image column", "under one extension")
    assert "Original Traceback" not in proc.stdout + proc.stderr
