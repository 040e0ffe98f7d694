"""What a run does between its optimizer steps: the losses of every process gathered, logs and evaluations as due.

A run counted in optimizer steps, with the Hugging Face Trainer's flags and meanings (utils/launch/flags.py
add_step_flags): --max_steps (the run's length, instead of --epochs), --eval_steps (evaluate every N steps instead of
after every epoch) and --logging_steps (log the mean training loss every N steps).

StepPlan says what is due after which optimizer step; after_step and at_epoch_end do it. Both are collective: every
process calls them after every optimizer step (at every epoch's end), and the plan, the same on every process, says
where they gather the losses or evaluate.
"""

import dataclasses
import math
from collections.abc import Callable

from accelerate.logging import get_logger

from ..errors import UserError
from ..run.best import save_if_best
from ..run.checkpoints import newest_good_checkpoint
from ..run.progress import TrainingProgress

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a run does after which optimizer step (counted from 1, over the whole run)."""

    steps_per_epoch: int
    max_steps: int  # the run ends right after this step: --max_steps, else --epochs whole epochs
    eval_steps: int | None = None  # --eval_steps; None: evaluate at every epoch's end
    logging_steps: int | None = None  # --logging_steps; None: the training loss is reported per epoch only
    early_stopping_patience: int | None = None
    metric_for_best: str | None = None  # what --early_stopping_patience watches and best/ keeps the best of
    streaming: bool = False  # --streaming: an epoch's length is unknown, `steps_per_epoch` stands in (as max_steps)

    @classmethod
    def of(cls, steps_per_epoch: int, epochs: int, max_steps=None, eval_steps=None, logging_steps=None,
           early_stopping_patience=None, metric_for_best=None, streaming=False) -> "StepPlan":
        """As the Trainer: --max_steps, when given, overrides --epochs."""
        return cls(steps_per_epoch, max_steps or epochs * steps_per_epoch, eval_steps, logging_steps,
                   early_stopping_patience, metric_for_best, streaming)

    @property
    def epochs(self) -> int:
        """The epochs the run spans, the last one perhaps cut short (the Trainer's num_train_epochs)."""
        return math.ceil(self.max_steps / self.steps_per_epoch)

    def training_over(self, progress) -> bool:
        """No optimizer step is left: `max_steps` are done, or --early_stopping_patience is spent (every process counts
        the same evaluations, of the same gathered metrics). Then the epoch in progress ends where it is."""
        return progress.global_step >= self.max_steps or (
            self.early_stopping_patience is not None
            and progress.evaluations_without_improvement >= self.early_stopping_patience)

    def logging_due(self, step: int) -> bool:
        return self.logging_steps is not None and step % self.logging_steps == 0

    def evaluation_due(self, step: int, epoch_end: bool = False) -> bool:
        """After optimizer step `step` (`epoch_end`: at the end of the epoch it ended): every --eval_steps steps, and
        at the end of the run when its last step was not one of them; without --eval_steps at every epoch's end."""
        if self.eval_steps is None:
            return epoch_end
        if epoch_end:
            return step >= self.max_steps and step % self.eval_steps != 0
        return step % self.eval_steps == 0


@dataclasses.dataclass
class TrainingEvents:
    """What after_step and at_epoch_end work with: the run's plan, its evaluation (a call without arguments: the
    script's evaluate, over exactly the eval set, on every process), what --metric_for_best keeps in best/ (the model,
    --model_ema's average), the run's `results` (the last epoch's training metrics and the last evaluation's), and
    what measures the training: the losses, the throughput meter (paused while logging or evaluating), the schedule."""

    plan: StepPlan
    evaluate: Callable[[], dict]
    model: object
    ema: object
    output_dir: object  # --output_dir, where best/ is kept
    results: dict
    running_loss: object  # utils/report/meters.py RunningLoss
    meter: object  # utils/report/meters.py ThroughputMeter
    lr_scheduler: object


def after_step(accelerator, events: TrainingEvents, progress, epoch: int) -> None:
    """Collective: every process calls it after every optimizer step of epoch `epoch`. Does what --logging_steps and
    --eval_steps ask after this step: log the mean training loss since the last log (every process's samples, gathered)
    and the learning rate; evaluate, log the metrics and keep best/ (--metric_for_best)."""
    step = progress.global_step
    logging, evaluating = events.plan.logging_due(step), events.plan.evaluation_due(step)
    if not (logging or evaluating):
        return
    with events.meter.paused():  # logging and evaluating are not training time
        if logging:
            gather_running_loss(accelerator, events.running_loss, progress, events.output_dir)
            logged = {"loss": progress.take_logged_loss(), "learning_rate": events.lr_scheduler.get_last_lr()[0]}
            logger.info(f"step {step}: {logged}")
            accelerator.log(logged, step=step)  # to every tracker
        if evaluating:
            report(accelerator, events.results, step, f"step {step}", events.evaluate())
            events.model.train()  # evaluate() left the model in eval mode; its epoch goes on
            save_if_best(accelerator, events.model, progress, events.results, epoch, events.plan.metric_for_best,
                         events.output_dir, events.ema)


def at_epoch_end(accelerator, events: TrainingEvents, progress, epoch: int, **train_metrics) -> None:
    """Collective: every process calls it at the end of epoch `epoch` (after progress.end_epoch), with the epoch's
    training metrics (train_loss, the gradient norms). Reports those, the learning rate and the scheduler's steps (it
    counts them in last_epoch, once per optimizer step that was not skipped) with the evaluation due (after every
    epoch; with --eval_steps at the run's end only, unless its last step evaluated), and keeps best/."""
    measured = {**train_metrics, "current_learning_rate": events.lr_scheduler.get_last_lr()[0],
                "lr_scheduler_steps": events.lr_scheduler.scheduler.last_epoch}
    evaluating = events.plan.evaluation_due(progress.global_step, epoch_end=True)
    report(accelerator, events.results, progress.global_step, f"epoch {epoch}",
           measured | (events.evaluate() if evaluating else {}), epoch=epoch)
    if evaluating:
        save_if_best(accelerator, events.model, progress, events.results, epoch, events.plan.metric_for_best,
                     events.output_dir, events.ema)


def report(accelerator, results: dict, step: int, where: str, measured: dict, **tracked_too) -> None:
    """`measured` into the run's `results`, to the logger (one line, `where` first) and to every tracker at optimizer
    step `step`, with `tracked_too` (the epoch)."""
    results.update(measured)
    logger.info(f"{where}: {measured}")
    accelerator.log(measured | tracked_too, step=step)


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
