"""Every image mode PIL opens as the 8-bit RGB an image viewer shows: what training, evaluation and scripts/predict.py
decode a non-JPEG (or rotated JPEG) file to (utils/data/decoding.py decode_rgb).

PIL's own convert("RGB") does not: it clips 16-bit greyscale to 255 (a 16-bit PNG becomes a white blob) and drops the
alpha channel, leaving what transparent pixels store (often black: black ink on a transparent background becomes an
all-black image).
"""

import numpy as np

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
    rounded), transparency composited on white, palette, 1-bit, greyscale and CMYK converted by PIL."""
    from PIL import Image

    if image.mode in WIDE_GREYSCALE_MODES:
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, WIDE_GREYSCALE_MAX)
        grey = ((wide * 255 + WIDE_GREYSCALE_MAX // 2) // WIDE_GREYSCALE_MAX).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        background = Image.new("RGBA", image.size, BACKGROUND)
        return np.array(Image.alpha_composite(background, image.convert("RGBA")).convert("RGB"))
    return np.array(image.convert("RGB"))
