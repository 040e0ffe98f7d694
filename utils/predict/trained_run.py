"""Prediction with what a training run wrote (scripts/predict.py): the run's records read back and its model
rebuilt from them, and the inputs as its evaluation read them (the predictions file's rows:
utils/predict/prediction_rows.py)."""

import bisect
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from ..data.image_dataset import TransformedImages
from ..data.image_loading import load_image_datasets, load_unlabelled_images
from ..data.mnist import load_mnist
from ..data.recipes import eval_transform
from ..errors import UserError, first_line
from ..models import ConvNet, build_model
from ..output_files import EMA_WEIGHTS, RESULTS, RUN_RECORD, WEIGHTS
from ..run.run_record import RESUMABLE_KEYS, read_run_record

WEIGHT_FILES = {"model": WEIGHTS, "ema": EMA_WEIGHTS}  # --weights: the trained weights, or --model_ema's average
SCRIPTS = ("train_mnist.py", "train_image_classifier.py")
MNIST_CLASS_NAMES = [str(digit) for digit in range(10)]
# What the image classifier's model and inputs are rebuilt from: run.json keys, then results.json keys
IMAGE_RUN_KEYS = ("model", "pretrained", "image_size", "augmentation", "val_split")
IMAGE_RESULT_KEYS = ("class_names", "stem")


@dataclass
class TrainedRun:
    """A training run as predict.py needs it: the folder with the weights, and the run's records."""

    folder: Path  # OUTPUT_DIR, or OUTPUT_DIR/best
    run: dict  # run.json: the script, model and recipe
    results: dict  # results.json of the run: class names, the resolved stem
    class_names: list  # class id i is class_names[i]
    weights: str = WEIGHTS  # the file in `folder` with the weights to predict with

    @property
    def is_mnist(self) -> bool:
        return self.run["script"] == "train_mnist.py"


