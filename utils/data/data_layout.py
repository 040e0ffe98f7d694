"""Image data laid out so that `datasets` reads it as something else than it looks: one line naming the folder, file
or split and the fix, where `datasets` would go on silently, fail later or say nothing of what to do.

Image folders (--data_dir) are checked before `datasets` reads them: `imagefolder` names each image's class by its
parent folder, over all splits, and drops the labels altogether when the images do not all lie at the same depth. So
an empty class folder is no class (10 classes where there are 11 folders), a class with a val/ folder only is a class
without training images, and one image beside the class folders leaves no labels at all ("fewer than 2 class
folders"). Webdataset shards whose samples' images have different extensions come without some images.
"""

import os
import re
from pathlib import Path

from ..errors import UserError, first_line

SHOWN = 3  # files or folders named in one error line


def check_image_folder(data_dir: Path) -> None:
    """One line for: image files beside class folders, a class folder without images, a class that has evaluation
    images (DIR/val|validation|test/<class>) but no training images. DIR/<class>/* or DIR/train/<class>/* with
    DIR/val/<class>/*; a folder of images without class folders is left to the caller."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    def is_image(entry) -> bool:
        return entry.is_file() and os.path.splitext(entry.name)[1].lower() in ImageFolder.EXTENSIONS

    def has_images(path: Path) -> bool:
        with os.scandir(path) as entries:  # stops at the first image: one class folder of ImageNet costs microseconds
            return any(is_image(entry) for entry in entries)

    def folders(path: Path) -> list:
        with os.scandir(path) as entries:
            return sorted(entry.name for entry in entries if entry.is_dir() and not entry.name.startswith("."))

    split_roots = {name: data_dir / name for name in folders(data_dir) if split_of(name) is not None}
    roots = split_roots or {"": data_dir}  # DIR/train/<class>/..., or DIR/<class>/...
    classes = {}
    for name, root in roots.items():
        class_folders = folders(root)
        with os.scandir(root) as entries:
            strays = sorted(entry.name for entry in entries if is_image(entry))
        if strays and class_folders:
            raise UserError(f"--data_dir {data_dir}: {_some(strays)} lie directly in {root}, beside its class folders "
                            f"({_some(class_folders)}); move each image into its class's folder, or out of {root}")
        empty = [folder for folder in class_folders if not has_images(root / folder)]
        if empty:
            raise UserError(f"--data_dir {data_dir}: the class folder(s) {_some(empty)} in {root} hold no images "
                            f"(.jpg, .png, ... directly in them); add the class's images, or delete the folder(s)")
        classes[name] = set(class_folders)
    train = next((name for name in roots if split_of(name) in ("", "train")), None)
    for name, names in classes.items():
        untrained = sorted(names - classes[train]) if train is not None and name != train else []
        if untrained:
            raise UserError(f"--data_dir {data_dir}: the class(es) {_some(untrained)} have images in {roots[name]} "
                            f"but none in {roots[train]}, so the model cannot learn them; add their training images "
                            f"to {roots[train]}/<class>/, or delete their folders in {roots[name]}")


def split_of(folder_name: str):
    """The split `datasets` reads a folder of this name as ("train", "validation", "test"), "" for the root, else None:
    a folder named by one of its split keywords, alone or between separators (train, val, test-2024, my_validation)."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    if folder_name == "":
        return ""
    for split, keywords in SPLIT_KEYWORDS.items():
        for keyword in keywords:
            if re.fullmatch(rf"(.*[{NON_WORDS_CHARS}])?{keyword}([{NON_WORDS_CHARS}].*)?", folder_name):
                return str(split)
    return None


def _some(names: list) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


# Webdataset shards whose samples' images have different extensions: `datasets` makes a column of each extension, or
# only of those its first samples have, so other samples come without an image, or the shards do not load
MIXED_EXTENSIONS = ("webdataset shards must store every sample's image under one extension (KEY.jpg with KEY.cls, "
                    "not KEY.png in some samples): re-encode the others, or rename them, as this script decodes an "
                    "image by its content, not its name")
MISSING_IMAGE = (f"a sample has no image in the image column; {MIXED_EXTENSIONS}. Other data sets: drop the rows "
                 f"without an image")


def mixed_extensions_error(source: str, err: Exception):
    """The line for webdataset shards that `datasets` cannot load because their samples' files differ (its own message
    does not say what to do); None for other errors."""
    if "WebDataset format" in str(err):
        return f"{source}: {MIXED_EXTENSIONS} (datasets: {first_line(err)})"
    return None


def check_every_row_has_an_image(split, image_column: str, source: str) -> None:
    """One line where rows of a map-style split have no image (arrow's count of nulls: nothing is read)."""
    missing = split.data.column(image_column).null_count
    if missing:
        raise UserError(f"{source} has {missing} row(s) without an image in its column {image_column!r}; "
                        f"{MIXED_EXTENSIONS}. Other data sets: drop the rows without an image")
