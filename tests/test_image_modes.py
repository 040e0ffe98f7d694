"""Every image mode PIL opens becomes the RGB a viewer shows (utils/data/decoding.py viewer_rgb), in every path that decodes
images: the map-style dataset, the stream and scripts/predict.py's inputs. Issue 29: 16-bit greyscale PNGs trained as
white blobs (PIL's convert clips them) and black ink on a transparent background decoded all black.

Each generated file is 8x8 px, its left half one value and its right half another; the expected RGB of each half is
what an image viewer shows (transparent: the white page behind it)."""

import io

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from utils.data.decoding import decode_rgb
from utils.data.image_dataset import TransformedImages
from utils.data.recipes import eval_transform
from utils.data.streaming import StreamedImages
from utils.predict.trained_run import TrainedRun, read_inputs

SIZE = 8
WHITE, BLACK, RED = (255, 255, 255), (0, 0, 0), (255, 0, 0)


def halves(mode, left, right, dtype=np.uint8):
    """A SIZE x SIZE image of `mode`: `left` in the left half, `right` in the right half."""
    channels = np.shape(left)
    pixels = np.empty((SIZE, SIZE, *channels), dtype=dtype)
    pixels[:, :SIZE // 2], pixels[:, SIZE // 2:] = left, right
    return Image.fromarray(pixels, mode) if mode in ("RGBA", "LA", "CMYK") else Image.fromarray(pixels).convert(mode) \
        if mode == "1" else Image.fromarray(pixels)


def encoded(image, file_format, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, file_format, **options)
    return buffer.getvalue()


def palette_with_transparency() -> bytes:
    """A palette PNG: entry 0 black and transparent (the background), entry 1 black ink."""
    image = Image.fromarray(np.array([[0] * (SIZE // 2) + [1] * (SIZE // 2)] * SIZE, dtype=np.uint8), "P")
    image.putpalette([0, 0, 0, 0, 0, 0])
    return encoded(image, "PNG", transparency=0)


def greyscale_with_transparent_colour() -> bytes:
    """An 8-bit greyscale PNG whose level 0 is marked transparent (a tRNS chunk), level 40 opaque."""
    return encoded(halves("L", 0, 40), "PNG", transparency=0)


# (name, file bytes, mode PIL opens it as, RGB of the left half, RGB of the right half)
CASES = [
    ("16-bit greyscale PNG", encoded(halves("I;16", 32768, 65535, np.uint16), "PNG"), "I;16", (128,) * 3, WHITE),
    ("16-bit greyscale PNG, dark", encoded(halves("I;16", 0, 257 * 30, np.uint16), "PNG"), "I;16", BLACK, (30,) * 3),
    ("32-bit integer TIFF", encoded(halves("I", 0, 65535, np.int32), "TIFF"), "I", BLACK, WHITE),
    # values outside the 16-bit range: clipped to it (black, white), not scaled past 8 bits (-70000 would wrap to 239,
    # 70000 to 16)
    ("32-bit integer TIFF beyond 16 bits", encoded(halves("I", -70000, 70000, np.int32), "TIFF"), "I", BLACK, WHITE),
    ("palette PNG with a transparent entry", palette_with_transparency(), "P", WHITE, BLACK),
    ("greyscale PNG with a transparent level", greyscale_with_transparent_colour(), "L", WHITE, (40,) * 3),
    ("greyscale and alpha PNG", encoded(halves("LA", (0, 0), (0, 255)), "PNG"), "LA", WHITE, BLACK),
    ("RGBA PNG", encoded(halves("RGBA", (0, 0, 0, 0), (255, 0, 0, 255)), "PNG"), "RGBA", WHITE, RED),
    ("RGBA PNG, half transparent", encoded(halves("RGBA", (0, 0, 0, 128), (0, 0, 0, 255)), "PNG"), "RGBA",
     (127,) * 3, BLACK),
    ("CMYK TIFF", encoded(halves("CMYK", (0, 0, 0, 0), (0, 255, 255, 0)), "TIFF"), "CMYK", WHITE, RED),
    ("greyscale PNG", encoded(halves("L", 100, 200), "PNG"), "L", (100,) * 3, (200,) * 3),
    ("1-bit PNG", encoded(halves("1", 0, 255), "PNG"), "1", BLACK, WHITE),
]
IDS = [case[0] for case in CASES]


def assert_halves(image: torch.Tensor, left, right, tolerance=0):
    """`image`, a uint8 (3, H, W) tensor, shows `left` in every pixel of its left half and `right` in its right half."""
    assert image.dtype == torch.uint8 and tuple(image.shape) == (3, SIZE, SIZE)
    pixels = image.permute(1, 2, 0).to(torch.int16)
    for half, expected in ((pixels[:, :SIZE // 2], left), (pixels[:, SIZE // 2:], right)):
        difference = (half - torch.tensor(expected, dtype=torch.int16)).abs().max().item()
        assert difference <= tolerance, (half[0, 0].tolist(), expected)


@pytest.mark.parametrize("name, data, mode, left, right", CASES, ids=IDS)
def test_each_mode_decodes_to_what_a_viewer_shows(name, data, mode, left, right):
    assert Image.open(io.BytesIO(data)).mode == mode  # the generated file is of the mode it claims
    assert_halves(decode_rgb(data), left, right)


def test_a_16_bit_gradient_is_scaled_not_clipped():
    """Issue 29: every level of a 16-bit PNG above 255 became 255. Scaled, 65535 -> 255 and each level to the nearest
    8-bit one: 256 distinct levels from a gradient over the whole range."""
    wide = (np.arange(SIZE * 32, dtype=np.uint32).reshape(SIZE, 32) * 257).astype(np.uint16)
    image = decode_rgb(encoded(Image.fromarray(wide), "PNG"))
    assert torch.equal(image[0], torch.from_numpy((wide.astype(np.int64) // 257).astype(np.uint8)))
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])


def test_cmyk_jpegs_and_plain_jpegs():
    """A CMYK JPEG (which TurboJPEG cannot turn into RGB) through PIL: white and red within JPEG's error; an RGB JPEG
    stays on the fast path, simplejpeg's pixels exactly."""
    cmyk = encoded(halves("CMYK", (0, 0, 0, 0), (0, 255, 255, 0)), "JPEG", quality=100)
    assert_halves(decode_rgb(cmyk), WHITE, RED, tolerance=3)
    rgb = encoded(halves("RGB", (200, 30, 30), (30, 30, 200)), "JPEG", quality=90)
    expected = simplejpeg.decode_jpeg(rgb, colorspace="RGB", fastupsample=True)
    assert torch.equal(decode_rgb(rgb), torch.from_numpy(expected).permute(2, 0, 1))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Each case as a file, in CASES' order (their names sort so), with its label: its index."""
    folder = tmp_path_factory.mktemp("modes")
    paths = []
    for index, (name, data, *_) in enumerate(CASES):
        extension = "tif" if "TIFF" in name else "png"
        paths.append(folder / f"{index:02d}.{extension}")
        paths[-1].write_bytes(data)
    return folder, paths


def image_dataset(paths):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": [str(p) for p in paths], "label": list(range(len(paths)))}, features)


def test_the_map_style_and_streamed_datasets_decode_every_mode_so(files):
    _, paths = files
    transform = eval_transform(SIZE, "none")  # the whole image at its own size: the pixels as decoded
    mapped = TransformedImages(image_dataset(paths), transform, "image", "label")
    import datasets

    stream = image_dataset(paths).to_iterable_dataset().cast_column("image", datasets.Image(decode=False))
    streamed = list(StreamedImages(stream, transform, "image", "label"))
    assert [label for _, label in streamed] == list(range(len(CASES)))
    for index, (_, _, _, left, right) in enumerate(CASES):
        assert_halves(mapped[index][0], left, right)
        assert_halves(streamed[index][0], left, right)


def test_predict_decodes_every_mode_so(files):
    """scripts/predict.py's inputs from a folder of unlabelled images, as a run at SIZE px without crops reads them."""
    folder, _ = files
    run = {"script": "train_image_classifier.py", "image_size": SIZE, "augmentation": "none", "val_split": 0.2,
           "data": str(folder)}
    inputs = read_inputs(TrainedRun(folder, run, {}, ["a", "b"]), data_dir=folder)
    assert len(inputs.dataset) == len(CASES)
    for index, (_, _, _, left, right) in enumerate(CASES):
        assert_halves(inputs.dataset[index][0], left, right)
