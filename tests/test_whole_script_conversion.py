"""A whole script converted: scripts/baselines/ddp_imagenet_style.py (pytorch/examples imagenet style: mp.spawn,
DistributedSampler, all_reduce'd meters, torch.save checkpoints) and scripts/converted_ddp_imagenet_style.py (the
same on Accelerate). On one process they train the same model bit for bit; on two they print the same per-step
losses and count every test image once; each resumes exactly where it stopped. docs/converting_a_ddp_script.md
shows their diff, hunk by hunk, and stays equal to it."""

import json
import re
import socket
import subprocess
import sys

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from doc_commands import bash_commands, check_command
from helpers import MNIST_10K, REPO, launch, requires_mnist_10k, run
from safetensors.torch import load_file
from torch.utils.data import BatchSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

BEFORE = REPO / "scripts" / "baselines" / "ddp_imagenet_style.py"
AFTER = REPO / "scripts" / "converted_ddp_imagenet_style.py"
PAGE = REPO / "docs" / "converting_a_ddp_script.md"
# 512 training images = 8 global batches of 64 (no padded last batch); 101 test images: an odd tail on 2 processes.
# -b is per node, so 1 and 2 processes train on the same global batches.
TRAIN = [MNIST_10K, "--train-samples", "512", "--val-samples", "101", "-b", "64", "-j", "0", "-p", "1"]
# accelerate launch gives each process OMP_NUM_THREADS=1; mp.spawn's workers get the same, since another
# thread count sums the convolutions in another order (other last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
STEP = re.compile(r"^Epoch: \[(\d+)\]\[(\d+)/\d+\]\tLoss (\S+) ", flags=re.M)
EVALUATION = re.compile(r"^ \* Acc@1 (\S+) Loss (\S+) \((\d+) images\)$", flags=re.M)
LEARNING_RATE = re.compile(r"^Epoch: \[\d+\] lr (\S+)$", flags=re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_before(num_processes, out, *args):
    """The baseline under its own mp.spawn, one node of `num_processes` CPU processes (gloo)."""
    return run([sys.executable, BEFORE, *TRAIN, "--checkpoint-dir", out, "--cpu", "--multiprocessing-distributed",
                "--cpu-processes", num_processes, "--world-size", "1", "--rank", "0",
                "--dist-url", f"tcp://127.0.0.1:{free_port()}", *args], env=ONE_THREAD).stdout


def run_after(num_processes, out, *args):
    return launch([*TRAIN, "--checkpoint-dir", out, *args], num_processes=num_processes, script=AFTER,
                  env=ONE_THREAD).stdout


def printed(stdout) -> dict:
    steps = [(int(epoch), int(step), float(loss)) for epoch, step, loss in STEP.findall(stdout)]
    evaluations = [(float(acc), float(loss), int(count)) for acc, loss, count in EVALUATION.findall(stdout)]
    return {"steps": steps, "evaluations": evaluations, "learning_rates": LEARNING_RATE.findall(stdout)}


def before_state(folder):
    """Weights and SGD momentum buffers of the baseline's checkpoint.pth.tar (DDP's `module.` names dropped)."""
    checkpoint = torch.load(folder / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
    weights = {name.removeprefix("module."): tensor for name, tensor in checkpoint["state_dict"].items()}
    momenta = [state["momentum_buffer"] for _, state in sorted(checkpoint["optimizer"]["state"].items())]
    return weights, momenta, {"epoch": checkpoint["epoch"], "best_acc1": checkpoint["best_acc1"]}


def after_state(folder):
    """The same from the converted script's save_state folder."""
    optimizer = torch.load(folder / "checkpoint" / "optimizer.bin", map_location="cpu", weights_only=True)
    momenta = [state["momentum_buffer"] for _, state in sorted(optimizer["state"].items())]
    progress = json.loads((folder / "checkpoint" / "progress.json").read_text())
    return load_file(folder / "checkpoint" / "model.safetensors"), momenta, progress


def assert_equal_state(a, b):
    (weights_a, momenta_a, progress_a), (weights_b, momenta_b, progress_b) = a, b
    assert weights_a.keys() == weights_b.keys() and len(momenta_a) == len(momenta_b) == len(weights_a)
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    assert all(torch.equal(x, y) for x, y in zip(momenta_a, momenta_b))
    assert progress_a == progress_b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two epochs of each script on 1 process and on 2, and on 1 process each again as 1 epoch + a resume
    for the second: 8 launches, printed output and checkpoint folder of each."""
    out = tmp_path_factory.mktemp("conversion")
    results = {}
    for name, train, processes in (("before", run_before, 1), ("after", run_after, 1),
                                   ("before", run_before, 2), ("after", run_after, 2)):
        folder = out / f"{name}_{processes}"
        results[name, processes] = folder, printed(train(processes, folder, "--epochs", "2"))
    for name, train, resume in (("before", run_before, "checkpoint.pth.tar"), ("after", run_after, "checkpoint")):
        folder = out / f"{name}_resumed"
        first_epoch = printed(train(1, folder, "--epochs", "1"))
        second_epoch = printed(train(1, folder, "--epochs", "2", "--resume", folder / resume))
        results[name, "resumed"] = folder, {key: first_epoch[key] + second_epoch[key] for key in first_epoch}
    return results


@requires_mnist_10k
def test_one_process_trains_the_same_model_bit_for_bit(runs):
    (before_folder, before), (after_folder, after) = runs["before", 1], runs["after", 1]
    assert len(before["steps"]) == 16 and before == after  # every printed loss, learning rate and evaluation
    assert before["learning_rates"] == ["0.050000", "0.035000"]  # StepLR(gamma=0.7), stepped once per epoch
    assert [count for _, _, count in after["evaluations"]] == [101, 101]
    assert after["evaluations"][-1][0] >= 60  # accuracy in %; measured 68.3 after 16 steps
    assert_equal_state(before_state(before_folder), after_state(after_folder))


@requires_mnist_10k
def test_two_processes_print_the_same_losses_and_count_every_test_image_once(runs):
    (_, before), (_, after), (_, one_process) = runs["before", 2], runs["after", 2], runs["after", 1]
    # The same samples in each global batch (DistributedSampler: rank r takes perm[r::2] of the permutation of
    # seed + epoch; Accelerate's seedable sampler draws that permutation and hands out whole batches of it), so
    # the loss averaged over the processes is the same, to float rounding, and equals the one-process loss.
    assert [step[:2] for step in before["steps"]] == [step[:2] for step in after["steps"]] == \
           [step[:2] for step in one_process["steps"]]
    for (_, _, loss_before), (_, _, loss_after), (_, _, loss_one) in zip(before["steps"], after["steps"],
                                                                        one_process["steps"]):
        assert loss_before == pytest.approx(loss_after, abs=2e-5) and loss_after == pytest.approx(loss_one, abs=2e-5)
    assert before["learning_rates"] == after["learning_rates"] == ["0.050000", "0.035000"]
    # 101 = 2 x 50 + 1: the baseline's drop_last sampler gives each process 50 and both evaluate the last one
    # after the all_reduce; gather_for_metrics drops the sample the converted script's shards repeat.
    assert [count for _, _, count in before["evaluations"]] == [count for _, _, count in after["evaluations"]] == \
           [101, 101]
    for (acc_before, loss_before, _), (acc_after, loss_after, _) in zip(before["evaluations"], after["evaluations"]):
        assert acc_before == acc_after and loss_before == pytest.approx(loss_after, abs=2e-5)
    # What a padded DistributedSampler would count instead (51 + 51), and a plain gather of Accelerate's shards:
    # batches of 32, 32, 32 and 5, process 1's last one filled up to 32 from the start.
    assert sum(len(DistributedSampler(range(101), num_replicas=2, rank=rank)) for rank in (0, 1)) == 102
    batches = BatchSampler(SequentialSampler(range(101)), batch_size=32, drop_last=False)
    assert sum(len(batch) for rank in (0, 1) for batch in BatchSamplerShard(batches, 2, rank)) == 128


@requires_mnist_10k
def test_a_resumed_run_ends_as_the_uninterrupted_one(runs):
    for name, state in (("before", before_state), ("after", after_state)):
        (folder, uninterrupted), (resumed_folder, resumed) = runs[name, 1], runs[name, "resumed"]
        # the second epoch's shuffle, learning rate, momentum and best accuracy all came back
        assert resumed == uninterrupted, name
        assert_equal_state(state(resumed_folder), state(folder))


def conversion_diff() -> str:
    return subprocess.run(["diff", "-U0", "--label", "scripts/baselines/ddp_imagenet_style.py", "--label",
                           "scripts/converted_ddp_imagenet_style.py", BEFORE, AFTER],
                          capture_output=True, text=True).stdout


def hunks(diff: str) -> list:
    return re.findall(r"^@@ .*\n(?:[-+].*\n)*", diff, flags=re.M)


def test_the_page_shows_every_hunk_of_the_real_diff_and_each_is_marked():
    diff = conversion_diff()
    real = hunks(diff)
    shown = [hunk for block in re.findall(r"```diff\n(.*?)```", PAGE.read_text(), flags=re.S) for hunk in hunks(block)]
    assert len(real) > 20 and shown == real, "the page's diff is stale: paste the hunks of the diff -U0 it names"
    docstring_end = AFTER.read_text().splitlines().index('"""') + 1
    for hunk in real:
        added = [line for line in hunk.splitlines()[1:] if line.startswith("+")]
        if added and int(re.match(r"@@ -\S+ \+(\d+)", hunk).group(1)) > docstring_end:
            assert any("# [accelerate]" in line for line in added), hunk
    added_code = "\n".join(line for hunk in real for line in hunk.splitlines() if line.startswith("+"))
    for call in ("prepare", "backward", "gather_for_metrics", "save_state", "load_state", "reduce"):
        assert f"accelerator.{call}(" in added_code, call
    for script in (BEFORE, AFTER):
        assert not re.search(r"^(from|import) utils\b", script.read_text(), flags=re.M), f"{script.name} uses utils/"


def test_the_page_commands_name_existing_files_and_flags(helps):
    commands = bash_commands(PAGE.read_text())
    assert any("ddp_imagenet_style.py" in c for c in commands) and any("accelerate launch" in c for c in commands)
    for command in commands:
        check_command(command, helps)
