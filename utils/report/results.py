"""What a run reports: results.json after training, eval_results.json after --eval_only."""

from pathlib import Path

import torch
from accelerate.utils import is_compiled_module

from ..files import write_json_atomically
from ..output_files import EVAL_RESULTS, RESULTS
from ..report.meters import ThroughputMeter, peak_memory_mb
from ..run.deepspeed import zero3
from ..run.fingerprints import fingerprint, replica_fingerprints
from ..run.fsdp import parameter_bytes
from ..run.run_record import read_run_record


def report_run(accelerator, model, meter: ThroughputMeter, progress, results: dict, checkpoint, plan, output_dir,
               batch_size: int, accumulation: int, learning_rate: float, seed: int, max_grad_norm=None) -> None:
    """Collective: every process calls it once, after training. Completes `results` with what the
    run measured and the flags it ran with (--batch_size, --gradient_accumulation_steps, --learning_rate, --seed,
    --max_grad_norm), and the main process writes OUTPUT_DIR/results.json. `plan`: the run's length and
    --metric_for_best (utils/run/steps.py StepPlan).

    Throughput is the samples of all processes over the slowest one's steady-state time (over all its
    batches when it had no more than the warm-up's, as `train_samples_per_second_over` says). Every
    replica must hold the same weights: each process adds the fingerprints of its parameters and buffers
    (BatchNorm statistics agree after an evaluation: DDP broadcasts rank 0's buffers before each forward that
    follows a synced training forward, so before the evaluation's first batch). Under FSDP and ZeRO-3 each process
    holds a shard, so the full weights are fingerprinted once.
    """
    device = accelerator.device
    local_bytes, model_bytes = parameter_bytes(model)  # under FSDP (ZeRO-3): this process's shards (partitions)
    sharded = accelerator.is_fsdp2 or zero3(accelerator)
    per_process = accelerator.gather(torch.tensor(
        [[meter.steady_samples, meter.steady_time_s, meter.train_time_s, peak_memory_mb(device), meter.samples,
          local_bytes]],
        dtype=torch.float64, device=device,
    )).cpu()
    slowest, slowest_in_all = per_process[:, 1].max().item(), per_process[:, 2].max().item()
    if slowest > 0:
        results["train_samples_per_second"] = per_process[:, 0].sum().item() / slowest
        results["train_samples_per_second_over"] = "steady_state"
    elif slowest_in_all > 0:  # no more batches than the warm-up: all count, warm-up included (a lower bound)
        results["train_samples_per_second"] = per_process[:, 4].sum().item() / slowest_in_all
        results["train_samples_per_second_over"] = "all_batches"
    else:  # nothing trained (--eval_only, or a resume with no step left)
        results["train_samples_per_second"], results["train_samples_per_second_over"] = None, "no_batches"
    results["train_time_s"] = slowest_in_all
    results["peak_memory_mb"] = per_process[:, 3].max().item()
    results["parameter_bytes"] = model_bytes  # and what each process held: under FSDP (ZeRO-3) its shards, about 1/N
    results["parameter_bytes_per_process"] = [int(b) for b in per_process[:, 5]]
    if sharded:
        full_weights = accelerator.get_state_dict(model)  # gathers the shards (collective)
        replicas = [[fingerprint(full_weights.values()), 0]] if accelerator.is_main_process else []
    else:
        replicas = replica_fingerprints(accelerator, accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        results.update({
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "grad_scaler": accelerator.scaler is not None,
            "sharded": sharded,
            "compiled": is_compiled_module(model),  # torch.compile, by --compile or the launch config's dynamo backend
            # --epochs, or those --max_steps spans (the last one perhaps cut short); --streaming: the epochs gone through,
            # of lengths that vary and are not known beforehand (utils/data/streaming.py)
            "epochs": progress.epoch if plan.streaming else plan.epochs,
            "max_steps": plan.max_steps,
            "steps_per_epoch": None if plan.streaming else plan.steps_per_epoch,
            "global_step": progress.global_step,
            "samples_seen": progress.samples_seen,
            "optimizer_steps_skipped": progress.optimizer_steps_skipped,
            "batch_size_per_process": batch_size,
            "gradient_accumulation_steps": accumulation,
            "global_batch_size": progress.global_batch_size,
            "learning_rate": learning_rate,
            "seed": seed,
            "resumed_from": str(checkpoint) if checkpoint is not None else None,
            # the run.json of this run: a restart of the same command finds it finished (utils/run/run_folder.py)
            "run": read_run_record(output_dir),
            "max_grad_norm": max_grad_norm,
            "parameter_fingerprints": [row[0] for row in replicas],
            "buffer_fingerprints": [row[1] for row in replicas],
        })
        if plan.metric_for_best is not None:
            results.update({"metric_for_best": plan.metric_for_best, "best_epoch": progress.best_epoch,
                            "best_step": progress.best_step, f"best_{plan.metric_for_best}": progress.best_metric,
                            "stopped_early": progress.global_step < plan.max_steps})
        write_json_atomically(Path(output_dir) / RESULTS, results)
        print(f"Wrote {Path(output_dir) / RESULTS}", flush=True)


def report_evaluation(accelerator, results: dict, checkpoint, progress, output_dir) -> None:
    """--eval_only: the main process prints the metrics and writes OUTPUT_DIR/eval_results.json (never
    results.json, which belongs to the run that trained), describing the checkpoint evaluated: its path,
    how far it had trained and the run it comes from (its run.json, with that run's --epochs)."""
    if not accelerator.is_main_process:
        return
    metrics = {key: value for key, value in results.items() if key != "train_loss"}  # nothing was trained
    record = {
        **metrics,
        "checkpoint": str(checkpoint),
        "checkpoint_epochs_done": progress.epoch,  # whole epochs trained when it was saved
        "checkpoint_global_step": progress.global_step,
        "checkpoint_samples_seen": progress.samples_seen,
        "run": read_run_record(checkpoint),  # null for a checkpoint saved before runs were recorded
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
    }
    path = Path(output_dir) / EVAL_RESULTS
    write_json_atomically(path, record)
    scores = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()
                       if key.startswith("eval_") and isinstance(value, float))
    print(f"Evaluated {checkpoint} (after {progress.epoch} epochs, step {progress.global_step}): {scores} "
          f"on {metrics['eval_samples']} samples; wrote {path}", flush=True)


