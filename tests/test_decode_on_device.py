"""--decode_on_device (utils/data/device_decoding.py), on the CPU: everything but nvJPEG's decode. The workers' samples
carry the CPU path's crop box and flip for the same per-sample seed; decode_batch, given a CPU decoder standing in for
nvJPEG, gives the CPU path's pixels (within the resize's rounding) in the CPU path's order, whatever the batch mixes
(image sizes, greyscale, CMYK, PNG, rotated photos); a damaged JPEG is named; without CUDA the script refuses in one
line. tests/test_gpu_paths.py compares nvJPEG's own pixels on a GPU."""

import io

import numpy as np
import pytest
import torch
from helpers import REPO, load_script
from PIL import Image

import utils.data.recipes as recipes
from utils.data.decoding import decode_rgb
from utils.data.device_decoding import (
    EncodedImages,
    collate_encoded,
    decode_batch,
    device_decoding_refusal,
    nvjpeg_decoder,
)
from utils.data.image_dataset import TransformedImages, collate_images
from utils.data.recipes import eval_transform, train_transform
from utils.errors import UserError

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PHOTO_SIZES = [(480, 640), (375, 500), (600, 400), (300, 300), (500, 333), (256, 700)]  # (height, width)


def photo(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth colour gradients with edges and noise: what JPEG is made for, and what a shifted crop box shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    channels = [np.sin(6 * x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) * np.cos(5 * y * rng.uniform(0.5, 2))
                for _ in range(3)]
    pixels = (np.stack(channels, axis=-1) * 100 + 128 + rng.normal(0, 6, (height, width, 3)))
    pixels[height // 3: height // 2, width // 4: width // 2] = rng.integers(0, 256, 3)  # a sharp-edged block
    return np.clip(pixels, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, mode: str = "RGB", **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def rotated_jpeg(pixels: np.ndarray) -> bytes:
    """A JPEG tagged as rotated (EXIF orientation 6): the CPU path turns it upright through PIL."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return jpeg(pixels, exif=exif.tobytes())


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def image_set(files: list):
    """A `datasets.Dataset` of the images' bytes and a label each, as load_image_datasets gives (decode=False)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": [{"bytes": data, "path": None} for data in files],
                                       "label": list(range(len(files)))}, features=features)


@pytest.fixture(scope="module")
def photos():
    """Colour JPEGs of six sizes, twice each (12 samples)."""
    return image_set([jpeg(photo(h, w, seed)) for seed in range(2) for h, w in PHOTO_SIZES])


@pytest.fixture
def full_size_decodes(monkeypatch):
    """The CPU path decoding every JPEG whole, as nvJPEG does: its decode at 1/2..1/8 moves the crop box to the scaled
    image's grid, up to 7.7 levels per image on average (measured on photos-jpeg), which is the CPU path's own
    shortcut, not what this compares."""
    monkeypatch.setattr(recipes, "reduction_for", lambda region, size: 1)


def simplejpeg_decoder(encoded: list) -> list:
    """The CPU path's own decoder (simplejpeg) standing in for nvJPEG: what is left is the crop, resize and flip."""
    return [decode_rgb(bytes(data.numpy())) for data in encoded]


def cpu_path_batch(dataset, indices) -> torch.Tensor:
    return collate_images([dataset[i] for i in indices])[0]


def device_path_batch(dataset, indices, size: int, decode) -> tuple:
    batch, labels = collate_encoded([dataset[i] for i in indices])
    return decode_batch(batch, size, "cpu", decode), labels, batch


TRANSFORMS = {
    "imagenet 224": lambda: train_transform(224, "imagenet", hflip=True),
    "imagenet 96": lambda: train_transform(96, "imagenet", hflip=True),
    "none, flips": lambda: train_transform(64, "none", hflip=True),
    "evaluation 224": lambda: eval_transform(224, "imagenet"),
}


@pytest.mark.parametrize("recipe", TRANSFORMS)
def test_each_sample_gets_the_cpu_paths_crop_box_and_flip(recipe, photos, full_size_decodes, monkeypatch):
    """The box and flip an encoded sample carries are those the CPU path applies to the same sample (seed, epoch,
    index), seen by recording what its crop step and flip were given."""
    from torchvision.transforms import v2

    transform = TRANSFORMS[recipe]()
    applied = []
    first = type(transform.transforms[0])
    crop, flip = first.transform, v2.RandomHorizontalFlip.transform
    monkeypatch.setattr(first, "transform", lambda self, image, params: (applied.append(dict(params, flipped=0)),
                                                                         crop(self, image, params))[1])
    monkeypatch.setattr(v2.RandomHorizontalFlip, "transform",
                        lambda self, image, params: (applied[-1].update(flipped=1), flip(self, image, params))[1])
    cpu_path, device_path = TransformedImages(photos, transform, "image", "label", seed=7), \
        EncodedImages(photos, transform, "image", "label", seed=7)
    boxes = set()
    for epoch in (0, 1):
        cpu_path.set_epoch(epoch)
        device_path.set_epoch(epoch)
        for index in range(len(photos)):
            applied.clear()
            cpu_path[index]
            (sample, label), (expected,) = device_path[index], applied
            assert label == index
            assert sample["box"] == tuple(expected[key] for key in ("top", "left", "height", "width", "flipped"))
            boxes.add(sample["box"])
    if recipe.startswith("imagenet"):
        assert len(boxes) == 2 * len(photos)  # every sample and epoch its own box
    assert {box[4] for box in boxes} == ({0} if recipe.startswith("evaluation") else {0, 1})


@pytest.mark.parametrize("recipe", TRANSFORMS)
def test_the_device_path_gives_the_cpu_paths_pixels(recipe, photos, full_size_decodes):
    """The same decoder on both paths: every pixel within 1 level (the CPU's uint8 resize rounds its weights to
    integers; the device resizes in float: 0.08-0.16 levels apart on average here, 0.13 on photos-jpeg).
    torchvision's CPU decode_jpeg (libjpeg's smooth upsampling of the colour, where simplejpeg repeats it) standing in
    for nvJPEG: 0.09-0.33 levels on average, at most 0.64 on one image here (photos-jpeg's at 224 px: 0.56, at most
    1.57), so each image within 1.5 on average."""
    transform = TRANSFORMS[recipe]()
    size = transform.transforms[0].size[0]
    cpu_path, device_path = TransformedImages(photos, transform, "image", "label", seed=3), \
        EncodedImages(photos, transform, "image", "label", seed=3)
    indices = list(range(len(photos)))
    expected = cpu_path_batch(cpu_path, indices).int()
    images, labels, _ = device_path_batch(device_path, indices, size, simplejpeg_decoder)
    assert images.shape == expected.shape and images.is_contiguous(memory_format=torch.channels_last)
    assert labels.tolist() == indices
    assert (images.int() - expected).abs().max() <= 1
    images, _, _ = device_path_batch(device_path, indices, size, nvjpeg_decoder("cpu"))
    per_image = (images.int() - expected).abs().float().mean(dim=(1, 2, 3))
    assert per_image.max() < 1.5, per_image


def test_the_batches_come_through_a_prepared_loader_and_its_worker_as_the_cpu_paths(photos, full_size_decodes):
    """Through a DataLoader worker and Accelerate's prepared loader, as the script builds them: the bytes and boxes stay
    on the CPU, the labels come as the CPU path's, in the same shuffled order, and decoding_first (torchvision's
    decode_jpeg on the run's device, here the CPU) gives the model's input from the CPU path's pixels."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from utils.data.device_decoding import decoding_first
    from utils.data.device_input import normalise_on_device

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    transform = train_transform(96, "imagenet", hflip=True)
    loaders = [accelerator.prepare(DataLoader(images(photos, transform, "image", "label", seed=2), batch_size=4,
                                              shuffle=True, drop_last=True, num_workers=1, collate_fn=collate))
               for images, collate in ((TransformedImages, collate_images), (EncodedImages, collate_encoded))]
    model_input = decoding_first(normalise_on_device, accelerator.device, 96)
    batches = 0
    for (expected, expected_labels), (batch, labels) in zip(*loaders, strict=True):
        assert all(isinstance(data, bytes) for data in batch["jpegs"]) and labels.tolist() == expected_labels.tolist()
        difference = (model_input(batch) - normalise_on_device(expected)).abs() * 0.226 * 255  # in levels
        assert difference.mean(dim=(1, 2, 3)).max() < 1.5
        batches += 1
    assert batches == len(photos) // 4


def test_a_batch_of_every_kind_of_file_keeps_its_order(full_size_decodes):
    """Mixed sizes, a greyscale JPEG (nvJPEG decodes it to RGB), a CMYK JPEG, a PNG and a photo tagged as rotated
    (decoded and transformed in the worker, as without the flag) in one batch: each image where the CPU path puts it,
    with its pixels; the labels in the same order."""
    colour = [jpeg(photo(h, w, seed=10 + k)) for k, (h, w) in enumerate(PHOTO_SIZES[:3])]
    others = {"grey": jpeg(photo(400, 300, 20), "L"), "cmyk": jpeg(photo(300, 420, 21), "CMYK"),
              "png": png(photo(200, 260, 22)), "rotated": rotated_jpeg(photo(240, 320, 23))}
    files = [colour[0], others["png"], colour[1], others["grey"], others["cmyk"], colour[2], others["rotated"]]
    data = image_set(files)
    transform = train_transform(128, "imagenet", hflip=True)
    cpu_path, device_path = TransformedImages(data, transform, "image", "label", seed=1), \
        EncodedImages(data, transform, "image", "label", seed=1)
    indices = list(range(len(files)))
    images, labels, batch = device_path_batch(device_path, indices, 128, nvjpeg_decoder("cpu"))
    assert batch["jpeg_at"] == [0, 2, 3, 5] and batch["pixels_at"] == [1, 4, 6]  # nvJPEG: the colour and grey JPEGs
    assert labels.tolist() == indices
    expected = cpu_path_batch(cpu_path, indices).int()
    per_image = (images.int() - expected).abs().float().mean(dim=(1, 2, 3))
    assert per_image.max() < 1.5, per_image
    for k in batch["pixels_at"]:  # decoded in the worker: the CPU path's very pixels
        assert torch.equal(images[k].int(), expected[k])
    grey = images[3]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])


def test_a_damaged_jpeg_is_named():
    """nvJPEG refuses a whole batch without saying which image: decode_batch decodes them one by one to name it."""
    good = jpeg(photo(300, 400, 0))
    damaged = good[:len(good) // 3] + bytes(400)  # the header reads; the image data does not
    device_path = EncodedImages(image_set([good, damaged]), train_transform(224), "image", "label")
    batch, _ = collate_encoded([device_path[0], device_path[1]])
    with pytest.raises(UserError, match="image 1 of the dataset cannot be decoded on the GPU .* replace it"):
        decode_batch(batch, 224, "cpu", nvjpeg_decoder("cpu"))


def test_without_a_cuda_device_it_refuses(monkeypatch):
    """--cpu (here on a node with a GPU), or no CUDA device: the run's device is the CPU, and the script's first step
    with the data stops with one line saying so and what to do, before anything is read or written (the script prints
    it as `error: ...`, exit 1, as every UserError)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    script = load_script(CLASSIFIER)
    args = script.parse_args(["--cpu", "--data_dir", "nowhere", "--decode_on_device", "--output_dir", "nowhere/out"])
    with pytest.raises(UserError, match="--decode_on_device decodes the JPEGs with nvJPEG on a CUDA GPU, and this "
                                        "run's device is cpu .* drop --decode_on_device"):
        script.build_datasets(args, SimpleNamespace(device=torch.device("cpu")), None)


def test_with_cuda_and_batched_nvjpeg_it_goes_ahead(monkeypatch):
    import torchvision

    assert device_decoding_refusal(torch.device("cuda", 1)) is None
    monkeypatch.setattr(torchvision, "__version__", "0.18.1+cu121")  # decode_jpeg takes no list before 0.19
    assert "needs torchvision 0.19" in device_decoding_refusal(torch.device("cuda"))


@pytest.mark.parametrize("flags, words", [
    (["--image_size", "32"], ["--decode_on_device does the imagenet and none recipes", "not small"]),
    (["--augmentation", "small"], ["not small", "--augmentation imagenet or none"]),
    (["--mixup_alpha", "0.2"], ["--mixup_alpha does not work with --decode_on_device"]),
    (["--streaming", "--max_steps", "4"], ["--streaming does not work with --decode_on_device"]),
    (["--auto_find_batch_size"], ["--auto_find_batch_size does not work with --decode_on_device"]),
])
def test_flags_it_cannot_serve_are_one_line(flags, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script(CLASSIFIER).parse_args(["--data_dir", "d", "--decode_on_device", *flags])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")
    for word in words:
        assert word in line, line


def test_the_recipes_it_serves():
    assert train_transform(224, "imagenet").decodes_on_device and eval_transform(224, "imagenet").decodes_on_device
    assert train_transform(64, "none", hflip=True).decodes_on_device and eval_transform(32, "small").decodes_on_device
    assert not train_transform(32, "small").decodes_on_device
    with pytest.raises(UserError, match="--decode_on_device does a crop"):
        EncodedImages(image_set([jpeg(photo(64, 64, 0))]), train_transform(32, "small"), "image", "label")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")
def test_nvjpeg_gives_the_cpu_paths_pixels_on_a_gpu(record_property, full_size_decodes):
    """nvJPEG itself, in one batched call, on the mixed batch: each image within 1.5 levels of the CPU path's on
    average (its decoder rounds as no CPU stand-in here need), the greyscale JPEG as 3 equal channels, the rest in
    place; the largest per-image mean goes to the GPU check's report."""
    colour = [jpeg(photo(h, w, seed=30 + k)) for k, (h, w) in enumerate(PHOTO_SIZES)]
    files = [*colour[:3], jpeg(photo(400, 300, 40), "L"), png(photo(200, 260, 41)), *colour[3:]]
    data = image_set(files)
    transform = train_transform(224, "imagenet", hflip=True)
    cpu_path, device_path = TransformedImages(data, transform, "image", "label", seed=5), \
        EncodedImages(data, transform, "image", "label", seed=5)
    indices = list(range(len(files)))
    batch, labels = collate_encoded([device_path[i] for i in indices])
    images = decode_batch(batch, 224, torch.device("cuda"), nvjpeg_decoder(torch.device("cuda"))).cpu()
    expected = cpu_path_batch(cpu_path, indices).int()
    per_image = (images.int() - expected).abs().float().mean(dim=(1, 2, 3))
    record_property("nvjpeg_mean_level_difference_max", round(per_image.max().item(), 3))
    record_property("nvjpeg_mean_level_difference", round(per_image.mean().item(), 3))
    assert batch["jpeg_at"] == [0, 1, 2, 3, 5, 6, 7] and labels.tolist() == indices
    assert per_image.max() < 1.5, per_image
    assert torch.equal(images[3][0], images[3][1]) and torch.equal(images[3][1], images[3][2])
    assert torch.equal(images[4].int(), expected[4])
