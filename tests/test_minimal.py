"""The minimal pair: scripts/baselines/minimal_mnist_plain.py (plain PyTorch, one device) and
scripts/minimal_mnist.py (Accelerate). Their diff is the migration; on one process they train
the same model, bit for bit; on two, the evaluation counts every sample once; a launch that
would run, but not as asked, stops with one line. The one-process runs (the pair on the real digits, and the
refusal of a folder without the data) are jobs of one process (tests/jobs.py: torch and Accelerate imported once, a
child forked per run); the launches with config files and the two-process run are launches of their
own."""

import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from helpers import (
    MNIST_10K,
    REPO,
    assert_clean_user_error,
    launch,
    requires_mnist_10k,
    results,
    run,
)
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.models import ConvNet as UtilsConvNet

PLAIN = REPO / "scripts" / "baselines" / "minimal_mnist_plain.py"
MINIMAL = REPO / "scripts" / "minimal_mnist.py"
# accelerate launch gives each process OMP_NUM_THREADS=1 unless told otherwise; the plain run gets the
# same, since a different thread count sums the convolutions in another order (other last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def load_script(path):
    """The script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def minimal_diff() -> str:
    return subprocess.run(["diff", "-U0", "--label", "scripts/baselines/minimal_mnist_plain.py", "--label",
                           "scripts/minimal_mnist.py", PLAIN, MINIMAL], capture_output=True, text=True).stdout


def test_the_migration_is_at_most_55_marked_lines_and_the_readme_shows_it():
    diff = minimal_diff()
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-" and not line.startswith("@@")]
    assert 20 <= len(changed) <= 55, len(changed)
    # Past the docstring, every hunk that adds code carries a marker: each Accelerate line is marked.
    docstring_end = MINIMAL.read_text().splitlines().index('"""') + 1
    hunks = re.findall(r"^@@ -\S+ \+(\d+)\S* @@\n((?:[-+].*\n)*)", diff, flags=re.M)
    assert len(hunks) == diff.count("\n@@ ") > 5
    for start, hunk in hunks:
        added = [line for line in hunk.splitlines() if line.startswith("+")]
        if added and int(start) > docstring_end:
            assert any("# [accelerate]" in line for line in added), hunk
    added_code = "\n".join(line for line in changed if line.startswith("+"))
    for call in ("prepare", "accumulate", "backward", "gather_for_metrics", "save_model"):
        assert f"accelerator.{call}(" in added_code, call
    minimal = MINIMAL.read_text()
    assert not re.search(r"^(from|import) utils\b", minimal, flags=re.M), "the minimal script uses no utils/"
    assert not re.search(r"mixed_precision=|autocast|GradScaler|\.half\(", minimal), "precision is the launcher's"
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"```diff\n(.*?)```", readme, flags=re.S).group(1)
    assert shown == diff, "README's diff is stale: paste the output of the diff -U0 command it names"
    assert f"the whole\nmigration, {len(changed)} lines" in readme, "the README counts the diff's lines"


def test_each_script_of_the_pair_writes_its_own_folder():
    """Run one after the other with their defaults, the second must not overwrite the first's results."""
    plain, minimal = (load_script(path).parse_args(["--data_dir", "data"]).output_dir for path in (PLAIN, MINIMAL))
    assert (plain, minimal) == ("outputs/minimal_mnist_plain", "outputs/minimal_mnist")


CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # the same case on a GPU machine: no GPU to fall back on


@pytest.mark.parametrize("launcher, script_flags, expected_words", [
    # the torchrun launcher starts 2 processes, which form no group on the CPU without --cpu: 2 lone runs
    (["--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml"], [], ["formed no group", "--cpu"]),
    # without --multi_gpu, accelerate's one-process launcher runs the script once, whatever was asked
    (["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"], ["--cpu"],
     ["asked for several processes but started one", "--multi_gpu"]),
    # single_gpu.yaml's fp16 where there is no GPU: Accelerate would train in fp32 without a word
    (["--config_file", REPO / "accelerate_configs" / "single_gpu.yaml"], [], ["fp16 needs a GPU", "--mixed_precision"]),
], ids=["two-processes-without-cpu", "two-processes-without-multi-gpu", "fp16-on-the-cpu"])
def test_a_launch_not_as_asked_stops_with_one_line(launcher, script_flags, expected_words, synthetic_mnist, tmp_path):
    if "fp16" in expected_words[0] and torch.cuda.is_available():
        pytest.skip("single_gpu.yaml names GPU 0, which this machine has: fp16 runs there as asked")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, MINIMAL, *script_flags]
    proc = run([*command, "--data_dir", synthetic_mnist, "--epochs", "1", "--output_dir", out], check=False,
               env=CPU_ONLY, timeout=300)
    assert_clean_user_error(proc, *expected_words)
    assert not out.exists(), "nothing trained, nothing written"


