"""Checkpoint folders: `epoch_{n}` / `step_{n}` as in accelerate's examples, written atomically.

A checkpoint is complete when its folder carries `training_state.json`, which is written
(before `manifest.json`) once every process has written its files, inside a temporary folder
that is renamed into place. An interrupted save leaves only
a `.tmp-*` folder, which `find_latest_checkpoint` never returns.

Each checkpoint also carries `run.json`, what defines the run that saved it (model, data, seed,
schedule, batch geometry), so that one --output_dir never mixes two runs: see check_output_dir.

And `manifest.json`, the size and sha256 of every other file as saved: a resume checks them ('latest'
skips a damaged checkpoint, a named one is refused), and --checkpoints_total_limit keeps the newest
checkpoint that checks out. Files and folders are fsynced before the rename that publishes a
checkpoint, so after a power loss it is either absent or complete. A full disk ends the run with one
line naming the disk, the space needed and the last complete checkpoint, the partial folder removed.
"""

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import load_file

from utils.ema import EMA_WEIGHTS
from utils.errors import UserError
from utils.flags import HIGHER_IS_BETTER
from utils.results import (
    EVAL_RESULTS,
    RESUMABLE_KEYS,
    RUN_RECORD,
    create_output_dir,
    read_run_record,
    write_json_atomically,
)

TRAINING_STATE = "training_state.json"
MANIFEST = "manifest.json"  # {"files": {relative path: {"size", "sha256"}}} of every other file, written last
BEST = "best"  # --metric_for_best: OUTPUT_DIR/best holds the best epoch's model.safetensors and training state
CHECKPOINT_NAME = re.compile(r"^(epoch|step)_(\d+)$")
TMP_PREFIX = ".tmp-"
# What a run leaves in --output_dir besides its checkpoints; --overwrite_output_dir deletes them with those.
RUN_FILES = ("model.safetensors", EMA_WEIGHTS, RUN_RECORD, "results.json", EVAL_RESULTS)
logger = get_logger(__name__)


class AccelerateSaveLines(logging.Filter):
    """Accelerate's info lines about saved files, made true. save_state logs one line per file into the
    temporary folder, renamed a moment later (save_checkpoint then logs one line for the final folder), and
    names sampler.bin, which it writes only for iterable datasets; save_model names pytorch_model.bin when it
    wrote model.safetensors. Those lines are dropped, or pointed at the file that was written; warnings and
    errors always pass. (The objects registered for checkpointing, --model_ema's average, get a line each too.)"""

    SAVED = re.compile(r"^(.* (?:saved in|Saving current state to|Saving the state of \S+ to) )(\S+)$")

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.SAVED.match(record.getMessage()) if record.levelno < logging.WARNING else None
        if match is None:
            return True
        path = Path(match[2])
        if f"/{TMP_PREFIX}" in path.as_posix():
            return False
        if not path.exists() and path.name == "pytorch_model.bin" and path.with_name("model.safetensors").is_file():
            record.msg, record.args = f"{match[1]}{path.with_name('model.safetensors')}", ()
            return True
        return path.exists()


# Installed once, on the loggers of accelerate's modules that save (checkpointing: save_state, accelerator:
# save_model), so that every save of the scripts is covered, also their final save_model.
for _name in ("accelerate.checkpointing", "accelerate.accelerator"):
    logging.getLogger(_name).addFilter(AccelerateSaveLines())


