"""Checkpoint folders: `epoch_{n}` / `step_{n}` as in accelerate's examples, written atomically, checked and found.

A checkpoint is complete when its folder carries `training_state.json`, which is written
(before `manifest.json`) once every process has written its files, inside a temporary folder
that is renamed into place. An interrupted save leaves only
a `.tmp-*` folder, which `find_latest_checkpoint` never returns.

Each checkpoint also carries `run.json`, what defines the run that saved it (model, data, seed,
schedule, batch geometry), so that one --output_dir never mixes two runs: see utils/run/run_folder.py.

And `manifest.json`, the size and sha256 of every other file as saved: a resume checks them ('latest'
skips a damaged checkpoint, a named one is refused), and --checkpoints_total_limit keeps the newest
checkpoint that checks out. Files and folders are fsynced before the rename that publishes a
checkpoint, so after a power loss it is either absent or complete. A full disk ends the run with one
line naming the disk, the space needed and the last complete checkpoint, the partial folder removed.
Accelerate's own log lines about the files it saved are made true (AccelerateSaveLines).
"""

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object

from ..errors import UserError
from ..files import write_json_atomically
from ..output_files import MANIFEST, RUN_RECORD, TRAINING_STATE
from ..run.progress import TrainingProgress, read_training_state

CHECKPOINT_NAME = re.compile(r"^(epoch|step)_(\d+)$")
TMP_PREFIX = ".tmp-"
logger = get_logger(__name__)


class AccelerateSaveLines(logging.Filter):
    """Accelerate's info lines about saved files, made true. save_state logs one line per file into the
    temporary folder, renamed a moment later (save_checkpoint then logs one line for the final folder), and
    names sampler.bin, which it writes only for iterable datasets; save_model names pytorch_model.bin when it
    wrote model.safetensors. Those lines are dropped, or pointed at the file that was written; warnings and
    errors always pass. (The objects registered for checkpointing, --model_ema's average, get a line each too.)
    Under FSDP save_state and its helpers (accelerate/utils/fsdp_utils.py) say the same of the model's and the
    optimizer's shard folders, with two lines that name no folder ("Saving FSDP model"), dropped as well."""

    # after Accelerate's "[RANK N] " (its logging adapter's)
    SAVED = re.compile(r"^((?:.* )?(?:saved in|saved to(?: output dir)?|Saving current state to|Saving the state of \S+ "
                       r"to|Saving (?:model|Optimizer state) to) )(\S+)$")
    UNNAMED = re.compile(r"^(?:.* )?Saving FSDP (?:model|Optimizer)$")

    def __init__(self, tmp_prefix: str):
        super().__init__()
        self.tmp_prefix = tmp_prefix  # of the temporary folders that checkpoints are written into

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        match = self.SAVED.match(record.getMessage())
        if match is None:
            return not self.UNNAMED.match(record.getMessage())
        path = Path(match[2])
        if f"/{self.tmp_prefix}" in path.as_posix():
            return False
        if not path.exists() and path.name == "pytorch_model.bin" and path.with_name("model.safetensors").is_file():
            record.msg, record.args = f"{match[1]}{path.with_name('model.safetensors')}", ()
            return True
        return path.exists()


# Installed once, on the loggers of accelerate's modules that save (checkpointing: save_state, accelerator:
# save_model, utils.fsdp_utils: FSDP's shards), so that every save of the scripts is covered, also their final
# save_model.
for _name in ("accelerate.checkpointing", "accelerate.accelerator", "accelerate.utils.fsdp_utils"):
    logging.getLogger(_name).addFilter(AccelerateSaveLines(TMP_PREFIX))


