"""The predictions file's rows (scripts/predict.py): the inputs padded to whole batches, so that every input is
predicted beside the same inputs on any number of processes, and the gathered predictions written back one row per
input, in input order, whatever order the processes gathered them in."""

import csv
import io
import math
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from ..errors import UserError

if TYPE_CHECKING:  # trained_run.py builds the inputs (and imports torchvision and datasets to do so)
    from .trained_run import Inputs


class WholeBatches(Dataset):
    """The inputs padded to whole batches with copies of the first ones; item p: (image, label, p, unreadable).

    With every batch whole, each input is predicted in the same batch, beside the same inputs, on any number
    of processes: process k of N takes batches k, k + N, ... and Accelerate evens out the last round with
    whole batches. A smaller last batch could round differently (kernels are chosen by batch size), so the
    probabilities would not be the same bits on every process count. Positions past the inputs are dropped
    after gathering. An image that cannot be decoded comes as `blank`, flagged, unless `stop_on_error`."""

    def __init__(self, inputs: Dataset, batch_size: int, blank: torch.Tensor, stop_on_error: bool):
        self.inputs, self.blank, self.stop_on_error = inputs, blank, stop_on_error
        self.length = math.ceil(len(inputs) / batch_size) * batch_size

    def __len__(self):
        return self.length

    def __getitem__(self, position):
        try:
            image, label = self.inputs[position % len(self.inputs)]
            return image, label, position, 0
        except UserError:
            if self.stop_on_error:
                raise
            return self.blank, -1, position, 1

    def error_of(self, index: int) -> str:
        """Why input `index` could not be read (its UserError's line)."""
        try:
            self.inputs[index]
        except UserError as err:
            return str(err)
        return ""


def predictions_csv(columns, inputs: "Inputs", errors: WholeBatches, class_names: list, top_k: int) -> tuple:
    """The predictions file's text, from the gathered columns (positions, unreadable flags, labels, top-k class
    ids and probabilities) in any order, with the padding; and its counts: inputs labelled and readable, those
    whose top-1 class is their label, and the unreadable ones. One row per input, in input order; probabilities
    with 6 decimals."""
    positions, unreadable, labels, classes, probabilities = (torch.cat(column).cpu() for column in columns)
    keep = positions < len(inputs.dataset)  # the padding to whole batches
    order = positions[keep].argsort()
    positions, unreadable, labels, classes, probabilities = (
        column[keep][order] for column in (positions, unreadable, labels, classes, probabilities))
    if not torch.equal(positions, torch.arange(len(inputs.dataset))):
        raise RuntimeError(f"gathered {len(positions)} rows for {len(inputs.dataset)} inputs, not each once")
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["index", "source", "label", *[f"{name}_{rank}" for rank in range(1, top_k + 1)
                                                   for name in ("class", "probability")], "error"])
    counts = {"labelled": 0, "correct": 0, "unreadable": 0}
    for index, bad, label, top_classes, top_probabilities in zip(
            positions.tolist(), unreadable.tolist(), labels.tolist(), classes.tolist(), probabilities.tolist()):
        label_name = inputs.label_names[label] if label >= 0 else ""
        if bad:
            counts["unreadable"] += 1
            writer.writerow([index, inputs.source_of(index), label_name, *[""] * (2 * top_k), errors.error_of(index)])
            continue
        predicted = [class_names[c] for c in top_classes]
        writer.writerow([index, inputs.source_of(index), label_name,
                         *[cell for name, p in zip(predicted, top_probabilities) for cell in (name, f"{p:.6f}")], ""])
        if label_name:
            counts["labelled"] += 1
            counts["correct"] += predicted[0] == label_name
    return text.getvalue(), counts
