"""The image Dataset: one image decoded and transformed per item inside the DataLoader workers, seeded by (seed, epoch,
index), and the uint8 batches collated channels-last."""

import contextlib

import numpy as np
import torch

from ..data.data_layout import MISSING_IMAGE
from ..data.decoding import decode_rgb
from ..errors import UserError


def collate_images(samples: list):
    """default_collate of (image, label, ...) samples, the (3, H, W) uint8 images stacked into a channels-last batch:
    (N, 3, H, W) over (N, H, W, 3) memory, the layout the workers' resize gives them in, so stacking is one plain copy
    (into contiguous (N, 3, H, W) memory it costs a third of the resize). normalise_on_device writes the layout the
    model wants, contiguous or channels-last, on the device."""
    from torch.utils.data import default_collate
    images, *rest = default_collate([(sample[0].permute(1, 2, 0), *sample[1:]) for sample in samples])
    return [images.permute(0, 3, 1, 2), *rest]


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
        return image_source(self.dataset[index][self.image_column], index)

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
        return decode_and_transform(image_bytes(image), self.transform, self.seed_entropy(index),
                                    image_source(image, index)), label

    def seed_entropy(self, index) -> list:
        """What seeds sample `index`'s augmentation this epoch (augmentation_seeded)."""
        return [self.seed, self.epoch, index]


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


def image_source(image: dict, index: int) -> str:
    """The file an image comes from, or its row of the data set where it holds the bytes."""
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

    with augmentation_seeded(transform, seed_entropy):
        return transform.apply_to_file(data, decode)


def augmentation_seeded(transform, seed_entropy: list):
    """A block in which `transform` draws its random numbers for the sample `seed_entropy` names (seed, epoch, and what
    names the sample): the same draws wherever and however the sample is loaded."""
    if not transform.draws_random_numbers:  # evaluation: there the seeding would be a twentieth of an image's cost
        return contextlib.nullcontext()
    return cpu_generator_seeded(int(np.random.SeedSequence(seed_entropy).generate_state(1)[0]))


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
