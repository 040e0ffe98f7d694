"""Class ids of plain label columns (integers or strings, no ClassLabel): one order for training, evaluation,
`class_names`, scripts/predict.py and the ONNX metadata, with and without --streaming.

Class id i is the i-th of the distinct label values in sorted order: numbers in numeric order (0, 1, 2, ..., 10, 11),
strings in string order. `datasets`' class_encode_column sorts the values as strings (0, 1, 10, 11, 2, ...) and encodes
each split on its own (a class missing from one split shifts the ids of the others), so it is not used here.
"""

from ..errors import UserError


def sorted_label_values(values, source: str) -> list:
    """The distinct label values, sorted: numbers as numbers, strings as strings. A missing label or a column that
    mixes numbers and strings: one line."""
    distinct = set(values)
    if None in distinct:
        raise UserError(f"{source}: some rows have no label; give every image one, or drop those rows")
    try:
        return sorted(distinct)
    except TypeError:  # numbers beside strings: no order both would agree on
        kinds = sorted({type(value).__name__ for value in distinct})
        raise UserError(f"{source}: the label column mixes {' and '.join(kinds)} values; store every label as one "
                        f"type") from None


def class_names_of(values: list) -> list:
    """The class names of sorted label values, as results.json and the ONNX metadata list them: their text."""
    return [str(value) for value in values]


def encode_labels(dataset, label_column: str, values: list, source: str, split: str):
    """`dataset` with its plain `label_column` replaced by a ClassLabel of `values` (sorted_label_values'): each row's
    value becomes its index in `values`. A value not among them: one line naming it and the split."""
    import datasets

    unknown = set(dataset.unique(label_column)) - set(values)
    if unknown:
        raise UserError(f"{source}: the {split} split has the labels {sorted(map(str, unknown))}, which the training "
                        f"split lacks, so the model cannot learn them; add training images of those classes, or drop "
                        f"their {split} images")
    ids = {value: class_id for class_id, value in enumerate(values)}
    features = dataset.features.copy()
    features[label_column] = datasets.ClassLabel(names=class_names_of(values))
    return dataset.map(lambda batch: {label_column: [ids[value] for value in batch[label_column]]}, batched=True,
                       features=features, desc="class ids")
