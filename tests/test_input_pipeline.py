"""The image input pipeline (utils/image_data.py): the workers decode file bytes straight into uint8 tensors and
crop, resize and flip them as uint8; the device normalises. Decoding must give PIL's pixels in every image mode,
and the device-side normalisation what the float pipeline gave, in one copy."""

import io

import datasets
import numpy as np
import pytest
import torch
from PIL import ExifTags, Image
from torchvision.transforms import v2

from utils.errors import UserError
from utils.image_data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TransformedImages,
    _region_scaled,
    collate_images,
    decode_and_transform,
    decode_rgb,
    eval_transform,
    load_image_datasets,
    normalise_on_device,
    reduction_for,
    train_transform,
)

RNG = np.random.default_rng(0)
PHOTO = Image.fromarray(RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8))
# smooth, as photos are at the scale of a pixel: resamplers that round apart differ by a level or two, not by 255
ROWS, COLUMNS = np.mgrid[0:30, 0:40]
SMOOTH = Image.fromarray(np.stack([ROWS * 8, COLUMNS * 6, (ROWS + COLUMNS) * 3], axis=-1).astype(np.uint8))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


# each format with the modes it stores; simplejpeg decodes the JPEGs, PIL the rest
FORMATS_AND_MODES = [("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "L"), ("PNG", "P"),
                     ("PNG", "RGBA"), ("PNG", "LA"), ("WEBP", "RGB"), ("WEBP", "RGBA"), ("GIF", "P"), ("BMP", "RGB"),
                     ("BMP", "L"), ("BMP", "P"), ("TIFF", "RGB"), ("TIFF", "CMYK"), ("TIFF", "RGBA")]


@pytest.mark.parametrize("fmt, mode", FORMATS_AND_MODES)
def test_every_format_and_mode_decodes_to_the_rgb_pixels_pil_gives(fmt, mode):
    # colour at full resolution: the next test is about JPEG's half-resolution colour
    data = encoded(PHOTO.convert(mode), fmt, **({"subsampling": 0} if fmt == "JPEG" else {}))
    pixels = decode_rgb(data)
    expected = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 30, 40)
    # JPEG: both use libjpeg-turbo's exact decoder; CMYK to RGB is the libraries' own arithmetic, rounding apart
    assert (pixels.int() - expected.permute(2, 0, 1).int()).abs().max() <= (1 if mode == "CMYK" else 0)
    # (3, H, W) over (H, W, 3) memory: the layout torch's uint8 resize reads fastest, no copy made
    assert pixels.stride() == (1, 40 * 3, 3)


def test_a_jpeg_with_colour_at_half_resolution_repeats_it_where_pil_interpolates_a_level_or_two_apart():
    data = encoded(SMOOTH, "JPEG", subsampling=2)  # 4:2:0, as most cameras and PIL's default store photos
    difference = decode_rgb(data).int() - torch.from_numpy(np.array(Image.open(io.BytesIO(data)))).permute(2, 0, 1)
    # fastupsample: each colour sample covers its 2x2 pixels; PIL blends neighbouring ones (libjpeg's fancy upsampling)
    assert 0 < difference.abs().float().mean() < 2 and difference.abs().max() <= 8


@pytest.mark.parametrize("orientation", [1, 3])
def test_a_jpeg_whose_exif_has_an_orientation_gives_the_pixels_datasets_gives(orientation):
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation  # 1: upright as stored (decoded by simplejpeg); 3: upside down
    exif[ExifTags.Base.Make] = "a camera"  # more than one tag, as cameras write them
    data = encoded(SMOOTH, "JPEG", exif=exif, subsampling=0)
    upright = datasets.Image().decode_example({"bytes": data, "path": None}).convert("RGB")
    assert torch.equal(decode_rgb(data), torch.from_numpy(np.array(upright)).permute(2, 0, 1))