def read_trained_run(model_dir, weights: str = WEIGHTS) -> TrainedRun:
    """The records of the run that wrote `model_dir`/`weights` (model.safetensors, or --model_ema's
    model_ema.safetensors); one clear line for each way they can be missing or not belong together."""
    folder = Path(model_dir)
    fix = "point --model_dir at the --output_dir of a finished training run, or at its best/"
    if weights == EMA_WEIGHTS and not (folder / weights).is_file() and (folder / WEIGHTS).is_file():
        raise UserError(f"--model_dir {folder} has no {EMA_WEIGHTS}: its run kept no moving average (trained without "
                        f"--model_ema), or it is a best/ folder, which holds one set of weights (the average's with "
                        f"--metric_for_best eval_ema_*); drop --weights ema")
    if not (folder / weights).is_file():
        raise UserError(f"--model_dir {folder} has no {weights}; {fix}")
    run = read_run_record(folder)
    if run is None:
        raise UserError(f"--model_dir {folder} has no {RUN_RECORD} beside {weights}, so its model cannot be rebuilt; "
                        f"{fix}")
    results_path = next((f / RESULTS for f in (folder, folder.parent) if (f / RESULTS).is_file()), None)
    if results_path is None:
        raise UserError(f"--model_dir {folder}: no {RESULTS} in it or in its parent folder: the training run has "
                        f"not finished; let it finish (or resume it), or {fix}")
    if results_path.parent != folder and _defining(read_run_record(folder.parent) or {}) != _defining(run):
        raise UserError(f"--model_dir {folder}: its {RUN_RECORD} is not that of the run in {folder.parent}, whose "
                        f"{RESULTS} would describe its classes; {fix}")
    try:
        results = json.loads(results_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{results_path} is unreadable ({type(err).__name__}); train again, or {fix}") from None
    script = run.get("script")
    if script not in SCRIPTS:
        raise UserError(f"{folder / RUN_RECORD} names the script {script!r}; predict.py rebuilds the models of "
                        f"{' and '.join(SCRIPTS)}: {fix}")
    if script == "train_mnist.py":
        return TrainedRun(folder, run, results, MNIST_CLASS_NAMES, weights)
    missing = [f"{RUN_RECORD}:{key}" for key in IMAGE_RUN_KEYS if key not in run] + \
              [f"{RESULTS}:{key}" for key in IMAGE_RESULT_KEYS if key not in results]
    if missing:
        raise UserError(f"--model_dir {folder}: the run's records lack {', '.join(missing)} (written by an older "
                        f"version of the training script?); train again with this version")
    return TrainedRun(folder, run, results, results["class_names"], weights)


def _defining(run: dict) -> dict:
    """What a resume cannot change: best/ keeps the resumable keys of its time."""
    return {key: value for key, value in run.items() if key not in RESUMABLE_KEYS}


def build_trained_model(trained: TrainedRun) -> torch.nn.Module:
    """The model the run trained, rebuilt from its records (never from flags), with its weights, in eval mode."""
    run, num_classes = trained.run, len(trained.class_names)
    if trained.is_mnist:
        model = ConvNet(num_classes)
    else:
        # the stem the run ended with (`--stem auto` depends on --pretrained and the size); null: not a ResNet
        model = build_model(run["model"], num_classes, image_size=run["image_size"],
                            stem=trained.results["stem"] or "imagenet")
        if run["pretrained"] and hasattr(model, "transform_input"):
            model.transform_input = True  # torchvision's pretrained GoogLeNet and Inception v3 rescale their input
    weights = trained.folder / trained.weights
    try:
        model.load_state_dict(load_file(weights))
    except Exception as err:  # safetensors' own error for a damaged file, RuntimeError for names and shapes
        raise UserError(f"{weights} does not fit the model its {RUN_RECORD} describes ({first_line(err)}); point "
                        f"--model_dir at the folder its training run wrote, untouched") from None
    return model.eval()


@dataclass
class Inputs:
    """What predict.py reads, in input order: `dataset[i]` is (uint8 image (C, H, W), label id, or -1 if unknown)."""

    dataset: Dataset
    blank: torch.Tensor  # zeros, shaped as one input: stands in for an image that cannot be decoded
    label_names: list  # the data's names of its label ids (its classes may differ from the model's)
    source_of: Callable[[int], str]  # input index -> its file, or SPLIT/ROW for a data set without files
    description: str  # what was read, for the summary line

    def first(self, count) -> "Inputs":
        """Only the first `count` inputs (all when None)."""
        if count is None or count >= len(self.dataset):
            return self
        return Inputs(Subset(self.dataset, range(count)), self.blank, self.label_names, self.source_of,
                      f"the first {count} of {self.description}")


def read_inputs(trained: TrainedRun, data_dir=None, dataset=None, split="eval", dataset_config=None,
                image_column=None, label_column=None) -> Inputs:
    """The inputs as the run's evaluation read them: for MNIST the IDX files (or ylecun/mnist) through
    utils/data/mnist.py; for images an image folder, a Hub or local `datasets` data set, or a flat folder of
    unlabelled images, decoded and resized by training's eval_transform. `split`: eval (what the run evaluated
    on, chosen the same way), train, or all (train, then eval). An input's source is its file, else SPLIT/ROW."""
    splits = {"eval": ["eval"], "train": ["train"], "all": ["train", "eval"]}[split]
    if trained.is_mnist:
        if dataset is not None:
            raise UserError(f"--model_dir {trained.folder} holds an MNIST ConvNet: give --data_dir with the MNIST IDX "
                            f"files (or neither, for ylecun/mnist), not --dataset")
        mnist = load_mnist(data_dir)
        mnist["eval"] = mnist["test"]  # what train_mnist.py evaluates on
        parts = [TensorDataset(mnist[name][0].unsqueeze(1), mnist[name][1]) for name in splits]
        where = f"--data_dir {data_dir}" if data_dir is not None else "ylecun/mnist"
        inputs, file_of, label_names = ConcatDataset(parts), None, MNIST_CLASS_NAMES
        blank = torch.zeros(1, 28, 28, dtype=torch.uint8)
    else:
        run = trained.run
        if data_dir is None and dataset is None:  # MNIST's default, ylecun/mnist, has no counterpart here
            trained_on = f"--data_dir {run['data']}" if Path(run["data"]).is_absolute() else f"--dataset {run['data']}"
            raise UserError(f"--model_dir {trained.folder} is an image classifier: name the images to predict with "
                            f"--data_dir (an image folder) or --dataset (a Hub data set or a folder of data files); "
                            f"it was trained on {trained_on}")
        folder = Path(data_dir) if data_dir is not None else None
        if folder is not None and folder.is_dir() and not any(p.is_dir() and not p.name.startswith(".")
                                                              for p in folder.iterdir()):
            splits, parts = ["all"], [load_unlabelled_images(folder)]
            image_column, label_column, label_names = "image", "label", []
            where = f"--data_dir {folder} (unlabelled: no class folders)"
        else:
            if dataset is not None and dataset == run["data"]:  # the run's own data set: its config and columns
                dataset_config = dataset_config or run.get("dataset_config")
                image_column = image_column or run.get("image_column")
                label_column = label_column or run.get("label_column")
            train, eval_, image_column, label_column, label_names = load_image_datasets(
                data_dir, dataset, dataset_config, image_column, label_column, run["val_split"])
            parts = [{"train": train, "eval": eval_}[name] for name in splits]
            where = f"--data_dir {folder}" if folder is not None else f"--dataset {dataset}"
        import datasets

        inputs = TransformedImages(datasets.concatenate_datasets(parts), eval_transform(run["image_size"],
                                   run["augmentation"]), image_column, label_column)
        file_of, size = inputs.file_of, run["image_size"]
        blank = torch.zeros(3, size, size, dtype=torch.uint8)  # as eval_transform makes them: square, RGB
    starts = list(itertools.accumulate((len(part) for part in parts), initial=0))

    def source_of(index: int) -> str:
        part = bisect.bisect_right(starts, index) - 1
        return (file_of and file_of(index)) or f"{splits[part]}/{index - starts[part]}"

    return Inputs(inputs, blank, label_names, source_of, f"split {'+'.join(splits)} of {where}")
