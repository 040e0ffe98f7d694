"""Inputs a user can get wrong end with one `error:` line naming the input and the fix, a non-zero
exit, no traceback through our code, and nothing written: the table grows with every case found."""

import sys

import pytest
from helpers import REPO, TRAIN_MNIST, assert_clean_user_error, launch, make_synthetic_mnist, run
from image_data import make_split_image_folder

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
SMALL = ["--image_size", "32", "--num_workers", "0", "--batch_size", "8", "--epochs", "1", "--optimizer", "adamw"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("bad_inputs_digits"), num_train=64, num_test=20)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_split_image_folder(tmp_path_factory.mktemp("bad_inputs_images"), train_per_class=8, val_per_class=2)


@pytest.mark.parametrize("flags, words", [
    (["--seed", "-1"], ["--seed", "0 <= seed < 2**32"]),
    (["--seed", str(2**32)], ["--seed", "0 <= seed < 2**32"]),
    (["--seed", "abc"], ["--seed", "whole number"]),
    (["--ddp_timeout", "0"], ["--ddp_timeout", "positive integer"]),
])
def test_bad_shared_flags(digits, tmp_path, flags, words):
    proc = run([sys.executable, TRAIN_MNIST, "--cpu", "--data_dir", digits, "--output_dir", tmp_path / "out", *flags],
               check=False)
    assert_clean_user_error(proc, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, words", [
    (["--warmup_epochs", "nan"], ["--warmup_epochs", "finite number >= 0"]),
    (["--warmup_epochs", "inf"], ["--warmup_epochs", "finite number >= 0"]),
    (["--momentum", "nan"], ["--momentum", "finite number >= 0"]),
    (["--weight_decay", "-0.1"], ["--weight_decay", "finite number >= 0"]),
    (["--model", "torch.nn:Linear"], ["--model torch.nn:Linear", "Linear(num_classes=4) failed", "takes num_classes"]),
    (["--model", ":resnet18"], ["--model :resnet18", "package.module:function"]),
    (["--model", "no_such_module:f"], ["--model no_such_module:f", "cannot import it"]),
    (["--model", "vit_b_16"], ["--model vit_b_16 cannot take --image_size 32", "224"]),
])
def test_bad_classifier_inputs(images, tmp_path, flags, words):
    proc = run([sys.executable, CLASSIFIER, "--cpu", "--data_dir", images, "--output_dir", tmp_path / "out", *SMALL,
                *flags], check=False)
    assert_clean_user_error(proc, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("num_workers", ["0", "1"])  # decoded in the main process, and in a DataLoader worker
def test_a_corrupt_image_names_its_file(tmp_path, num_workers):
    folder = make_split_image_folder(tmp_path / "images", train_per_class=8, val_per_class=2)
    broken = sorted((folder / "train").rglob("*.png"))[3]
    broken.write_bytes(broken.read_bytes()[:60])  # truncated: a valid PNG header, then nothing
    flags = [f if f != "0" else num_workers for f in SMALL]
    proc = launch(["--data_dir", folder, "--output_dir", tmp_path / "out", *flags], script=CLASSIFIER, check=False)
    assert_clean_user_error(proc, broken.name, "cannot be decoded", "replace or delete it")
    assert "Traceback" not in "\n".join(l for l in (proc.stdout + proc.stderr).splitlines() if l.startswith("error"))
    assert not (tmp_path / "out" / "results.json").exists()