def test_a_jpeg_whose_orientation_is_in_its_xmp_metadata_is_turned_upright_as_datasets_does():
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    data = encoded(SMOOTH, "JPEG", xmp=xmp)
    upright = datasets.Image().decode_example({"bytes": data, "path": None}).convert("RGB")
    assert upright.size == (30, 40)  # PIL reads XMP orientations too
    assert torch.equal(decode_rgb(data), torch.from_numpy(np.array(upright)).permute(2, 0, 1))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_photo_the_camera_tagged_as_rotated_is_turned_upright_as_datasets_does(fmt):
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # "turn 90 degrees clockwise to view": phones write it for portrait shots
    buffer = io.BytesIO()
    SMOOTH.save(buffer, fmt, exif=exif)
    data = buffer.getvalue()
    pixels = decode_rgb(data)
    assert pixels.shape == (3, 40, 30)  # 40 wide, 30 high as stored; upright it is 30 wide, 40 high
    upright = datasets.Image().decode_example({"bytes": data, "path": None}).convert("RGB")  # what `datasets` gives
    assert torch.equal(pixels, torch.from_numpy(np.array(upright)).permute(2, 0, 1))


def test_a_truncated_jpeg_is_an_error_not_a_grey_half_image():
    data = encoded(PHOTO, "JPEG")
    with pytest.raises(OSError, match="truncated"):
        decode_rgb(data[: len(data) // 2])


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


def test_the_transforms_keep_uint8_and_do_what_the_float_pipeline_did_to_the_same_pixels():
    pixels = decode_rgb(encoded(SMOOTH, "PNG"))
    old_float_pipeline = {  # the same geometry on the PIL image, as before the uint8 pipeline
        "train imagenet": v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()]),
        "train small": v2.Compose([v2.Resize((16, 16), antialias=True), v2.RandomAffine(degrees=0, scale=(0.9, 1.1)),
                                   v2.RandomCrop(16, padding=2, padding_mode="reflect")]),
        "eval imagenet": v2.Compose([v2.Resize(18, antialias=True), v2.CenterCrop(16)]),
    }
    ours = {"train imagenet": train_transform(16, "imagenet"), "train small": train_transform(16, "small", hflip=False),
            "eval imagenet": eval_transform(16, "imagenet")}
    for name, transform in ours.items():
        torch.manual_seed(3)
        out = transform(pixels)
        torch.manual_seed(3)
        before = v2.functional.pil_to_tensor(old_float_pipeline[name](SMOOTH))
        assert type(out) is torch.Tensor and out.dtype == torch.uint8 and out.shape == (3, 16, 16), name
        # the same random draws, the same crop; PIL and torch resize with the same antialiased filter, rounding
        # differently; evaluation cuts its crop out first, to the nearest pixel: a third of one here, 3 levels of SMOOTH
        assert (out.int() - before.int()).abs().float().mean() < (4 if name == "eval imagenet" else 3), name


@pytest.mark.parametrize("height, width", [(375, 500), (500, 333), (480, 640), (224, 300), (90, 100), (256, 256)])
def test_the_evaluation_crop_is_cut_out_where_resize_then_center_crop_puts_it(height, width):
    rows, columns = np.mgrid[0:height, 0:width]
    ramps = np.stack([rows * 255 // (height - 1), columns * 255 // (width - 1), (rows + columns) % 256], axis=-1)
    pixels = torch.from_numpy(ramps.astype(np.uint8)).permute(2, 0, 1)
    out = eval_transform(224, "imagenet")(pixels)
    before = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])(pixels)
    assert out.shape == before.shape == (3, 224, 224)
    difference = (out.int() - before.int()).abs().float()
    # a ramp down the rows and one across the columns: a crop a pixel of the image off would differ by a step of it
    assert difference[0].mean() < 0.7 * 255 / height and difference[1].mean() < 0.7 * 255 / width
    # the third channel wraps around every 256 pixels: edges that must stay in place
    assert difference[2].gt(64).float().mean() < 0.01


