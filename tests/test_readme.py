"""The README stays true: its commands name files and flags that exist, and they run."""

import re
import shlex

import pytest
from doc_commands import ACCELERATE, bash_commands, check_command, runnable
from helpers import REPO, make_synthetic_mnist, results, run

README = (REPO / "README.md").read_text()


def launch_commands() -> list:
    """Commands that run `accelerate launch`, directly or through a wrapper script."""
    return [c for c in bash_commands(README) if "accelerate launch " in c]


QUICKSTART_RUN = "accelerate launch scripts/train_mnist.py"
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile tests"


def test_quickstart_has_the_install_run_and_test_commands():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = bash_commands(quickstart)
    assert commands[0] == "pip install -r requirements.txt" and commands[-2:] == [QUICKSTART_RUN, TEST_COMMAND]
    assert any("scripts/minimal_mnist.py" in c for c in commands), "the quickstart starts with the minimal pair"


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text()
    assert "requirements=(-r requirements.txt -r requirements-trackers.txt -r requirements-export.txt)" in ci
    assert 'install=("${requirements[@]}" -c constraints.txt)' in ci  # CI installs the versions that were tested
    pinned = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    for package in ("torch", "torchvision", "accelerate", "datasets"):
        assert f"{package} {pinned[package]}" in README, f"the README names the tested {package} {pinned[package]}"
    assert ci.rstrip().splitlines()[-1] == TEST_COMMAND


def test_readme_commands_name_existing_files_and_flags(helps):
    commands = bash_commands(README)
    assert launch_commands(), "the README shows how to launch"
    for command in commands:
        check_command(command, helps)


def test_quickstart_command_as_written_offline_asks_for_data_dir(tmp_path):
    # Offline (conftest), ylecun/mnist cannot be downloaded: the exact README command must say what to do.
    proc = run([*ACCELERATE, *shlex.split(QUICKSTART_RUN)[1:], "--output_dir", tmp_path / "out"], check=False)
    assert proc.returncode != 0
    assert any(line.startswith("error: ") and "--data_dir" in line for line in proc.stderr.splitlines())


# Our scripts that read MNIST, from the Hub unless --data_dir names local files (benchmark.py only for --models mnist).
MNIST_SCRIPTS = re.compile(r"^scripts/(train_mnist|minimal_mnist|baselines/\w+_mnist|benchmark|benchmark_train)\.py$")


def downloads(words: list):
    """What the command, run as written, fetches from the network (None: nothing)."""
    if "--dataset" in words:
        return "a Hub dataset"
    if "--pretrained" in words:
        return "pretrained weights"
    if "--data_dir" in words:
        return None
    models = words[words.index("--models") + 1] if "--models" in words else "mnist"
    for script in (word for word in words if MNIST_SCRIPTS.match(word)):
        if "mnist" in models or "benchmark" not in script:
            return "MNIST from the Hub"
    return None


def readme_command_lines() -> list:
    """(command, the comment on its line) for every line of the README's ```bash blocks."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, comment = re.fullmatch(r"(.*?)(?:(?:^|\s)(#.*))?", line).groups()
            if command.strip():
                lines.append((command.strip(), comment or ""))
    return lines


def test_every_readme_command_runs_offline_or_says_in_its_line_what_it_needs():
    """A user offline (or on a compute node without network) copies a command and it fails: each one names
    local data with --data_dir, or its own line's comment says what it downloads / what to add."""
    commands = readme_command_lines()
    assert [command for command, _ in commands] == bash_commands(README)
    needing = []
    for command, comment in commands:
        fetched = downloads(shlex.split(command))
        if fetched == "MNIST from the Hub" and "--data_dir" not in comment:
            needing.append(command)
        elif fetched in ("a Hub dataset", "pretrained weights") and "network" not in comment:
            needing.append(command)
    assert not needing, "add --data_dir path/to/MNIST/raw, or say what it downloads:\n" + "\n".join(needing)
    # the rule can fail: the Quickstart's command downloads, and its comment says what to add
    quickstart = ("accelerate launch scripts/train_mnist.py",
                  "# downloads MNIST once; offline add --data_dir path/to/MNIST/raw")
    assert downloads(shlex.split(quickstart[0])) == "MNIST from the Hub" and quickstart in commands


def first_command_per_topology() -> list:
    """One command per (launch options, script): the others differ only in script flags,
    which test_launch_commands_name_existing_files_and_flags checks. scripts/predict.py needs a trained
    run: tests/test_predict.py runs its commands."""
    chosen = {}
    for command in launch_commands():
        if "scripts/predict.py" in command:
            continue
        launcher_part = command.split(".py", 1)[0]
        chosen.setdefault(launcher_part, command)
    return sorted(chosen.values())


@pytest.mark.parametrize("command", first_command_per_topology())
def test_launch_commands_run_on_cpu(command, tmp_path):
    config = re.search(r"--config_file\s+(\S+)", command)
    if config and "cpu" not in config.group(1):
        pytest.skip(f"{config.group(1)} needs GPUs or several machines (CI has neither); "
                    "tests/test_configs.py and tests/test_topologies.py check it")
    out = tmp_path / "out"
    # The command as written, plus small generated data, on a machine where `accelerate config` never ran.
    if "train_image_classifier.py" in command:
        from image_data import make_flat_image_folder

        data = make_flat_image_folder(tmp_path / "images", per_class=10)
        extra, expected_eval = ["--image_size", "32", "--num_workers", "0", "--batch_size", "8"], 8
    else:
        data, extra, expected_eval = make_synthetic_mnist(tmp_path / "data", num_train=128, num_test=40), [], 40
    run([*runnable(command), "--data_dir", data, "--epochs", "1", "--output_dir", out, *extra])
    assert results(out)["eval_samples"] == expected_eval
