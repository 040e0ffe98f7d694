"""--decode_on_device, for nodes with too few CPU cores per GPU: the DataLoader workers read each JPEG's bytes and draw
its crop box and flip, decoding nothing; the GPU decodes the batch with nvJPEG (torchvision's batched decode_jpeg) and
crops, resizes and flips there.

The draws are the CPU path's own (recipes.py draws_for_size), from the same per-sample seeds (image_dataset.py
augmentation_seeded): a sample gets the same crop box and flip with or without the flag. The pixels differ by the
decoder's rounding and the resize's arithmetic only (docs/image_classification.md, "Decoding on the GPU"). Files
nvJPEG is not given are decoded and transformed in the worker as without the flag, and take their place in the batch:
other formats (PNG, WebP...), photos tagged as rotated (PIL turns them upright), CMYK and YCCK JPEGs (PIL converts
them as a viewer shows them).
"""

import warnings

import torch
import torch.nn.functional as F

from ..data.decoding import jpeg_header
from ..data.image_dataset import (
    TransformedImages,
    augmentation_seeded,
    collate_images,
    decode_and_transform,
    image_bytes,
    image_source,
)
from ..errors import UserError, first_line

# The colour spaces nvJPEG is given; the rest (CMYK, YCCK: print files) go through PIL in the worker
DEVICE_COLOURSPACES = ("YCbCr", "Gray")
BATCHED_DECODE_TORCHVISION = (0, 19)  # decode_jpeg takes a list of images (one batched nvJPEG call) from 0.19


def device_decoding_refusal(device: torch.device):
    """Why --decode_on_device cannot run on `device` (one line), or None: it needs a CUDA device and torchvision's
    batched decode."""
    import torchvision

    if device.type != "cuda":
        return (f"--decode_on_device decodes the JPEGs with nvJPEG on a CUDA GPU, and this run's device is "
                f"{device.type} (--cpu, or no CUDA device seen): drop --decode_on_device; the DataLoader workers then "
                f"decode them")
    version = tuple(int(part) for part in torchvision.__version__.split("+")[0].split(".")[:2])
    if version < BATCHED_DECODE_TORCHVISION:
        return (f"--decode_on_device needs torchvision 0.19 or later (batched nvJPEG decoding); this is "
                f"{torchvision.__version__}: upgrade it, or drop --decode_on_device")
    return None


def device_jpeg_size(data: bytes):
    """(height, width) of a JPEG the device decodes (upright, YCbCr or greyscale), from its header; else None."""
    header = jpeg_header(data)
    return header[:2] if header is not None and header[2] in DEVICE_COLOURSPACES else None


class EncodedImages(TransformedImages):
    """TransformedImages for --decode_on_device: a JPEG sample is {"jpeg": its bytes, "box": (top, left, height,
    width, flipped), "source": its file} for decode_batch, the box and flip drawn here, seeded as TransformedImages
    seeds them; any other file is decoded and transformed here, as TransformedImages does."""

    def __init__(self, dataset, transform, image_column: str, label_column: str, seed: int = 0):
        if not transform.decodes_on_device:
            raise UserError(f"--decode_on_device does a crop (or the whole image) resized and flips on the GPU, not "
                            f"{transform}: use --augmentation imagenet or none, or drop --decode_on_device")
        super().__init__(dataset, transform, image_column, label_column, seed)

    def _sample(self, index, image, label):
        data, source = image_bytes(image), image_source(image, index)
        size = device_jpeg_size(data)
        if size is None:
            return decode_and_transform(data, self.transform, self.seed_entropy(index), source), label
        with augmentation_seeded(self.transform, self.seed_entropy(index)):
            region, flipped = self.transform.draws_for_size(*size)
        box = (region["top"], region["left"], region["height"], region["width"], int(flipped))
        return {"jpeg": data, "box": box, "source": source}, label


