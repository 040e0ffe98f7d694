"""Whole scripts converted, each pair a "before" written the way a public example writes it and its "after" on
Accelerate, and a page that shows their diff hunk by hunk and stays equal to it:

- scripts/baselines/ddp_imagenet_style.py (pytorch/examples imagenet: mp.spawn, DistributedSampler, all_reduce'd
  meters, torch.save checkpoints) -> scripts/converted_ddp_imagenet_style.py, docs/converting_a_ddp_script.md;
- scripts/baselines/horovod_mnist.py (Horovod's examples/pytorch/pytorch_mnist.py) ->
  scripts/converted_horovod_style.py, docs/converting_a_horovod_script.md;
- scripts/baselines/apex_amp_imagenet_style.py (apex's examples/imagenet/main_amp.py) ->
  scripts/converted_apex_amp_style.py, docs/converting_an_apex_amp_script.md;
- scripts/baselines/fabric_mnist.py (Lightning Fabric's examples/fabric/image_classifier/train_fabric.py, on the real
  lightning-fabric) -> scripts/converted_fabric_style.py, docs/converting_a_fabric_script.md;
- scripts/baselines/deepspeed_mnist.py (DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, on the real deepspeed,
  ZeRO-2 on CPU processes) -> scripts/converted_deepspeed_style.py, docs/converting_a_deepspeed_script.md.

Horovod and apex cannot be installed here: their "before" runs on the stand-ins in tests/standins (their calls
over torch.distributed). On one process each pair trains the same model; on two the after ends with the
before's weights and reports the exact metric over every test image once; each resumes exactly where it stopped.
The Fabric pair's launches also run tests/silent_differences.py (torchmetrics on uneven shards, a per-step warm-up,
DeepSpeed's WarmupLR prepared) and the converted script with the Net's dropouts, which makes two processes train
otherwise than one; the DeepSpeed pair's, tests/literal_adam.py (DeepSpeed's "Adam" converted to torch.optim.Adam).

Every run of the three pairs is a job of one of two launches of tests/jobs.py (conversion_runs):
each launched process imports torch and Accelerate once and forks a child per run, which runs the script as
`python SCRIPT ARGS` would (tests/baseline_job.py starts a before as its launcher would)."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from doc_commands import bash_commands, check_command
from helpers import MNIST_10K, REPO, free_port, launcher_args, requires_mnist_10k
from jobs import finished_job, launch_jobs, read_job
from safetensors.torch import load_file
from torch.utils.data import BatchSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

BEFORE = REPO / "scripts" / "baselines" / "ddp_imagenet_style.py"
AFTER = REPO / "scripts" / "converted_ddp_imagenet_style.py"
PAGE = REPO / "docs" / "converting_a_ddp_script.md"
HOROVOD_BEFORE = REPO / "scripts" / "baselines" / "horovod_mnist.py"
HOROVOD_AFTER = REPO / "scripts" / "converted_horovod_style.py"
HOROVOD_PAGE = REPO / "docs" / "converting_a_horovod_script.md"
APEX_BEFORE = REPO / "scripts" / "baselines" / "apex_amp_imagenet_style.py"
APEX_AFTER = REPO / "scripts" / "converted_apex_amp_style.py"
APEX_PAGE = REPO / "docs" / "converting_an_apex_amp_script.md"
FABRIC_BEFORE = REPO / "scripts" / "baselines" / "fabric_mnist.py"
FABRIC_AFTER = REPO / "scripts" / "converted_fabric_style.py"
FABRIC_PAGE = REPO / "docs" / "converting_a_fabric_script.md"
DEEPSPEED_BEFORE = REPO / "scripts" / "baselines" / "deepspeed_mnist.py"
DEEPSPEED_AFTER = REPO / "scripts" / "converted_deepspeed_style.py"
DEEPSPEED_PAGE = REPO / "docs" / "converting_a_deepspeed_script.md"
CONVERSIONS = [(BEFORE, AFTER, PAGE), (HOROVOD_BEFORE, HOROVOD_AFTER, HOROVOD_PAGE),
               (APEX_BEFORE, APEX_AFTER, APEX_PAGE)]
SHOWN_CONVERSIONS = [*CONVERSIONS, (FABRIC_BEFORE, FABRIC_AFTER, FABRIC_PAGE),
                     (DEEPSPEED_BEFORE, DEEPSPEED_AFTER, DEEPSPEED_PAGE)]
# 512 training images = 8 global batches of 64 (no padded last batch); 101 test images: an odd tail on 2 processes.
# -b is per node, so 1 and 2 processes train on the same global batches.
TRAIN = [MNIST_10K, "--train-samples", "512", "--val-samples", "101", "-b", "64", "-j", "0", "-p", "1"]
# accelerate launch gives each process OMP_NUM_THREADS=1; mp.spawn's workers get the same, since another
# thread count sums the convolutions in another order (other last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
STEP = re.compile(r"^Epoch: \[(\d+)\]\[(\d+)/\d+\]\tLoss (\S+) ", flags=re.M)
EVALUATION = re.compile(r"^ \* Acc@1 (\S+) Loss (\S+) \((\d+) images\)$", flags=re.M)
LEARNING_RATE = re.compile(r"^Epoch: \[\d+\] lr (\S+)$", flags=re.M)


BASELINE_JOB = REPO / "tests" / "baseline_job.py"
SILENT_DIFFERENCES = REPO / "tests" / "silent_differences.py"
LITERAL_ADAM = REPO / "tests" / "literal_adam.py"


def before_args(num_processes, out, *args) -> list:
    """The baseline under its own mp.spawn, one node of `num_processes` CPU processes (gloo)."""
    return [BEFORE, *TRAIN, "--checkpoint-dir", out, "--cpu", "--multiprocessing-distributed",
            "--cpu-processes", num_processes, "--world-size", "1", "--rank", "0",
            "--dist-url", f"tcp://127.0.0.1:{free_port()}", *args]


def after_args(out, *args) -> list:
    """The converted script: one process as a user may run it (python: an Accelerator needs no launcher), two under
    accelerate launch."""
    return [AFTER, "--cpu", *TRAIN, "--checkpoint-dir", out, *args]


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
def conversion_runs(tmp_path_factory):
    """Every run of the three pairs, as jobs of two launches (tests/jobs.py): the one-process runs, and the DDP
    before's two-process one (mp.spawn starts its processes), as jobs of one python process; the other two-process
    runs as jobs of one accelerate launch of 2 processes. A run that resumes follows the one it resumes. Returns the
    folder and {job name: (its LOG, its processes)}: finished_job(*jobs[name])."""
    out = tmp_path_factory.mktemp("conversion")
    apex_one_batch = [*APEX_ARGS, "-b", "512", "--epochs", "2", "-p", "1"]
    # apex's scripts write into their working directory (the launch's): checkpoint.pth.tar and model_best.pth.tar
    # the before, checkpoint/ and model_best/ the after
    one_process = {
        "before_1": before_args(1, out / "before_1", "--epochs", "2"),
        "after_1": after_args(out / "after_1", "--epochs", "2"),
        "before_2": before_args(2, out / "before_2", "--epochs", "2"),
        "before_resumed_first": before_args(1, out / "before_resumed", "--epochs", "1"),
        "before_resumed": before_args(1, out / "before_resumed", "--epochs", "2", "--resume",
                                      out / "before_resumed" / "checkpoint.pth.tar"),
        "after_resumed_first": after_args(out / "after_resumed", "--epochs", "1"),
        "after_resumed": after_args(out / "after_resumed", "--epochs", "2", "--resume",
                                    out / "after_resumed" / "checkpoint"),
        "horovod_before_1": [BASELINE_JOB, "--standins", HOROVOD_BEFORE, *HOROVOD_ARGS, "--save-model",
                             out / "horovod_before_1.pt"],
        "horovod_after_1": [HOROVOD_AFTER, *HOROVOD_ARGS, "--save-model", out / "horovod_after_1.pt"],
        "apex_before_1": [BASELINE_JOB, "--standins", APEX_BEFORE, *apex_one_batch],
        "apex_after_1": [APEX_AFTER, *apex_one_batch],
        **fabric_jobs(out, 1),
        **deepspeed_jobs(out, 1),
    }
    two_processes = {
        "after_2": after_args(out / "after_2", "--epochs", "2"),
        # the befores get torchrun's environment (accelerate launch --multi_gpu runs torch.distributed.run's run());
        # --no-cuda: the Horovod pair's spelling of --cpu (in HOROVOD_ARGS)
        "horovod_before_2": [BASELINE_JOB, "--standins", HOROVOD_BEFORE, *HOROVOD_ARGS, "--save-model",
                             out / "horovod_before_2.pt"],
        "horovod_after_2": [HOROVOD_AFTER, *HOROVOD_ARGS, "--save-model", out / "horovod_after_2.pt"],
        # torch.distributed.launch's --local-rank=N: apex's --deterministic seeds each process with it
        "apex_before_2": [BASELINE_JOB, "--standins", "--local-rank", APEX_BEFORE, *APEX_ARGS, "-b", "32",
                          "--epochs", "2"],
        "apex_after_2_first": [APEX_AFTER, "--cpu", *APEX_ARGS, "-b", "32", "--epochs", "1"],
        "apex_after_2": [APEX_AFTER, "--cpu", *APEX_ARGS, "-b", "32", "--epochs", "2", "--resume", "checkpoint"],
        **fabric_jobs(out, 2),
        **deepspeed_jobs(out, 2),
    }
    # each job in its launch's folder, also its working directory; each run was a process of its own
    jobs = {}
    for launched, launcher, num_processes, folder in ((one_process, [sys.executable], 1, out / "one_process"),
                                                      (two_processes, launcher_args(2), 2, out / "two_processes")):
        folder.mkdir()
        launch_jobs(launched, launcher, folder, env=ONE_THREAD, cwd=folder)
        jobs.update({name: (folder / name, num_processes) for name in launched})
    return out, jobs


@pytest.fixture(scope="module")
def runs(conversion_runs):
    """The DDP pair: two epochs of each script on 1 process and on 2, and on 1 process each again as 1 epoch + a
    resume for the second: 8 runs, printed output and checkpoint folder of each."""
    out, jobs = conversion_runs
    results = {}
    for name, processes in (("before", 1), ("after", 1), ("before", 2), ("after", 2)):
        results[name, processes] = (out / f"{name}_{processes}",
                                    printed(finished_job(*jobs[f"{name}_{processes}"]).stdout))
    for name in ("before", "after"):
        first_epoch = printed(finished_job(*jobs[f"{name}_resumed_first"]).stdout)
        second_epoch = printed(finished_job(*jobs[f"{name}_resumed"]).stdout)
        results[name, "resumed"] = out / f"{name}_resumed", {key: first_epoch[key] + second_epoch[key]
                                                             for key in first_epoch}
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


def conversion_diff(before, after) -> str:
    return subprocess.run(["diff", "-U0", "--label", str(before.relative_to(REPO)), "--label",
                           str(after.relative_to(REPO)), before, after], capture_output=True, text=True).stdout


def hunks(diff: str) -> list:
    return re.findall(r"^@@ .*\n(?:[-+].*\n)*", diff, flags=re.M)


@pytest.mark.parametrize("before, after, page", SHOWN_CONVERSIONS, ids=lambda path: path.stem)
def test_the_page_shows_every_hunk_of_the_real_diff_and_each_is_marked(before, after, page):
    diff = conversion_diff(before, after)
    real = hunks(diff)
    shown = [hunk for block in re.findall(r"```diff\n(.*?)```", page.read_text(), flags=re.S) for hunk in hunks(block)]
    assert len(real) >= 20 and shown == real, f"{page.name} is stale: paste the hunks of the diff -U0 it names"
    docstring_end = after.read_text().splitlines().index('"""') + 1
    for hunk in real:
        added = [line for line in hunk.splitlines()[1:] if line.startswith("+")]
        if added and int(re.match(r"@@ -\S+ \+(\d+)", hunk).group(1)) > docstring_end:
            assert any("# [accelerate]" in line for line in added), hunk
    added_code = "\n".join(line for hunk in real for line in hunk.splitlines() if line.startswith("+"))
    for call in ("prepare", "backward", "gather_for_metrics"):
        assert f"accelerator.{call}(" in added_code, call
    for script in (before, after):
        assert not re.search(r"^(from|import) utils\b", script.read_text(), flags=re.M), f"{script.name} uses utils/"


