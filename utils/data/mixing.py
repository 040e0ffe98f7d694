"""--mixup_alpha, --cutmix_alpha, --mix_prob (timm's names and meanings): Mixup and CutMix with torchvision's v2.MixUp
and v2.CutMix, done per sample in the DataLoader workers.

Whether sample i of epoch e is mixed, with which partner, by which method and by how much is a pure function of
(seed, e, i), as its augmentations are (utils/image_data.TransformedImages): 1, 2 or 3 processes, any number of
workers, any batch size and a resumed run mix the same pairs into the same pixels. timm and torchvision's examples mix
within each batch instead, pairing a sample with its neighbour in this process's batch: which neighbour that is
changes with the process count and the batch size. The cost: a mixed sample decodes and augments two images.
"""

from typing import NamedTuple

import numpy as np
import torch

from ..data.image_dataset import cpu_generator_seeded
from ..errors import UserError

# Seeds the mixing's draws apart from the augmentations' (seed, epoch, index). Not 0: numpy's SeedSequence pads its
# entropy with zeros, so [seed, epoch, index, 0] would draw exactly what [seed, epoch, index] draws.
MIXING_STREAM = 0x6D6978  # "mix"
SWITCH_PROB = 0.5  # with both methods on, the share of mixed samples that CutMix makes (timm's switch_prob)


class Pairing(NamedTuple):
    """How a sample is mixed in an epoch: `partner` is the other sample's index and `kind` "mixup" or "cutmix" (-1 and
    "" when it is not mixed); `seed` seeds torchvision's draws (lam, and CutMix's box)."""

    partner: int
    kind: str
    seed: int


class MixedImages(torch.utils.data.Dataset):
    """`dataset` (a TransformedImages: uint8 images and class ids) with Mixup and CutMix: each sample is (image,
    target), the target a float vector of the `num_classes` class weights: lam for the sample's class, 1 - lam for
    its partner's (one-hot when the sample is not mixed, so that every batch collates). See `pairing` and
    `mix_pair`."""

    def __init__(self, dataset, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 mix_prob: float = 1.0, seed: int = 0):
        from torchvision.transforms import v2

        if len(dataset) < 2:
            raise UserError(f"--mixup_alpha/--cutmix_alpha mix two training images, and there is {len(dataset)}; "
                            f"add images or drop the flags")
        self.dataset, self.num_classes, self.mix_prob, self.seed = dataset, num_classes, mix_prob, seed
        # num_classes 2: each pair is labelled as classes 0 and 1, so that the first target row reads [lam, 1 - lam]
        self.transforms = {kind: method(alpha=alpha, num_classes=2) for kind, method, alpha in
                           (("mixup", v2.MixUp, mixup_alpha), ("cutmix", v2.CutMix, cutmix_alpha)) if alpha > 0}
        if not self.transforms:
            raise ValueError("MixedImages needs mixup_alpha > 0 or cutmix_alpha > 0")

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)  # one epoch for both: the augmentations' (shared with the workers) is the mix's

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def __len__(self):
        return len(self.dataset)

    def pairing(self, epoch: int, index: int) -> Pairing:
        """Sample `index` of `epoch` is mixed with probability mix_prob, by CutMix with probability SWITCH_PROB when
        both methods are on, with a partner drawn uniformly among the other samples. A function of (seed, epoch,
        index) only; every draw is made whatever the outcome, so each decision keeps its own random number."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, index, MIXING_STREAM]))
        mixed, use_cutmix = rng.random() < self.mix_prob, rng.random() < SWITCH_PROB
        partner = int(rng.integers(len(self) - 1))
        partner += partner >= index  # skips the sample itself
        seed = int(rng.integers(2**63))
        if not mixed:
            return Pairing(-1, "", seed)
        if len(self.transforms) == 2:
            return Pairing(partner, "cutmix" if use_cutmix else "mixup", seed)
        (kind,) = self.transforms
        return Pairing(partner, kind, seed)

    def lam_of(self, epoch: int, index: int, height: int, width: int) -> float:
        """The weight of sample `index`'s own image and class in its mix, 1.0 when it is not mixed: what __getitem__
        gives an image of height x width (CutMix's lam is the share of whole pixels left to the image)."""
        pairing = self.pairing(epoch, index)
        if not pairing.kind:
            return 1.0
        return mix_pair(self.transforms[pairing.kind], pairing.seed, torch.zeros(2, 1, height, width))[1]

    def __getitem__(self, index):
        image, label = self.dataset[index]
        target = torch.zeros(self.num_classes)
        pairing = self.pairing(self.epoch, index)
        if not pairing.kind:
            target[label] = 1.0
            return image, target
        partner_image, partner_label = self.dataset[pairing.partner]  # augmented as itself: seeded by its own index
        mixed, lam = mix_pair(self.transforms[pairing.kind], pairing.seed, torch.stack([image, partner_image]))
        target[label] += lam
        target[partner_label] += 1.0 - lam
        return mixed, target


def mix_pair(transform, seed: int, pair: torch.Tensor) -> tuple:
    """torchvision's `transform` (v2.MixUp or v2.CutMix, num_classes=2) on a (2, C, H, W) pair, its draws from the
    CPU generator seeded with `seed`: (the first image mixed with the second, in the pair's dtype, and lam, the first
    one's weight). v2.MixUp needs float pixels; uint8 comes back rounded, at most half a grey level off, so that the
    batches stay uint8 up to the device (utils/data/device_input.py)."""
    with cpu_generator_seeded(seed):  # v2's Beta and box draws use the global CPU generator
        # v2 mixes image k with image k - 1; one-hot float64 labels give the first row [lam, 1 - lam], lam exact
        mixed, weights = transform(pair.float(), torch.eye(2, dtype=torch.float64))
    if not pair.dtype.is_floating_point:
        mixed = mixed.round().to(pair.dtype)
    return mixed[0], weights[0, 0].item()
