"""The README stays true: its commands name files and flags that exist, and they run."""

import re
import shlex
import subprocess
import sys

import pytest
from helpers import REPO, make_synthetic_mnist, results, run

README = (REPO / "README.md").read_text()
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def bash_commands(text: str = README) -> list:
    """Every command line in ```bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def launch_commands() -> list:
    """Commands that run `accelerate launch`, directly or through a wrapper script."""
    return [c for c in bash_commands() if "accelerate launch " in c]


def runnable(command: str) -> list:
    """The command's words, with `accelerate` run from this interpreter's environment."""
    words = shlex.split(command)
    at = words.index("accelerate")
    prefix = ["bash", REPO / words[0]] if at > 0 else []  # e.g. scripts/restart_on_failure.sh 3 ...
    return [*prefix, *words[1 if prefix else 0:at], *ACCELERATE, *words[at + 1:]]


QUICKSTART_RUN = "accelerate launch scripts/train_mnist.py"
TEST_COMMAND = "python -m pytest -q tests"


def test_quickstart_has_the_install_run_and_test_commands():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert bash_commands(quickstart) == ["pip install -r requirements.txt", QUICKSTART_RUN, TEST_COMMAND]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"pip install .*-r requirements\.txt", ci)
    assert ci.rstrip().splitlines()[-1] == TEST_COMMAND


def _help(cmd) -> str:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, check=True).stdout


@pytest.fixture(scope="module")
def launch_help():
    return _help([*ACCELERATE, "launch", "--help"])


def test_launch_commands_name_existing_files_and_flags(launch_help):
    helps = {}
    assert launch_commands(), "the README shows how to launch"
    for command in launch_commands():
        wrapper = shlex.split(command)[0]
        assert wrapper == "accelerate" or (REPO / wrapper).is_file(), command
        words = shlex.split(command.split("accelerate launch ", 1)[1])
        script_at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        launcher_words, script, script_words = words[:script_at], words[script_at], words[script_at + 1:]
        assert (REPO / script).is_file(), command
        for word in launcher_words + script_words:
            if re.match(r"^(accelerate_configs|scripts|utils|tests)/", word):
                assert (REPO / word).exists(), f"{word} in: {command}"
        for flag in (w.split("=")[0] for w in launcher_words if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", launch_help), f"accelerate launch has no {flag}: {command}"
        if script not in helps:
            helps[script] = _help([sys.executable, REPO / script, "--help"])
        for flag in (w.split("=")[0] for w in script_words if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", helps[script]), f"{script} has no {flag}: {command}"


def test_quickstart_command_as_written_offline_asks_for_data_dir(tmp_path):
    # Offline (conftest), ylecun/mnist cannot be downloaded: the exact README command must say what to do.
    proc = run([*ACCELERATE, *shlex.split(QUICKSTART_RUN)[1:], "--output_dir", tmp_path / "out"], check=False)
    assert proc.returncode != 0
    assert any(line.startswith("error: ") and "--data_dir" in line for line in proc.stderr.splitlines())


def first_command_per_topology() -> list:
    """One command per (launch options, script): the others differ only in script flags,
    which test_launch_commands_name_existing_files_and_flags checks."""
    chosen = {}
    for command in launch_commands():
        launcher_part = command.split(".py", 1)[0]
        chosen.setdefault(launcher_part, command)
    return sorted(chosen.values())


@pytest.mark.parametrize("command", first_command_per_topology())
def test_launch_commands_run_on_cpu(command, tmp_path):
    config = re.search(r"--config_file\s+(\S+)", command)
    if config and "cpu" not in config.group(1):
        pytest.skip(f"{config.group(1)} needs GPUs; CI has none")
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
