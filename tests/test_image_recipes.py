"""Recipes by image size: the ImageNet recipe for photos from 128 px up, the small-image recipe below (no
crop of the borders, no flips of digits), and the small-image stem for ResNets up to 64 px."""

import importlib.util

import numpy as np
import pytest
import torch
from helpers import MNIST_10K, REPO, launch, requires_mnist_10k, results
from PIL import Image
from torchvision.transforms import v2

from utils.data.mnist import load_mnist_idx
from utils.data.recipes import default_hflip, eval_transform, resolve_augmentation, train_transform
from utils.errors import UserError
from utils.models import build_model, stem_of

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"


def parse(*flags):
    spec = importlib.util.spec_from_file_location("recipes_classifier", CLASSIFIER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(["--data_dir", "d", *flags])


def test_auto_picks_the_imagenet_recipe_from_128_px_and_flips_only_photos():
    assert [resolve_augmentation("auto", size) for size in (32, 64, 127, 128, 224)] == \
        ["small", "small", "small", "imagenet", "imagenet"]
    assert resolve_augmentation("none", 224) == "none" and resolve_augmentation("imagenet", 32) == "imagenet"
    args = parse("--image_size", "32")
    assert (args.augmentation, args.hflip, args.stem) == ("small", False, "auto")
    args = parse()  # 224
    assert (args.augmentation, args.hflip) == ("imagenet", True)
    assert parse("--no_hflip").hflip is False and parse("--image_size", "32", "--hflip").hflip is True
    assert default_hflip("none") is False


def square_on_black(size=32, side=16, left_half_only=False):
    """A bright square in the middle (or its left half only) of a black image."""
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    start = (size - side) // 2
    pixels[start:start + side, start:start + (side // 2 if left_half_only else side)] = 255
    return torch.from_numpy(pixels).permute(2, 0, 1)  # as utils.data.decoding.decode_rgb gives it


def bright(tensor):
    return tensor.float().mean(0) > 127  # uint8 pixels: the square is far above the black background


def draws(transform, image, n=40):
    out = []
    for seed in range(n):
        torch.manual_seed(seed)
        out.append(transform(image))
    return out


def test_the_small_recipe_keeps_the_whole_image_where_random_resized_crops_lose_most_of_it():
    image = square_on_black()
    area = 16 * 16
    small = [bright(x).sum().item() / area for x in draws(train_transform(32, "small", hflip=False), image)]
    assert all(0.75 < kept < 1.3 for kept in small), small  # scale jitter 0.9-1.1, shifts of at most 4 px
    imagenet = [bright(x).sum().item() / area for x in draws(train_transform(32, "imagenet"), image)]
    assert sum(not 0.75 < kept < 1.3 for kept in imagenet) > len(imagenet) // 2, imagenet  # the old default


def test_evaluation_of_small_images_is_a_plain_resize_that_keeps_the_borders():
    pixels = np.zeros((28, 28, 3), dtype=np.uint8)
    pixels[0, :] = pixels[-1, :] = pixels[:, 0] = pixels[:, -1] = 255  # a 1-pixel frame, as a digit's stroke
    image = torch.from_numpy(pixels).permute(2, 0, 1)
    small = eval_transform(32, "small")(image)
    assert small.shape == (3, 32, 32) and bright(small)[0].any() and bright(small)[:, -1].any()
    plain = train_transform(32, "none", hflip=False)(image)
    assert torch.equal(small, plain)  # evaluation sees what the no-augmentation run trains on
    cropped = eval_transform(32, "imagenet")(image)  # resize to 37, central 32: the frame is cut off
    assert not bright(cropped).any()


def test_without_hflip_no_training_image_is_ever_mirrored():
    image = square_on_black(left_half_only=True)
    columns = torch.arange(32.0)

    def centre_column(x):
        mask = bright(x).float()
        return (mask.sum(0) * columns).sum() / mask.sum()

    assert all(centre_column(x) < 16 for x in draws(train_transform(32, "small", hflip=False), image))  # on the left
    assert any(centre_column(x) > 16 for x in draws(train_transform(32, "small", hflip=True), image))  # some mirrored
    assert not any(isinstance(t, v2.RandomHorizontalFlip) for t in train_transform(224, "imagenet", False).transforms)


def test_resnets_get_the_small_stem_up_to_64_px_and_keep_4x4_feature_maps_at_32():
    model = build_model("resnet18", num_classes=10, image_size=32, stem="auto")
    assert stem_of(model) == "small" and model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    features = torch.nn.Sequential(*list(model.children())[:-2])(torch.zeros(1, 3, 32, 32))
    assert features.shape[-2:] == (4, 4)  # the ImageNet stem leaves 1x1
    imagenet = build_model("resnet18", num_classes=10, image_size=32, stem="imagenet").eval()
    assert torch.nn.Sequential(*list(imagenet.children())[:-2])(torch.zeros(1, 3, 32, 32)).shape[-2:] == (1, 1)
    assert [stem_of(build_model("resnet18", 10, image_size=size, stem="auto")) for size in (64, 65, 224)] == \
        ["small", "imagenet", "imagenet"]
    assert stem_of(build_model("resnext50_32x4d", 10, image_size=32, stem="auto")) == "small"


def test_a_small_stem_runs_weights_load_strictly_into_build_model_small_not_into_plain_torchvision():
    """docs/fsdp.md: a run's whole weights load into a plain torchvision.models.resnet18 with the ImageNet stem only;
    a small-stem run's (64 px and below, from scratch) into build_model(..., stem="small")."""
    import torchvision

    small = build_model("resnet18", num_classes=4, image_size=64, stem="auto").state_dict()
    with pytest.raises(RuntimeError, match=r"conv1.weight: copying a param with shape torch.Size\(\[64, 3, 3, 3\]\)"):
        torchvision.models.resnet18(num_classes=4).load_state_dict(small)
    build_model("resnet18", 4, stem="small").load_state_dict(small)  # strict
    imagenet_stem = build_model("resnet18", 4, image_size=65, stem="auto").state_dict()
    torchvision.models.resnet18(num_classes=4).load_state_dict(imagenet_stem)


def test_pretrained_resnets_keep_their_stem_unless_asked(monkeypatch):
    import torchvision

    import utils.models

    monkeypatch.setattr(utils.models, "_build", lambda name, n, pretrained: torchvision.models.resnet18(num_classes=n))
    assert stem_of(build_model("resnet18", 10, pretrained=True, image_size=32, stem="auto")) == "imagenet"
    assert stem_of(build_model("resnet18", 10, pretrained=True, image_size=32, stem="small")) == "small"


def test_the_small_stem_on_a_model_that_is_not_a_resnet_is_one_error():
    assert stem_of(build_model("efficientnet_b0", num_classes=10, image_size=32, stem="auto")) is None
    with pytest.raises(UserError, match="--stem small replaces a ResNet's first layers; --model efficientnet_b0"):
        build_model("efficientnet_b0", num_classes=10, image_size=32, stem="small")


@requires_mnist_10k
def test_real_digits_at_16_px_with_the_default_flags_name_their_recipe_and_learn(tmp_path):
    """Real handwritten digits as an image folder (320 to train, 200 to evaluate) at 16 px, which gets the small
    recipe and stem as 32 px does, at a quarter of the compute: AdamW for a quick start (SGD's default warmup needs
    more steps than a test can pay for), batches of 8, 60 steps in 3 epochs. Measured: 77.5% in 35 CPU-seconds
    (at 32 px, 2 epochs: 69.5% in 59). docs/benchmarks/cpu_image_recipes has the full measurement at 32 px
    (8,000 digits, the default SGD: 98.9%)."""
    splits = load_mnist_idx(MNIST_10K)
    for split, folder, count in (("train", "train", 320), ("test", "val", 200)):
        images, labels = splits[split]
        for i in range(count):
            class_folder = tmp_path / "digits" / folder / str(int(labels[i]))
            class_folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i].numpy()).save(class_folder / f"{i}.png")
    out = tmp_path / "out"
    launch(["--data_dir", tmp_path / "digits", "--output_dir", out, "--model", "resnet18", "--image_size", "16",
            "--epochs", "3", "--batch_size", "8", "--num_workers", "0", "--optimizer", "adamw",
            "--warmup_epochs", "0"], num_processes=2, script=CLASSIFIER)
    r = results(out)
    assert (r["augmentation"], r["hflip"], r["stem"]) == ("small", False, "small")
    assert r["eval_samples"] == 200 and r["eval_accuracy"] >= 0.6, r["eval_accuracy"]  # chance: 0.1
