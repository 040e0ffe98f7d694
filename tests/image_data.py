"""Test helpers for train_image_classifier.py: generated image folders, models with an
unused parameter, and a probe that reports what DDP actually did.

The probe runs as the launched script (`accelerate launch tests/image_data.py SCRIPT ARGS`):
it patches DistributedDataParallel to remember the instance (and, if asked, to count the
gradient all-reduces, through the script's own comm hook or DDP's plain all-reduce where it registers
none), runs SCRIPT unchanged, and writes one JSON file per rank to $DDP_PROBE_OUT.{rank}. The training script stays free of test code.
"""

import functools
import json
import os
import runpy
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from torch import nn

# One (colour, shape) per class: learnable from colour alone, and from shape alone.
CLASSES = {
    "circle_red": ((220, 40, 40), "ellipse"),
    "square_green": ((40, 190, 60), "rectangle"),
    "triangle_blue": ((50, 70, 230), "triangle"),
    "cross_yellow": ((230, 210, 40), "cross"),
}


def draw_example(rng: np.random.Generator, class_name: str, size: int = 40) -> Image.Image:
    """A noisy background with one jittered, randomly placed shape of the class's colour."""
    colour, shape = CLASSES[class_name]
    background = rng.integers(0, 110, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    fill = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in colour)
    extent = int(rng.integers(size // 2, size - 4))
    x0, y0 = (int(v) for v in rng.integers(0, size - extent + 1, size=2))
    x1, y1 = x0 + extent - 1, y0 + extent - 1
    if shape == "ellipse":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "rectangle":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        bar = max(2, extent // 4)
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        draw.rectangle((x0, cy - bar, x1, cy + bar), fill=fill)
        draw.rectangle((cx - bar, y0, cx + bar, y1), fill=fill)
    return image


def write_class_folders(root: Path, per_class: int, rng: np.random.Generator, ext: str = "png") -> None:
    for class_name in CLASSES:
        folder = root / class_name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw_example(rng, class_name).save(folder / f"{i:04d}.{ext}")


def make_split_image_folder(root: Path, train_per_class: int = 60, val_per_class: int = 20,
                            val_name: str = "val", seed: int = 0) -> Path:
    """ROOT/train/<class>/*.png and ROOT/<val_name>/<class>/*.png (the ImageNet layout)."""
    rng = np.random.default_rng(seed)
    write_class_folders(root / "train", train_per_class, rng)
    write_class_folders(root / val_name, val_per_class, rng)
    return root


def make_flat_image_folder(root: Path, per_class: int = 75, seed: int = 1) -> Path:
    """ROOT/<class>/*.jpg, one folder per class and no split (the flower-photos layout)."""
    write_class_folders(root, per_class, np.random.default_rng(seed), ext="jpg")
    return root


def make_parquet_dataset(root: Path, train_per_class: int = 30, test_per_class: int = 10, seed: int = 2,
                         string_labels: bool = False) -> Path:
    """A Hub-style dataset saved as parquet with CIFAR-100-like column names ("img", "fine_label").

    Class ids follow CLASSES' order (not sorted); with `string_labels` the label column holds
    the class names as plain strings instead of a ClassLabel.
    """
    import datasets

    rng = np.random.default_rng(seed)
    names = list(CLASSES)
    label_feature = datasets.Value("string") if string_labels else datasets.ClassLabel(names=names)
    features = datasets.Features({"img": datasets.Image(), "fine_label": label_feature, "note": datasets.Value("string")})
    root.mkdir(parents=True, exist_ok=True)
    for split, per_class in (("train", train_per_class), ("test", test_per_class)):
        rows = {"img": [], "fine_label": [], "note": []}
        for label, class_name in enumerate(names):
            for _ in range(per_class):
                rows["img"].append(draw_example(rng, class_name))
                rows["fine_label"].append(class_name if string_labels else label)
                rows["note"].append(class_name)
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(root / f"{split}.parquet"))
    return root


def grid_cell_png(rng: np.random.Generator, cell: int, size: int = 16) -> bytes:
    """A dark 16-px PNG, one bright 4x4 cell of its 4x4 grid (number `cell`, row by row), faint noise (each image's
    bytes unique): `pixel_linear` tells the cells apart within a few dozen steps."""
    import io

    pixels = rng.integers(0, 30, size=(size, size, 3), dtype=np.uint8)
    side = size // 4
    row, column = divmod(cell, 4)
    pixels[row * side:(row + 1) * side, column * side:(column + 1) * side] = 230
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def pixel_linear(num_classes: int) -> nn.Module:
    """`--model tests.image_data:pixel_linear`: one linear layer on the pixels of a 16-px image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))


class ResNetWithUnusedHead(nn.Module):
    """resnet18 plus a second head that forward() never calls: DDP's classic unused-parameter case."""

    def __init__(self, num_classes: int):
        super().__init__()
        from torchvision.models import resnet18

        self.backbone = resnet18(num_classes=num_classes)
        self.unused_head = nn.Linear(512, num_classes)
        nn.init.constant_(self.unused_head.weight, 0.5)  # a known value: it must never change
        nn.init.constant_(self.unused_head.bias, 0.5)

    def forward(self, images):
        return self.backbone(images)


def resnet_with_unused_head(num_classes: int) -> nn.Module:
    """Model builder for `--model tests.image_data:resnet_with_unused_head`."""
    return ResNetWithUnusedHead(num_classes)


# ---------------------------------------------------------------- the DDP probe


def run_with_ddp_probe(argv) -> None:
    import torch
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    seen = {"ddp": None, "synced_backward_passes": 0, "input_channels_last": [], "hook_registered": False}
    count_allreduce = os.environ.get("DDP_PROBE_COUNT_ALLREDUCE") == "1"
    original_init = DistributedDataParallel.__init__
    original_register_comm_hook = DistributedDataParallel.register_comm_hook

    def counting(hook):
        @functools.wraps(hook)  # its name too: DDP reports the hook by its __qualname__
        def counted(state, bucket):
            if bucket.is_last():  # one call per bucket; the last bucket closes one synchronised backward
                seen["synced_backward_passes"] += 1
            return hook(state, bucket)
        return counted

    def patched_register_comm_hook(self, state, hook):
        # the script's own hook (--ddp_comm_hook), counted as it is: a run can be counted and compressed at once
        seen["hook_registered"] = True
        return original_register_comm_hook(self, state, counting(hook) if count_allreduce else hook)

    def before_each_forward(module, inputs):
        # the first forward, and the script registered no hook: DDP's plain all-reduce, counted
        if count_allreduce and not seen["hook_registered"] and seen.get("ddp") is not None:
            patched_register_comm_hook(seen["ddp"], None, default_hooks.allreduce_hook)
        seen["input_channels_last"].append(inputs[0].is_contiguous(memory_format=torch.channels_last))

    def patched_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["ddp"] = self
        self.module.register_forward_pre_hook(before_each_forward)

    DistributedDataParallel.__init__ = patched_init
    DistributedDataParallel.register_comm_hook = patched_register_comm_hook
    report = {"ddp_wrapped": False}

    def read_ddp():
        ddp = seen.pop("ddp", None)  # and let it go: the script ends only once its DDP model is released
        if ddp is None:
            return
        logging_data = ddp._get_ddp_logging_data()
        first_conv = next(m for m in ddp.module.modules() if isinstance(m, nn.Conv2d))
        report.update({
            "ddp_wrapped": True,
            "comm_hook": logging_data.get("comm_hook"),
            "find_unused_parameters": bool(logging_data.get("find_unused_parameters")),
            "has_sync_bn": bool(logging_data.get("has_sync_bn")),
            "synced_backward_passes": seen["synced_backward_passes"],
            "weights_channels_last": first_conv.weight.is_contiguous(memory_format=torch.channels_last),
            "inputs_channels_last": sorted(set(seen["input_channels_last"])),
        })

    # Read the DDP model when the script releases it (free_memory, just before end_training), not after the
    # script: held past end_training, it would keep gloo's threads alive to the exit (helpers.run fails that).
    original_free_memory = Accelerator.free_memory

    def patched_free_memory(self, *objects):
        read_ddp()
        return original_free_memory(self, *objects)

    Accelerator.free_memory = patched_free_memory

    def write_report():
        rank = os.environ.get("RANK", "0")  # the process group may be gone by now
        Path(f"{os.environ['DDP_PROBE_OUT']}.{rank}").write_text(json.dumps(report))

    script, *script_args = argv
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:  # the scripts end with sys.exit(status)
        if exit_.code not in (0, None):
            raise  # a script that fails exits here, with no report
    write_report()


if __name__ == "__main__":
    run_with_ddp_probe(sys.argv[1:])
