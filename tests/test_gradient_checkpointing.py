"""--gradient_checkpointing (utils/models.py): the same gradients and BatchNorm statistics as without it, less peak
memory, under DDP too; one error line for models it does not know. The DDP pair also carries
train_image_classifier.py's step schedule (issue 23, see test_lr_schedules.py): one launch fewer."""

import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
import torchvision
from helpers import REPO, launch, results, run
from image_data import make_split_image_folder

from utils.errors import UserError
from utils.models import ConvNet, build_model, use_gradient_checkpointing

SCRIPT = REPO / "scripts" / "train_image_classifier.py"


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


@pytest.fixture(scope="module")
def ddp_pair(tmp_path_factory):
    """train_image_classifier.py on 2 processes, without and with --gradient_checkpointing, side by side (a launch this
    small leaves the cores idle much of the time: see test_fsdp.py's side_by_side). 64 images, 2 x 8 per step: 4 steps
    per epoch, 12 in 3 epochs, under the step schedule after the default 1 warmup epoch."""
    root = tmp_path_factory.mktemp("checkpointing_ddp")
    data = make_split_image_folder(root / "data", train_per_class=16, val_per_class=4)
    flags = ["--data_dir", data, "--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer",
             "adamw", "--learning_rate", "0.002", "--lr_scheduler_type", "step", "--num_workers", "0",
             "--batch_size", "8", "--epochs", "3"]
    modes = {"plain": [], "checkpointed": ["--gradient_checkpointing"]}
    with ThreadPoolExecutor(len(modes)) as pool:
        for future in [pool.submit(partial(launch, [*map(str, flags), "--output_dir", str(root / mode), *extra],
                                           num_processes=2, script=SCRIPT)) for mode, extra in modes.items()]:
            future.result()
    return root


def test_ddp_training_with_it_ends_with_the_weights_of_training_without_it(ddp_pair):
    plain, checkpointed = results(ddp_pair / "plain"), results(ddp_pair / "checkpointed")
    assert checkpointed["num_processes"] == 2 and checkpointed["gradient_checkpointing"] is True
    assert plain["global_step"] == checkpointed["global_step"] == 3 * 64 // 16
    assert checkpointed["parameter_fingerprints"] == plain["parameter_fingerprints"]  # both ranks, bit for bit
    assert checkpointed["buffer_fingerprints"] == plain["buffer_fingerprints"]  # BatchNorm statistics too
    assert checkpointed["eval_loss"] == plain["eval_loss"]


def test_train_image_classifier_step_schedule_ends_at_a_hundredth(ddp_pair):
    """(test_lr_schedules.py's claim, on this module's DDP pair.) 4 classes x 16 images = 64, 2 processes x 8 x 1:
    4 steps per epoch, 12 in 3 epochs; 1 warmup epoch, then a tenth after each third of the other 8 steps: the last
    step's rate is a hundredth of the peak."""
    for mode in ("plain", "checkpointed"):
        out = ddp_pair / mode
        r = results(out)
        assert r["num_processes"] == 2 and r["global_step"] == r["lr_scheduler_steps"] == 12, mode
        # after 12 steps: 4 of warmup, then 8 more (3 * 8 // 8 = 3 thirds passed; the decay stops at a hundredth)
        assert r["current_learning_rate"] == pytest.approx(0.002 / 100), mode
        assert json.loads((out / "run.json").read_text())["lr_scheduler_type"] == "step", mode
