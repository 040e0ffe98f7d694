"""Image datasets loaded: image folders and Hub datasets through `datasets`, split into training and evaluation, their
image and label columns found; a folder of new images for predictions."""

from pathlib import Path

# datasets is imported in the functions that use it: it takes seconds to import, which `--help` need not wait for
from ..data.data_layout import check_every_row_has_an_image, check_image_folder, mixed_extensions_error
from ..data.labels import encode_labels, sorted_label_values
from ..errors import UserError, first_line

EVAL_SPLITS = ("validation", "test")  # `imagefolder` names a val/ folder "validation"


# The train/val split of a single class-folder root must not move when --seed changes,
# or runs with different seeds would be evaluated on different images.
VAL_SPLIT_SEED = 0


def load_image_datasets(data_dir=None, dataset=None, dataset_config=None, image_column=None,
                        label_column=None, val_split=0.2):
    """(train, eval, image_column, label_column, class_names) as `datasets.Dataset`s.

    `data_dir`: an ImageFolder tree, either DIR/train/<class>/* with DIR/val|validation|test/<class>/*,
    or DIR/<class>/* alone, split by `val_split` (stratified, fixed seed). `dataset`: a Hub dataset
    name (or a local folder of data files); columns are detected unless given. Class ids follow the folder names
    sorted as strings (as torchvision's ImageFolder), the values of a plain label column sorted (integers as numbers,
    strings as strings: utils/data/labels.py), and the ClassLabel's own order (not necessarily sorted) for a data set
    that has one; either way the same in every split, on every process and in every run.
    """
    import datasets  # imported here: the unit tests of the models need none of it

    if data_dir is not None:
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise UserError(f"--data_dir {data_dir}: no such directory; point it at an image folder "
                            f"(DIR/<class>/*.jpg or DIR/train/<class>/*)")
        source = f"--data_dir {data_dir}"
        check_image_folder(data_dir)  # stray images, empty class folders, classes without training images: one line
        try:
            splits = datasets.load_dataset("imagefolder", data_dir=str(data_dir))
        except Exception as err:  # no images, unreadable files: datasets raises many types
            raise UserError(f"{source}: not an image folder ({type(err).__name__}: {first_line(err)}); "
                            f"expected DIR/<class>/*.jpg or DIR/train/<class>/* and DIR/val/<class>/*") from None
    else:
        source = f"--dataset {dataset}"
        try:
            splits = datasets.load_dataset(dataset, dataset_config)
        except Exception as err:  # offline, no cache, unknown name, gated dataset, mixed webdataset extensions...
            raise UserError(mixed_extensions_error(source, err) or
                            f"could not load {source} ({type(err).__name__}: {first_line(err)}); check the name "
                            f"(and --dataset_config), log in for gated datasets, or pass --data_dir with an image "
                            f"folder") from None

    train = splits["train"] if "train" in splits else None
    if train is None:
        raise UserError(f"{source} has no 'train' split (it has {sorted(splits)}); use a dataset with one")
    if data_dir is not None and len(getattr(train.features.get("label"), "names", [])) < 2:
        # imagefolder labels images by their parent folder; a flat folder gives no labels
        raise UserError(f"{source}: found fewer than 2 class folders; put each class's images in DIR/<class>/ "
                        f"(or DIR/train/<class>/ and DIR/val/<class>/)")
    image_column = image_column or column_of_type(train, datasets.Image, "image", source, "--image_column")
    label_column = label_column or column_of_type(train, datasets.ClassLabel, "label", source, "--label_column")
    for column, flag in ((image_column, "--image_column"), (label_column, "--label_column")):
        if column not in train.column_names:
            raise UserError(f"{source}: no column {column!r} (columns: {train.column_names}); fix {flag}")
    if not isinstance(train.features[label_column], datasets.ClassLabel):
        # integer or string labels: one id per distinct value of the training split, in sorted order (numbers as
        # numbers), the same ids in every split (utils/data/labels.py)
        values = sorted_label_values(train.unique(label_column), source)
        splits = datasets.DatasetDict({name: encode_labels(split, label_column, values, source, name)
                                       for name, split in splits.items()})
        train = splits["train"]

    eval_name = next((name for name in EVAL_SPLITS if name in splits), None)
    if eval_name is not None:
        eval_ = splits[eval_name]
    else:
        try:
            parts = train.train_test_split(test_size=val_split, seed=VAL_SPLIT_SEED, stratify_by_column=label_column)
        except ValueError as err:  # e.g. fewer images in a class than the split needs
            raise UserError(f"{source}: cannot split off --val_split {val_split} ({first_line(err)}); "
                            f"add images or change --val_split") from None
        train, eval_ = parts["train"], parts["test"]
    for name, split in (("training", train), ("evaluation", eval_)):
        check_every_row_has_an_image(split, image_column, f"{source}: the {name} split")
    class_names = train.features[label_column].names
    return train, eval_, image_column, label_column, class_names


def load_unlabelled_images(folder):
    """Every image file directly in `folder` (no class folders), sorted by name, as a `datasets.Dataset` with an
    "image" column and a "label" column of -1 (no class known): new images for scripts/predict.py. Image files are
    told by their extension, as `imagefolder` tells them."""
    import datasets
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    folder = Path(folder)
    paths = sorted(str(path.resolve()) for path in folder.iterdir()
                   if path.is_file() and path.suffix.lower() in ImageFolder.EXTENSIONS)
    if not paths:
        raise UserError(f"--data_dir {folder} holds no images (no .jpg, .png, ... file directly in it, and no class "
                        f"folders); point it at a folder of images, or at an image folder DIR/<class>/*.jpg")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": paths, "label": [-1] * len(paths)}, features=features)


def column_of_type(dataset, feature_type, preferred, source, flag):
    if preferred in dataset.column_names and isinstance(dataset.features[preferred], feature_type):
        return preferred
    matches = [name for name, feature in dataset.features.items() if isinstance(feature, feature_type)]
    if len(matches) != 1:
        raise UserError(f"{source}: cannot tell which column holds the {preferred}s (found {matches or 'none'} "
                        f"among {dataset.column_names}); name it with {flag}")
    return matches[0]
