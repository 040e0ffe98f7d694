"""What scripts/sweep.py knows about a trial (one grid point's run): the flags its script takes, and the record in its
folder of the command that defines it, by which a later sweep tells a finished trial of this command from one of
another command and from an interrupted one.

Nothing here imports torch: the sweep only starts other programs.
"""

import difflib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ..errors import UserError
from ..output_files import LAUNCH_LOG, RESULTS, TRIAL_RECORD

# argparse lists each option at this indent in --help; help text wraps at a deeper one
OPTION_LINE = re.compile(r"^  (-.*?)(?:  |$)", re.MULTILINE)


def script_flags(script) -> set:
    """The long flags `script --help` lists ({'--learning_rate', ...}): the grid's names are checked against them,
    as argparse would otherwise take an abbreviation (`lr` for --lr_scheduler_type) or a typo ends the run late."""
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, errors="replace")
    flags = {flag for invocation in OPTION_LINE.findall(proc.stdout) for flag in re.findall(r"--[\w-]+", invocation)}
    if proc.returncode != 0 or not flags:
        raise UserError(f"`python {script} --help` listed no flags (exit {proc.returncode}); the sweep reads the "
                        f"script's flags from it: give an argparse script that runs on its own")
    return flags


def check_grid_flags(grid: dict, flags: set, script) -> None:
    """Every grid name is one of the script's flags, spelled out: an abbreviation or an unknown name is refused with
    the flags it may have meant (those it abbreviates, those of the same initials, close spellings)."""
    for name in grid:
        if f"--{name}" in flags:
            continue
        names = sorted(flag[2:] for flag in flags)
        initials = [flag for flag in names if "".join(word[0] for word in flag.split("_") if word) == name]
        candidates = dict.fromkeys([*(flag for flag in names if flag.startswith(name)), *initials,
                                    *difflib.get_close_matches(name, names, n=3)])
        hint = f"did you mean {' or '.join(f'--grid {flag}=...' for flag in candidates)}?" if candidates \
            else f"see `python {script} --help`"
        raise UserError(f"--grid {name}: {script} has no flag --{name} (a grid names a flag in full); {hint}")


def trial_command(script, script_args: list, config_file) -> dict:
    """What defines a trial: the script, its arguments, the launch config. Not the port, which changes nothing."""
    return {"script": str(Path(script).resolve()), "args": [str(arg) for arg in script_args],
            "config_file": str(Path(config_file).resolve()) if config_file else None}


def option_groups(script_args: list) -> Counter:
    """['--epochs', '1', '--cpu'] -> Counter({'--epochs 1': 1, '--cpu': 1}): each flag with its values, in any
    order, as argparse reads them."""
    groups = []
    for arg in script_args:
        if not groups or re.match(r"--?[A-Za-z]", arg):
            groups.append(arg)
        else:
            groups[-1] += f" {arg}"
    return Counter(groups)


def same_command(recorded: dict, command: dict) -> bool:
    return (recorded.get("script"), recorded.get("config_file")) == (command["script"], command["config_file"]) \
        and option_groups(recorded.get("args", [])) == option_groups(command["args"])


def differences(recorded: dict, command: dict) -> str:
    """'`--epochs 1` then, `--epochs 2` now': what separates two trial commands, briefly."""
    before, now = option_groups(recorded.get("args", [])), option_groups(command["args"])
    parts = []
    if before != now:
        then_only, now_only = " ".join((before - now).elements()), " ".join((now - before).elements())
        parts.append(f"`{then_only or 'nothing'}` then, `{now_only or 'nothing'}` now")
    for key, label in (("script", "script"), ("config_file", "--config_file")):
        if recorded.get(key) != command[key]:
            parts.append(f"{label} {recorded.get(key)} then, {command[key]} now")
    return "; ".join(parts)


def read_record(folder: Path) -> dict:
    try:
        return json.loads((folder / TRIAL_RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise UserError(f"{folder / TRIAL_RECORD} is unreadable ({type(err).__name__}); delete {folder} to rerun "
                        f"its run") from None


def trial_state(folder: Path, command: dict) -> str:
    """'new', 'done' (this command ended with exit 0 and results.json) or 'unfinished' (this command was started and
    did not end so: interrupted or failed); UserError for a folder holding files of another command's run or of no
    sweep's."""
    recorded = read_record(folder).get("command")
    if not folder.is_dir() or {path.name for path in folder.iterdir()} <= {TRIAL_RECORD, LAUNCH_LOG}:
        # never launched, or a launch that stopped before writing anything (say, at a wrong --data_dir): nothing to keep
        return "unfinished" if recorded is not None and same_command(recorded, command) else "new"
    if recorded is None:
        raise UserError(f"{folder} holds files but no {TRIAL_RECORD}: not a run of a sweep, or of an older sweep.py; "
                        f"give this sweep another --output_dir")
    if not same_command(recorded, command):
        raise UserError(f"{folder} was run by another command ({differences(recorded, command)}): its files belong "
                        f"to that run; give this sweep another --output_dir, or the command it was run with")
    return "done" if read_record(folder).get("exit_code") == 0 and (folder / RESULTS).is_file() else "unfinished"


def record_trial(folder: Path, command: dict, exit_code) -> None:
    """The trial's command and how its last launch ended (None: started, not ended), replaced in one rename so
    that a sweep stopped at any moment leaves the old record or the new one."""
    tmp = folder / f".{TRIAL_RECORD}.tmp"
    tmp.write_text(json.dumps({"command": command, "exit_code": exit_code}, indent=2) + "\n")
    os.replace(tmp, folder / TRIAL_RECORD)
