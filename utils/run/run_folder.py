"""One run per --output_dir, and one training at a time in it.

A folder holds one run: its checkpoints, best/, model.safetensors, results.json and run.json. check_output_dir
decides, before anything is written, whether a command may train into it: a new run refuses a folder holding
another run's files (unless --overwrite_output_dir, which start_output_dir acts on), a resume refuses another run's
checkpoint. The same command again is never refused: where results.json reports that very run finished (its
record, results.json's `run`, equals the command's), nothing_left_to_train says so and the script writes nothing;
where the run has not finished, --resume_from_checkpoint latest continues it.

one_training_at_a_time: the main process holds a lock on OUTPUT_DIR/run.lock for the run's lifetime, so that two
trainings never write into one folder at once (a restart while the first still runs, two sweeps, a launcher that
died and left its training running). The kernel drops the lock with the process, so a crash or SIGKILL never leaves
it stuck.
"""

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from accelerate.logging import get_logger

from ..errors import UserError
from ..files import create_output_dir, write_json_atomically
from ..output_files import BEST, EMA_WEIGHTS, EVAL_RESULTS, LOCK, RESULTS, RUN_RECORD, TRAINING_STATE, WEIGHTS
from ..run.checkpoints import CHECKPOINT_NAME, TMP_PREFIX, list_checkpoints, main_process_warning
from ..run.progress import TrainingProgress
from ..run.run_record import RESUMABLE_KEYS, read_run_record

# What a run leaves in --output_dir besides its checkpoints; --overwrite_output_dir deletes them with those.
RUN_FILES = (WEIGHTS, EMA_WEIGHTS, RUN_RECORD, RESULTS, EVAL_RESULTS)
logger = get_logger(__name__)


def command_record(run: dict, epochs, max_steps, early_stopping_patience) -> dict:
    """What a finished run's record must equal for a command to be that run again: `run` (the script's
    describe_run()) and the run's length, which a command may change from one start to the next of one run
    (train_mnist.py's `run` holds epochs and max_steps itself)."""
    return {**run, "epochs": epochs, "max_steps": max_steps, "early_stopping_patience": early_stopping_patience}


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """--output_dir as a command means to use it: for the run `run` (the script's describe_run()) of a length (--epochs,
    --max_steps, --early_stopping_patience); `overwrite`: --overwrite_output_dir deletes an earlier run's files first;
    `eval_only`: --eval_only writes eval_results.json only, so the folder is neither checked nor recorded."""

    path: Path
    run: dict
    epochs: int
    max_steps: int | None = None
    early_stopping_patience: int | None = None
    overwrite: bool = False
    eval_only: bool = False

    @property
    def record(self) -> dict:
        """What a finished run's record must equal for this command to be that run again."""
        return command_record(self.run, self.epochs, self.max_steps, self.early_stopping_patience)


def differences(recorded: dict, expected: dict) -> list:
    """`key old -> new` for each key of `expected` whose recorded value differs, and for each key only `recorded`
    has (a run with --model_ema against one without), bar those a resume may change."""
    keys = [*expected, *(key for key in recorded if key not in expected and key not in RESUMABLE_KEYS)]
    return [f"{key} {recorded.get(key)!r} -> {expected.get(key)!r}" for key in keys
            if recorded.get(key) != expected.get(key)]


def read_results(output_dir) -> dict | None:
    """OUTPUT_DIR/results.json (written when a run ends), or None where there is none or it is unreadable."""
    try:
        results = json.loads((Path(output_dir) / RESULTS).read_text())
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) else None


def finished_here(output_dir, record: dict) -> dict | None:
    """The results.json of the run `record` describes, when it finished in `output_dir`, else None. results.json
    carries the run.json of the run that wrote it (`run`): a run.json alone would not tell, as a continuation
    (a higher --epochs) rewrites it when it starts and may die before it writes its own results."""
    results = read_results(output_dir)
    recorded = results.get("run") if results else None
    return results if isinstance(recorded, dict) and not differences(recorded, record) else None


def run_files_held(output_dir) -> list:
    """The names of what a run left in `output_dir` that a new run must not mix with: checkpoints (damaged ones
    too), best/, the final weights and results."""
    output_dir = Path(output_dir)
    unreadable = []  # those whose training_state.json cannot be read: a run's all the same
    checkpoints = [folder.name for folder in list_checkpoints(output_dir, unreadable) + sorted(unreadable)]
    best = [BEST] if (output_dir / BEST / TRAINING_STATE).is_file() else []
    files = [name for name in (WEIGHTS, EMA_WEIGHTS, RESULTS) if (output_dir / name).is_file()]
    return checkpoints + best + files


