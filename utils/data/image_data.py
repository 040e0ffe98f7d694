"""Image classification data: image folders and Hub datasets through `datasets`, torchvision
transforms, and a Dataset that decodes and augments inside the DataLoader workers.

The workers do only what must happen per image on a CPU core: decode the file's bytes into a uint8 tensor
(libjpeg-turbo through simplejpeg for JPEGs, PIL for the rest) and crop, resize and flip it as uint8. The batch
stays uint8 up to the device, a quarter of float32's bytes, and `normalise_on_device` makes it the model's input
there. scripts/benchmark_data.py measures this against the earlier float pipeline (docs/benchmarks/cpu_input_pipeline).
"""

import contextlib
import functools
import io
from pathlib import Path

import numpy as np
import torch

# torchvision, simplejpeg, PIL and datasets are imported in the functions that use them: they take seconds to import,
# which `--help` need not wait for
from utils.data.data_layout import (
    MISSING_IMAGE,
    check_every_row_has_an_image,
    check_image_folder,
    mixed_extensions_error,
)
from utils.data.image_modes import viewer_rgb
from utils.data.labels import encode_labels, sorted_label_values
from utils.errors import UserError, first_line

# torchvision's pretrained weights expect ImageNet-normalised inputs; from scratch it does no harm.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
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
    strings as strings: utils/data/labels.py), and the ClassLabel's own order (not necessarily sorted) for a data set that
    has one; either way the same in every split, on every process and in every run.
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
    image_column = image_column or _column_of_type(train, datasets.Image, "image", source, "--image_column")
    label_column = label_column or _column_of_type(train, datasets.ClassLabel, "label", source, "--label_column")
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


def _column_of_type(dataset, feature_type, preferred, source, flag):
    if preferred in dataset.column_names and isinstance(dataset.features[preferred], feature_type):
        return preferred
    matches = [name for name, feature in dataset.features.items() if isinstance(feature, feature_type)]
    if len(matches) != 1:
        raise UserError(f"{source}: cannot tell which column holds the {preferred}s (found {matches or 'none'} "
                        f"among {dataset.column_names}); name it with {flag}")
    return matches[0]


# --augmentation auto: the ImageNet recipe from this side up; below it, the small-image one.
SMALL_IMAGE_LIMIT = 128


def resolve_augmentation(augmentation: str, image_size: int) -> str:
    """--augmentation {auto,imagenet,small,none} -> the recipe: auto picks by the image size."""
    if augmentation == "auto":
        return "imagenet" if image_size >= SMALL_IMAGE_LIMIT else "small"
    return augmentation


def default_hflip(recipe: str) -> bool:
    """Horizontal flips by default for photos (the ImageNet recipe) only: small images are as often digits,
    text, icons or scans, where a mirror image is another symbol."""
    return recipe == "imagenet"


