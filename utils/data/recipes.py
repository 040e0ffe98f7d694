"""The augmentation recipes (imagenet, small, none): torchvision's crops, resizes and flips on uint8 tensors, applied
to an image file with no more decoding than the recipe's first crop needs.

The workers do only what must happen per image on a CPU core: decode the file's bytes into a uint8 tensor
(utils/data/decoding.py) and crop, resize and flip it as uint8 (here). The batch stays uint8 up to the device, a
quarter of float32's bytes, and utils/data/device_input.py makes it the model's input there. scripts/benchmark_data.py
measures this against the earlier float pipeline (docs/benchmarks/cpu_input_pipeline).
"""

import torch

# torchvision is imported in the functions that use it: it takes seconds to import, which `--help` need not wait for
from ..data.decoding import jpeg_size, reduction_for, region_scaled

# --augmentation auto: the ImageNet recipe from this side up; below it, the small-image one.
SMALL_IMAGE_LIMIT = 128


def resolve_augmentation(augmentation: str, image_size: int) -> str:
    """--augmentation {auto,imagenet,small,none} -> the recipe: auto picks by the image size."""
    if augmentation == "auto":
        return "imagenet" if image_size >= SMALL_IMAGE_LIMIT else "small"
    return augmentation


def default_hflip(recipe: str) -> bool:
    """Horizontal flips by default for photos (the ImageNet recipe) only: small images are as often digits,
    text, icons or scans, where a mirror image is another symbol."""
    return recipe == "imagenet"


def train_transform(image_size: int, recipe: str = "imagenet", hflip: bool = True):
    """imagenet: RandomResizedCrop (8-100% of the area) as in torchvision's recipes. small: the whole image
    resized, a mild scale jitter (90-110%) and a random crop from a reflect-padded copy (pad 1/8 of the side), as in
    CIFAR recipes; a random crop of 8% of a 32-pixel image would leave a few pixels. none: the image resized."""
    from torchvision.transforms import v2
    if recipe == "imagenet":
        geometry = [RandomResizedCrop(image_size)]
    elif recipe == "small":
        geometry = [_whole_image(image_size), v2.RandomAffine(degrees=0, scale=(0.9, 1.1)),
                    v2.RandomCrop(image_size, padding=image_size // 8, padding_mode="reflect")]
    else:
        geometry = [_whole_image(image_size)]
    return _uint8_image(*geometry, *([v2.RandomHorizontalFlip()] if hflip else []))


def eval_transform(image_size: int, recipe: str = "imagenet"):
    """imagenet: the central crop of the image resized to size/0.875 (224 of 256, the usual ImageNet ratio). small and
    none: the whole image resized to the size: the central crop would cut the borders off small images."""
    if recipe == "imagenet":
        return _uint8_image(CentralCropResized(image_size, round(image_size / 0.875)))
    return _uint8_image(_whole_image(image_size))


def _resized_crop(image: torch.Tensor, params: dict, size) -> torch.Tensor:
    """The region `params` (top, left, height, width) of a (3, H, W) uint8 image resized to `size`, antialiased.

    The region is copied to contiguous (H, W, 3) memory first: torch's uint8 resize reads that layout at full speed,
    and a strided view of the image at a third more cost than the copy and the resize together."""
    from torchvision.transforms import v2
    top, left, height, width = params["top"], params["left"], params["height"], params["width"]
    crop = image[:, top:top + height, left:left + width].permute(1, 2, 0).contiguous().permute(2, 0, 1)
    return v2.functional.resize(crop, list(size), antialias=True)


class _RegionResized:
    """A first step that resizes one region of the image, (top, left, height, width) from make_params, to `size`,
    antialiased (_resized_crop). The region depends on the image's size only: decode_and_transform draws it from a
    JPEG's header and decodes no more pixels than the region needs (_TensorCompose.apply_to_file)."""

    size: tuple

    def make_params(self, flat_inputs) -> dict:
        return self.region(*flat_inputs[0].shape[-2:])

    def region(self, height: int, width: int) -> dict:
        raise NotImplementedError

    def transform(self, image, params):
        return _resized_crop(image, params, self.size)

    def __call__(self, image):  # as a v2 transform is called, so that v2.Compose can hold it
        return self.transform(image, self.make_params([image]))


class RandomResizedCrop(_RegionResized):
    """v2.RandomResizedCrop(size, antialias=True): its own draws, the same pixels."""

    def __init__(self, size: int):
        from torchvision.transforms import v2
        self.draws, self.size = v2.RandomResizedCrop(size, antialias=True), (size, size)

    def region(self, height, width):
        # v2 reads only the size of what it is given: a tensor of that shape over one byte of memory
        return self.draws.make_params([torch.empty(1, dtype=torch.uint8).expand(3, height, width)])

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]})"


