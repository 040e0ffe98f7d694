"""MNIST as tensors, decoded once: from the classic IDX files or from the Hugging Face Hub."""

import gzip
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ..errors import UserError

# File names as torchvision's MNIST/raw folder has them; each may also end in .gz.
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_HUB_DATASET = "ylecun/mnist"
# The usual MNIST normalisation constants (mean and std of the training pixels in [0, 1]).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def _find_idx_file(data_dir: Path, name: str) -> Path:
    """`name` or `name.gz`, in DIR itself or in DIR/MNIST/raw (torchvision's layout)."""
    for folder in (data_dir, data_dir / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    raise UserError(
        f"--data_dir {data_dir} has no MNIST file {name}[.gz] (looked in {data_dir} and "
        f"{data_dir / 'MNIST' / 'raw'}); put the four MNIST IDX files there, or omit --data_dir "
        f"to load {MNIST_HUB_DATASET} from the Hub"
    )


def _read_idx(path: Path, reader):
    """Read one IDX file with torchvision's reader, which opens raw files only, so a .gz
    file is decompressed to a temporary copy first."""
    try:
        if path.suffix != ".gz":
            return reader(str(path))
        with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(suffix=path.stem) as raw:
            shutil.copyfileobj(src, raw)
            raw.flush()
            return reader(raw.name)
    except Exception as err:  # torchvision signals bad files with asserts, TypeError, RuntimeError...
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise UserError(
            f"{path} is not a valid MNIST IDX file ({reason}); replace it with an intact copy "
            f"(check it against SHA256SUMS if you have them)"
        ) from None


def load_mnist_idx(data_dir) -> dict:
    """{"train": (images uint8 [N, 28, 28], labels int64 [N]), "test": (...)} from IDX files."""
    from torchvision.datasets.mnist import read_image_file, read_label_file  # here: --help need not import torchvision

    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"--data_dir {data_dir}: no such directory; point it at a folder holding the MNIST IDX files")
    splits = {}
    for split, (image_name, label_name) in MNIST_FILES.items():
        image_path, label_path = _find_idx_file(data_dir, image_name), _find_idx_file(data_dir, label_name)
        images, labels = _read_idx(image_path, read_image_file), _read_idx(label_path, read_label_file)
        _check_split(f"{image_path} / {label_path}", images, labels)
        splits[split] = (images, labels.long())
    return splits


def load_mnist_hub(name: str = MNIST_HUB_DATASET) -> dict:
    """The same splits, through `datasets` (downloaded once, then served from its cache)."""
    import datasets  # imported here so that IDX users never pay for it

    try:
        dataset = datasets.load_dataset(name).with_format("torch")
        splits = {}
        for split in MNIST_FILES:
            columns = dataset[split][:]  # decodes every PNG once, here, not in the training loop
            splits[split] = (columns["image"].to(torch.uint8), columns["label"].long())
    except Exception as err:  # offline, no cache, hub errors: all end the same way for the user
        raise UserError(
            f"could not load {name} from the Hugging Face Hub ({type(err).__name__}); "
            f"pass --data_dir DIR with the MNIST IDX files (e.g. torchvision's MNIST/raw folder)"
        ) from None
    for split, (images, labels) in splits.items():
        _check_split(f"{name}[{split}]", images, labels)
    return splits


def _check_split(source: str, images: torch.Tensor, labels: torch.Tensor) -> None:
    if images.ndim != 3 or tuple(images.shape[1:]) != (28, 28):
        raise UserError(f"{source}: expected 28x28 images, got shape {tuple(images.shape)}; these are not MNIST images")
    if len(images) != len(labels):
        raise UserError(f"{source}: {len(images)} images but {len(labels)} labels; the files do not belong together")
    if len(labels) == 0:
        raise UserError(f"{source}: no samples; replace the files with intact MNIST files")
    if labels.min() < 0 or labels.max() > 9:
        raise UserError(f"{source}: labels outside 0-9 (min {labels.min()}, max {labels.max()}); these are not "
                        f"MNIST labels")


def load_mnist(data_dir=None) -> dict:
    return load_mnist_hub() if data_dir is None else load_mnist_idx(data_dir)


def normalise_mnist(images: torch.Tensor) -> torch.Tensor:
    """uint8 digits [N, 1, 28, 28] as the ConvNet's input: a new float tensor, scaled to [0, 1] and standardised
    with MNIST's mean and std. scripts/predict.py applies it on the device, and its ONNX export inside the model."""
    return images.float().div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)


def to_tensor_dataset(images: torch.Tensor, labels: torch.Tensor, max_samples=None) -> TensorDataset:
    """Normalised float images [N, 1, 28, 28] and labels, built once for the whole run."""
    if max_samples is not None:
        images, labels = images[:max_samples], labels[:max_samples]
    return TensorDataset(normalise_mnist(images.unsqueeze(1)), labels)