def train_transform(image_size: int, recipe: str = "imagenet", hflip: bool = True):
    """imagenet: RandomResizedCrop (8-100% of the area) as in torchvision's recipes. small: the whole image
    resized, a mild scale jitter (90-110%) and a random crop from a reflect-padded copy (pad 1/8 of the side), as in
    CIFAR recipes; a random crop of 8% of a 32-pixel image would leave a few pixels. none: the image resized."""
    from torchvision.transforms import v2
    if recipe == "imagenet":
        geometry = [RandomResizedCrop(image_size)]
    elif recipe == "small":
        geometry = [_whole_image(image_size), v2.RandomAffine(degrees=0, scale=(0.9, 1.1)),
                    v2.RandomCrop(image_size, padding=image_size // 8, padding_mode="reflect")]
    else:
        geometry = [_whole_image(image_size)]
    return _uint8_image(*geometry, *([v2.RandomHorizontalFlip()] if hflip else []))


def eval_transform(image_size: int, recipe: str = "imagenet"):
    """imagenet: the central crop of the image resized to size/0.875 (224 of 256, the usual ImageNet ratio). small and
    none: the whole image resized to the size: the central crop would cut the borders off small images."""
    if recipe == "imagenet":
        return _uint8_image(CentralCropResized(image_size, round(image_size / 0.875)))
    return _uint8_image(_whole_image(image_size))


def _resized_crop(image: torch.Tensor, params: dict, size) -> torch.Tensor:
    """The region `params` (top, left, height, width) of a (3, H, W) uint8 image resized to `size`, antialiased.

    The region is copied to contiguous (H, W, 3) memory first: torch's uint8 resize reads that layout at full speed,
    and a strided view of the image at a third more cost than the copy and the resize together."""
    from torchvision.transforms import v2
    top, left, height, width = params["top"], params["left"], params["height"], params["width"]
    crop = image[:, top:top + height, left:left + width].permute(1, 2, 0).contiguous().permute(2, 0, 1)
    return v2.functional.resize(crop, list(size), antialias=True)


class _RegionResized:
    """A first step that resizes one region of the image, (top, left, height, width) from make_params, to `size`,
    antialiased (_resized_crop). The region depends on the image's size only: decode_and_transform draws it from a
    JPEG's header and decodes no more pixels than the region needs (_TensorCompose.apply_to_file)."""

    size: tuple

    def make_params(self, flat_inputs) -> dict:
        return self.region(*flat_inputs[0].shape[-2:])

    def region(self, height: int, width: int) -> dict:
        raise NotImplementedError

    def transform(self, image, params):
        return _resized_crop(image, params, self.size)

    def __call__(self, image):  # as a v2 transform is called, so that v2.Compose can hold it
        return self.transform(image, self.make_params([image]))


class RandomResizedCrop(_RegionResized):
    """v2.RandomResizedCrop(size, antialias=True): its own draws, the same pixels."""

    def __init__(self, size: int):
        from torchvision.transforms import v2
        self.draws, self.size = v2.RandomResizedCrop(size, antialias=True), (size, size)

    def region(self, height, width):
        # v2 reads only the size of what it is given: a tensor of that shape over one byte of memory
        return self.draws.make_params([torch.empty(1, dtype=torch.uint8).expand(3, height, width)])

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]})"


class CentralCropResized(_RegionResized):
    """v2.Resize(resize_to) then v2.CenterCrop(size) as one step: the part of the image that the central crop shows
    (the same, to the nearest pixel of the image) is cut out first and only it is resized, a quarter to a half less
    resizing work."""

    def __init__(self, size: int, resize_to: int):
        self.size, self.resize_to = (size, size), resize_to

    def region(self, height, width):
        size = self.size[0]
        # the resized image's sides and the crop's corner in it, as v2.Resize and v2.CenterCrop compute them
        longer = int(self.resize_to * max(height, width) / min(height, width))
        resized_height, resized_width = (self.resize_to, longer) if height <= width else (longer, self.resize_to)
        top, left = round((resized_height - size) / 2), round((resized_width - size) / 2)
        scale_y, scale_x = height / resized_height, width / resized_width  # back in the image's pixels
        top, left = round(top * scale_y), round(left * scale_x)
        return {"top": top, "left": left, "height": min(round(size * scale_y), height - top),
                "width": min(round(size * scale_x), width - left)}

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]}, resize_to={self.resize_to})"


class WholeImageResized(_RegionResized):
    """v2.Resize((size, size), antialias=True): the whole image, squeezed to a square, the same pixels."""

    def __init__(self, size: int):
        self.size = (size, size)

    def region(self, height, width):
        return {"top": 0, "left": 0, "height": height, "width": width}

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]})"


def _whole_image(image_size: int):
    return WholeImageResized(image_size)  # no crop: non-square images are squeezed


def _uint8_image(*geometry):
    """The recipe's geometric steps on a uint8 (3, H, W) tensor, giving one: torchvision's uint8 resize is its fastest,
    and normalise_on_device does the rest on the device."""
    return _TensorCompose(geometry)


