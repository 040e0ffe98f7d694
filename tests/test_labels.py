"""utils/data/labels.py: one class order for plain label columns, numbers in numeric order, the same ids in every split.
End to end (12 webdataset classes, streamed and not, and predict.py): tests/test_streaming.py."""

import re

import datasets
import pytest

from utils.data.image_loading import load_image_datasets
from utils.data.labels import class_names_of, encode_labels, sorted_label_values
from utils.errors import UserError


def test_numbers_sort_as_numbers_and_strings_as_strings():
    assert sorted_label_values([10, 2, 11, 0, 2, 1], "s") == [0, 1, 2, 10, 11]
    assert sorted_label_values(["10", "2", "b", "a"], "s") == ["10", "2", "a", "b"]
    with pytest.raises(UserError, match="mixes int and str values"):
        sorted_label_values([1, "1"], "s")
    with pytest.raises(UserError, match="some rows have no label"):
        sorted_label_values([1, None], "s")


def parquet_splits(root, train_labels, test_labels):
    """ROOT/train.parquet and ROOT/test.parquet: 1-px PNGs with plain integer labels."""
    from PIL import Image

    root.mkdir()
    for split, labels in (("train", train_labels), ("test", test_labels)):
        images = [Image.new("RGB", (1, 1), (label, 0, 0)) for label in labels]
        features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
        rows = datasets.Dataset.from_dict({"image": images, "label": labels}, features)
        rows.to_parquet(str(root / f"{split}.parquet"))
    return root


def test_every_split_has_the_training_splits_ids_in_numeric_order(tmp_path):
    """datasets' class_encode_column would name the classes 0, 1, 10, 11, 2, ... and number the test split's own
    values (here without 5): class 7 would be id 5 in one split and 6 in the other."""
    train_labels = [7, 11, 2, 0, 10, 5, 1, 9, 3, 8, 6, 4]
    test_labels = [11, 0, 7, 2]
    root = parquet_splits(tmp_path / "data", train_labels, test_labels)
    train, test, _, _, class_names = load_image_datasets(dataset=str(root), label_column="label")
    assert class_names == [str(label) for label in range(12)]
    assert train["label"] == train_labels and test["label"] == test_labels
    assert test.features["label"].names == class_names


def test_a_label_the_training_split_lacks_is_one_line(tmp_path):
    root = parquet_splits(tmp_path / "data", [0, 1, 2], [2, 3])
    with pytest.raises(UserError, match=r"the test split has the labels \['3'\], which the training split lacks"):
        load_image_datasets(dataset=str(root), label_column="label")


def test_encode_labels_maps_values_to_their_index():
    dataset = datasets.Dataset.from_dict({"label": ["cat", "ant", "cat"]})
    encoded = encode_labels(dataset, "label", ["ant", "bee", "cat"], "s", "train")
    assert encoded["label"] == [2, 0, 2] and encoded.features["label"].names == ["ant", "bee", "cat"]


def test_each_refusal_names_the_source_the_problem_and_the_fix():
    def refusal(call) -> str:
        with pytest.raises(UserError) as refused:
            call()
        return str(refused.value)

    assert refusal(lambda: sorted_label_values([2.5, "b", 1, "a"], "data/x")) == (
        "data/x: the label column mixes float and int and str values; store every label as one type")
    assert refusal(lambda: sorted_label_values(["a", None, "b"], "data/y")) == (
        "data/y: some rows have no label; give every image one, or drop those rows")
    dataset = datasets.Dataset.from_dict({"label": [10, 2, 7, 10]})
    assert refusal(lambda: encode_labels(dataset, "label", [1, 2, 3], "data/z", "validation")) == (
        "data/z: the validation split has the labels ['10', '7'], which the training split lacks, so the model cannot "
        "learn them; add training images of those classes, or drop their validation images")


def test_numbers_of_any_kind_sort_together_and_name_their_classes_by_their_text():
    values = sorted_label_values([True, 2, 0.5, -1, 2, 10], "s")
    assert values == [-1, 0.5, True, 2, 10]
    assert class_names_of(values) == ["-1", "0.5", "True", "2", "10"]
    assert class_names_of(sorted_label_values(("b", "a", "b"), "s")) == ["a", "b"]
    assert sorted_label_values([], "s") == []


def test_encode_labels_numbers_each_class_by_its_place_in_the_order_not_by_its_value(capsys):
    """Integer labels that are not 0..N-1 (a casting of the values alone would keep 10 as 10)."""
    dataset = datasets.Dataset.from_dict({"label": [10, 2, 7, 10]})
    encoded = encode_labels(dataset, "label", [2, 7, 10], "s", "train")
    assert encoded["label"] == [2, 0, 1, 2] and encoded.features["label"].names == ["2", "7", "10"]
    assert re.search(r"(^|\r)class ids: ", capsys.readouterr().err)  # the progress bar says what it does
