"""Image files decoded into uint8 RGB tensors: JPEGs through libjpeg-turbo (simplejpeg), at 1/2, 1/4 or 1/8 of their
size where the recipe's crop allows, their EXIF orientation read from the header; PIL for the rest, every image mode
it opens as the 8-bit RGB an image viewer shows (viewer_rgb)."""

import io

import numpy as np
import torch

# simplejpeg and PIL are imported in the functions that use them: `--help` need not wait for them

# libjpeg-turbo decodes at 1/2, 1/4 and 1/8 with its fast (SIMD) inverse DCTs; its other scales (3/8, 5/8...) take
# longer than a full decode on photos
JPEG_REDUCTIONS = (8, 4, 2)


def reduction_for(region: dict, size) -> int:
    """The largest of JPEG_REDUCTIONS that leaves `region` (top, left, height, width) at least `size` (height, width),
    or 1: the image is then resized down as much as before, never up."""
    return next((r for r in JPEG_REDUCTIONS if region["height"] >= r * size[0] and region["width"] >= r * size[1]), 1)


def region_scaled(region: dict, size, shape) -> dict:
    """`region` of an image of `size` (height, width) in the pixels of the same image decoded at `shape`, within it."""
    scale_y, scale_x = shape[0] / size[0], shape[1] / size[1]
    top, left = min(round(region["top"] * scale_y), shape[0] - 1), min(round(region["left"] * scale_x), shape[1] - 1)
    return {"top": top, "left": left, "height": max(1, min(round(region["height"] * scale_y), shape[0] - top)),
            "width": max(1, min(round(region["width"] * scale_x), shape[1] - left))}


def jpeg_size(data: bytes):
    """(height, width) of a JPEG that decode_rgb decodes with simplejpeg (stored upright), from its header; None for
    other files, and where the header does not read (decoding then names the problem)."""
    header = jpeg_header(data)
    return None if header is None else header[:2]


def jpeg_header(data: bytes):
    """(height, width, colour space: "YCbCr", "Gray", "CMYK", ...) of an upright JPEG, from its header; None as for
    jpeg_size."""
    import simplejpeg
    if not _is_upright_jpeg(data):
        return None
    try:
        height, width, colourspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return height, width, colourspace


def decode_rgb(data: bytes, reduction: int = 1) -> torch.Tensor:
    """An image file's bytes as a uint8 (3, H, W) RGB tensor, as a viewer shows the file: greyscale, palette, CMYK and
    16-bit images become 3 channels of 8 bits, transparent pixels white (viewer_rgb).

    JPEGs, most of any photo data set, go through simplejpeg (libjpeg-turbo's TurboJPEG API, as PIL uses): a third
    less time than PIL here. With fastupsample, colour stored at half resolution (4:2:0, most photos) is repeated over
    its 2x2 pixels rather than blended with its neighbours: under a level (of 255) from PIL's pixels on average, for
    6% less time; JPEGs with full-resolution colour give PIL's pixels exactly. `reduction` (2, 4 or 8): such a JPEG
    decoded at that fraction of its size, rounded up (libjpeg-turbo's scaled decoding). PIL reads the rest (PNG, WebP,
    BMP, TIFF) and the photos tagged as rotated, which it turns upright, as `datasets` does when it decodes, at full
    size. Both give rows of RGB pixels, so the tensor is a (3, H, W) view of (H, W, 3) memory, the channels-last
    layout in which torch's uint8 resize is fastest.
    """
    import simplejpeg
    from PIL import Image, ImageOps

    pixels = None
    if _is_upright_jpeg(data):
        try:
            scaled = {}
            if reduction > 1:
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
                scaled = {"min_height": -(-height // reduction), "min_width": -(-width // reduction),
                          "min_factor": reduction}
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastupsample=True, **scaled)
        except ValueError:  # damaged, or a JPEG flavour TurboJPEG does not read: PIL decides which
            pass
    if pixels is None:
        with Image.open(io.BytesIO(data)) as image:
            pixels = viewer_rgb(ImageOps.exif_transpose(image))  # 16-bit scaled, transparency on white
    return torch.from_numpy(pixels).permute(2, 0, 1)


def _is_upright_jpeg(data: bytes) -> bool:
    """A JPEG stored the way up it is shown (no EXIF or XMP orientation to apply): what simplejpeg decodes."""
    return data[:3] == b"\xff\xd8\xff" and _jpeg_orientation(data) == 1


def _jpeg_orientation(data: bytes):
    """The EXIF orientation of a JPEG's bytes (1: stored upright, as when it has no EXIF), or None where PIL should
    decide: XMP metadata (PIL reads an orientation there too), or a header not as expected.

    Hand-written because PIL's Image.open parses every table of the header in Python, a twentieth of an image's
    whole cost in a worker; walking the segments' lengths up to the image data costs microseconds."""
    from PIL import ExifTags, Image

    exif, position = None, 2  # after the start-of-image marker
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before a marker
            position += 1
            continue
        if marker == 0xDA:  # start of scan: the image data follows, the header is complete
            if exif is None:
                return 1
            orientation = Image.Exif()
            orientation.load(exif)  # the parser Image.getexif uses
            return orientation.get(ExifTags.Base.Orientation, 1)
        end = position + 2 + int.from_bytes(data[position + 2:position + 4], "big")
        if marker == 0xE1:  # APP1: EXIF or XMP
            if data[position + 4:position + 10] != b"Exif\x00\x00":
                return None
            exif = exif or data[position + 4:end]  # the first one, as PIL keeps it
        position = end
    return None


# Greyscale modes of more than 8 bits: 16-bit PNGs and TIFFs open as "I;16" (or its byte orders), some TIFFs as "I"
# (32-bit integers, read here as 16-bit values, what such files hold in practice)
WIDE_GREYSCALE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
WIDE_GREYSCALE_MAX = 65535
# Modes with an alpha channel; palette, greyscale and RGB images may instead name one transparent colour or palette
# entries ("transparency" in their info)
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
BACKGROUND = (255, 255, 255, 255)  # transparent pixels show as white, as browsers and viewers show them on a page


def viewer_rgb(image) -> np.ndarray:
    """`image` (a PIL image of any mode) as (H, W, 3) uint8 RGB: 16-bit greyscale scaled to 8 bits (65535 -> 255,
    rounded), transparency composited on white, palette, 1-bit, greyscale and CMYK converted by PIL.

    PIL's own convert("RGB") does not: it clips 16-bit greyscale to 255 (a 16-bit PNG becomes a white blob) and drops
    the alpha channel, leaving what transparent pixels store (often black: black ink on a transparent background
    becomes an all-black image)."""
    from PIL import Image

    if image.mode in WIDE_GREYSCALE_MODES:
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, WIDE_GREYSCALE_MAX)
        grey = ((wide * 255 + WIDE_GREYSCALE_MAX // 2) // WIDE_GREYSCALE_MAX).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        background = Image.new("RGBA", image.size, BACKGROUND)
        return np.array(Image.alpha_composite(background, image.convert("RGBA")).convert("RGB"))
    return np.array(image.convert("RGB"))
