"""Models: the MNIST ConvNet, and torchvision classification models by name."""

import contextlib
import importlib
from collections import OrderedDict
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import UserError, first_line

# torchvision is imported in the functions that use it: it takes a second to import, which `--help` need not wait for


class ConvNet(nn.Module):
    """The classic two-block MNIST ConvNet: (Conv5x5 -> BN -> ReLU -> MaxPool) x 2 -> Linear.

    28x28 -> 14x14 (16 channels) -> 7x7 (32 channels) -> 10 logits.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))


# --stem auto: the small-image stem for ResNets up to this image side.
SMALL_STEM_LIMIT = 64


def build_model(name: str, num_classes: int, pretrained: bool = False, image_size=None, stem: str = "imagenet"):
    """A torchvision classification model by name ("resnet18", "resnet50", ...) with
    `num_classes` outputs, or `package.module:function` called as function(num_classes=N).
    `stem` (ResNets; see use_small_image_stem): "imagenet" leaves the model as built, "small" swaps the stem,
    "auto" swaps it up to SMALL_STEM_LIMIT pixels unless the weights are pretrained.
    With `image_size`, one image of that size goes through it first (see check_image_size)."""
    from torchvision.models import ResNet
    model = _build(name, num_classes, pretrained)
    is_resnet = isinstance(model, ResNet)
    if stem == "small" and not is_resnet:
        raise UserError(f"--stem small replaces a ResNet's first layers; --model {name} is not a ResNet: "
                        f"drop --stem (or use resnet18/resnet50/resnext/wide_resnet)")
    if stem == "small" or (stem == "auto" and is_resnet and not pretrained and image_size is not None
                           and image_size <= SMALL_STEM_LIMIT):
        use_small_image_stem(model)
    if image_size is not None:
        check_image_size(model, name, image_size)
    return model


def use_small_image_stem(model) -> None:
    """The CIFAR-style stem: a 3x3 stride-1 first convolution and no max-pool, in place of the 7x7 stride-2
    convolution and the max-pool that shrink an ImageNet image 4x before the first block; on a 32-pixel
    image those leave 8x8 feature maps for the first block and 1x1 for the last (16x the compute of the
    ImageNet stem at 32 px). The new convolution is freshly initialised, also on a pretrained model."""
    old = model.conv1
    model.conv1 = nn.Conv2d(old.in_channels, old.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision's ResNet
    model.maxpool = nn.Identity()


def stem_of(model: nn.Module):
    """Which stem a ResNet has ("small" or "imagenet"), for results.json; None for other models."""
    from torchvision.models import ResNet
    if not isinstance(model, ResNet):
        return None
    return "small" if isinstance(model.maxpool, nn.Identity) and model.conv1.stride == (1, 1) else "imagenet"


def check_image_size(model: nn.Module, name: str, image_size: int) -> None:
    """Some architectures fix their input size when built (ViT's patch grid: 224 for vit_b_16) or
    shrink small images to nothing; find out now, on the CPU, not after the data is loaded.
    One dry forward rather than passing image_size to the models that take it: it covers every model
    (your own ones too), and never builds an architecture other than the one named (a ViT built for
    32 px has another positional embedding, which its pretrained weights do not fit)."""
    import torch

    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, 3, image_size, image_size))
    except Exception as err:  # torchvision asserts, shape errors: any of them means this size does not fit
        raise UserError(f"--model {name} cannot take --image_size {image_size} images ({first_line(err)}); choose "
                        f"the size it was built for (224 for torchvision's ViTs) or another model") from None
    finally:
        model.train(was_training)


def _build(name: str, num_classes: int, pretrained: bool) -> nn.Module:
    if ":" in name:
        module_name, _, function_name = name.partition(":")
        if not module_name or not function_name:
            raise UserError(f"--model {name}: expected package.module:function, e.g. tests.models:tiny_cnn")
        try:
            builder = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise UserError(f"--model {name}: cannot import it ({err}); give a module:function importable "
                            f"from the repository root") from None
        if pretrained:
            raise UserError(f"--pretrained loads torchvision weights; --model {name} is your own builder, "
                            f"so drop --pretrained")
        try:
            model = builder(num_classes=num_classes)
        except TypeError as err:
            raise UserError(f"--model {name}: calling it as {function_name}(num_classes={num_classes}) failed "
                            f"({err}); give a function that takes num_classes and returns the model") from None
        if not isinstance(model, nn.Module):
            raise UserError(f"--model {name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)  # classification models only
    if name not in available:
        raise UserError(f"--model {name}: not a torchvision classification model; choose one of e.g. "
                        f"resnet18, resnet50, efficientnet_b0, convnext_tiny (all: torchvision.models.list_models())")
    if not pretrained:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    else:
        try:
            model = torchvision.models.get_model(name, weights="DEFAULT")  # downloaded once to ~/.cache/torch
        except Exception as err:  # offline, proxy, disk full: all end the same way for the user
            raise UserError(f"--pretrained: could not fetch the torchvision weights of {name} ({type(err).__name__}); "
                            f"run once with internet access (they are cached under $TORCH_HOME) or train from "
                            f"scratch without --pretrained") from None
        model = replace_classifier(model, num_classes)
    return drop_auxiliary_heads(model)


def drop_auxiliary_heads(model: nn.Module) -> nn.Module:
    """GoogLeNet and Inception v3 return extra auxiliary logits in training mode; keep the main output only
    (unused auxiliary heads would also trip DDP's unused-parameter check)."""
    if getattr(model, "aux_logits", False):
        model.aux_logits = False
        for head in ("aux1", "aux2", "AuxLogits"):
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def replace_classifier(model: nn.Module, num_classes: int) -> nn.Module:
    """Swap the last Linear layer (the 1000-class ImageNet head) for a fresh one with `num_classes`."""
    name, head = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    if head.out_features != num_classes:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], nn.Linear(head.in_features, num_classes))
    return model


