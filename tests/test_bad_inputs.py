"""Inputs a user can get wrong end with one `error:` line naming the input and the fix, a non-zero
exit, no traceback through our code, and nothing written: the table grows with every case found."""

import sys

import pytest
from helpers import REPO, TRAIN_MNIST, assert_clean_user_error, launch, load_script, run
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


# Decoded in the main process; in a DataLoader worker on one of two processes, whose partner stops with a note.
@pytest.mark.parametrize("num_workers, num_processes", [("0", 1), ("1", 2)])
def test_a_corrupt_image_names_its_file(tmp_path, num_workers, num_processes):
    folder = make_split_image_folder(tmp_path / "images", train_per_class=8, val_per_class=2)
    broken = sorted((folder / "train").rglob("*.png"))[3]
    broken.write_bytes(broken.read_bytes()[:60])  # truncated: a valid PNG header, then nothing
    flags = [f if f != "0" else num_workers for f in SMALL]
    proc = launch(["--data_dir", folder, "--output_dir", tmp_path / "out", *flags], num_processes=num_processes,
                  script=CLASSIFIER, check=False)
    assert_clean_user_error(proc, broken.name, "cannot be decoded", "replace it with a good copy")
    # a DataLoader worker wraps the error in its own traceback ("Original Traceback ..."): none of it is printed
    assert "Original Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()
