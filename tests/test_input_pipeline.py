"""The image input pipeline (utils/image_data.py): the workers decode file bytes straight into uint8 tensors and
crop, resize and flip them as uint8; the device normalises. Decoding must give PIL's pixels in every image mode,
and the device-side normalisation what the float pipeline gave, in one copy."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from utils.image_data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TransformedImages,
    decode_rgb,
    eval_transform,
    load_image_datasets,
    normalise_on_device,
    train_transform,
)

RNG = np.random.default_rng(0)
PHOTO = Image.fromarray(RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str) -> torch.Tensor:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


# each format with the modes it stores; torchvision decodes JPEG, PNG, WebP and GIF itself, PIL BMP and TIFF
FORMATS_AND_MODES = [("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "L"), ("PNG", "P"),
                     ("PNG", "RGBA"), ("PNG", "LA"), ("WEBP", "RGB"), ("WEBP", "RGBA"), ("GIF", "P"), ("BMP", "RGB"),
                     ("BMP", "L"), ("BMP", "P"), ("TIFF", "RGB"), ("TIFF", "CMYK"), ("TIFF", "RGBA")]


@pytest.mark.parametrize("fmt, mode", FORMATS_AND_MODES)
def test_every_format_and_mode_decodes_to_the_rgb_pixels_pil_gives(fmt, mode):
    data = encoded(PHOTO.convert(mode), fmt)
    pixels = decode_rgb(data)
    expected = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 30, 40)
    assert torch.equal(pixels, expected.permute(2, 0, 1))


def test_a_16_bit_png_is_scaled_to_8_bits():
    deep = np.zeros((4, 5), dtype=np.uint16)
    deep[0, 0], deep[1, 1] = 65535, 32896  # white, and 128 * 257
    pixels = decode_rgb(encoded(Image.fromarray(deep), "PNG"))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 4, 5)
    assert pixels[:, 0, 0].tolist() == [255] * 3 and pixels[:, 1, 1].tolist() == [128] * 3 and pixels[:, 2, 2].sum() == 0


def float_pipeline_input(images: torch.Tensor) -> torch.Tensor:
    """What the workers used to hand over: float32, scaled to [0, 1], normalised."""
    return v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)(v2.ToDtype(torch.float32, scale=True)(images))


def test_normalising_on_the_device_gives_the_float_pipelines_input_in_the_asked_layout_and_dtype():
    batch = torch.from_numpy(RNG.integers(0, 256, (4, 3, 8, 8), dtype=np.uint8))
    kept = batch.clone()
    plain = normalise_on_device(batch)
    assert plain.dtype == torch.float32 and plain.is_contiguous()
    torch.testing.assert_close(plain, float_pipeline_input(batch), rtol=0, atol=1e-5)
    assert torch.equal(batch, kept)  # the uint8 batch is not touched
    nhwc = normalise_on_device(batch, channels_last=True)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and not nhwc.is_contiguous()
    torch.testing.assert_close(nhwc, plain, rtol=0, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):  # the autocast dtype: the first layer casts nothing
        low = normalise_on_device(batch, dtype, channels_last=True)
        assert low.dtype == dtype and low.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(low.float(), plain, rtol=0, atol=0.05)  # a bf16 step near 2.6 is 0.016


def test_the_transforms_keep_uint8_and_give_the_same_geometry_to_a_pil_image_and_its_tensor():
    tensor = v2.functional.pil_to_tensor(PHOTO)
    for transform in (train_transform(16, "imagenet"), train_transform(16, "small"), eval_transform(16, "imagenet")):
        torch.manual_seed(3)
        from_tensor = transform(tensor)
        torch.manual_seed(3)
        from_pil = transform(PHOTO)
        assert type(from_tensor) is torch.Tensor and from_tensor.dtype == torch.uint8
        assert from_tensor.shape == from_pil.shape == (3, 16, 16)
        # PIL and torch resize with the same antialiased filter, rounding differently
        assert (from_tensor.int() - from_pil.int()).abs().float().mean() < 2


def test_folders_of_mixed_formats_and_modes_give_uint8_items_and_a_corrupt_file_is_named(tmp_path):
    for split, count in (("train", 6), ("val", 2)):
        for label in ("a", "b"):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                mode, fmt = [("RGB", "JPEG"), ("L", "PNG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("RGB", "BMP"),
                             ("P", "GIF")][i % 6]
                PHOTO.convert(mode).save(folder / f"{i}.{fmt.lower()}", fmt)
    train_split, _, image_column, label_column, names = load_image_datasets(data_dir=tmp_path)
    dataset = TransformedImages(train_split, eval_transform(16, "small"), image_column, label_column)
    items = [dataset[i] for i in range(len(dataset))]
    assert len(items) == 12 and names == ["a", "b"]
    assert all(pixels.dtype == torch.uint8 and pixels.shape == (3, 16, 16) for pixels, _ in items)
    assert sorted(label for _, label in items) == [0] * 6 + [1] * 6
    broken = dataset.source_of(4)
    with open(broken, "r+b") as file:  # keep the header, cut the rest
        file.truncate(40)
    with pytest.raises(Exception, match=rf"{broken}.*cannot be decoded") as error:
        dataset[4]
    assert "/__w/" not in str(error.value) and ".cpp" not in str(error.value)  # torchvision's C++ file is not news
