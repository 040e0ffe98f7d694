"""Which training samples a job's processes fetched, for train_mnist.py and train_image_classifier.py, unchanged.

A job of tests/jobs.py with "record_samples" calls record_samples(LOG) before its script runs: the script's training
dataset is then wrapped so that every __getitem__ appends one line "EPOCH INDEX" to LOG.rank{RANK} (from a DataLoader
worker: LOG.rank{RANK}.worker{ID}), in fetch order, flushed at once. EPOCH is the image dataset's own epoch (what
TransformedImages seeds its augmentations with); the MNIST TensorDataset has none, so it is -1 there. The evaluation
datasets are left alone.

With --mixup_alpha/--cutmix_alpha the mixed sample is what trains: its line is "EPOCH INDEX PARTNER KIND LAM
DIGEST" (utils/data/mixing.py: PARTNER -1 and KIND "-" when it is not mixed; DIGEST: a hash of its pixels and
target), and its two images' fetches from the dataset it wraps write no line of their own.

With --streaming each image the stream decodes for training writes "EPOCH KEY" (KEY: the CRC-32 of the image file,
what utils/data/streaming.py seeds its augmentations with): a decoded image may be one of the last few that no whole
batch took.

Fetched is trained here: a prepared DataLoaderShard fetches one batch ahead but within the epoch only, and
skip_first_batches skips indices, not fetched batches. (A loop that breaks out of an epoch early would have
fetched one batch more than it trained.)
"""

import hashlib
import os
import sys
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def record_samples(log) -> None:
    """From here on, this process's training datasets write their fetches beside LOG (see the top of this file)."""
    os.environ["SAMPLE_LOG"] = str(log)  # read by the DataLoader workers too
    sys.path.insert(0, str(REPO))  # the same `utils` package that the script imports
    _patch_datasets()


class _Log:
    """One line-buffered file per process (the training process, and each DataLoader worker)."""

    files = {}

    @classmethod
    def write(cls, *fields) -> None:
        pid = os.getpid()
        if pid not in cls.files:
            info = torch.utils.data.get_worker_info()
            suffix = f".worker{info.id}" if info is not None else ""
            cls.files[pid] = open(f"{os.environ['SAMPLE_LOG']}.rank{os.environ.get('RANK', '0')}{suffix}", "a",
                                  buffering=1)
        cls.files[pid].write(" ".join(map(str, fields)) + "\n")


class RecordedTensorDataset(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        _Log.write(-1, int(index))
        return self.dataset[index]


def _patch_datasets() -> None:
    import utils.data.image_dataset
    import utils.data.mixing
    import utils.data.mnist
    import utils.data.recipes
    import utils.data.streaming

    # train_mnist.py: the training split's tensors, recognised by identity, become a recorded dataset
    load_mnist, to_tensor_dataset = utils.data.mnist.load_mnist, utils.data.mnist.to_tensor_dataset
    train_images = []

    def recorded_load_mnist(*args, **kwargs):
        splits = load_mnist(*args, **kwargs)
        train_images.append(splits["train"][0])
        return splits

    def recorded_to_tensor_dataset(images, labels, *args, **kwargs):
        dataset = to_tensor_dataset(images, labels, *args, **kwargs)
        return RecordedTensorDataset(dataset) if any(images is t for t in train_images) else dataset

    utils.data.mnist.load_mnist, utils.data.mnist.to_tensor_dataset = recorded_load_mnist, recorded_to_tensor_dataset

    # train_image_classifier.py: the dataset built with train_transform()'s transform records its fetches
    train_transform, TransformedImages = utils.data.recipes.train_transform, utils.data.image_dataset.TransformedImages
    train_transforms = []

    def recorded_train_transform(*args, **kwargs):
        train_transforms.append(train_transform(*args, **kwargs))
        return train_transforms[-1]

    class RecordedTransformedImages(TransformedImages):
        mixed = False  # wrapped by RecordedMixedImages, which writes the lines

        def _sample(self, index, *args):  # under both __getitem__ and __getitems__ (a batch's rows in one query)
            if any(self.transform is t for t in train_transforms) and not self.mixed:
                _Log.write(self.epoch, int(index))  # the epoch its augmentations are seeded with
            return super()._sample(index, *args)

    utils.data.recipes.train_transform = recorded_train_transform
    utils.data.image_dataset.TransformedImages = RecordedTransformedImages

    # --mixup_alpha/--cutmix_alpha: the training dataset is wrapped; the wrapper records what it hands out
    class RecordedMixedImages(utils.data.mixing.MixedImages):
        def __init__(self, dataset, *args, **kwargs):
            super().__init__(dataset, *args, **kwargs)
            dataset.mixed = True

        def __getitem__(self, index):
            image, target = super().__getitem__(index)
            epoch, (partner, kind, _) = self.epoch, self.pairing(self.epoch, index)
            lam = self.lam_of(epoch, index, *image.shape[-2:])
            _Log.write(epoch, int(index), partner, kind or "-", repr(lam), digest_of(image, target))
            return image, target

    utils.data.mixing.MixedImages = RecordedMixedImages

    # --streaming: each decoded training image writes "EPOCH KEY", KEY the CRC-32 of its file that seeds its augmentations
    class RecordedStreamedImages(utils.data.streaming.StreamedImages):
        def transformed(self, data, *args):
            _Log.write(self.epoch, zlib.crc32(data))
            return super().transformed(data, *args)

    utils.data.streaming.StreamedImages = RecordedStreamedImages


def digest_of(image: torch.Tensor, target: torch.Tensor) -> str:
    """A mixed sample's DIGEST: a hash of its pixels and target."""
    return hashlib.sha256(image.numpy().tobytes() + target.numpy().tobytes()).hexdigest()[:16]