@pytest.mark.parametrize("page", [PAGE, HOROVOD_PAGE, APEX_PAGE, FABRIC_PAGE, DEEPSPEED_PAGE],
                         ids=lambda path: path.stem)
def test_the_page_commands_name_existing_files_and_flags(page, helps):
    commands = bash_commands(page.read_text())
    assert any("accelerate launch" in c for c in commands)
    for command in commands:
        check_command(command, helps)


def test_the_ddp_page_and_the_readme_list_the_three_conversions():
    readme = (REPO / "README.md").read_text()
    for _, after, page in CONVERSIONS:
        assert page.name in PAGE.read_text() and after.name in PAGE.read_text(), page.name
        assert f"(docs/{page.name})" in readme, page.name


# ---------------------------------------------------------------- Horovod's pytorch_mnist.py

def script_module(path):
    """The converted script as a module (its Net and load_split; main() does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exact_evaluation(script, weights, samples):
    """(accuracy in %, mean loss, count) of `weights` over the first `samples` test images, on one process."""
    module = script_module(script)
    model = module.Net()
    model.load_state_dict({name.removeprefix("module."): tensor for name, tensor in weights.items()})
    images, labels = module.load_split(MNIST_10K, "t10k", samples).tensors
    with torch.no_grad():
        output = model.eval()(images)
    log_probabilities = torch.log_softmax(output, dim=1)
    loss = torch.nn.functional.nll_loss(log_probabilities, labels).item()
    return (output.argmax(1) == labels).float().mean().item() * 100, loss, len(labels)


HOROVOD_ARGS = ["--data-dir", MNIST_10K, "--train-samples", "512", "--test-samples", "101", "--epochs", "2",
                "--log-interval", "2", "--lr", "0.05", "--no-cuda"]
HOROVOD_TRAIN = re.compile(r"^Train Epoch: (\d+) \[(\d+)/(\d+) \(\d+%\)\]\tLoss: (\S+)$", flags=re.M)
HOROVOD_TEST = re.compile(r"^Test set: Average loss: (\S+), Accuracy: (\S+)% \((\d+) samples\)$", flags=re.M)


@pytest.fixture(scope="module")
def horovod_runs(conversion_runs):
    """Each script on 1 process and on 2 (the before on the Horovod stand-in): printed output and saved weights of
    each."""
    out, jobs = conversion_runs
    return {(name, processes): (finished_job(*jobs[f"horovod_{name}_{processes}"]).stdout,
                                torch.load(out / f"horovod_{name}_{processes}.pt", weights_only=True))
            for name in ("before", "after") for processes in (1, 2)}


@requires_mnist_10k
def test_horovod_one_process_trains_the_same_model_bit_for_bit(horovod_runs):
    (before, before_weights), (after, after_weights) = horovod_runs["before", 1], horovod_runs["after", 1]
    assert len(HOROVOD_TRAIN.findall(before)) == 8 and HOROVOD_TRAIN.findall(before) == HOROVOD_TRAIN.findall(after)
    assert before_weights.keys() == after_weights.keys()
    assert all(torch.equal(before_weights[name], after_weights[name]) for name in before_weights)
    for (loss_b, acc_b, count_b), (loss_a, acc_a, count_a) in zip(HOROVOD_TEST.findall(before),
                                                                  HOROVOD_TEST.findall(after), strict=True):
        # the before's metric_average passes the mean through a float32 tensor: its last digit may differ
        assert acc_b == acc_a and count_b == count_a == "101"
        assert float(loss_b) == pytest.approx(float(loss_a), abs=2e-6)


@requires_mnist_10k
def test_horovod_two_processes_end_with_the_befores_weights_and_the_exact_metric(horovod_runs):
    """lr * hvd.size() kept as lr * num_processes: the same weights; gather_for_metrics: the exact test metric over
    101 images, where the before averages two per-process means over 51 + 51 (one image twice)."""
    (before, before_weights), (after, after_weights) = horovod_runs["before", 2], horovod_runs["after", 2]
    assert "Train Epoch: 2 [0/256" in before and "Train Epoch: 2 [0/256" in after  # 256 samples per process
    for name in before_weights:  # measured: 3e-8 apart (which process holds which sample differs)
        torch.testing.assert_close(after_weights[name], before_weights[name], rtol=0, atol=1e-6)
    loss, accuracy, count = HOROVOD_TEST.findall(after)[-1]
    exact_accuracy, exact_loss, exact_count = exact_evaluation(HOROVOD_AFTER, after_weights, 101)
    assert int(count) == exact_count == 101
    assert float(accuracy) == pytest.approx(exact_accuracy, abs=1e-4)
    assert float(loss) == pytest.approx(exact_loss, abs=1e-6)
    assert exact_evaluation(HOROVOD_AFTER, before_weights, 101)[0] == exact_accuracy
    assert HOROVOD_TEST.findall(before)[-1][2] == "102"  # the before's padded shards: what it averaged over


# ---------------------------------------------------------------- apex's main_amp.py

APEX_ARGS = [MNIST_10K, "--train-samples", "512", "--val-samples", "101", "-j", "0", "-p", "2", "--opt-level", "O0",
             "--deterministic", "--cpu", "--lr", "0.4"]
APEX_STEP = re.compile(r"^Epoch: \[(\d+)\]\[(\d+)/(\d+)\]\tLoss (\S+) ", flags=re.M)
APEX_EVALUATION = re.compile(r"^ \* Prec@1 (\S+) Prec@5 (\S+) Loss (\S+) \((\d+) images\)$", flags=re.M)


@pytest.fixture(scope="module")
def apex_runs(conversion_runs):
    """One process, 2 epochs of one batch of 512 (see the test); two processes, -b 32 (8 steps per epoch): the before
    for 2 epochs on the apex stand-in, the after for 1 epoch and then --resume for the second. The working folder
    of each run and its printed output (each process's of the two-process before: every rank prints its own
    evaluation line, as apex's does)."""
    out, jobs = conversion_runs
    folders = {"before_1": out / "one_process", "after_1": out / "one_process",
               "before_2": out / "two_processes", "after_2": out / "two_processes"}
    results = {("before", 1): finished_job(*jobs["apex_before_1"]).stdout,
               ("after", 1): finished_job(*jobs["apex_after_1"]).stdout,
               ("after", 2): (finished_job(*jobs["apex_after_2_first"]).stdout
                              + finished_job(*jobs["apex_after_2"]).stdout)}
    for rank in (0, 1):
        results["before", 2, rank] = finished_job(*jobs["apex_before_2"]).outputs[rank]
    return folders, results


@requires_mnist_10k
def test_apex_one_process_trains_the_same_model(apex_runs):
    """One process: the before shuffles with the global RNG (DataLoader(shuffle=True), no sampler), which no
    Accelerate sampler reproduces; with one batch per epoch the order inside it only changes the summation order."""
    folders, results = apex_runs
    before, after = results["before", 1], results["after", 1]
    assert [step[:3] for step in APEX_STEP.findall(before)] == [("0", "1", "1"), ("1", "1", "1")]
    for (*_, loss_b), (*_, loss_a) in zip(APEX_STEP.findall(before), APEX_STEP.findall(after), strict=True):
        assert float(loss_b) == pytest.approx(float(loss_a), abs=1e-6)
    for (acc_b, _, loss_b, count_b), (acc_a, _, loss_a, count_a) in zip(APEX_EVALUATION.findall(before),
                                                                        APEX_EVALUATION.findall(after), strict=True):
        assert acc_b == acc_a and count_b == count_a == "101"
        assert float(loss_b) == pytest.approx(float(loss_a), abs=1e-5)
    before_weights = torch.load(folders["before_1"] / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    after_weights = load_file(folders["after_1"] / "checkpoint" / "model.safetensors")
    for name in after_weights:
        torch.testing.assert_close(after_weights[name], before_weights[name], rtol=0, atol=1e-6)


@requires_mnist_10k
def test_apex_two_processes_resumed_end_as_the_uninterrupted_before_with_the_exact_metric(apex_runs):
    """The after's 2 epochs, the second after --resume, print the before's per-step losses (reduce_tensor) and end
    with its weights; its evaluation is the exact one over 101 images, where the before averages per-batch
    precisions over padded shards of 51 and prints its own 51."""
    folders, results = apex_runs
    before, after = results["before", 2, 0], results["after", 2]
    assert "=> loaded checkpoint 'checkpoint' (epoch 1)" in after
    steps_before, steps_after = APEX_STEP.findall(before), APEX_STEP.findall(after)
    assert len(steps_before) == 8 and [s[:3] for s in steps_before] == [s[:3] for s in steps_after]
    for (*_, loss_b), (*_, loss_a) in zip(steps_before, steps_after):
        assert float(loss_b) == pytest.approx(float(loss_a), abs=1e-6)  # measured: 2.4e-7 apart
    before_checkpoint = torch.load(folders["before_2"] / "checkpoint.pth.tar", weights_only=True)
    after_weights = load_file(folders["after_2"] / "checkpoint" / "model.safetensors")
    for name in after_weights:
        torch.testing.assert_close(after_weights[name], before_checkpoint["state_dict"]["module." + name], rtol=0,
                                   atol=1e-6)
    progress = json.loads((folders["after_2"] / "checkpoint" / "progress.json").read_text())
    assert progress["epoch"] == before_checkpoint["epoch"] == 2
    accuracy, _, loss, count = APEX_EVALUATION.findall(after)[-1]
    exact_accuracy, exact_loss, exact_count = exact_evaluation(APEX_AFTER, after_weights, 101)
    assert int(count) == exact_count == 101
    assert float(accuracy) == pytest.approx(exact_accuracy, abs=1e-3)
    assert float(loss) == pytest.approx(exact_loss, abs=1e-6)
    for rank in (0, 1):  # each process's padded shard, each epoch
        assert [count for *_, count in APEX_EVALUATION.findall(results["before", 2, rank])] == ["51", "51"]
    assert progress["best_prec1"] == pytest.approx(max(float(a) for a, *_ in APEX_EVALUATION.findall(after)), abs=1e-3)


# ---------------------------------------------------------------- Lightning Fabric's image_classifier/train_fabric.py

# 512 training images: 8 global batches of 64 a epoch (-b 64 on one process, 32 on two: Fabric's batch size is per
# process); 501 test images, an odd tail on 2 processes
FABRIC_ARGS = ["--data-dir", MNIST_10K, "--train-samples", "512", "--test-samples", "501", "--epochs", "2",
               "--log-interval", "1"]
FABRIC_TRAIN = re.compile(r"^Train Epoch: (\d+) \[(\d+)/512 \(\d+%\)\]\tLoss: (\S+)$", flags=re.M)
FABRIC_TEST = re.compile(r"^Test set: Average loss: (\S+), Accuracy: \((\S+)%\)(?: \((\d+) images\))?$", flags=re.M)


def fabric_run_env(num_processes) -> dict:
    """What `fabric run --accelerator cpu --devices N [--strategy ddp]` sets before it starts the processes with
    torchrun (lightning_fabric/cli.py, _set_env_variables): Fabric() reads its settings from them."""
    strategy = {"LT_STRATEGY": "ddp"} if num_processes > 1 else {}
    return {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_DEVICES": str(num_processes), "LT_NUM_NODES": "1",
            **strategy}


def fabric_jobs(out, num_processes) -> dict:
    """The Fabric pair without dropout, the converted script with the Net's two dropouts for one epoch, and
    tests/silent_differences.py, on `num_processes`: jobs of launch_jobs. The before's exit check writes into a
    folder of its own (fabric_exit_check): Fabric's example ends with its process group alive, which the test
    records instead of failing the launch."""
    batch = ["--batch-size", str(64 // num_processes)]
    exit_check = out / f"fabric_before_{num_processes}_exit_check"
    exit_check.mkdir()
    return {
        f"fabric_before_{num_processes}": {"env": {**fabric_run_env(num_processes), "EXIT_CHECK_DIR": str(exit_check)},
                                           "argv": [
            FABRIC_BEFORE, *FABRIC_ARGS, *batch, "--no-dropout", "--save-model",
            out / f"fabric_before_{num_processes}.pt"]},
        f"fabric_after_{num_processes}": [FABRIC_AFTER, "--cpu", *FABRIC_ARGS, *batch, "--no-dropout", "--save-model",
                                          out / f"fabric_after_{num_processes}.pt"],
        f"fabric_dropout_{num_processes}": [FABRIC_AFTER, "--cpu", *FABRIC_ARGS, *batch, "--epochs", "1",
                                            "--save-model", out / f"fabric_dropout_{num_processes}.pt"],
        f"silent_differences_{num_processes}": [SILENT_DIFFERENCES, out / f"silent_differences_{num_processes}.json"],
    }


def mean_losses(conversion_runs, name, num_processes) -> list:
    """((epoch, the step's first sample in its process), the mean of every process's printed loss) for each step of
    job NAME: the loss of the global batch, each process's own batch being as large."""
    ranks = [FABRIC_TRAIN.findall(finished_job(*conversion_runs[name]).outputs[rank]) for rank in range(num_processes)]
    steps = []
    for same_step in zip(*ranks, strict=True):
        (epoch, seen, _), losses = same_step[0], [float(loss) for *_, loss in same_step]
        assert {step[:2] for step in same_step} == {(epoch, seen)}, same_step
        steps.append(((int(epoch), int(seen) * num_processes), sum(losses) / num_processes))
    return steps


def per_image(script, weights, samples):
    """(whether each of the first `samples` test images is predicted right, its loss) under `weights`."""
    module = script_module(script)
    model = module.Net()
    model.load_state_dict(weights)
    images, labels = module.load_split(MNIST_10K, "t10k", samples).tensors
    with torch.no_grad():
        output = model.eval()(images)
    return output.argmax(1) == labels, torch.nn.functional.nll_loss(output, labels, reduction="none")


@pytest.fixture(scope="module")
def fabric_runs(conversion_runs):
    """{(name, processes): (its printed output, rank after rank; its saved weights)} for the Fabric jobs."""
    out, jobs = conversion_runs
    return {(name, processes): (finished_job(*jobs[f"fabric_{name}_{processes}"]).stdout,
                                torch.load(out / f"fabric_{name}_{processes}.pt", weights_only=True))
            for name in ("before", "after", "dropout") for processes in (1, 2)}


def fabric_exit_check(conversion_runs, num_processes) -> list:
    """What the exit check recorded at the exit of each process of the Fabric before: gloo threads still alive."""
    out, _ = conversion_runs
    return [path.read_text() for path in sorted((out / f"fabric_before_{num_processes}_exit_check").iterdir())]


@requires_mnist_10k
def test_fabric_one_process_trains_the_same_model_bit_for_bit(fabric_runs):
    (before, before_weights), (after, after_weights) = fabric_runs["before", 1], fabric_runs["after", 1]
    assert len(FABRIC_TRAIN.findall(before)) == 16 and FABRIC_TRAIN.findall(before) == FABRIC_TRAIN.findall(after)
    assert before_weights.keys() == after_weights.keys()
    assert all(torch.equal(before_weights[name], after_weights[name]) for name in before_weights)
    # the test set's loss and accuracy after each epoch; the after also counts its images
    assert [line[:2] for line in FABRIC_TEST.findall(before)] == [line[:2] for line in FABRIC_TEST.findall(after)]
    assert [line[2] for line in FABRIC_TEST.findall(after)] == ["501", "501"]


@requires_mnist_10k
def test_fabric_two_processes_train_as_the_before_and_report_the_exact_metric(conversion_runs, fabric_runs):
    """Per step, the loss of the global batch (the mean of the two processes') is the before's and the one-process
    run's; the weights end as the before's. The after's test metrics are exact over the 501 images: torchmetrics
    updated with gather_for_metrics' rows. The before's are not: Fabric's DistributedSampler pads 501 to 502, so its
    torchmetrics accuracy and its all_gather'd loss count image 0 twice."""
    _, jobs = conversion_runs
    (_, before_weights), (after, after_weights) = fabric_runs["before", 2], fabric_runs["after", 2]
    steps_before, steps_after = mean_losses(jobs, "fabric_before_2", 2), mean_losses(jobs, "fabric_after_2", 2)
    steps_one_process = mean_losses(jobs, "fabric_after_1", 1)
    assert [step for step, _ in steps_before] == [step for step, _ in steps_after] == \
           [step for step, _ in steps_one_process] and len(steps_after) == 16
    for (_, loss_before), (_, loss_after), (_, loss_one) in zip(steps_before, steps_after, steps_one_process):
        assert loss_before == pytest.approx(loss_after, abs=2e-5) and loss_after == pytest.approx(loss_one, abs=2e-5)
    for name in before_weights:  # measured: 2.4e-7 apart
        torch.testing.assert_close(after_weights[name], before_weights[name], rtol=0, atol=1e-6)

    loss, accuracy, count = FABRIC_TEST.findall(after)[-1]
    correct, losses = per_image(FABRIC_AFTER, after_weights, 501)
    assert len(FABRIC_TEST.findall(after)) == 2 and count == "501"  # the main process prints, once an epoch
    assert float(accuracy) == pytest.approx(100 * correct.double().mean().item(), abs=1e-4)
    assert float(loss) == pytest.approx(losses.double().mean().item(), abs=1e-6)
    correct, losses = per_image(FABRIC_BEFORE, before_weights, 501)
    for rank in (0, 1):  # every process prints the synced accuracy and the all_gather'd loss
        loss, accuracy, _ = FABRIC_TEST.findall(finished_job(*jobs["fabric_before_2"]).outputs[rank])[-1]
        assert float(accuracy) == pytest.approx(100 * (correct.sum() + correct[0]).item() / 502, abs=1e-4)
        assert float(loss) == pytest.approx((losses.double().sum() + losses[0]).item() / 501, abs=1e-6)
    assert correct.sum().item() / 501 != (correct.sum() + correct[0]).item() / 502  # the repeated image shows
    # Fabric's example ends with its DDP process group alive: every process exits with gloo's threads running, which
    # can abort its exit (docs/migration_guide.md, "Ending a run cleanly"); the after's launch exit check found none
    assert len(fabric_exit_check(conversion_runs, 2)) == 2 and fabric_exit_check(conversion_runs, 1) == []
    assert all("gloo worker threads alive at the exit of" in record for record in fabric_exit_check(conversion_runs, 2))


@requires_mnist_10k
def test_dropout_makes_two_processes_train_otherwise_than_one(conversion_runs, fabric_runs):
    """Without dropout 1 and 2 processes train the same model (above); with the Net's dropouts each process draws
    its masks from its own generator, seeded alike, so on 2 processes they fall on other images than on 1: other
    losses from the first step on, other weights. (The before and the after on 2 processes differ from each other
    too: Fabric's sampler deals the images out one by one, Accelerate's in whole batches.)"""
    _, jobs = conversion_runs
    one, two = mean_losses(jobs, "fabric_dropout_1", 1), mean_losses(jobs, "fabric_dropout_2", 2)
    assert [step for step, _ in one] == [step for step, _ in two] and len(one) == 8
    # 50 times the tolerances the dropout-free runs meet (2e-5, 1e-6); measured: 0.0073 at the first step
    assert abs(one[0][1] - two[0][1]) > 1e-3, (one[0], two[0])
    (_, one_weights), (_, two_weights) = fabric_runs["dropout", 1], fabric_runs["dropout", 2]
    apart = max((one_weights[name] - two_weights[name]).abs().max().item() for name in one_weights)
    assert apart > 5e-5, apart


@pytest.fixture(scope="module")
def silent_differences(conversion_runs):
    """{processes: [each process's numbers]} of tests/silent_differences.py."""
    out, jobs = conversion_runs
    numbers = {}
    for processes in (1, 2):
        finished_job(*jobs[f"silent_differences_{processes}"])  # every process exited 0
        numbers[processes] = [json.loads((out / f"silent_differences_{processes}.json.rank{rank}").read_text())
                              for rank in range(processes)]
    return numbers


def test_torchmetrics_counts_the_repeated_rows_unless_updated_with_gather_for_metrics(silent_differences):
    """501 samples, batches of 64: on 2 processes torchmetrics updated with each process's own rows counts 512 (the
    rows prepare() repeats to give each process whole batches), updated with gather_for_metrics' rows and left to
    sync it counts 1,002, and with sync_on_compute=False every process counts each sample once."""
    one, two = silent_differences[1][0]["metrics"], silent_differences[2]
    assert all(numbers["metrics"] == two[0]["metrics"] for numbers in two)  # every process computes the same
    two = two[0]["metrics"]
    exact = one["exact_accuracy"]
    assert two["exact_accuracy"] == exact and 0.7 < exact < 0.9
    for accuracy, count in one["ways"].values():  # one process: nothing repeated, nothing to sync
        assert count == 501 and accuracy == pytest.approx(exact, abs=1e-7)
    own, gathered, fixed = (two["ways"][way] for way in
                            ("own rows, synced", "gathered rows, synced", "gathered rows, sync_on_compute=False"))
    assert own[1] == 512 and own[0] != pytest.approx(exact, abs=1e-3)  # measured: 0.7695 for 0.7864
    assert gathered[1] == 1002 and gathered[0] == pytest.approx(exact, abs=1e-7)
    assert fixed[1] == 501 and fixed[0] == pytest.approx(exact, abs=1e-7)


def test_a_per_step_warmup_built_in_optimizer_steps_ends_num_processes_times_too_early(silent_differences):
    """A prepared scheduler steps num_processes times per optimizer step: a warm-up over 4 optimizer steps built 4
    long is over after 2 on 2 processes; built 4 x num_processes long, or left unprepared and stepped by hand, it
    takes its 4 steps on any number of processes."""
    warmup = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # the learning rate after each optimizer step
    one, two = silent_differences[1][0]["warmup"], silent_differences[2]
    assert all(numbers["warmup"] == two[0]["warmup"] for numbers in two)
    two = two[0]["warmup"]
    assert all(rates == warmup for rates in one.values()), one
    assert two["built W long, prepared"] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert two["built W x num_processes long, prepared"] == two["built W long, not prepared"] == warmup


# ---------------------------------------------------------------- DeepSpeedExamples' training/cifar/cifar10_deepspeed.py

# 512 training images: 8 global batches of 64 (train_batch_size; 32 per process on two), one epoch (DeepSpeed's
# loader repeats epoch 0's order, Accelerate's reshuffles: a second epoch trains on other batches); 501 test images,
# an odd tail on 2 processes. The before under ZeRO-2.
DEEPSPEED_ARGS = ["--data-dir", MNIST_10K, "--train-samples", "512", "--test-samples", "501", "-b", "64", "-e", "1"]
DEEPSPEED_STEP = re.compile(r"^\[(\d+), +(\d+)\] rank (\d+) loss: (\S+) lr: (\S+)$", flags=re.M)
DEEPSPEED_TEST = re.compile(r"^Accuracy of the network on the (\d+) test images: (\S+) %, loss (\S+)$", flags=re.M)
# What torchrun --nproc_per_node 1 sets (accelerate launch of 2 processes sets it for two): deepspeed.init_distributed
# and DeepSpeed's loader (a DistributedSampler where LOCAL_RANK is set) read it
TORCHRUN_ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1"}


def deepspeed_jobs(out, num_processes) -> dict:
    """The DeepSpeed pair on `num_processes`, and on one process the after as tests/literal_adam.py runs it: jobs of
    launch_jobs. The before's exit check writes into a folder of its own (deepspeed_exit_check): DeepSpeed's example
    ends with its process group alive, which the test records instead of failing the launch."""
    exit_check = out / f"deepspeed_before_{num_processes}_exit_check"
    exit_check.mkdir()
    env = {**(TORCHRUN_ONE_PROCESS if num_processes == 1 else {}), "EXIT_CHECK_DIR": str(exit_check)}
    jobs = {
        f"deepspeed_before_{num_processes}": {"env": env, "argv": [
            DEEPSPEED_BEFORE, *DEEPSPEED_ARGS, "--stage", "2", "--save-model", out / f"deepspeed_before_{num_processes}.pt"]},
        f"deepspeed_after_{num_processes}": [DEEPSPEED_AFTER, "--cpu", *DEEPSPEED_ARGS, "--save-model",
                                             out / f"deepspeed_after_{num_processes}.pt"],
    }
    if num_processes == 1:
        jobs["deepspeed_literal_adam_1"] = [LITERAL_ADAM, DEEPSPEED_AFTER, "--cpu", *DEEPSPEED_ARGS, "--save-model",
                                            out / "deepspeed_literal_adam_1.pt"]
        # fp16 on a CPU: DeepSpeed stops at initialize (its group left alive: recorded apart), the after in its one
        # error: line
        (out / "deepspeed_fp16_before_1_exit_check").mkdir()
        jobs["deepspeed_fp16_before_1"] = {
            "env": {**env, "EXIT_CHECK_DIR": str(out / "deepspeed_fp16_before_1_exit_check")},
            "argv": [DEEPSPEED_BEFORE, *DEEPSPEED_ARGS, "--dtype", "fp16"]}
        jobs["deepspeed_fp16_after_1"] = [DEEPSPEED_AFTER, "--cpu", *DEEPSPEED_ARGS, "--dtype", "fp16"]
    else:  # a global batch that does not split over the processes
        jobs["deepspeed_odd_batch_after_2"] = [DEEPSPEED_AFTER, "--cpu", *DEEPSPEED_ARGS, "-b", "63"]
    return jobs


def deepspeed_steps(conversion_runs, name, num_processes) -> list:
    """(step, the mean of every process's printed loss, the learning rate every process printed) for each step of
    job NAME: the loss of the global batch, each process's share being as large."""
    ranks = [DEEPSPEED_STEP.findall(finished_job(*conversion_runs[name]).outputs[rank]) for rank in range(num_processes)]
    steps = []
    for same_step in zip(*ranks, strict=True):
        assert [int(rank) for _, _, rank, _, _ in same_step] == list(range(num_processes)), same_step
        assert len({(epoch, step, lr) for epoch, step, _, _, lr in same_step}) == 1, same_step
        epoch, step, _, _, lr = same_step[0]
        steps.append(((int(epoch), int(step)), sum(float(loss) for *_, loss, _ in same_step) / num_processes, float(lr)))
    return steps


@pytest.fixture(scope="module")
def deepspeed_runs(conversion_runs):
    """{name: (its per-step losses and learning rates, its test lines, its saved weights)} for the DeepSpeed jobs."""
    out, jobs = conversion_runs
    runs = {}
    for name, processes in (("before_1", 1), ("after_1", 1), ("literal_adam_1", 1), ("before_2", 2), ("after_2", 2)):
        runs[name] = (deepspeed_steps(jobs, f"deepspeed_{name}", processes),
                      DEEPSPEED_TEST.findall(finished_job(*jobs[f"deepspeed_{name}"]).stdout),
                      torch.load(out / f"deepspeed_{name}.pt", weights_only=True))
    return runs


def deepspeed_exit_check(conversion_runs, num_processes) -> list:
    """What the exit check recorded at the exit of each process of the DeepSpeed before: gloo threads still alive."""
    out, _ = conversion_runs
    return [path.read_text() for path in sorted((out / f"deepspeed_before_{num_processes}_exit_check").iterdir())]


def deepspeed_exact_evaluation(weights, samples):
    """(accuracy in %, mean cross-entropy, count) of `weights` over the first `samples` test images, on one process."""
    module = script_module(DEEPSPEED_AFTER)
    model = module.Net()
    model.load_state_dict(weights)
    images, labels = module.load_split(MNIST_10K, "t10k", samples).tensors
    with torch.no_grad():
        output = model.eval()(images)
    loss = torch.nn.functional.cross_entropy(output.double(), labels).item()
    return 100 * (output.argmax(1) == labels).double().mean().item(), loss, len(labels)


@requires_mnist_10k
def test_deepspeed_one_process_trains_the_same_model_bit_for_bit(deepspeed_runs):
    """The ds_config's parts written as Accelerate and torch objects (AdamW, WarmupLR as a LambdaLR, clip_grad_norm_,
    the loader drawing DistributedSampler's permutation): every printed loss and learning rate, the test line and the
    weights are the ZeRO-2 before's."""
    (steps_before, test_before, weights_before), (steps_after, test_after, weights_after) = \
        deepspeed_runs["before_1"], deepspeed_runs["after_1"]
    assert len(steps_before) == 8 and steps_before == steps_after
    # WarmupLR ("log", 4 steps, from 0): optimizer steps 1 and 2 train at 0, then log(s - 1) / log(4) of the peak
    assert [lr for *_, lr in steps_before] == [0, 0.0005, 0.00079248125, 0.001, 0.001, 0.001, 0.001, 0.001]
    assert test_before == test_after and test_after[0][0] == "501" and float(test_after[0][1]) > 20  # measured 28.1
    assert weights_before.keys() == weights_after.keys()
    assert all(torch.equal(weights_before[name], weights_after[name]) for name in weights_before)


@requires_mnist_10k
def test_deepspeed_two_processes_train_as_the_before_per_step_and_count_every_test_image_once(deepspeed_runs):
    """Per step, the loss of the global batch (the mean of the processes' printed losses) is the before's and the
    one-process run's, at the before's learning rate; the weights end as the before's. Both count each of the 501
    test images once: the before evaluates all of them on every process, the after its shard, gathered."""
    (steps_before, test_before, weights_before), (steps_after, test_after, weights_after) = \
        deepspeed_runs["before_2"], deepspeed_runs["after_2"]
    steps_one_process = deepspeed_runs["after_1"][0]
    assert [step for step, *_ in steps_before] == [step for step, *_ in steps_after] == \
           [step for step, *_ in steps_one_process] and len(steps_after) == 8
    for (_, loss_before, lr_before), (_, loss_after, lr_after), (_, loss_one, lr_one) in zip(
            steps_before, steps_after, steps_one_process):
        # measured: equal to the printed 6 decimals
        assert loss_before == pytest.approx(loss_after, abs=2e-6) and loss_after == pytest.approx(loss_one, abs=2e-6)
        assert lr_before == lr_after == lr_one  # WarmupLR counts optimizer steps, not processes
    for name in weights_before:  # measured: 3.7e-8 apart
        torch.testing.assert_close(weights_after[name], weights_before[name], rtol=0, atol=1e-6)
    accuracy, loss, count = deepspeed_exact_evaluation(weights_after, 501)
    assert len(test_before) == 2 and len(test_after) == 1  # the before prints on every process, the after once
    for printed_count, printed_accuracy, printed_loss in [*test_before, *test_after]:
        assert int(printed_count) == count == 501
        assert float(printed_accuracy) == pytest.approx(accuracy, abs=1e-4)
        assert float(printed_loss) == pytest.approx(loss, abs=2e-6)


@requires_mnist_10k
def test_deepspeeds_example_ends_with_its_process_group_alive_and_the_after_does_not(conversion_runs, deepspeed_runs):
    """DeepSpeed's example never destroys its process group: every process of the before exits with gloo's threads
    running, which can abort its exit (docs/ending_a_run_cleanly.md); the after's launch exit check found none."""
    for processes in (1, 2):
        records = deepspeed_exit_check(conversion_runs, processes)
        assert len(records) == processes, records
        assert all("gloo worker threads alive at the exit of" in record for record in records)


@requires_mnist_10k
def test_deepspeed_adam_converted_to_torch_adam_trains_another_model(deepspeed_runs):
    """DeepSpeed's "type": "Adam" is AdamW (adam_w_mode defaults to true). Converted literally to
    torch.optim.Adam(weight_decay=0.01), the weight decay joins the gradient Adam normalises: the losses agree while
    the learning rate is 0 (the first two steps' updates) and drift from the first step that moved the weights."""
    steps_before, test_before, weights_before = deepspeed_runs["before_1"]
    steps_adam, test_adam, weights_adam = deepspeed_runs["literal_adam_1"]
    assert [loss for _, loss, _ in steps_adam[:3]] == [loss for _, loss, _ in steps_before[:3]]
    drift = [abs(adam - before) for (_, adam, _), (_, before, _) in zip(steps_adam, steps_before, strict=True)]
    # measured: 0.0003 at step 4, 0.0070 at step 8: 150 and 3,500 times the tolerance the conversion meets (2e-6)
    assert drift[3] > 1e-4 and drift[-1] > 3e-3, drift
    apart = max((weights_adam[name] - weights_before[name]).abs().max().item() for name in weights_before)
    assert apart > 1e-3, apart  # measured: 0.011, where the conversion meets 3.7e-8 on 2 processes


def test_deepspeed_warmup_prepared_under_the_default_warms_up_num_processes_times_too_fast(silent_differences,
                                                                                         deepspeed_runs):
    """The converted script's WarmupLR, prepared with Accelerate's default step_scheduler_with_optimizer=True, steps
    once per process at each optimizer step: on 2 processes it reaches the peak after 2 optimizer steps where DeepSpeed
    takes 4. Under step_scheduler_with_optimizer=False (the script's) it follows DeepSpeed's learning rates."""
    deepspeed = [lr for *_, lr in deepspeed_runs["before_2"][0]]  # what DeepSpeed's engine printed on 2 processes
    assert deepspeed == [lr for *_, lr in deepspeed_runs["before_1"][0]]
    for processes in (1, 2):
        rates = silent_differences[processes]
        assert all(numbers["deepspeed_warmup"] == rates[0]["deepspeed_warmup"] for numbers in rates)
        default, fixed = (rates[0]["deepspeed_warmup"][f"prepared, step_scheduler_with_optimizer={flag}"]
                          for flag in (True, False))
        assert fixed == pytest.approx(deepspeed, rel=1e-7)  # printed to 8 digits
        assert (default == fixed) == (processes == 1)
    assert default[:3] == pytest.approx([0.0005, 0.001, 0.001], rel=1e-7)  # 2 processes: the peak after 2 steps


@requires_mnist_10k
def test_deepspeed_fp16_on_a_cpu_and_an_unsplittable_batch_stop_in_one_line(conversion_runs):
    """DeepSpeed's fp16 on CPU processes stops at deepspeed.initialize; Accelerate's would train in fp32 without a word,
    so the after stops in one error: line, as it does for a global batch that does not split over the processes."""
    _, jobs = conversion_runs
    before = read_job(*jobs["deepspeed_fp16_before_1"])
    statuses, outputs = before.statuses, before.outputs
    assert statuses == [1] and "ValueError: Type fp16 is not supported on your device." in outputs[0], outputs[0][-3000:]
    for name, processes, line in (
            ("deepspeed_fp16_after_1", 1, "error: --dtype fp16 needs a GPU: on CPU processes use --dtype "
                                                      "bf16 or fp32"),
            ("deepspeed_odd_batch_after_2", 2, "error: --batch_size 63 does not split over 2 processes: "
                                                             "give a multiple of 2")):
        job = read_job(*jobs[name])
        statuses, outputs = job.statuses, job.outputs
        assert jobs[name][1] == processes
        assert statuses == [1] * processes, (name, [output[-2000:] for output in outputs])
        assert all(output.strip().splitlines()[-1] == line and "Traceback" not in output for output in outputs), outputs
