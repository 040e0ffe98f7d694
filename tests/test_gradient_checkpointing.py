"""--gradient_checkpointing (utils/models.py): the same gradients and BatchNorm statistics as without it, less peak
memory; one error line for models it does not know. Under DDP, launched: test_image_classifier.py's
test_ddp_training_with_gradient_checkpointing_ends_with_the_weights_of_training_without_it, whose run resumed with it
must end bit for bit as the run without it (a pair of launches that test_image_classifier.py makes anyway for its
resume; train_image_classifier.py's step schedule, issue 23, rides on that pair too)."""

import copy
import json
import sys

import pytest
import torch
import torchvision
from helpers import REPO, run

from utils.errors import UserError
from utils.models import ConvNet, build_model, use_gradient_checkpointing


def one_training_step(model, images, labels, seed=1):
    torch.manual_seed(seed)  # the ViT's dropout draws the same masks in both models
    model.train()
    torch.nn.functional.cross_entropy(model(images), labels).backward()


@pytest.mark.parametrize("name", ["resnet18", "vit"])
def test_the_same_gradients_batchnorm_statistics_and_weight_names_bit_for_bit(name):
    torch.manual_seed(0)
    if name == "vit":  # a small torchvision VisionTransformer with dropout: the recomputation must redraw its masks
        plain = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                                                     hidden_dim=16, mlp_dim=32, num_classes=5, dropout=0.2)
    else:
        plain = build_model(name, num_classes=5, image_size=64)
    checkpointed = copy.deepcopy(plain)
    blocks = use_gradient_checkpointing(checkpointed, name)
    assert blocks == (3 if name == "vit" else 8)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # weights load and save as before
    images, labels = torch.randn(4, 3, *(32, 32) if name == "vit" else (64, 64)), torch.tensor([0, 1, 2, 3])
    for model in (plain, checkpointed):
        one_training_step(model, images, labels)
    for (param_name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), param_name
    for (buffer_name, a), b in zip(plain.named_buffers(), checkpointed.buffers(), strict=True):
        assert torch.equal(a, b), buffer_name  # running statistics moved once, and the batch count is 1
    if name == "resnet18":
        assert checkpointed.bn1.num_batches_tracked.item() == checkpointed.layer1[0].bn1.num_batches_tracked.item() == 1
    plain.eval(), checkpointed.eval()
    with torch.no_grad():
        assert torch.equal(plain(images), checkpointed(images))


def test_a_model_without_known_blocks_is_one_error_line():
    with pytest.raises(UserError, match="--gradient_checkpointing works on the torchvision ResNets and ViTs"):
        use_gradient_checkpointing(ConvNet(10), "my_models:convnet")


PEAK_MEMORY = """
import json, re, torch
from utils.models import build_model, use_gradient_checkpointing

def peak_resident_mib():
    # VmHWM: this process image's own peak. (getrusage's ru_maxrss starts at the parent's resident size at fork,
    # which a pytest worker full of earlier tests' tensors can make larger than anything measured here.)
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1)) / 1024

def step_peak(model):
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM back down to what is resident now (Linux 4.0+): one process measures both
    before = peak_resident_mib()
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    return peak_resident_mib() - before

torch.set_num_threads(1)
images, labels = torch.randn(16, 3, 128, 128), torch.randint(0, 10, (16,))
peak = {}
# with it first: the one-time allocations of a first step (thread pools, kernel caches) count against it
for mode in ("on", "off"):
    model = build_model("resnet50", 10)
    if mode == "on":
        use_gradient_checkpointing(model, "resnet50")
    peak[mode] = step_peak(model)
    del model  # its weights and gradients: returned to the system at once (see MALLOC_MMAP_THRESHOLD_)
print(json.dumps(peak))
"""


def test_a_resnet50_step_needs_far_less_peak_memory_on_the_cpu():
    """Peak resident memory of one training step above what the model took, with and without."""
    # glibc returns freed large blocks to the system at once: the peak then measures live tensors, not its heap
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    peak = json.loads(run([sys.executable, "-c", PEAK_MEMORY], env=env).stdout)
    print(f"resnet50, 16 x 128 px, one step: {peak['off']:.0f} MiB without, {peak['on']:.0f} MiB with")
    assert peak["on"] < 0.8 * peak["off"], peak  # measured here: 300 against 500 MiB
