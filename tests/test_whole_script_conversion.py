"""Whole scripts converted, each pair a "before" written the way a public example writes it and its "after" on
Accelerate, and a page that shows their diff hunk by hunk and stays equal to it:

- scripts/baselines/ddp_imagenet_style.py (pytorch/examples imagenet: mp.spawn, DistributedSampler, all_reduce'd
  meters, torch.save checkpoints) -> scripts/converted_ddp_imagenet_style.py, docs/converting_a_ddp_script.md;
- scripts/baselines/horovod_mnist.py (Horovod's examples/pytorch/pytorch_mnist.py) ->
  scripts/converted_horovod_style.py, docs/converting_a_horovod_script.md;
- scripts/baselines/apex_amp_imagenet_style.py (apex's examples/imagenet/main_amp.py) ->
  scripts/converted_apex_amp_style.py, docs/converting_an_apex_amp_script.md.

Horovod and apex cannot be installed here: their "before" runs on the stand-ins in tests/standins (their calls
over torch.distributed). On one process each pair trains the same model; on two the after ends with the
before's weights and reports the exact metric over every test image once; each resumes exactly where it stopped.

Every run of the three pairs is a job of one of two launches of tests/sample_recorder.py --jobs (conversion_runs):
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
from helpers import MNIST_10K, REPO, free_port, launcher_args, requires_mnist_10k, run
from safetensors.torch import load_file
from sample_recorder import job_outcome, jobs_file
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
CONVERSIONS = [(BEFORE, AFTER, PAGE), (HOROVOD_BEFORE, HOROVOD_AFTER, HOROVOD_PAGE),
               (APEX_BEFORE, APEX_AFTER, APEX_PAGE)]
# 512 training images = 8 global batches of 64 (no padded last batch); 101 test images: an odd tail on 2 processes.
# -b is per node, so 1 and 2 processes train on the same global batches.
TRAIN = [MNIST_10K, "--train-samples", "512", "--val-samples", "101", "-b", "64", "-j", "0", "-p", "1"]
# accelerate launch gives each process OMP_NUM_THREADS=1; mp.spawn's workers get the same, since another
# thread count sums the convolutions in another order (other last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
STEP = re.compile(r"^Epoch: \[(\d+)\]\[(\d+)/\d+\]\tLoss (\S+) ", flags=re.M)
EVALUATION = re.compile(r"^ \* Acc@1 (\S+) Loss (\S+) \((\d+) images\)$", flags=re.M)
LEARNING_RATE = re.compile(r"^Epoch: \[\d+\] lr (\S+)$", flags=re.M)


RECORDER = REPO / "tests" / "sample_recorder.py"
BASELINE_JOB = REPO / "tests" / "baseline_job.py"


def before_args(num_processes, out, *args) -> list:
    """The baseline under its own mp.spawn, one node of `num_processes` CPU processes (gloo)."""
    return [BEFORE, *TRAIN, "--checkpoint-dir", out, "--cpu", "--multiprocessing-distributed",
            "--cpu-processes", num_processes, "--world-size", "1", "--rank", "0",
            "--dist-url", f"tcp://127.0.0.1:{free_port()}", *args]


def after_args(out, *args) -> list:
    """The converted script: one process as a user may run it (python: an Accelerator needs no launcher), two under
    accelerate launch."""
    return [AFTER, "--cpu", *TRAIN, "--checkpoint-dir", out, *args]


def launch_jobs(jobs: dict, num_processes: int, folder) -> dict:
    """One launch of tests/sample_recorder.py --jobs in `folder` (its working directory): each job {name: SCRIPT ARGS}
    in turn, in a child forked from each launched process, its output in folder/NAME.rank{R}.out. One process: plain
    python; two: accelerate launch. Returns {name: (folder, num_processes, the launch)} for printed_by()."""
    folder.mkdir()
    manifest = jobs_file(folder / "jobs.json", [{"argv": argv, "sample_log": folder / name, "timeout": 600}
                                                for name, argv in jobs.items()])
    launcher = launcher_args(num_processes) if num_processes > 1 else [sys.executable]
    # each run was a process of its own, with helpers.run's limit of 600 s
    launch = run([*launcher, RECORDER, "--jobs", manifest], check=False, timeout=600 * len(jobs),
                 env=ONE_THREAD, cwd=folder)
    return {name: (folder, num_processes, launch) for name in jobs}


def printed_by(conversion_runs, name) -> str:
    """What every process of job NAME printed (stdout and stderr), rank after rank; every one of them exited 0."""
    return "".join(printed_by_each_rank(conversion_runs, name))


def printed_by_each_rank(conversion_runs, name) -> list:
    """What each process of job NAME printed; every one of them exited 0."""
    folder, num_processes, launch = conversion_runs[name]
    statuses, texts = job_outcome(folder / name, num_processes)
    assert statuses == [0] * num_processes, \
        f"{name}:\n" + "\n".join(text[-6000:] for text in texts) + f"\nthe launch: {launch.stderr[-3000:]}"
    return texts


def printed_by_rank(conversion_runs, name, rank) -> str:
    return printed_by_each_rank(conversion_runs, name)[rank]


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
    """Every run of the three pairs, as jobs of two launches (launch_jobs): the one-process runs, and the DDP
    before's two-process one (mp.spawn starts its processes), as jobs of one python process; the other two-process
    runs as jobs of one accelerate launch of 2 processes. A run that resumes follows the one it resumes."""
    out = tmp_path_factory.mktemp("conversion")
    apex_one_batch = [*APEX_ARGS, "-b", "512", "--epochs", "2", "-p", "1"]
    # apex's scripts write into their working directory (the launch's): checkpoint.pth.tar and model_best.pth.tar
    # the before, checkpoint/ and model_best/ the after
    one_process = launch_jobs({
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
    }, 1, out / "one_process")
    two_processes = launch_jobs({
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
    }, 2, out / "two_processes")
    return out, {**one_process, **two_processes}


@pytest.fixture(scope="module")
def runs(conversion_runs):
    """The DDP pair: two epochs of each script on 1 process and on 2, and on 1 process each again as 1 epoch + a
    resume for the second: 8 runs, printed output and checkpoint folder of each."""
    out, jobs = conversion_runs
    results = {}
    for name, processes in (("before", 1), ("after", 1), ("before", 2), ("after", 2)):
        results[name, processes] = out / f"{name}_{processes}", printed(printed_by(jobs, f"{name}_{processes}"))
    for name in ("before", "after"):
        first_epoch = printed(printed_by(jobs, f"{name}_resumed_first"))
        second_epoch = printed(printed_by(jobs, f"{name}_resumed"))
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


@pytest.mark.parametrize("before, after, page", CONVERSIONS, ids=lambda path: path.stem)
def test_the_page_shows_every_hunk_of_the_real_diff_and_each_is_marked(before, after, page):
    diff = conversion_diff(before, after)
    real = hunks(diff)
    shown = [hunk for block in re.findall(r"```diff\n(.*?)```", page.read_text(), flags=re.S) for hunk in hunks(block)]
    assert len(real) > 20 and shown == real, f"{page.name} is stale: paste the hunks of the diff -U0 it names"
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


@pytest.mark.parametrize("page", [PAGE, HOROVOD_PAGE, APEX_PAGE], ids=lambda path: path.stem)
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
    return {(name, processes): (printed_by(jobs, f"horovod_{name}_{processes}"),
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
    results = {("before", 1): printed_by(jobs, "apex_before_1"), ("after", 1): printed_by(jobs, "apex_after_1"),
               ("after", 2): printed_by(jobs, "apex_after_2_first") + printed_by(jobs, "apex_after_2")}
    for rank in (0, 1):
        results["before", 2, rank] = printed_by_rank(jobs, "apex_before_2", rank)
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
