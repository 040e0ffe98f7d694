"""The sweep's decisions (utils/launch/sweep_trials.py), asked in this process on folders written here: which trial
is new, done or unfinished, which folder belongs to another command, and which grid names are the script's flags.
(tests/test_topologies.py runs scripts/sweep.py through the same decisions with real launches; these take
milliseconds, so that the mutation run of docs/testing.md, "Mutation testing", can run them for every mutant.)"""

import json
from pathlib import Path

import pytest

from utils.errors import UserError
from utils.launch.sweep_trials import (
    check_grid_flags,
    differences,
    option_groups,
    read_record,
    record_trial,
    same_command,
    script_flags,
    trial_command,
    trial_state,
)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_mnist.py"


def command(*args, config_file=None) -> dict:
    return trial_command(SCRIPT, list(args), config_file)


def trial(folder: Path, recorded: dict, exit_code, *files) -> Path:
    """A trial's folder as a sweep leaves it: its record, its launch.log and what the run wrote (`files`)."""
    folder.mkdir(parents=True, exist_ok=True)
    record_trial(folder, recorded, exit_code)
    (folder / "launch.log").write_text("...\n")
    for name in files:
        (folder / name).write_text("{}")
    return folder


def test_the_same_command_with_its_flags_in_another_order_is_the_same_trial(tmp_path):
    """Issue 43 #9: the same sweep with its fixed flags in another order (each flag with its values, as argparse reads
    them) is the same command, whose finished trial is done; values swapped between flags are another command."""
    folder = tmp_path / "learning_rate_0.1"
    before = command("--epochs", "1", "--cpu", "--shift", "-1", "--output_dir", folder, "--learning_rate", "0.1")
    trial(folder, before, 0, "results.json", "model.safetensors")
    now = command("--cpu", "--learning_rate", "0.1", "--output_dir", folder, "--shift", "-1", "--epochs", "1")
    assert same_command(before, now) and trial_state(folder, now) == "done"
    for other, then_now in (
            (["--epochs", "-1", "--cpu", "--shift", "1"], "`--epochs 1 --shift -1` then, `--epochs -1 --shift 1` now"),
            (["--epochs", "1", "--cpu", "--cpu", "--shift", "-1"], "`nothing` then, `--cpu` now"),
            (["--epochs", "1", "--shift", "-1"], "`--cpu` then, `nothing` now"),
            (["--epochs=1", "--cpu", "--shift", "-1"], "`--epochs 1` then, `--epochs=1` now")):
        changed = command(*other, "--output_dir", folder, "--learning_rate", "0.1")
        assert not same_command(before, changed)
        with pytest.raises(UserError) as error:
            trial_state(folder, changed)
        assert str(error.value) == (f"{folder} was run by another command ({then_now}): its files belong to that run; "
                                    f"give this sweep another --output_dir, or the command it was run with")


def test_a_trial_is_done_only_when_its_command_ended_with_0_and_wrote_its_results(tmp_path):
    """Issue 43 #12: exit 0 without results.json (a script that ends 0 before its report) is unfinished, not done:
    done, the sweep would read the missing results.json and stop with a traceback."""
    now = command("--epochs", "1")
    assert trial_state(trial(tmp_path / "no_results", now, 0, "model.safetensors"), now) == "unfinished"
    assert trial_state(trial(tmp_path / "done", now, 0, "results.json"), now) == "done"
    for exit_code in (None, 1, 143):  # started and not ended; failed; stopped by a signal
        assert trial_state(trial(tmp_path / f"exit_{exit_code}", now, exit_code, "results.json"), now) == "unfinished"
    (tmp_path / "results_folder" / "results.json").mkdir(parents=True)
    assert trial_state(trial(tmp_path / "results_folder", now, 0), now) == "unfinished"


def test_a_folder_with_nothing_of_a_run_in_it_is_new_or_its_own_commands_unfinished_trial(tmp_path):
    now = command("--epochs", "1")
    assert trial_state(tmp_path / "never_made", now) == "new"
    (tmp_path / "empty").mkdir()
    assert trial_state(tmp_path / "empty", now) == "new"
    (tmp_path / "only_log").mkdir()
    (tmp_path / "only_log" / "launch.log").write_text("error: ...\n")
    assert trial_state(tmp_path / "only_log", now) == "new"
    # launched and stopped before writing (a wrong --data_dir): its own command's is rerun, another's left
    stopped = trial(tmp_path / "stopped", now, 1)
    assert trial_state(stopped, now) == "unfinished"
    assert trial_state(stopped, command("--epochs", "2")) == "new"
    assert trial_state(stopped, command("--epochs", "1", config_file=tmp_path / "fsdp.yaml")) == "new"