class CheckpointedBlocks(nn.Sequential):
    """A Sequential of blocks that, in training, keeps only each block's input for the backward pass and runs the
    block's forward again there: the activations of one block at a time instead of all, for a second forward.
    The same children under the same names, so the weights load and save unchanged."""

    def forward(self, x):
        for block in self:
            if self.training and torch.is_grad_enabled():
                # non-reentrant: works under DDP, torch.compile and with inputs that need no gradient; the RNG state
                # is replayed, so dropout draws the same mask twice
                x = checkpoint(block, x, use_reentrant=False, context_fn=partial(_first_pass_updates_batchnorm, block))
            else:
                x = block(x)
        return x


def _first_pass_updates_batchnorm(block):
    """checkpoint's contexts: the forward as usual; the recomputation normalises with the batch's statistics again but
    leaves the running ones alone, which the first pass already updated (or they would move twice per step)."""
    return contextlib.nullcontext(), _running_stats_frozen(block)


@contextlib.contextmanager
def _running_stats_frozen(block):
    """BatchNorm as in training (batch statistics, the same saved tensors) with momentum 0: the running statistics
    stay as they are, and the batch count is put back."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, saved, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(count)


def use_gradient_checkpointing(model: nn.Module, name: str) -> int:
    """--gradient_checkpointing: a ResNet's residual blocks or a ViT's encoder layers become CheckpointedBlocks.
    Returns the number of blocks; one error line for other models."""
    from torchvision.models import ResNet, VisionTransformer
    if isinstance(model, ResNet):
        stages = ["layer1", "layer2", "layer3", "layer4"]
    elif isinstance(model, VisionTransformer):
        model, stages = model.encoder, ["layers"]
    else:
        raise UserError(f"--gradient_checkpointing works on the torchvision ResNets and ViTs; --model {name} is "
                        f"neither: drop the flag, or call torch.utils.checkpoint.checkpoint in your model's forward")
    for stage in stages:
        setattr(model, stage, CheckpointedBlocks(OrderedDict(getattr(model, stage).named_children())))
    return sum(len(getattr(model, stage)) for stage in stages)
