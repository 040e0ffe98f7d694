"""Image classification plumbing: image folders and Hub datasets through `datasets`,
torchvision transforms and models by name, and the diagnosis of DDP's unused-parameter error.
"""

import copy
import importlib
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchvision.transforms import v2

from utils.errors import UserError

# torchvision's pretrained weights expect ImageNet-normalised inputs; from scratch it does no harm.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVAL_SPLITS = ("validation", "test")  # `imagefolder` names a val/ folder "validation"
# The train/val split of a single class-folder root must not move when --seed changes,
# or runs with different seeds would be evaluated on different images.
VAL_SPLIT_SEED = 0


# ---------------------------------------------------------------- data


def load_image_datasets(data_dir=None, dataset=None, dataset_config=None, image_column=None,
                        label_column=None, val_split=0.2):
    """(train, eval, image_column, label_column, class_names) as `datasets.Dataset`s.

    `data_dir`: an ImageFolder tree, either DIR/train/<class>/* with DIR/val|validation|test/<class>/*,
    or DIR/<class>/* alone, split by `val_split` (stratified, fixed seed). `dataset`: a Hub dataset
    name (or a local folder of data files); columns are detected unless given. Class ids follow
    the sorted class names, so they are the same on every process and in every run.
    """
    import datasets  # imported here: the unit tests of the models need none of it

    if data_dir is not None:
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise UserError(f"--data_dir {data_dir}: no such directory; point it at an image folder "
                            f"(DIR/<class>/*.jpg or DIR/train/<class>/*)")
        source = f"--data_dir {data_dir}"
        try:
            splits = datasets.load_dataset("imagefolder", data_dir=str(data_dir))
        except Exception as err:  # no images, unreadable files: datasets raises many types
            raise UserError(f"{source}: not an image folder ({type(err).__name__}: {_first_line(err)}); "
                            f"expected DIR/<class>/*.jpg or DIR/train/<class>/* and DIR/val/<class>/*") from None
    else:
        source = f"--dataset {dataset}"
        try:
            splits = datasets.load_dataset(dataset, dataset_config)
        except Exception as err:  # offline, no cache, unknown name, gated dataset...
            raise UserError(f"could not load {source} ({type(err).__name__}: {_first_line(err)}); check the name "
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
        # integer or string labels: one id per distinct value, in sorted order (deterministic)
        splits = splits.class_encode_column(label_column)
        train = splits["train"]

    eval_name = next((name for name in EVAL_SPLITS if name in splits), None)
    if eval_name is not None:
        eval_ = splits[eval_name]
    else:
        try:
            parts = train.train_test_split(test_size=val_split, seed=VAL_SPLIT_SEED, stratify_by_column=label_column)
        except ValueError as err:  # e.g. fewer images in a class than the split needs
            raise UserError(f"{source}: cannot split off --val_split {val_split} ({_first_line(err)}); "
                            f"add images or change --val_split") from None
        train, eval_ = parts["train"], parts["test"]
    class_names = train.features[label_column].names
    return train, eval_, image_column, label_column, class_names


def _column_of_type(dataset, feature_type, preferred, source, flag):
    if preferred in dataset.column_names and isinstance(dataset.features[preferred], feature_type):
        return preferred
    matches = [name for name, feature in dataset.features.items() if isinstance(feature, feature_type)]
    if len(matches) != 1:
        raise UserError(f"{source}: cannot tell which column holds the {preferred}s (found {matches or 'none'} "
                        f"among {dataset.column_names}); name it with {flag}")
    return matches[0]


def _first_line(err) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def train_transform(image_size: int):
    return v2.Compose([
        v2.RandomResizedCrop(image_size, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def eval_transform(image_size: int):
    return v2.Compose([
        v2.Resize(round(image_size / 0.875), antialias=True),  # 256 for 224: the usual ImageNet ratio
        v2.CenterCrop(image_size),
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


class TransformedImages(torch.utils.data.Dataset):
    """Decodes and transforms one image per __getitem__, i.e. inside the DataLoader workers.

    Random augmentations draw from a generator seeded by (seed, epoch, sample index), so a
    sample is augmented the same way whichever worker or process loads it, and a resumed run
    (which skips batches and restarts workers) sees the same images as an uninterrupted one.
    (datasets' set_transform does not see the sample index, which these seeds need.)
    """

    def __init__(self, dataset, transform, image_column: str, label_column: str, seed: int = 0):
        self.dataset, self.transform = dataset, transform
        self.image_column, self.label_column, self.seed = image_column, label_column, seed
        # shared memory: persistent workers see set_epoch() of the main process
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        example = self.dataset[index]
        image = example[self.image_column].convert("RGB")  # greyscale, palette, CMYK, RGBA -> 3 channels
        sample_seed = np.random.SeedSequence([self.seed, int(self._epoch), index]).generate_state(1)[0]
        with torch.random.fork_rng(devices=[]):  # torchvision's random transforms use the global CPU RNG
            torch.manual_seed(int(sample_seed))
            pixels = self.transform(image)
        return pixels, example[self.label_column]


# ---------------------------------------------------------------- models


def build_model(name: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """A torchvision classification model by name ("resnet18", "resnet50", ...) with
    `num_classes` outputs, or `package.module:function` called as function(num_classes=N)."""
    if ":" in name:
        module_name, _, function_name = name.partition(":")
        try:
            builder = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as err:
            raise UserError(f"--model {name}: cannot import it ({err}); give a module:function importable "
                            f"from the repository root") from None
        if pretrained:
            raise UserError(f"--pretrained loads torchvision weights; --model {name} is your own builder, "
                            f"so drop --pretrained")
        return builder(num_classes=num_classes)

    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)  # classification models only
    if name not in available:
        raise UserError(f"--model {name}: not a torchvision classification model; choose one of e.g. "
                        f"resnet18, resnet50, efficientnet_b0, convnext_tiny (all: torchvision.models.list_models())")
    if not pretrained:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    else:
        try:
            model = torchvision.models.get_model(name, weights="DEFAULT")  # downloaded once to ~/.cache/torch
        except Exception as err:  # offline, proxy, disk full: all end the same way for the user
            raise UserError(f"--pretrained: could not fetch the torchvision weights of {name} ({type(err).__name__}); "
                            f"run once with internet access (they are cached under $TORCH_HOME) or train from "
                            f"scratch without --pretrained") from None
        model = replace_classifier(model, num_classes)
    return drop_auxiliary_heads(model)


def drop_auxiliary_heads(model: nn.Module) -> nn.Module:
    """GoogLeNet and Inception v3 return extra auxiliary logits in training mode; keep the main output only
    (unused auxiliary heads would also trip DDP's unused-parameter check)."""
    if getattr(model, "aux_logits", False):
        model.aux_logits = False
        for head in ("aux1", "aux2", "AuxLogits"):
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def replace_classifier(model: nn.Module, num_classes: int) -> nn.Module:
    """Swap the last Linear layer (the 1000-class ImageNet head) for a fresh one with `num_classes`."""
    name, head = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    if head.out_features != num_classes:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], nn.Linear(head.in_features, num_classes))
    return model


# ---------------------------------------------------------------- DDP's unused-parameter error


def is_unused_parameter_error(err: BaseException) -> bool:
    """DDP's "Expected to have finished reduction in the prior iteration ..." RuntimeError."""
    return isinstance(err, RuntimeError) and "not used in producing loss" in str(err)


def parameters_without_gradient(model: nn.Module, inputs: torch.Tensor) -> list:
    """Names of the trainable parameters that get no gradient from one forward/backward.

    The single-process debugging recipe, on a copy: the model inside DDP keeps its hooks
    and its state untouched.
    """
    probe = copy.deepcopy(model).train()
    for parameter in probe.parameters():
        parameter.grad = None
    with torch.enable_grad():
        outputs = probe(inputs)
        outputs = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        outputs.float().sum().backward()
    return [name for name, p in probe.named_parameters() if p.requires_grad and p.grad is None]