def test_a_folder_with_a_runs_files_but_no_record_is_not_the_sweeps(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.json").write_text("{}")
    with pytest.raises(UserError) as error:
        trial_state(folder, command("--epochs", "1"))
    assert str(error.value) == (f"{folder} holds files but no sweep_trial.json: not a run of a sweep, or of an older "
                                f"sweep.py; give this sweep another --output_dir")
    (folder / "sweep_trial.json").write_text("{")
    with pytest.raises(UserError) as error:
        trial_state(folder, command("--epochs", "1"))
    assert str(error.value) == (f"{folder / 'sweep_trial.json'} is unreadable (JSONDecodeError); delete {folder} to "
                                f"rerun its run")


def test_another_script_or_launch_config_is_another_command(tmp_path):
    now = command("--epochs", "1", config_file="accelerate_configs/fsdp_cpu.yaml")
    assert now["config_file"] == str(Path("accelerate_configs/fsdp_cpu.yaml").resolve())
    assert now["script"] == str(SCRIPT) and now["args"] == ["--epochs", "1"]
    assert command(Path("a") / "b", 3)["args"] == [str(Path("a") / "b"), "3"] and command()["config_file"] is None
    other_script = {**now, "script": "/elsewhere/train.py"}
    assert not same_command(other_script, now) and not same_command({**now, "config_file": None}, now)
    assert same_command(json.loads(json.dumps(now)), now) and not same_command({}, command())
    no_args = {"script": str(SCRIPT), "config_file": None}  # a record without arguments: none
    assert same_command(no_args, command()) and differences(no_args, command("--cpu")) == "`nothing` then, `--cpu` now"
    assert differences(other_script, now) == f"script /elsewhere/train.py then, {SCRIPT} now"
    assert differences({**other_script, "config_file": None, "args": []}, now) == (
        f"`nothing` then, `--epochs 1` now; script /elsewhere/train.py then, {SCRIPT} now; --config_file None then, "
        f"{now['config_file']} now")
    folder = trial(tmp_path / "trial", other_script, 0, "results.json")
    with pytest.raises(UserError, match=r"was run by another command \(script /elsewhere/train.py then, "):
        trial_state(folder, now)


def test_option_groups_are_each_flag_with_its_values():
    assert option_groups([]) == {}
    assert option_groups(["value", "--a", "1", "2", "-b", "--c=3", "-5", "--d", "--a", "1", "2", "-W", "x", "--Z"]) == {
        "value": 1, "--a 1 2": 2, "-b": 1, "--c=3 -5": 1, "--d": 1, "-W x": 1, "--Z": 1}


def test_the_record_is_replaced_whole_and_read_back(tmp_path):
    assert read_record(tmp_path) == {}
    now = command("--epochs", "1")
    record_trial(tmp_path, now, None)
    assert read_record(tmp_path) == {"command": now, "exit_code": None}
    record_trial(tmp_path, now, 0)
    text = (tmp_path / "sweep_trial.json").read_text()
    assert json.loads(text) == {"command": now, "exit_code": 0}
    # indented, for a person to read
    assert text.startswith('{\n  "command": {\n    "script": ') and text.endswith('\n  "exit_code": 0\n}\n')
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sweep_trial.json"]  # no temporary file left


def test_grid_names_are_the_scripts_flags_spelled_out(tmp_path):
    flags = {"--learning_rate", "--lr_scheduler_type", "--batch_size", "--seed", "--epochs"}
    check_grid_flags({"learning_rate": ["0.1"], "seed": ["1", "2"]}, flags, "train.py")
    for name, hint in (
            ("lr", "did you mean --grid lr_scheduler_type=... or --grid learning_rate=...?"),
            ("bs", "did you mean --grid batch_size=...?"),
            ("epoch", "did you mean --grid epochs=...?"),
            ("seeds", "did you mean --grid seed=...?"),
            ("zzz", "see `python train.py --help`"),
            ("weigth", "did you mean --grid weight_d=... or --grid weight_c=... or --grid weight_b=...?")):  # 3 at most
        with pytest.raises(UserError) as error:
            check_grid_flags({"seed": ["1"], name: ["1"]}, flags | {"--weight_a", "--weight_b", "--weight_c",
                                                                   "--weight_d"}, "train.py")
        assert str(error.value) == f"--grid {name}: train.py has no flag --{name} (a grid names a flag in full); {hint}"


def test_the_scripts_flags_are_read_from_its_help(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, sys\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--learning_rate', '--lr', type=float, help='the peak learning rate, as in the\\n'\n"
        "                    'examples --not_a_flag' + ' x' * 60)\n"
        "parser.add_argument('-s', '--seed', type=int)\n"
        "parser.add_argument('--very_long_option_name_that_pushes_help_down', help='--neither')\n"
        "parser.add_argument('--with-dashes', action='store_true')\n"
        "parser.add_argument('--caf', help='caf\\xe9 in Latin-1')\n"
        "sys.stdout.reconfigure(encoding='latin-1')  # help text that is not UTF-8: read all the same\n"
        "parser.parse_args()\n")
    assert script_flags(script) == {"--help", "--learning_rate", "--lr", "--seed", "--caf",
                                    "--very_long_option_name_that_pushes_help_down", "--with-dashes"}
    (tmp_path / "broken.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(UserError) as error:
        script_flags(tmp_path / "broken.py")
    assert str(error.value) == (f"`python {tmp_path / 'broken.py'} --help` listed no flags (exit 3); the sweep reads "
                                f"the script's flags from it: give an argparse script that runs on its own")
    (tmp_path / "no_flags.py").write_text("print('usage: no_flags')\n")
    with pytest.raises(UserError, match=r"listed no flags \(exit 0\)"):
        script_flags(tmp_path / "no_flags.py")
    # flags listed, but the script failed: not one that runs on its own
    (tmp_path / "fails.py").write_text(script.read_text().replace("parser.parse_args()", "parser.print_help(); "
                                                                  "raise SystemExit(2)"))
    with pytest.raises(UserError, match=r"listed no flags \(exit 2\)"):
        script_flags(tmp_path / "fails.py")