def test_both_scripts_hold_the_collections_convnet():
    expected = repr(UtilsConvNet())
    assert repr(load_script(PLAIN).ConvNet()) == repr(load_script(MINIMAL).ConvNet()) == expected


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process runs, each a child forked from one `python tests/jobs.py` (ONE_THREAD; plain
    python, as a user may run either script: an Accelerator needs no launcher, and the two-process test goes through
    accelerate launch), in turn: the minimal script on an empty folder (no_data), then, where the real digits are,
    both scripts, one epoch on the 8,000 training digits (plain/, accelerate/). Accumulating over 2 of the 125
    batches ends the epoch with a window of one batch, where hand-written loops go wrong. On one process accelerate
    leaves the DataLoader's RandomSampler as it is, so both shuffle with the same seed drawn from torch's global
    generator (use_seedable_sampler=True would shuffle otherwise). Each test reads its run (finished_job)."""
    out = tmp_path_factory.mktemp("minimal")
    (out / "empty").mkdir()
    jobs = {"no_data": [MINIMAL, "--cpu", "--data_dir", out / "empty", "--output_dir", out / "empty" / "out"]}
    if not requires_mnist_10k.args[0]:  # the skip's condition: the real digits are absent
        common = ["--data_dir", MNIST_10K, "--epochs", "1", "--gradient_accumulation_steps", "2", "--cpu"]
        jobs.update(plain=[PLAIN, *common, "--output_dir", out / "plain"],
                    accelerate=[MINIMAL, *common, "--output_dir", out / "accelerate"])
    launch_jobs(jobs, [sys.executable], out, env=ONE_THREAD)
    return out


def test_a_folder_without_the_data_ends_with_one_line(one_process):
    # one process: the script reads its data on one process as on several, and the refusals above go through
    # accelerate launch
    proc = finished_job(one_process / "no_data", fails=True)
    assert_clean_user_error(proc, "train-images-idx3-ubyte.gz", "--data_dir")
    assert not (one_process / "empty" / "out").exists()


@requires_mnist_10k
def test_one_process_trains_exactly_the_plain_model(one_process):
    for name in ("plain", "accelerate"):
        finished_job(one_process / name)
    plain, accelerated = results(one_process / "plain"), results(one_process / "accelerate")
    assert plain["eval_samples"] == accelerated["eval_samples"] == 2000
    assert accelerated["num_processes"] == plain["num_processes"] == 1
    assert accelerated["eval_accuracy"] == plain["eval_accuracy"] >= 0.94  # measured 0.9525
    plain_weights, accelerated_weights = (load_file(one_process / name / "model.safetensors")
                                          for name in ("plain", "accelerate"))
    assert plain_weights.keys() == accelerated_weights.keys()
    assert all(torch.equal(plain_weights[k], accelerated_weights[k]) for k in plain_weights)


@requires_mnist_10k
def test_two_processes_evaluate_every_sample_once_and_save_a_plain_model(tmp_path):
    launch(["--data_dir", MNIST_10K, "--epochs", "1", "--output_dir", tmp_path], num_processes=2, script=MINIMAL)
    r = results(tmp_path)
    # 2,000 = 31 batches of 64 and one of 16: the shards are evened out with repeated samples, which
    # gather_for_metrics drops (a plain gather would count 2,048).
    assert r["num_processes"] == 2 and r["eval_samples"] == 2000
    assert r["eval_accuracy"] >= 0.95  # measured 0.963
    # The saved weights load strictly into the plain twin's ConvNet (no DDP `module.` names), and one
    # device scores them exactly as the two processes did: each eval sample counted once.
    plain = load_script(PLAIN)
    model = plain.ConvNet()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    images, labels = plain.load_split(MNIST_10K, "t10k").tensors
    with torch.no_grad():
        predictions = torch.cat([model.eval()(batch).argmax(dim=-1) for batch in images.split(64)])
    correct = (predictions == labels).sum().item()
    assert correct == round(r["eval_accuracy"] * 2000)
