"""The run's progress counters (TrainingProgress), saved as training_state.json in every checkpoint and read back.

Counted in samples, not batches, so that a run can resume on another number of processes.
"""

import dataclasses
import json
import math
from pathlib import Path

from ..errors import UserError
from ..output_files import TRAINING_STATE


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