def save_checkpoint(accelerator, output_dir, name: str, progress: TrainingProgress, total_limit=None,
                    write_into=None) -> Path:
    """`accelerator.save_state` (or `write_into(folder)`, called on every process) into a temporary
    folder, then one rename makes it visible. OUTPUT_DIR/run.json (start_output_dir) goes in too, and
    manifest.json last. A full disk (on any process) raises UserError on every process, the partial
    folder removed; --checkpoints_total_limit then deletes old checkpoints (delete_old_checkpoints).

    Collective: every process calls it at the same step (it holds barriers, and each process
    writes its own RNG state); the main process writes training_state.json and renames.
    """
    output_dir = Path(output_dir)
    final, tmp = output_dir / name, output_dir / f"{TMP_PREFIX}{name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was killed
    accelerator.wait_for_everyone()
    failure = None
    try:
        if write_into is None:
            accelerator.save_state(str(tmp))
        else:
            write_into(tmp)
    except Exception as err:  # torch.save, safetensors and pickle each raise their own type on a full disk
        failure = err
    stop_if_any_failed(accelerator, failure, output_dir, tmp)  # also a barrier: every rank has written into tmp
    if accelerator.is_main_process:
        try:
            if (output_dir / RUN_RECORD).is_file():  # which run the checkpoint belongs to, for a resume to check
                shutil.copyfile(output_dir / RUN_RECORD, tmp / RUN_RECORD)
            write_json_atomically(tmp / TRAINING_STATE, dataclasses.asdict(progress))
            write_manifest(tmp)
            publish(tmp, final)
        except Exception as err:
            failure = err
    stop_if_any_failed(accelerator, failure, output_dir, tmp)
    if accelerator.is_main_process:
        logger.info(f"Saved {final}: {', '.join(sorted(path.name for path in final.iterdir()))}")
        if total_limit:
            delete_old_checkpoints(output_dir, total_limit)
    accelerator.wait_for_everyone()
    return final


def sha256_of(path) -> str:
    """In 1 MiB chunks, so memory stays flat whatever the size. sha256 reads roughly 0.5-2 GB/s on one
    core: MNIST's 0.4 MB checkpoints cost milliseconds, a 10 GB one several seconds at the save (main
    process, while the others wait) and again at the resume (every process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder) -> None:
    """The size and sha256 of every file in `folder` (every process's, subfolders included)."""
    folder = Path(folder)
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST)
    write_json_atomically(folder / MANIFEST, {"files": {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": sha256_of(path)}
        for path in files}})


def check_checkpoint(folder):
    """What is wrong with the files of checkpoint `folder`, in a few words, or None when they match its
    manifest.json. A checkpoint saved before manifests existed has none: None too (it loads as before)."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for relative, saved in files.items():  # sizes first: a truncated file is found without reading anything
        path = folder / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != saved["size"]:
            return f"{relative} has {path.stat().st_size} bytes, {saved['size']} when saved"
    for relative, saved in files.items():
        if sha256_of(folder / relative) != saved["sha256"]:
            return f"{relative} differs from its sha256 when saved"
    return None


def fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder too: its fsync makes the names in it durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`, durably: without the fsyncs a power loss soon after the rename could leave
    `final` with empty or missing files (the rename reaches the disk before the data on some filesystems)."""
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before the folders that hold them
        fsync_path(path)
    fsync_path(tmp)
    if final.exists():  # e.g. the same step saved again after a restart
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_path(final.parent)  # the rename itself


def delete_old_checkpoints(output_dir, total_limit: int) -> None:
    """--checkpoints_total_limit: delete all but the newest `total_limit` checkpoints, but never the newest one
    whose files check out: when the newer ones are damaged, a resume needs it. Usually that is the one just
    saved, read back once more here. One with an unreadable training_state.json is left alone."""
    checkpoints = list_checkpoints(output_dir, unreadable=[])
    newest_good = next((folder for folder in reversed(checkpoints) if check_checkpoint(folder) is None), None)
    for old in checkpoints[:-total_limit]:
        if old != newest_good:
            shutil.rmtree(old)


def is_disk_full(error, free: int, needed: int) -> bool:
    """ENOSPC, as pickle and json raise it, or inside safetensors' message; torch.save raises only a C++
    RuntimeError ("basic_ios::clear: iostream error", then "unexpected pos N vs M" in its __exit__), so those
    count when the disk has less than `needed` bytes free."""
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
            return True
        if isinstance(error, RuntimeError) and ("basic_ios::clear" in str(error) or "unexpected pos" in str(error)):
            return free < needed
        error = error.__context__
    return False


def folder_size(folder) -> int:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def space_needed(output_dir, tmp: Path) -> tuple:
    """The last complete checkpoint (or None) and the bytes a new one needs: that one's size, or with none
    yet the partial one's (at least that much)."""
    last = next(reversed(list_checkpoints(output_dir, unreadable=[])), None)
    return last, folder_size(last if last is not None else tmp)