class CentralCropResized(_RegionResized):
    """v2.Resize(resize_to) then v2.CenterCrop(size) as one step: the part of the image that the central crop shows
    (the same, to the nearest pixel of the image) is cut out first and only it is resized, a quarter to a half less
    resizing work."""

    def __init__(self, size: int, resize_to: int):
        self.size, self.resize_to = (size, size), resize_to

    def region(self, height, width):
        size = self.size[0]
        # the resized image's sides and the crop's corner in it, as v2.Resize and v2.CenterCrop compute them
        longer = int(self.resize_to * max(height, width) / min(height, width))
        resized_height, resized_width = (self.resize_to, longer) if height <= width else (longer, self.resize_to)
        top, left = round((resized_height - size) / 2), round((resized_width - size) / 2)
        scale_y, scale_x = height / resized_height, width / resized_width  # back in the image's pixels
        top, left = round(top * scale_y), round(left * scale_x)
        return {"top": top, "left": left, "height": min(round(size * scale_y), height - top),
                "width": min(round(size * scale_x), width - left)}

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]}, resize_to={self.resize_to})"


class WholeImageResized(_RegionResized):
    """v2.Resize((size, size), antialias=True): the whole image, squeezed to a square, the same pixels."""

    def __init__(self, size: int):
        self.size = (size, size)

    def region(self, height, width):
        return {"top": 0, "left": 0, "height": height, "width": width}

    def __repr__(self):
        return f"{type(self).__name__}(size={self.size[0]})"


def _whole_image(image_size: int):
    return WholeImageResized(image_size)  # no crop: non-square images are squeezed


def _uint8_image(*geometry):
    """The recipe's geometric steps on a uint8 (3, H, W) tensor, giving one: torchvision's uint8 resize is its fastest,
    and normalise_on_device does the rest on the device."""
    return _TensorCompose(geometry)


class _TensorCompose:
    """v2.Compose(transforms) for one plain tensor: the same random draws in the same order, the same pixels.

    Hand-written because v2 spends as long on each call's bookkeeping (flattening nested inputs, finding the kernel
    for the input's type) as the crop and flip themselves: a tenth of an image's whole cost on a core. Each transform's
    own make_params and transform do the work; a flip draws its coin first, as v2's random-apply transforms do."""

    def __init__(self, transforms):
        self.transforms = list(transforms)

    @property
    def draws_random_numbers(self) -> bool:
        """False for evaluation's steps: its images need no seeded generator."""
        return not all(isinstance(t, (CentralCropResized, WholeImageResized)) for t in self.transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self._apply(self.transforms, image)

    def apply_to_file(self, data: bytes, decode) -> torch.Tensor:
        """The steps applied to the image file `data`, decoded by `decode(reduction)` (decode_rgb's). Where the first
        step resizes a region (_RegionResized) of a JPEG, the region is drawn from the header's size, before decoding,
        and the JPEG decoded at 1/2, 1/4 or 1/8 of its size where the region stays at least the output's size there:
        libjpeg-turbo's scaled decoding does a quarter of the work at 1/2 and less below. The same draws, in the same
        order, as decoding first; the pixels of a scaled decode differ from a full one's by a level or two."""
        first = self.transforms[0]
        size = jpeg_size(data) if isinstance(first, _RegionResized) else None
        if size is None:
            return self(decode(1))
        region = first.region(*size)
        image = decode(reduction_for(region, first.size))
        return self._apply(self.transforms[1:], first.transform(image, region_scaled(region, size, image.shape[1:])))

    @property
    def decodes_on_device(self) -> bool:
        """Whether --decode_on_device can do these steps after nvJPEG's decode (utils/data/device_decoding.py): a
        region resized (the random crop, the central crop, the whole image), then flips, and nothing else."""
        from torchvision.transforms import v2
        return isinstance(self.transforms[0], _RegionResized) and all(
            isinstance(t, v2.RandomHorizontalFlip) for t in self.transforms[1:])

    def draws_for_size(self, height: int, width: int) -> tuple:
        """(region, flipped) of an image of `height` x `width` for the steps decodes_on_device takes: the random draws
        apply_to_file makes for it, in its order (the first step's region, then each flip's coin), so that a sample
        seeded alike gets the same crop box and flip on either path."""
        region, flipped = self.transforms[0].region(height, width), False
        for transform in self.transforms[1:]:
            flipped ^= _flip_drawn(transform)
        return region, flipped

    @staticmethod
    def _apply(transforms, image):
        from torchvision.transforms import v2
        for transform in transforms:
            if isinstance(transform, v2.RandomHorizontalFlip):
                if _flip_drawn(transform):
                    image = transform.transform(image, {})
            else:
                image = transform.transform(image, transform.make_params([image]))
        return image

    def __repr__(self):
        return "\n".join([f"{type(self).__name__}(", *(f"    {t}" for t in self.transforms), ")"])


def _flip_drawn(flip) -> bool:
    """A v2.RandomHorizontalFlip's coin, drawn as v2's random-apply transforms draw it."""
    return bool(torch.rand(1) < flip.p)