def collate_encoded(samples: list) -> list:
    """EncodedImages' samples as [batch, labels]. The batch keeps the JPEGs' bytes and boxes as Python objects, which
    Accelerate's prepared loader leaves on the CPU (nvJPEG reads its input there, and reading boxes back from the GPU
    would wait for it), and stacks the images decoded in the workers (collate_images), which it moves to the device."""
    from torch.utils.data import default_collate

    at_device = [i for i, (item, _) in enumerate(samples) if isinstance(item, dict)]
    in_worker = [i for i, (item, _) in enumerate(samples) if not isinstance(item, dict)]
    batch = {"jpegs": [samples[i][0]["jpeg"] for i in at_device], "boxes": [samples[i][0]["box"] for i in at_device],
             "sources": [samples[i][0]["source"] for i in at_device], "jpeg_at": at_device,
             "pixels": collate_images([(samples[i][0],) for i in in_worker])[0] if in_worker else None,
             "pixels_at": in_worker}
    return [batch, default_collate([label for _, label in samples])]


def nvjpeg_decoder(device):
    """torchvision's decode_jpeg on `device` (nvJPEG on a GPU), RGB: a list of byte tensors in one batched call."""
    from functools import partial

    from torchvision.io import ImageReadMode, decode_jpeg
    return partial(decode_jpeg, mode=ImageReadMode.RGB, device=device)


def decode_batch(batch: dict, size: int, device, decode) -> torch.Tensor:
    """collate_encoded's batch as a uint8 (N, 3, size, size) batch on `device` over channels-last memory, in sample
    order, as collate_images would have stacked it: the JPEGs decoded by `decode` (nvjpeg_decoder) in one call, each
    cropped to its box, resized and flipped (crop_resize_flip), beside the images the workers decoded."""
    count = len(batch["jpeg_at"]) + len(batch["pixels_at"])
    images = torch.empty((count, size, size, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    if batch["jpegs"]:
        decoded = decoded_naming_the_file(batch, decode)
        for at, image, box in zip(batch["jpeg_at"], decoded, batch["boxes"], strict=True):
            images[at] = crop_resize_flip(image, box, size)
    if batch["pixels_at"]:
        images[batch["pixels_at"]] = batch["pixels"].to(device)
    return images


def decoded_naming_the_file(batch: dict, decode) -> list:
    """The batch's JPEGs decoded in one call; where that fails (nvJPEG names no image), one by one, to name the file."""
    with warnings.catch_warnings():  # the bytes are read-only and nvJPEG only reads them: no copy
        warnings.simplefilter("ignore", UserWarning)
        encoded = [torch.frombuffer(data, dtype=torch.uint8) for data in batch["jpegs"]]
    try:
        return decode(encoded)
    except RuntimeError:
        for data, source in zip(encoded, batch["sources"], strict=True):
            try:
                decode([data])
            except RuntimeError as err:
                raise UserError(f"{source} cannot be decoded on the GPU ({first_line(err)}); replace it with a good "
                                f"copy, or delete it") from None
        raise


def crop_resize_flip(image: torch.Tensor, box, size: int) -> torch.Tensor:
    """The box (top, left, height, width, flipped) of a uint8 (3, H, W) image resized to size x size, antialiased,
    then mirrored if flipped: the CPU path's RandomResizedCrop (or central crop, or whole image) and flip. In float,
    rounded: torchvision's uint8 resize does the same on a GPU (its integer kernel, which the workers use, is the
    CPU's), so this runs the GPU's arithmetic on either device."""
    top, left, height, width, flipped = box
    crop = image[:, top:top + height, left:left + width].unsqueeze(0).float()
    resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    resized = resized.round_().clamp_(0, 255).to(torch.uint8)
    return resized.flip(-1) if flipped else resized


def decoding_first(model_input, device, size: int):
    """`model_input` (normalise_on_device's) preceded by decode_batch with nvJPEG on `device`: what the training loop
    and evaluation apply to each batch under --decode_on_device."""
    decode = nvjpeg_decoder(device)
    return lambda batch: model_input(decode_batch(batch, size, device, decode))
