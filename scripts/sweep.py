#!/usr/bin/env python
"""Train once per point of a hyperparameter grid, one run after the other, and print a table.

    python scripts/sweep.py --grid learning_rate=1e-3,3e-3 --grid batch_size=32,64 \\
        --config_file accelerate_configs/cpu_2proc.yaml -- scripts/train_mnist.py --cpu --epochs 1 \\
        --data_dir path/to/MNIST/raw

Every run is `accelerate launch --config_file C --main_process_port P SCRIPT ARGS
--output_dir OUTPUT_DIR/NAME --resume_from_checkpoint latest --learning_rate ... --batch_size ...`:
its own output folder (NAME says its grid point) and its own port, so a run never reads another's
checkpoints and never meets a port the previous run left behind. The table of results.json values is
printed at the end and written to OUTPUT_DIR/summary.md. Each run's folder records its command
(sweep_trial.json): run again, the sweep skips the runs this command finished, resumes the others
from their last checkpoint (an interrupted sweep continues where it stopped), and refuses a folder
that another command ran (a changed fixed flag): its results would not be this command's.
"""

import itertools
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.errors import UserError, exit_with_error
from utils.launch.flags import ArgumentParser
from utils.launch.sweep_trials import check_grid_flags, record_trial, script_flags, trial_command, trial_state
from utils.output_files import RESULTS

# results.json keys shown in the table, with their format
COLUMNS = {"eval_accuracy": "{:.4f}", "eval_loss": "{:.4f}", "train_loss": "{:.4f}",
           "train_samples_per_second": "{:.0f}", "num_processes": "{}"}
# Flags the sweep gives every run itself: one folder per run, and the same command for its first start and a restart
SET_BY_SWEEP = ("--output_dir", "--resume_from_checkpoint")


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0],
                            usage="%(prog)s --grid FLAG=V1,V2,... [--grid ...] [options] -- SCRIPT [ARGS ...]")
    parser.add_argument("--grid", action="append", required=True, metavar="FLAG=V1,V2,...",
                        help="a training script flag and its values; repeat for more flags (all combinations run)")
    parser.add_argument("--output_dir", default="outputs/sweep", help="one folder per run inside it, and summary.md")
    parser.add_argument("--config_file", default=None, help="accelerate launch config; default: `accelerate config`'s")
    parser.add_argument("--main_process_port", type=int, default=0,
                        help="run i uses this port + i; pick one below the ephemeral range (e.g. 29500): any "
                             "connection may take an ephemeral port; 0: accelerate picks a free port for every run")
    parser.add_argument("command", nargs="+", metavar="SCRIPT [ARGS ...]", help="training script and its fixed flags")
    return parser.parse_args(argv)


def parse_grid(items) -> dict:
    """['learning_rate=1e-3,3e-3'] -> {'learning_rate': ['1e-3', '3e-3']}; the script checks the values."""
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        name = name.strip().lstrip("-")
        values = [v.strip() for v in values.split(",") if v.strip()]
        if not name or not values:
            raise UserError(f"--grid {item!r}: expected FLAG=VALUE[,VALUE...], e.g. --grid learning_rate=1e-3,3e-3")
        if name in grid:
            raise UserError(f"--grid {name} given twice; list all its values in one --grid {name}=V1,V2")
        grid[name] = values
    return grid


def failure_reason(log_file: Path, exit_code: int, start: int = 0) -> str:
    """The run's own one-line error, if it printed one (our scripts do) after byte `start` of its log (where this
    launch began writing), else where to look."""
    text = log_file.read_bytes()[start:].decode(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    return f"failed: {errors[-1][len('error: '):]}" if errors else f"failed (exit {exit_code}): see {log_file}"


def markdown_table(header, rows) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines)


def check_fixed_args(fixed_args) -> None:
    for arg in fixed_args:
        flag = arg.split("=", 1)[0]
        if flag in SET_BY_SWEEP:
            raise UserError(f"{flag} after `--`: the sweep gives every run its own --output_dir (OUTPUT_DIR/NAME) "
                            f"and --resume_from_checkpoint latest; leave {flag} out (the sweep's --output_dir sets "
                            f"OUTPUT_DIR)")


def main(args):
    grid = parse_grid(args.grid)
    script, *fixed_args = args.command
    if not Path(script).is_file():
        raise UserError(f"{script}: no such training script; give it after `--`, e.g. -- scripts/train_mnist.py --cpu")
    flags = script_flags(script)
    check_grid_flags(grid, flags, script)
    check_fixed_args(fixed_args)
    if set(SET_BY_SWEEP) & {f"--{name}" for name in grid}:
        raise UserError(f"--grid: the sweep sets {' and '.join(SET_BY_SWEEP)} itself; grid other flags")
    output_root = Path(args.output_dir)
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]

    trials = []  # (point, folder, command, state): every folder checked before anything runs
    for point in points:
        output_dir = output_root / "-".join(f"{flag}_{value}" for flag, value in point.items())
        script_args = [*fixed_args, "--output_dir", str(output_dir)]
        if "--resume_from_checkpoint" in flags:  # a restart continues from its last checkpoint; a first start has none
            script_args += ["--resume_from_checkpoint", "latest"]
        for flag, value in point.items():
            script_args += [f"--{flag}", value]
        command = trial_command(script, script_args, args.config_file)
        trials.append((point, output_dir, command, trial_state(output_dir, command)))

    rows, failures = [], 0
    for index, (point, output_dir, command, state) in enumerate(trials):
        results_file = output_dir / RESULTS
        port = args.main_process_port + index if args.main_process_port else 0
        # The same Python as this script, so the launcher and the training run in this environment.
        cmd = [sys.executable, "-m", "accelerate.commands.launch"]
        if args.config_file:
            cmd += ["--config_file", args.config_file]
        cmd += ["--main_process_port", str(port), script, *command["args"]]

        if state == "done":
            status = "done before"
        else:
            again = " (again: its last launch did not finish)" if state == "unfinished" else ""
            print(f"[{index + 1}/{len(trials)}] accelerate launch {' '.join(cmd[3:])}{again}", flush=True)
            output_dir.mkdir(parents=True, exist_ok=True)
            record_trial(output_dir, command, exit_code=None)  # started: a rerun resumes it until it ends with 0
            with open(output_dir / "launch.log", "a" if state == "unfinished" else "w") as log:
                start = log.tell()  # an earlier launch's output stays above
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            record_trial(output_dir, command, exit_code=code)
            status = "ok" if code == 0 and results_file.is_file() else \
                failure_reason(output_dir / "launch.log", code, start)
        if status in ("ok", "done before"):
            results = json.loads(results_file.read_text())
            cells = [fmt.format(results[key]) if results.get(key) is not None else "-" for key, fmt in COLUMNS.items()]
        else:
            failures += 1
            cells = ["-"] * len(COLUMNS)
        rows.append([*point.values(), *cells, status])

    table = markdown_table([*grid, *COLUMNS, "status"], rows)
    output_root.mkdir(parents=True, exist_ok=True)
    (output_root / "summary.md").write_text(table + "\n")
    print(table)
    if failures:
        raise UserError(f"{failures} of {len(points)} runs failed (see their launch.log); rerun to retry just those")


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err)
    except KeyboardInterrupt:  # the runs got the Ctrl-C too; their folders say what is left
        exit_with_error("interrupted; run the same command again to skip the finished runs and resume the others",
                        status=130)