def check_output_dir(folder: RunFolder, checkpoint, resume_from_checkpoint) -> None:
    """Before anything is written (every process reads the same files and decides the same): one --output_dir never
    mixes two runs. The folder's own run, finished (results.json's record equals this command's), passes:
    nothing_left_to_train then says so. A run that does not continue its own checkpoints refuses a folder holding
    another run's files (run_files_held), or this run's checkpoints without --resume_from_checkpoint latest; a
    restart with 'latest' before the first good checkpoint passes where the folder's run.json is this run's and it
    has not finished. --overwrite_output_dir passes (start_output_dir deletes the old run). A resume refuses a
    checkpoint whose run.json differs from `folder.run` (what cannot change: the caller's describe_run()). --eval_only
    writes only eval_results.json and is not checked."""
    if folder.eval_only or folder.overwrite:
        return
    output_dir, run, record = Path(folder.path), folder.run, folder.record
    if finished_here(output_dir, record):
        return
    continuing_here = checkpoint is not None and Path(checkpoint).resolve().parent == output_dir.resolve()
    held = [] if continuing_here else run_files_held(output_dir)
    if held:
        results = read_results(output_dir)
        # the record of what is there: results.json's, else run.json, else best/'s (a run that kept only best/)
        recorded = ((results or {}).get("run") or read_run_record(output_dir) or read_run_record(output_dir / BEST)
                    or {})
        changed = differences(recorded, record if results else run)
        unfinished_restart = (checkpoint is None and resume_from_checkpoint == "latest" and not changed
                              and results is None and not (output_dir / WEIGHTS).exists())
        if not unfinished_restart:
            raise UserError(refusal(output_dir, held, changed, checkpoint, finished=results is not None))
    if checkpoint is None:
        return
    recorded = read_run_record(checkpoint)
    if recorded is None:
        main_process_warning(f"{checkpoint} has no {RUN_RECORD} (saved by an older version): cannot check that it is "
                             f"of this run")
        return
    changed = differences(recorded, run)
    if changed:
        raise UserError(f"{checkpoint} was saved by a different run ({'; '.join(changed)}); resume with its "
                        f"values, or start a new run in another --output_dir")


def refusal(output_dir: Path, held: list, changed: list, checkpoint, finished: bool) -> str:
    """The one line that refuses to train into `output_dir`, which holds `held` of a run: this run's unfinished
    checkpoints (`changed` empty), or another run's, finished or not (`changed`: how it differs, where known)."""
    if checkpoint is not None:
        fix = f"continue {checkpoint} in another --output_dir"
    elif not changed and not finished:
        return (f"--output_dir {output_dir} already holds this run's checkpoints ({', '.join(held)}); continue it with "
                f"--resume_from_checkpoint latest, or pass --overwrite_output_dir to delete them and start afresh")
    else:
        fix = "pass --overwrite_output_dir to delete them and start afresh, or choose another --output_dir"
    whose = f"{'a finished' if finished else 'another'} run's files"
    return (f"--output_dir {output_dir} already holds {whose} ({', '.join(held)})"
            f"{' of other flags: ' + '; '.join(changed) if changed else ''}; {fix}")


def start_output_dir(folder: RunFolder, progress: TrainingProgress, batch_size: int, accumulation: int) -> None:
    """Main process, once data, model and checkpoint are known good: creates --output_dir. --overwrite_output_dir
    first deletes what an earlier run left there (checkpoints, best/, .tmp-* folders, RUN_FILES), so that
    'latest' can never pick it up. Then a training run records itself in OUTPUT_DIR/run.json: `folder.run` plus what
    may change on a resume (the process count, the batch split: `batch_size` per process, `accumulation` steps, the
    run's length where `run` leaves it out, as train_image_classifier.py's does), which its checkpoints copy and its
    results.json carries."""
    output_dir = Path(folder.path)
    if folder.overwrite and output_dir.is_dir():
        deleted = []
        for path in sorted(output_dir.iterdir()):
            if CHECKPOINT_NAME.match(path.name) or path.name == BEST or path.name.startswith(TMP_PREFIX):
                shutil.rmtree(path)
            elif path.name in RUN_FILES:
                path.unlink()
            else:
                continue
            deleted.append(path.name)
        if deleted:
            logger.info(f"--overwrite_output_dir: deleted {', '.join(deleted)} in {output_dir}", main_process_only=True)
    create_output_dir(output_dir)
    if not folder.eval_only:
        write_json_atomically(output_dir / RUN_RECORD, {
            **folder.record,
            "num_processes": progress.num_processes,
            "batch_size_per_process": batch_size,
            "gradient_accumulation_steps": accumulation,
            "global_batch_size": progress.global_batch_size,
        })