@dataclasses.dataclass
class TrainingProgress:
    """Where a run stands, all processes together; saved as training_state.json in every checkpoint.

    Counted in samples, not batches, so that a run can resume on another number of processes.
    """

    epoch: int = 0  # the epoch in progress (at an epoch boundary: the next one)
    global_step: int = 0  # optimizer steps taken, fp16-skipped ones included
    samples_seen: int = 0  # training samples processed over the whole run
    samples_in_epoch: int = 0  # of those, in the epoch in progress
    epoch_loss_sum: float = 0.0  # sum of the per-sample training losses of the epoch in progress
    optimizer_steps_skipped: int = 0  # fp16 steps the GradScaler skipped (overflowing gradients)
    num_processes: int = 1  # of the run that saved it
    global_batch_size: int = 0  # samples per optimizer step: processes x batch size x accumulation steps
    best_epoch: int = -1  # --metric_for_best: the epoch of the best evaluation so far (-1: none yet)
    best_metric: float | None = None  # and its value
    # Added later (ADDED_FIELDS): a checkpoint saved before them loads without them (read_training_state)
    # the per-sample training accuracies of the epoch in progress (RunningLoss); None: resumed mid-epoch from a
    # checkpoint saved before they were summed
    epoch_accuracy_sum: float | None = 0.0
    best_step: int = -1  # the optimizer step after which the best evaluation was (-1: none yet, or not recorded)
    evaluations_without_improvement: int = 0  # since the best one (--early_stopping_patience counts them)
    logging_loss_sum: float = 0.0  # --logging_steps: the per-sample training losses since the last log
    logging_samples: int = 0  # and their number

    def add(self, loss_sum: float, samples: int, accuracy_sum: float) -> None:
        """Fold in the losses, accuracies and sample count of every process since the last call: into the epoch's
        sums, and its losses into those of the next --logging_steps log."""
        self.epoch_loss_sum += loss_sum
        if self.epoch_accuracy_sum is not None:
            self.epoch_accuracy_sum += accuracy_sum
        self.samples_in_epoch += samples
        self.samples_seen += samples
        self.logging_loss_sum += loss_sum
        self.logging_samples += samples

    def take_logged_loss(self) -> float:
        """--logging_steps: the mean training loss since the last call (over epoch ends too); the sums restart."""
        mean_loss = self.logging_loss_sum / max(1, self.logging_samples)
        self.logging_loss_sum, self.logging_samples = 0.0, 0
        return mean_loss

    def with_batch(self, num_processes: int, batch_size: int, accumulation: int) -> "TrainingProgress":
        """A copy that records this run's process count and global batch (what its checkpoints will say)."""
        return dataclasses.replace(self, num_processes=num_processes,
                                   global_batch_size=num_processes * batch_size * accumulation)

    def steps_per_epoch(self, num_samples: int, batch_size: int, whole_global_batches: bool) -> int:
        """The length of an epoch in optimizer steps, for `num_samples` training samples and the global batch
        recorded by `with_batch`. whole_global_batches: the epoch ends after its last whole global batch (the same
        steps on any number of processes); otherwise every sample is trained, the last batches padded by
        Accelerate's even_batches and the last accumulation cycle cut short at the end of the data."""
        if whole_global_batches:
            steps = num_samples // self.global_batch_size
        else:
            batches_per_process = math.ceil(num_samples / (self.num_processes * batch_size))
            steps = math.ceil(batches_per_process / (self.global_batch_size // (self.num_processes * batch_size)))
        if steps == 0:
            raise UserError(f"{num_samples} training samples are fewer than one global batch "
                            f"({self.global_batch_size}); lower --batch_size or --gradient_accumulation_steps")
        return steps

    def end_epoch(self) -> dict:
        """The epoch's mean training loss and accuracy (None: see epoch_accuracy_sum); the progress then points at
        the next epoch. An epoch the run ended inside (--max_steps, --early_stopping_patience at --eval_steps) ends
        too: its means are those of the samples trained."""
        samples, accuracy_sum = max(1, self.samples_in_epoch), self.epoch_accuracy_sum
        means = {"train_loss": self.epoch_loss_sum / samples,
                 "train_accuracy": accuracy_sum / samples if accuracy_sum is not None else None}
        self.epoch, self.samples_in_epoch, self.epoch_loss_sum, self.epoch_accuracy_sum = self.epoch + 1, 0, 0.0, 0.0
        return means


ADDED_FIELDS = ("epoch_accuracy_sum", "best_step", "evaluations_without_improvement", "logging_loss_sum",
                "logging_samples")


def gather_running_loss(accelerator, running_loss, progress: TrainingProgress, output_dir) -> None:
    """Collective: every process calls it at the same step. Adds the losses, accuracies and samples of all
    processes since the last call to `progress`. Without a GradScaler (fp32, bf16) a non-finite loss
    ends the run here, naming its step: the weights are lost (fp16's scaler skips such steps)."""
    rows = accelerator.gather(running_loss.take().unsqueeze(0)).cpu()  # one row per process
    progress.add(rows[:, 0].sum().item(), int(rows[:, 1].sum().item()), rows[:, 4].sum().item())
    nonfinite = rows[rows[:, 2] >= 0]
    if accelerator.scaler is None and len(nonfinite):
        step, loss = nonfinite[nonfinite[:, 2].argmin(), 2:4].tolist()
        # A resume restores the checkpoint's learning rate with the optimizer state: a lower one needs a new run
        raise UserError(f"the loss became {loss} at step {int(step)} (epoch {progress.epoch}); last good checkpoint: "
                        f"{newest_good_checkpoint(output_dir) or 'none'}; resume from it with --max_grad_norm, or "
                        f"start afresh with a lower --learning_rate and --overwrite_output_dir")


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


def load_checkpoint(accelerator, model, checkpoint, progress: TrainingProgress, args) -> None:
    """Collective: `accelerator.load_state` (every process reads the weights, optimizer, scheduler,
    GradScaler, the objects registered for checkpointing (--model_ema's average) and its own RNG states), with
    one clear line when the folder does not fit the run.
    The weights-only folder `best` (--eval_only) loads into `model` alone.
    No checkpoint (None): a fresh start, said so when --resume_from_checkpoint latest found none."""
    if checkpoint is None:
        if args.resume_from_checkpoint == "latest":
            logger.info(f"No checkpoint in {args.output_dir} yet: starting from scratch", main_process_only=True)
        return
    try:
        if Path(checkpoint).name == BEST:
            # imported here: only this path needs it, and at the top it would cost --help and every process's start
            # about half a second (it imports torch._dynamo, which prepare() has loaded by the time it runs here)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # The plain weights, as save_model wrote them; full_state_dict: the same call loads them into an
            # FSDP-sharded model (each process keeps its shard), a DDP-wrapped or a compiled one.
            set_model_state_dict(accelerator.unwrap_model(model), load_file(Path(checkpoint) / "model.safetensors"),
                                 options=StateDictOptions(full_state_dict=True))
        else:
            accelerator.load_state(str(checkpoint))
    except Exception as err:  # torch.load, safetensors and shape mismatches raise many types
        raise UserError(f"cannot load checkpoint {checkpoint} ({type(err).__name__}); it is corrupt or from "
                        f"another model") from None
    logger.info(f"Resumed from {checkpoint}: epoch {progress.epoch}, step {progress.global_step}, "
                f"{progress.samples_in_epoch} samples into the epoch", main_process_only=True)


def save_if_best(accelerator, model, progress: TrainingProgress, results: dict, epoch: int, args, ema=None) -> bool:
    """--metric_for_best, after an evaluation in (or at the end of) epoch `epoch`: when `results` beat the best so far,
    record them in `progress` and write the plain weights (as the final model.safetensors) and the progress to
    OUTPUT_DIR/best, atomically; otherwise count one more evaluation without improvement. The weights are those the
    metric measured: for eval_ema_accuracy or eval_ema_loss, --model_ema's average `ema` (as best/model.safetensors
    all the same, so that best/ is used as it always is). Collective when it saves (gathers FSDP shards); `results`
    are the same on every process, so every process decides the same."""
    if args.metric_for_best is None:
        return False
    value, best = results[args.metric_for_best], progress.best_metric
    if best is not None and not (value > best if HIGHER_IS_BETTER[args.metric_for_best] else value < best):
        progress.evaluations_without_improvement += 1
        return False
    progress.best_epoch, progress.best_step, progress.best_metric = epoch, progress.global_step, value
    progress.evaluations_without_improvement = 0
    if args.metric_for_best.startswith("eval_ema_"):
        plain_model = ema.module
    else:
        plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)
    saved = save_checkpoint(accelerator, args.output_dir, BEST, progress,
                            write_into=lambda folder: accelerator.save_model(plain_model, folder))
    logger.info(f"step {progress.global_step} (epoch {epoch}): best {args.metric_for_best} so far ({value:.4f}), "
                f"saved to {saved}", main_process_only=True)
    return True


def epochs_to_train(accelerator, progress: TrainingProgress, args, max_steps: int):
    """The epochs left, from the checkpoint's (or 0), until `max_steps` optimizer steps are done (--max_steps, or
    --epochs whole epochs) and the last epoch has ended (also one the run ended inside, so that a resume from a
    checkpoint saved at its last step still evaluates and reports it); none with --eval_only. --early_stopping_patience
    ends them once --metric_for_best has not improved for that many evaluations (also when a resume finds it so).
    The main process decides and Accelerate's trigger tells the others (one tiny all-reduce per epoch), so all
    processes stop after the same epoch even if their metrics differed in the last bit. (Inside an epoch, with
    --eval_steps, StepPlan.training_over ends it: every process counts the evaluations of the same gathered metrics.)"""
    while not args.eval_only:
        if progress.samples_in_epoch == 0:  # at an epoch's start (every process decides the same)
            if progress.global_step >= max_steps:
                return
            if args.early_stopping_patience is not None:
                if accelerator.is_main_process and \
                        progress.evaluations_without_improvement >= args.early_stopping_patience:
                    accelerator.set_trigger()  # [accelerate]
                if accelerator.check_trigger():  # [accelerate] a collective: True everywhere if any process set it
                    logger.info(f"Stopping early: {args.metric_for_best} has not improved for "
                                f"{progress.evaluations_without_improvement} evaluations (best: "
                                f"{progress.best_metric:.4f} after step {progress.best_step}, epoch "
                                f"{progress.best_epoch})", main_process_only=True)
                    return
        yield progress.epoch


def read_training_state(checkpoint) -> TrainingProgress:
    path = Path(checkpoint) / TRAINING_STATE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{checkpoint} is not a complete checkpoint (no {TRAINING_STATE}); pass an epoch_N or "
            f"step_N folder written by these scripts, or --resume_from_checkpoint latest"
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({type(err).__name__}); resume from another checkpoint") from None
    fields = {field.name for field in dataclasses.fields(TrainingProgress)}
    if not isinstance(saved, dict) or not fields - set(ADDED_FIELDS) <= set(saved) <= fields:
        raise UserError(f"{path} is not in this version's layout (expected the keys {sorted(fields)}); resume from a "
                        f"checkpoint written by these scripts, or start afresh in another --output_dir") from None
    # The fields an older checkpoint lacks, where their defaults would be wrong (the others take them):
    if "epoch_accuracy_sum" not in saved and saved["samples_in_epoch"] > 0:
        saved["epoch_accuracy_sum"] = None  # part of the epoch went unsummed: its accuracy is unknown
    if "evaluations_without_improvement" not in saved and saved["best_epoch"] >= 0:
        # by a run that evaluated after every epoch: the epochs ended since the best
        saved["evaluations_without_improvement"] = saved["epoch"] - 1 - saved["best_epoch"]
    return TrainingProgress(**saved)


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


def resolve_checkpoint(resume_from_checkpoint, output_dir, eval_only: bool = False):
    """What `--resume_from_checkpoint {latest,PATH}` points at: a folder, or None to start fresh.

    'latest' with nothing saved yet means a first start (one command line serves the first
    start and every restart); --eval_only has nothing to evaluate then.
    """
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == BEST:
        checkpoint = Path(output_dir) / BEST
        if not (checkpoint / TRAINING_STATE).is_file():
            raise UserError(f"--resume_from_checkpoint best: no {checkpoint} with {TRAINING_STATE}; train with "
                            f"--metric_for_best (or --early_stopping_patience) first")
        return checkpoint
    if resume_from_checkpoint == "latest":
        checkpoint = newest_good_checkpoint(output_dir, say_skipped=True)
        if checkpoint is None and eval_only:
            raise UserError(f"--eval_only: no complete checkpoint in {output_dir}; pass a checkpoint folder")
        warn_if_unverifiable(checkpoint)
        return checkpoint
    checkpoint = Path(resume_from_checkpoint)
    if not checkpoint.is_dir():
        raise UserError(f"--resume_from_checkpoint {checkpoint}: no such folder; pass a checkpoint folder or 'latest'")
    if checkpoint.name == BEST and not eval_only:  # the literal 'best' is refused already by the flag checks
        raise UserError(f"{checkpoint} holds the best weights only (no optimizer state): evaluate them with "
                        f"--eval_only, or resume training from 'latest' or a step_N/epoch_N folder")
    problem = check_checkpoint(checkpoint)
    if problem is not None:
        good = newest_good_checkpoint(checkpoint.parent)
        fix = f"resume from the newest good one, {good}" if good else "no good checkpoint is left beside it"
        raise UserError(f"checkpoint {checkpoint} is damaged ({problem}); {fix}")
    warn_if_unverifiable(checkpoint)
    return checkpoint


def main_process_warning(message: str) -> None:
    """One line, from the main process only, before the Accelerator exists (the launcher's RANK says which);
    logging's own stderr handler, as the Accelerator's logger does not exist yet either."""
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


def check_output_dir(run: dict, checkpoint, args) -> None:
    """Before anything is written (every process reads the same files and decides the same): one --output_dir
    never mixes two runs. A run that does not continue its own checkpoints refuses a folder holding checkpoints
    (unless --overwrite_output_dir, which start_output_dir then acts on); a resume refuses a checkpoint whose
    run.json differs from `run` (what cannot change: the caller's describe_run()). --eval_only writes only
    eval_results.json and is not checked."""
    if args.eval_only:
        return
    output_dir = Path(args.output_dir)
    continuing_here = checkpoint is not None and Path(checkpoint).resolve().parent == output_dir.resolve()
    # 'latest' that found nothing is a first start (or a restart before the first checkpoint): nothing to mix
    fresh_start = checkpoint is None and args.resume_from_checkpoint == "latest"
    if not (continuing_here or fresh_start or args.overwrite_output_dir):
        held = [folder.name for folder in [*list_checkpoints(output_dir), output_dir / BEST]
                if (folder / TRAINING_STATE).is_file()]
        if held:
            fix = ("continue that run with --resume_from_checkpoint latest, or pass --overwrite_output_dir to delete "
                   "them and start afresh" if checkpoint is None else f"continue {checkpoint} in another --output_dir")
            raise UserError(f"--output_dir {output_dir} already holds another run's checkpoints "
                            f"({', '.join(held)}); {fix}")
    if checkpoint is None:
        return
    recorded = read_run_record(checkpoint)
    if recorded is None:  # logging's own stderr handler: the Accelerator, and so its logger, does not exist yet
        logging.getLogger(__name__).warning(
            f"{checkpoint} has no {RUN_RECORD} (saved by an older version): cannot check that it is of this run")
        return
    # also the keys only the checkpoint's run has (a resume that drops --model_ema), bar those a resume may change
    keys = [*run, *(key for key in recorded if key not in run and key not in RESUMABLE_KEYS)]
    differences = [f"{key} {recorded.get(key)!r} -> {run.get(key)!r}" for key in keys
                   if recorded.get(key) != run.get(key)]
    if differences:
        raise UserError(f"{checkpoint} was saved by a different run ({'; '.join(differences)}); resume with its "
                        f"values, or start a new run in another --output_dir")


def start_output_dir(args, run: dict, progress: TrainingProgress) -> None:
    """Main process, once data, model and checkpoint are known good: creates --output_dir. --overwrite_output_dir
    first deletes what an earlier run left there (checkpoints, best/, .tmp-* folders, RUN_FILES), so that
    'latest' can never pick it up. Then a training run records itself in OUTPUT_DIR/run.json: `run` plus what may
    change on a resume (the process count, the batch split, and --epochs and --max_steps where `run` leaves them out,
    as train_image_classifier.py's does), which its checkpoints copy."""
    output_dir = Path(args.output_dir)
    if args.overwrite_output_dir and output_dir.is_dir():
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
    if not args.eval_only:
        write_json_atomically(output_dir / RUN_RECORD, {
            **run,
            "epochs": args.epochs,
            "max_steps": args.max_steps,
            "num_processes": progress.num_processes,
            "batch_size_per_process": args.batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "global_batch_size": progress.global_batch_size,
        })


def nothing_left_to_train(progress: TrainingProgress, checkpoint, args) -> bool:
    """A resume from a checkpoint at or past the run's end (a finished run started again by a restart loop or a
    requeue; with train_image_classifier.py also a lower --epochs or --max_steps): --epochs epochs ended, or
    --max_steps optimizer steps done, or --early_stopping_patience spent. Says so in one line (main process). The
    caller then ends with status 0 and writes nothing, so model.safetensors and results.json stay those of the run that
    trained them. A checkpoint saved after the last step but before the end of its epoch (--checkpointing_steps N, a
    signal) still has that end to do, the final evaluation and the report, unless results.json says it was done."""
    ended = progress.samples_in_epoch == 0 or reported_after(args.output_dir, progress.global_step)
    if args.max_steps is None and progress.epoch >= args.epochs:
        done = f"has {progress.epoch} epochs done (step {progress.global_step}) and --epochs is {args.epochs}"
        flag = "--epochs"
    elif args.max_steps is not None and (progress.global_step > args.max_steps or
                                         progress.global_step == args.max_steps and ended):
        done = f"has {progress.global_step} optimizer steps done and --max_steps is {args.max_steps}"
        flag = "--max_steps"
    elif ended and args.early_stopping_patience is not None and \
            progress.evaluations_without_improvement >= args.early_stopping_patience:
        return say_nothing_left(f"{checkpoint} stopped early: {args.metric_for_best} has not improved for "
                                f"{progress.evaluations_without_improvement} evaluations (--early_stopping_patience "
                                f"{args.early_stopping_patience})", "a higher --early_stopping_patience")
    else:
        return False
    return say_nothing_left(f"{checkpoint} {done}", f"train_image_classifier.py takes a higher {flag}; "
                            f"train_mnist.py's run includes its {flag}, so start a new run in another --output_dir")


def reported_after(output_dir, step: int) -> bool:
    """OUTPUT_DIR/results.json is that of a run that ended after optimizer step `step`."""
    try:
        return json.loads((Path(output_dir) / "results.json").read_text()).get("global_step") == step
    except (OSError, ValueError, AttributeError):
        return False


def say_nothing_left(why: str, to_train_further: str) -> bool:
    logger.info(f"Nothing left to train: {why}; model.safetensors and results.json left as they are (to train "
                f"further: {to_train_further})", main_process_only=True)
    return True


def accumulation_keeping(progress: TrainingProgress, num_processes: int, args, batch_size=None) -> int:
    """On resume: the gradient accumulation steps that keep the checkpoint's global batch on `num_processes`
    processes of `batch_size` samples (default --batch_size): --gradient_accumulation_steps when it already does,
    else another number, logged.

    The learning-rate schedule and the optimizer state belong to that global batch; a different
    one would silently change the run. Raises UserError naming flags that work when none does.
    """
    target, batch_size = progress.global_batch_size, batch_size or args.batch_size
    if num_processes * batch_size * args.gradient_accumulation_steps == target:
        return args.gradient_accumulation_steps
    if target % (num_processes * batch_size) == 0:
        accumulation = target // (num_processes * batch_size)
        logger.info(f"resuming on {num_processes} processes: --gradient_accumulation_steps {accumulation} keeps the "
                    f"checkpoint's global batch of {target} samples", main_process_only=True)
        return accumulation
    if target % num_processes:
        raise UserError(f"the checkpoint's global batch of {target} samples cannot be split over {num_processes} "
                        f"processes; resume on a number of processes that divides {target}")
    per_process = target // num_processes
    keeps = max(b for b in range(1, min(batch_size, per_process) + 1) if per_process % b == 0)
    raise UserError(f"the checkpoint's global batch is {target} samples ({progress.num_processes} processes); on "
                    f"{num_processes} processes --batch_size {batch_size} cannot keep it: use --batch_size {keeps} "
                    f"--gradient_accumulation_steps {per_process // keeps}")


def step_checkpoint_due(checkpointing_steps, global_step: int) -> bool:
    """--checkpointing_steps N: a checkpoint after every N optimizer steps (not with "epoch" or none)."""
    return isinstance(checkpointing_steps, int) and global_step % checkpointing_steps == 0


def batches_to_skip(progress: TrainingProgress, num_processes: int, batch_size: int) -> int:
    """Batches per process already trained on in the epoch in progress (checkpoints are saved after an
    optimizer step, so this part of the epoch is a whole number of global batches). The shuffle order
    depends only on (seed, epoch) and each process takes every num_processes-th batch of it, so the
    first samples_in_epoch samples of the order are the first this-many batches of every process."""
    return math.ceil(progress.samples_in_epoch / (num_processes * batch_size))
