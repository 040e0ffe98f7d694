"""--metric_for_best: the best evaluation so far kept in OUTPUT_DIR/best, and the evaluations without improvement
that --early_stopping_patience counts."""

from accelerate.logging import get_logger

from ..launch.flags import HIGHER_IS_BETTER
from ..output_files import BEST
from ..run.checkpoints import save_checkpoint
from ..run.deepspeed import model_to_save
from ..run.progress import TrainingProgress

logger = get_logger(__name__)


def save_if_best(accelerator, model, progress: TrainingProgress, results: dict, epoch: int, metric_for_best, output_dir,
                 ema=None) -> bool:
    """`metric_for_best` (--metric_for_best; None: nothing to keep), after an evaluation in (or at the end of) epoch
    `epoch`: when `results` beat the best so far, record them in `progress` and write the plain weights (as the final
    model.safetensors) and the progress to `output_dir`/best, atomically; otherwise count one more evaluation without
    improvement. The weights are those the metric measured: for eval_ema_accuracy or eval_ema_loss, --model_ema's
    average `ema` (as best/model.safetensors all the same, so that best/ is used as it always is). Collective when it
    saves (gathers FSDP shards); `results` are the same on every process, so every process decides the same."""
    if metric_for_best is None:
        return False
    value, best = results[metric_for_best], progress.best_metric
    if best is not None and not (value > best if HIGHER_IS_BETTER[metric_for_best] else value < best):
        progress.evaluations_without_improvement += 1
        return False
    progress.best_epoch, progress.best_step, progress.best_metric = epoch, progress.global_step, value
    progress.evaluations_without_improvement = 0
    if metric_for_best.startswith("eval_ema_"):
        plain_model = ema.module
    else:
        plain_model = model_to_save(accelerator, model)  # DeepSpeed's engine gathers ZeRO-3's partitions
    saved = save_checkpoint(accelerator, output_dir, BEST, progress,
                            write_into=lambda folder: accelerator.save_model(plain_model, folder))
    logger.info(f"step {progress.global_step} (epoch {epoch}): best {metric_for_best} so far ({value:.4f}), "
                f"saved to {saved}", main_process_only=True)
    return True