def test_the_recipes_draw_and_crop_exactly_as_the_v2_transforms_they_stand_for():
    pixels = decode_rgb(encoded(SMOOTH.resize((80, 60)), "PNG"))
    whole, flip = v2.Resize((32, 32), antialias=True), v2.RandomHorizontalFlip()
    small = [whole, v2.RandomAffine(degrees=0, scale=(0.9, 1.1)), v2.RandomCrop(32, padding=4, padding_mode="reflect")]
    recipes = [(train_transform(32, "imagenet"), [v2.RandomResizedCrop(32, antialias=True), flip]),
               (train_transform(32, "imagenet", hflip=False), [v2.RandomResizedCrop(32, antialias=True)]),
               (train_transform(32, "small", hflip=True), [*small, flip]), (train_transform(32, "none"), [whole, flip]),
               (eval_transform(32, "small"), [whole])]
    for transform, reference in recipes:
        for seed in range(20):
            torch.manual_seed(seed)
            out, next_draw = transform(pixels), torch.rand(1)
            torch.manual_seed(seed)
            assert torch.equal(out, v2.Compose(reference)(pixels)), (transform, seed)
            assert torch.rand(1) == next_draw  # as many draws: the samples after it see the same numbers too


def recorded_decodes(data: bytes, reductions: list):
    """decode_rgb for _TensorCompose.apply_to_file, noting each reduction asked for."""
    def decode(reduction):
        reductions.append(reduction)
        return decode_rgb(data, reduction)
    return decode