class _TensorCompose:
    """v2.Compose(transforms) for one plain tensor: the same random draws in the same order, the same pixels.

    Hand-written because v2 spends as long on each call's bookkeeping (flattening nested inputs, finding the kernel
    for the input's type) as the crop and flip themselves: a tenth of an image's whole cost on a core. Each transform's
    own make_params and transform do the work; a flip draws its coin first, as v2's random-apply transforms do."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    @property
    def draws_random_numbers(self) -> bool:
        """False for evaluation's steps: its images need no seeded generator."""
        return not all(isinstance(t, (CentralCropResized, WholeImageResized)) for t in self.transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self._apply(self.transforms, image)

    def apply_to_file(self, data: bytes, decode) -> torch.Tensor:
        """The steps applied to the image file `data`, decoded by `decode(reduction)` (decode_rgb's). Where the first
        step resizes a region (_RegionResized) of a JPEG, the region is drawn from the header's size, before decoding,
        and the JPEG decoded at 1/2, 1/4 or 1/8 of its size where the region stays at least the output's size there:
        libjpeg-turbo's scaled decoding does a quarter of the work at 1/2 and less below. The same draws, in the same
        order, as decoding first; the pixels of a scaled decode differ from a full one's by a level or two."""
        first = self.transforms[0]
        size = jpeg_size(data) if isinstance(first, _RegionResized) else None
        if size is None:
            return self(decode(1))
        region = first.region(*size)
        image = decode(reduction_for(region, first.size))
        return self._apply(self.transforms[1:], first.transform(image, _region_scaled(region, size, image.shape[1:])))

    @staticmethod
    def _apply(transforms, image):
        from torchvision.transforms import v2
        for transform in transforms:
            if isinstance(transform, v2.RandomHorizontalFlip):
                if torch.rand(1) < transform.p:
                    image = transform.transform(image, {})
            else:
                image = transform.transform(image, transform.make_params([image]))
        return image

    def __repr__(self):
        return "\n".join([f"{type(self).__name__}(", *(f"    {t}" for t in self.transforms), ")"])


# libjpeg-turbo decodes at 1/2, 1/4 and 1/8 with its fast (SIMD) inverse DCTs; its other scales (3/8, 5/8...) take
# longer than a full decode on photos
JPEG_REDUCTIONS = (8, 4, 2)


def reduction_for(region: dict, size) -> int:
    """The largest of JPEG_REDUCTIONS that leaves `region` (top, left, height, width) at least `size` (height, width),
    or 1: the image is then resized down as much as before, never up."""
    return next((r for r in JPEG_REDUCTIONS if region["height"] >= r * size[0] and region["width"] >= r * size[1]), 1)


def _region_scaled(region: dict, size, shape) -> dict:
    """`region` of an image of `size` (height, width) in the pixels of the same image decoded at `shape`, within it."""
    scale_y, scale_x = shape[0] / size[0], shape[1] / size[1]
    top, left = min(round(region["top"] * scale_y), shape[0] - 1), min(round(region["left"] * scale_x), shape[1] - 1)
    return {"top": top, "left": left, "height": max(1, min(round(region["height"] * scale_y), shape[0] - top)),
            "width": max(1, min(round(region["width"] * scale_x), shape[1] - left))}


def jpeg_size(data: bytes):
    """(height, width) of a JPEG that decode_rgb decodes with simplejpeg (stored upright), from its header; None for
    other files, and where the header does not read (decoding then names the problem)."""
    import simplejpeg
    if not _is_upright_jpeg(data):
        return None
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return height, width


def autocast_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype autocast computes in under the launch's mixed precision ("fp16", "bf16"; float32 otherwise): what
    normalise_on_device should give, so the model's first layer casts nothing."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def normalise_on_device(images, dtype=torch.float32, channels_last: bool = False):
    """A uint8 (N, 3, H, W) batch, already on the device, as the model's input: `dtype` (the autocast dtype under
    mixed precision), normalised as torchvision's pretrained weights expect, channels-last if asked. One copy: the
    cast writes the new tensor in its final layout, and the normalisation works in place."""
    images = images.to(dtype=dtype, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    mean = torch.tensor(IMAGENET_MEAN, dtype=dtype, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, dtype=dtype, device=images.device).view(1, 3, 1, 1) * 255
    return images.sub_(mean).div_(std)


def device_normaliser(dtype=torch.float32, channels_last: bool = False):
    """normalise_on_device with this run's dtype and memory format: what the training loop applies to each batch."""
    return functools.partial(normalise_on_device, dtype=dtype, channels_last=channels_last)


def collate_images(samples: list):
    """default_collate of (image, label, ...) samples, the (3, H, W) uint8 images stacked into a channels-last batch:
    (N, 3, H, W) over (N, H, W, 3) memory, the layout the workers' resize gives them in, so stacking is one plain copy
    (into contiguous (N, 3, H, W) memory it costs a third of the resize). normalise_on_device writes the layout the
    model wants, contiguous or channels-last, on the device."""
    from torch.utils.data import default_collate
    images, *rest = default_collate([(sample[0].permute(1, 2, 0), *sample[1:]) for sample in samples])
    return [images.permute(0, 3, 1, 2), *rest]


def decode_rgb(data: bytes, reduction: int = 1) -> torch.Tensor:
    """An image file's bytes as a uint8 (3, H, W) RGB tensor, as a viewer shows the file: greyscale, palette, CMYK and
    16-bit images become 3 channels of 8 bits, transparent pixels white (utils/data/image_modes.py).

    JPEGs, most of any photo data set, go through simplejpeg (libjpeg-turbo's TurboJPEG API, as PIL uses): a third
    less time than PIL here. With fastupsample, colour stored at half resolution (4:2:0, most photos) is repeated over
    its 2x2 pixels rather than blended with its neighbours: under a level (of 255) from PIL's pixels on average, for
    6% less time; JPEGs with full-resolution colour give PIL's pixels exactly. `reduction` (2, 4 or 8): such a JPEG
    decoded at that fraction of its size, rounded up (libjpeg-turbo's scaled decoding). PIL reads the rest (PNG, WebP,
    BMP, TIFF) and the photos tagged as rotated, which it turns upright, as `datasets` does when it decodes, at full
    size. Both give rows of RGB pixels, so the tensor is a (3, H, W) view of (H, W, 3) memory, the channels-last
    layout in which torch's uint8 resize is fastest.
    """
    import simplejpeg
    from PIL import Image, ImageOps

    pixels = None
    if _is_upright_jpeg(data):
        try:
            scaled = {}
            if reduction > 1:
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
                scaled = {"min_height": -(-height // reduction), "min_width": -(-width // reduction),
                          "min_factor": reduction}
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastupsample=True, **scaled)
        except ValueError:  # damaged, or a JPEG flavour TurboJPEG does not read: PIL decides which
            pass
    if pixels is None:
        with Image.open(io.BytesIO(data)) as image:
            pixels = viewer_rgb(ImageOps.exif_transpose(image))  # 16-bit scaled, transparency on white
    return torch.from_numpy(pixels).permute(2, 0, 1)


def _is_upright_jpeg(data: bytes) -> bool:
    """A JPEG stored the way up it is shown (no EXIF or XMP orientation to apply): what simplejpeg decodes."""
    return data[:3] == b"\xff\xd8\xff" and _jpeg_orientation(data) == 1


def _jpeg_orientation(data: bytes):
    """The EXIF orientation of a JPEG's bytes (1: stored upright, as when it has no EXIF), or None where PIL should
    decide: XMP metadata (PIL reads an orientation there too), or a header not as expected.

    Hand-written because PIL's Image.open parses every table of the header in Python, a twentieth of an image's
    whole cost in a worker; walking the segments' lengths up to the image data costs microseconds."""
    from PIL import ExifTags, Image

    exif, position = None, 2  # after the start-of-image marker
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before a marker
            position += 1
            continue
        if marker == 0xDA:  # start of scan: the image data follows, the header is complete
            if exif is None:
                return 1
            orientation = Image.Exif()
            orientation.load(exif)  # the parser Image.getexif uses
            return orientation.get(ExifTags.Base.Orientation, 1)
        end = position + 2 + int.from_bytes(data[position + 2:position + 4], "big")
        if marker == 0xE1:  # APP1: EXIF or XMP
            if data[position + 4:position + 10] != b"Exif\x00\x00":
                return None
            exif = exif or data[position + 4:end]  # the first one, as PIL keeps it
        position = end
    return None


class TransformedImages(torch.utils.data.Dataset):
    """Decodes and transforms one image per __getitem__, i.e. inside the DataLoader workers: a uint8 tensor.

    Random augmentations draw from a generator seeded by (seed, epoch, sample index), so a
    sample is augmented the same way whichever worker or process loads it, and a resumed run
    (which skips batches and restarts workers) sees the same images as an uninterrupted one.
    (datasets' set_transform does not see the sample index, which these seeds need.)
    """

    def __init__(self, dataset, transform, image_column: str, label_column: str, seed: int = 0):
        import datasets

        # the files' bytes (or their paths), undecoded: decode_rgb makes the tensor without a PIL image
        self.dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.transform, self.image_column, self.label_column, self.seed = transform, image_column, label_column, seed
        # shared memory: persistent workers see set_epoch() of the main process
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def source_of(self, index) -> str:
        """The file (or dataset row) an image comes from."""
        return _source_of(self.dataset[index][self.image_column], index)

    def file_of(self, index):
        """The file the image is read from, or None where the data set holds the image's bytes."""
        image = self.dataset[index][self.image_column]
        return image["path"] if image["bytes"] is None else None

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the augmentations are seeded with, as the main process last set it."""
        return int(self._epoch)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        example = self.dataset[index]
        return self._sample(index, example[self.image_column], example[self.label_column])

    def __getitems__(self, indices):
        """The samples of a batch (the DataLoader calls this where it exists): one query reads all their rows, a
        twentieth of an image's cost less than a query per row."""
        rows = self.dataset[indices]
        return [self._sample(index, image, label)
                for index, image, label in zip(indices, rows[self.image_column], rows[self.label_column], strict=True)]

    def _sample(self, index, image, label):
        seed_entropy = [self.seed, self.epoch, index]
        return decode_and_transform(image_bytes(image), self.transform, seed_entropy, _source_of(image, index)), label


def image_bytes(image: dict) -> bytes:
    """The encoded bytes of a `datasets.Image(decode=False)` value, {"bytes": ..., "path": ...}: its own (Hub data,
    parquet and tar files) or its file's (folders), read with a plain open() and read(), about half the time of
    pathlib's read_bytes() for a photo."""
    if image is None:  # no file in the image column for this sample
        raise UserError(MISSING_IMAGE)
    if image["bytes"] is not None:
        return image["bytes"]
    with open(image["path"], "rb", buffering=0) as file:
        return file.readall()


def _source_of(image: dict, index: int) -> str:
    return image.get("path") or f"image {index} of the dataset"


def decode_and_transform(data: bytes, transform, seed_entropy: list, source: str) -> torch.Tensor:
    """An image file's bytes decoded (decode_rgb) and transformed, the random augmentations drawn from a generator
    seeded by `seed_entropy` (seed, epoch, and what names the sample), so that a sample is augmented the same way
    wherever it is loaded. A file that does not decode: one line naming `source`."""
    def decode(reduction: int) -> torch.Tensor:
        try:
            return decode_rgb(data, reduction)
        except (OSError, ValueError, SyntaxError) as err:  # PIL: truncated, corrupt or not an image at all
            # the same advice for training and predict.py: what to do next depends on the run (docs/troubleshooting.md)
            raise UserError(f"{source} cannot be decoded ({type(err).__name__}: {err}); replace it with a good copy, "
                            f"or delete it") from None

    # evaluation draws nothing: there the seeding would be a twentieth of an image's cost
    seeded = (cpu_generator_seeded(int(np.random.SeedSequence(seed_entropy).generate_state(1)[0]))
              if transform.draws_random_numbers else contextlib.nullcontext())
    with seeded:
        return transform.apply_to_file(data, decode)


@contextlib.contextmanager
def cpu_generator_seeded(seed: int):
    """Inside the block, the global CPU generator (which torchvision's random transforms draw from) seeded with `seed`;
    after it, as it was. The CPU generator only: torch.manual_seed also queues a seed for every CUDA device, recording
    a stack trace each time (0.2 ms, a tenth of an image's whole cost)."""
    generator = torch.default_generator
    state = generator.get_state()  # what fork_rng(devices=[]) keeps, without its checks: a third of its time
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)