def nothing_left_to_train(folder: RunFolder, progress: TrainingProgress, checkpoint, metric_for_best) -> bool:
    """Whether this command has nothing to train: says so in one line (main process), and the caller then ends with
    status 0 and writes nothing, so model.safetensors, results.json and run.json stay those of the run that trained
    them (a finished run started again by a restart loop, a requeue or a sweep).

    By the run's record: --output_dir holds this very run, finished (finished_here), whatever its last checkpoint
    (with --checkpointing_steps N it may be several steps before the end) and with or without
    --resume_from_checkpoint. By the checkpoint resumed from: --epochs epochs ended, or --max_steps optimizer steps
    done, or --early_stopping_patience spent (with train_image_classifier.py also a lower --epochs or --max_steps).
    A checkpoint saved after the last step but before the end of its epoch (--checkpointing_steps N, a signal) still
    has that end to do, the final evaluation and the report, unless results.json says it was done."""
    if folder.eval_only or folder.overwrite:
        return False
    if checkpoint is not None and checkpoint_is_at_the_end(folder, progress, checkpoint, metric_for_best):
        return True
    results = finished_here(folder.path, folder.record)
    if results is None:
        return False
    return say_nothing_left(
        f"{Path(folder.path) / RESULTS} reports this run finished after step {results.get('global_step')}",
        "train_image_classifier.py continues from the last checkpoint with a higher --epochs or --max_steps; to train "
        "it again, --overwrite_output_dir or another --output_dir")


def checkpoint_is_at_the_end(folder: RunFolder, progress: TrainingProgress, checkpoint, metric_for_best) -> bool:
    """nothing_left_to_train by the checkpoint resumed from; says so."""
    ended = progress.samples_in_epoch == 0 or reported_after(folder.path, progress.global_step)
    if folder.max_steps is None and progress.epoch >= folder.epochs:
        done = f"has {progress.epoch} epochs done (step {progress.global_step}) and --epochs is {folder.epochs}"
        flag = "--epochs"
    elif folder.max_steps is not None and (progress.global_step > folder.max_steps or
                                           progress.global_step == folder.max_steps and ended):
        done = f"has {progress.global_step} optimizer steps done and --max_steps is {folder.max_steps}"
        flag = "--max_steps"
    elif ended and folder.early_stopping_patience is not None and \
            progress.evaluations_without_improvement >= folder.early_stopping_patience:
        return say_nothing_left(f"{checkpoint} stopped early: {metric_for_best} has not improved for "
                                f"{progress.evaluations_without_improvement} evaluations (--early_stopping_patience "
                                f"{folder.early_stopping_patience})", "a higher --early_stopping_patience")
    else:
        return False
    return say_nothing_left(f"{checkpoint} {done}", f"train_image_classifier.py takes a higher {flag}; "
                            f"train_mnist.py's run includes its {flag}, so start a new run in another --output_dir")


def reported_after(output_dir, step: int) -> bool:
    """OUTPUT_DIR/results.json is that of a run that ended after optimizer step `step`."""
    return (read_results(output_dir) or {}).get("global_step") == step


def say_nothing_left(why: str, to_train_further: str) -> bool:
    logger.info(f"Nothing left to train: {why}; model.safetensors and results.json left as they are (to train "
                f"further: {to_train_further})", main_process_only=True)
    return True


@contextlib.contextmanager
def one_training_at_a_time(output_dir, eval_only: bool):
    """Held around a training run by its main process (RANK 0, or no launcher): an exclusive lock on
    OUTPUT_DIR/run.lock, or one `error:` line naming the process that holds it. --eval_only (it writes only
    eval_results.json) and the other processes take none. On several machines only the main process's machine is
    locked: the other machines' processes write into their own --output_dir only where it is another disk, and then
    only their part of each checkpoint, which the main process's lock covers in effect.

    fcntl.lockf (a POSIX lock) rather than flock: it belongs to this process alone, where DataLoader workers and
    other forked children would share a flock and keep it past a crash; it also works on NFS. The kernel drops it
    when the process ends, however it ends. A folder this call created, left holding only run.lock (the run stopped
    with an error before writing), is removed again."""
    if eval_only or os.environ.get("RANK", "0") != "0":
        yield
        return
    output_dir = Path(output_dir)
    created = not output_dir.exists()
    create_output_dir(output_dir)
    path = output_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise UserError(f"cannot write into --output_dir {output_dir} ({err.strerror}); choose a writable "
                        f"folder") from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "which has not written its name yet"
            raise UserError(f"--output_dir {output_dir} is in use by another training ({holder}); wait for it to end "
                            f"or stop it, or choose another --output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # empty: no training holds it
            if created and [entry.name for entry in output_dir.iterdir()] == [LOCK]:
                path.unlink()  # while still locked: a training starting now makes its own
                with contextlib.suppress(OSError):
                    output_dir.rmdir()
    finally:
        os.close(fd)  # releases the lock