def photo(height: int, width: int) -> Image.Image:
    """Smooth colour ramps with some texture at the scale of a few pixels, as photos have."""
    rows, columns = np.mgrid[0:height, 0:width]
    texture = 20 * np.sin(rows / 3.0) * np.cos(columns / 4.0)
    diagonal = (rows + columns) * 100 / (height + width)
    channels = [rows * 200 / height + texture, columns * 200 / width - texture, diagonal]
    return Image.fromarray(np.clip(np.stack(channels, axis=-1) + 30, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("name, transform, reduction", [
    ("train small 32", train_transform(32, "small"), 8),  # the whole 640x480 image: 80x60 at 1/8 still covers 32x32
    ("eval small 64", eval_transform(64, "small"), 4),
    ("eval imagenet 128", eval_transform(128, "imagenet"), 2),  # the central 421x421 of 480: 210 at 1/2, 105 at 1/4
    ("train imagenet 224", train_transform(224, "imagenet"), None),  # random crops: 1 or 2 as the crop allows
])
def test_a_jpeg_is_decoded_at_the_smallest_scale_its_region_allows_with_the_same_draws_and_nearly_the_same_pixels(
        name, transform, reduction):
    data = encoded(photo(480, 640), "JPEG", quality=90)
    for seed in range(12):
        torch.manual_seed(seed)
        reductions = []
        out, next_draw = transform.apply_to_file(data, recorded_decodes(data, reductions)), torch.rand(1)
        torch.manual_seed(seed)
        full = transform(decode_rgb(data))  # the whole image decoded, then the same steps
        assert torch.rand(1) == next_draw, (name, seed)  # the same draws: the region came from the header's size
        assert len(reductions) == 1 and reductions[0] in ((reduction,) if reduction else (1, 2)), (name, reductions)
        difference = (out.int() - full.int()).abs().float()
        if reductions[0] == 1:
            assert torch.equal(out, full), (name, seed)
        else:  # libjpeg-turbo's reduced inverse DCT averages the pixels a resize would: a level or two apart
            assert out.shape == full.shape and difference.mean() < 2.5 and difference.max() < 40, (name, seed)


def test_the_reduction_leaves_the_region_at_least_the_output_size_and_a_photo_at_224_is_decoded_whole():
    region = {"top": 0, "left": 0, "height": 480, "width": 640}
    assert [reduction_for(region, (size, size)) for size in (32, 60, 61, 119, 120, 121, 240, 241, 480)] == [
        8, 8, 4, 4, 4, 2, 2, 1, 1]
    assert reduction_for({**region, "height": 100}, (32, 32)) == 2  # the shorter side decides
    data, transform = encoded(photo(375, 500), "JPEG"), train_transform(224, "imagenet")
    for seed in range(20):  # a photo of ImageNet's usual size: no random crop of it is twice 224 on both sides
        torch.manual_seed(seed)
        reductions = []
        transform.apply_to_file(data, recorded_decodes(data, reductions))
        assert reductions == [1]


def test_a_region_scales_to_the_reduced_decode_by_each_sides_own_factor():
    """libjpeg-turbo decodes at 1/r to the ceiling of each side over r: 333 x 500 at 1/4 is 84 x 125, 375 x 500 at 1/8
    is 47 x 63, so rows and columns scale by different factors. A region's rows scale by the height's factor and its
    columns by the width's, to the nearest pixel (regions in the upper left half: never clipped at an edge)."""
    for size, shape in (((333, 500), (84, 125)), ((375, 500), (47, 63)), ((500, 333), (125, 84))):
        scale_y, scale_x = shape[0] / size[0], shape[1] / size[1]
        for top in range(0, size[0] // 2, 3):
            for left in range(0, size[1] // 2, 37):
                region = {"top": top, "left": left, "height": size[0] // 2 - 9, "width": size[1] // 2 - 9}
                scaled = _region_scaled(region, size, shape)
                assert abs(scaled["top"] - top * scale_y) <= 0.5 and abs(scaled["left"] - left * scale_x) <= 0.5
                assert abs(scaled["height"] - region["height"] * scale_y) <= 0.5
                assert abs(scaled["width"] - region["width"] * scale_x) <= 0.5


def test_only_training_recipes_draw_random_numbers_so_evaluation_images_skip_the_seeding():
    assert all(train_transform(32, recipe).draws_random_numbers for recipe in ("imagenet", "small", "none"))
    assert train_transform(32, "none", hflip=False).draws_random_numbers is False
    for recipe in ("imagenet", "small", "none"):
        transform, data = eval_transform(32, recipe), encoded(photo(60, 80), "JPEG")
        assert transform.draws_random_numbers is False
        torch.manual_seed(0)
        out, next_draw = decode_and_transform(data, transform, [1, 2, 3], "a photo"), torch.rand(1)
        torch.manual_seed(0)
        assert torch.rand(1) == next_draw and torch.equal(out, transform(decode_rgb(data)))


def test_batches_are_stacked_channels_last_with_the_values_default_collate_gives():
    images = [eval_transform(16, "imagenet")(decode_rgb(encoded(PHOTO, "JPEG"))) for _ in range(3)]
    samples = [(image, label, torch.tensor([0.25, 0.75]), 7) for label, image in enumerate(images)]  # predict's 4
    batch, expected = collate_images(samples), torch.utils.data.default_collate(samples)
    assert batch[0].shape == (3, 3, 16, 16) and batch[0].is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(batch, expected, strict=True))
    # the model's input is what a contiguous batch gives: normalise_on_device writes the layout asked for
    plain = normalise_on_device(batch[0])
    assert plain.is_contiguous() and torch.equal(plain, normalise_on_device(expected[0]))


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
    batch = dataset.__getitems__([5, 0, 11])  # what the DataLoader calls: one query for the batch's rows
    assert all(torch.equal(pixels, items[i][0]) and label == items[i][1] for (pixels, label), i in zip(batch, [5, 0, 11]))
    assert all(pixels.dtype == torch.uint8 and pixels.shape == (3, 16, 16) for pixels, _ in items)
    assert sorted(label for _, label in items) == [0] * 6 + [1] * 6
    broken = dataset.source_of(4)
    with open(broken, "r+b") as file:  # keep the header, cut the rest
        file.truncate(40)
    for load in (lambda: dataset[4], lambda: dataset.__getitems__([3, 4])):
        with pytest.raises(UserError, match=rf"{broken} cannot be decoded \(OSError: (?i:.*truncated)"):
            load()