def mount_point(path) -> Path:
    path = Path(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def stop_if_any_failed(accelerator, failure, output_dir: Path, tmp: Path) -> None:
    """Collective (a barrier too): every process learns whether any failed to write checkpoint `tmp`, so that
    all stop together rather than wait for the failed one. A full disk: every process raises UserError with
    the main process's line; another error: the failing process raises it, the others name that process."""
    code = 0
    if failure is not None:
        _, needed = space_needed(output_dir, tmp)
        code = 1 if is_disk_full(failure, shutil.disk_usage(output_dir).free, needed) else 2
    codes = [code] if accelerator.num_processes == 1 else gather_object([code])
    if not any(codes):
        return
    message = None
    if accelerator.is_main_process:
        last, needed = space_needed(output_dir, tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # never half a checkpoint on disk
        if 1 in codes:
            disk = shutil.disk_usage(output_dir)
            estimate = f"about {mib(needed)}, the size of {last.name}" if last else f"over {mib(needed)}"
            kept = f"the last complete checkpoint is {last}" if last else "there is no complete checkpoint yet"
            message = (f"the disk mounted at {mount_point(output_dir)} (holding {output_dir}) is full: "
                       f"{mib(disk.free)} free of {mib(disk.total)}, and saving {tmp.name[len(TMP_PREFIX):]} needs "
                       f"{estimate}; its partial folder was removed and {kept}; free some space or move --output_dir, "
                       f"then continue with --resume_from_checkpoint latest")
    if accelerator.num_processes > 1:
        message = broadcast_object_list([message])[0]
    if code == 2:
        raise failure
    if message is not None:
        raise UserError(message)
    raise UserError(f"process {codes.index(2)} failed to write checkpoint {tmp}: see its error above")


def list_checkpoints(output_dir, unreadable: list | None = None) -> list:
    """Complete checkpoints in `output_dir`, oldest first (by optimizer steps taken). One whose
    training_state.json is unreadable cannot be ordered: UserError, or with an `unreadable` list, added there."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for folder in output_dir.iterdir():
        if CHECKPOINT_NAME.match(folder.name) and (folder / TRAINING_STATE).is_file():
            try:
                progress = read_training_state(folder)
            except UserError:
                if unreadable is None:
                    raise
                unreadable.append(folder)
                continue
            # At equal step counts an end-of-epoch checkpoint is "later" than a step one.
            found.append(((progress.global_step, progress.samples_in_epoch == 0), folder))
    return [folder for _, folder in sorted(found)]


def find_latest_checkpoint(output_dir):
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def main_process_warning(message: str) -> None:
    """One line, from the main process only (the launcher's RANK says which); logging's own stderr handler, not
    Accelerate's logger, so that it works before an Accelerator exists too (as these checkpoint helpers may run)."""
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).warning(message)


def newest_good_checkpoint(output_dir, say_skipped: bool = False):
    """The newest checkpoint in `output_dir` whose files match its manifest (or that has none), or None.
    Every process reads the same files, so all decide the same. `say_skipped`: one line naming those passed over."""
    unreadable = []
    checkpoints = list_checkpoints(output_dir, unreadable)
    skipped = [f"{folder.name} ({check_checkpoint(folder) or f'its {TRAINING_STATE} is unreadable'})"
               for folder in sorted(unreadable)]
    for folder in reversed(checkpoints):
        problem = check_checkpoint(folder)
        if problem is None:
            break
        skipped.append(f"{folder.name} ({problem})")
    else:
        folder = None
    if skipped and say_skipped:
        main_process_warning(f"--resume_from_checkpoint latest: skipping damaged checkpoint {'; '.join(skipped)}; "
                             f"resuming from {folder or 'scratch (no good checkpoint left)'}")
    return folder


def warn_if_unverifiable(checkpoint) -> None:
    if checkpoint is not None and not (Path(checkpoint) / MANIFEST).is_file():
        main_process_warning(f"{checkpoint} has no {MANIFEST} (saved by an older version): its files cannot be "
                             f"checked; loading it as it is")


def step_checkpoint_due(checkpointing_steps, global_step: int) -> bool:
    """--checkpointing_steps N: a checkpoint after every N optimizer steps (not with "epoch" or none)."""
    return isinstance(checkpointing_steps, int) and global_step % checkpointing_steps == 0


