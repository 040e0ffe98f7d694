"""Checkpoint folders: `epoch_{n}` / `step_{n}` as in accelerate's examples, written atomically.

A checkpoint is complete when its folder carries `training_state.json`, which is written
last, inside a temporary folder that is renamed into place. An interrupted save leaves only
a `.tmp-*` folder, which `find_latest_checkpoint` never returns.
"""

import json
import re
import shutil
from pathlib import Path

from utils.errors import UserError
from utils.results import write_json_atomically

TRAINING_STATE = "training_state.json"
CHECKPOINT_NAME = re.compile(r"^(epoch|step)_(\d+)$")
TMP_PREFIX = ".tmp-"


def save_checkpoint(accelerator, output_dir, name: str, training_state: dict, total_limit=None) -> Path:
    """`accelerator.save_state` into a temporary folder, then one rename makes it visible.

    Every process calls this: each writes its own RNG state into the folder.
    """
    output_dir = Path(output_dir)
    final, tmp = output_dir / name, output_dir / f"{TMP_PREFIX}{name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank has finished writing into tmp
    if accelerator.is_main_process:
        write_json_atomically(tmp / TRAINING_STATE, training_state)
        if final.exists():  # e.g. the same step saved again after a restart
            shutil.rmtree(final)
        tmp.rename(final)
        if total_limit:
            for old in list_checkpoints(output_dir)[:-total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def read_training_state(checkpoint) -> dict:
    path = Path(checkpoint) / TRAINING_STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{checkpoint} is not a complete checkpoint (no {TRAINING_STATE}); pass an epoch_N or "
            f"step_N folder written by these scripts, or --resume_from_checkpoint latest"
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({type(err).__name__}); resume from another checkpoint") from None


def list_checkpoints(output_dir) -> list:
    """Complete checkpoints in `output_dir`, oldest first (by optimizer steps taken)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for folder in output_dir.iterdir():
        if CHECKPOINT_NAME.match(folder.name) and (folder / TRAINING_STATE).is_file():
            state = read_training_state(folder)
            # At equal step counts an end-of-epoch checkpoint is "later" than a step one.
            found.append(((state["global_step"], state["batches_in_epoch"] == 0), folder))
    return [folder for _, folder in sorted(found)]


def find_latest_checkpoint(output_dir):
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(resume_from_checkpoint, output_dir, eval_only: bool = False):
    """What `--resume_from_checkpoint {latest,PATH}` points at: a folder, or None to start fresh.

    'latest' with nothing saved yet means a first start (one command line serves the first
    start and every restart); --eval_only has nothing to evaluate then.
    """
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "latest":
        checkpoint = find_latest_checkpoint(output_dir)
        if checkpoint is None and eval_only:
            raise UserError(f"--eval_only: no complete checkpoint in {output_dir}; pass a checkpoint folder")
        return checkpoint
    checkpoint = Path(resume_from_checkpoint)
    if not checkpoint.is_dir():
        raise UserError(f"--resume_from_checkpoint {checkpoint}: no such folder; pass a checkpoint folder or 'latest'")
    return checkpoint
