"""The minimal pair: scripts/baselines/minimal_mnist_plain.py (plain PyTorch, one device) and
scripts/minimal_mnist.py (Accelerate). Their diff is the migration; on one process they train
the same model, bit for bit; on two, the evaluation still counts every sample once."""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import MNIST_10K, REPO, launch, requires_mnist_10k, results, run
from safetensors.torch import load_file

PLAIN = REPO / "scripts" / "baselines" / "minimal_mnist_plain.py"
MINIMAL = REPO / "scripts" / "minimal_mnist.py"
# accelerate launch gives each process OMP_NUM_THREADS=1 unless told otherwise; the plain run gets the
# same, since a different thread count sums the convolutions in another order (other last bits).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def minimal_diff() -> str:
    return subprocess.run(["diff", "-U0", "--label", "scripts/baselines/minimal_mnist_plain.py", "--label",
                           "scripts/minimal_mnist.py", PLAIN, MINIMAL], capture_output=True, text=True).stdout


def test_the_migration_is_at_most_40_changed_lines_and_the_readme_shows_it():
    diff = minimal_diff()
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-" and not line.startswith("@@")]
    assert 20 <= len(changed) <= 40, len(changed)
    assert not re.search(r"^(from|import) utils\b", MINIMAL.read_text(), flags=re.M), "the minimal script uses no utils/"
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"```diff\n(.*?)```", readme, flags=re.S).group(1)
    assert shown == diff, "README's diff is stale: paste the output of the diff -U0 command it names"


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """Both scripts, one epoch on the 8,000 real training digits, on one CPU process."""
    out = tmp_path_factory.mktemp("minimal")
    common = ["--data_dir", MNIST_10K, "--epochs", "1", "--cpu"]
    run([sys.executable, PLAIN, *common, "--output_dir", out / "plain"], env=ONE_THREAD)
    launch([*common, "--output_dir", out / "accelerate"], script=MINIMAL, env=ONE_THREAD)
    return out


@requires_mnist_10k
def test_one_process_trains_exactly_the_plain_model(one_epoch):
    plain, accelerated = results(one_epoch / "plain"), results(one_epoch / "accelerate")
    assert plain["eval_samples"] == accelerated["eval_samples"] == 2000
    assert accelerated["eval_accuracy"] == plain["eval_accuracy"] >= 0.96
    plain_weights, accelerated_weights = (load_file(one_epoch / name / "model.safetensors")
                                          for name in ("plain", "accelerate"))
    assert plain_weights.keys() == accelerated_weights.keys()
    assert all(torch.equal(plain_weights[k], accelerated_weights[k]) for k in plain_weights)


@requires_mnist_10k
def test_two_processes_evaluate_every_sample_once_and_save_a_plain_model(tmp_path):
    launch(["--data_dir", MNIST_10K, "--epochs", "1", "--output_dir", tmp_path, "--gradient_accumulation_steps", "2"],
           num_processes=2, script=MINIMAL)
    r = results(tmp_path)
    assert r["num_processes"] == 2 and r["eval_samples"] == 2000 and r["eval_accuracy"] >= 0.9
    sys.path.insert(0, str(PLAIN.parent))
    try:
        from minimal_mnist_plain import ConvNet
    finally:
        sys.path.remove(str(PLAIN.parent))
    ConvNet().load_state_dict(load_file(tmp_path / "model.safetensors"))  # strict: no DDP `module.` names
    assert json.loads((tmp_path / "results.json").read_text()) == r
