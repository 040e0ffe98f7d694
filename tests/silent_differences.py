"""Two things a converted script computes silently wrong unless written Accelerate's way, each computed the wrong way
and the right way on the processes of one launch (tests/test_whole_script_conversion.py runs it as a job of its
one-process and its two-process launch, and asserts the numbers):

1. A torchmetrics metric on uneven data. 501 samples in batches of 64 on 2 processes: prepare() gives each process
   4 whole batches, process 1's last one filled up from the first samples, 512 rows in all. Updated with each
   process's own rows, as Fabric and Lightning code updates it, torchmetrics' sync at compute() counts all 512;
   updated with gather_for_metrics' rows (the repeated ones dropped) on every process, its sync counts each of
   the 501 twice (1,002); with sync_on_compute=False as well it counts each once: the exact metric on every
   process. The first samples, those the padding repeats, are predicted wrong, so that counting them twice shows.
2. A per-step warm-up. A prepared scheduler (step_scheduler_with_optimizer=True, Accelerate's default) steps
   num_processes times per optimizer step, so a warm-up over W optimizer steps must be built W x num_processes long;
   built W long it ends after W / num_processes optimizer steps. An unprepared scheduler, stepped by hand once per
   optimizer step, keeps its W. DeepSpeed's WarmupLR, as scripts/converted_deepspeed_style.py writes it, is such a
   warm-up: prepared under the default it warms up num_processes times too fast; prepared under
   step_scheduler_with_optimizer=False (the converted script's Accelerator) it steps once per optimizer step, as
   DeepSpeed's engine steps it.

usage: silent_differences.py OUT.json   (each process writes its numbers to OUT.json.rank{RANK})
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import Accuracy

SAMPLES, BATCH_SIZE, CLASSES = 501, 64, 10
WARMUP, STEPS = 4, 6  # optimizer steps
DEEPSPEED_AFTER = Path(__file__).resolve().parents[1] / "scripts" / "converted_deepspeed_style.py"
DEEPSPEED_LR, DEEPSPEED_WARMUP, DEEPSPEED_STEPS = 0.001, 4, 8  # its ds_config's warmup_max_lr, warmup_num_steps; steps


def metric_counts(accelerator) -> dict:
    """{way: (accuracy, samples counted)}, and the exact accuracy over the 501 samples."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(SAMPLES, CLASSES, generator=generator)
    labels = logits.argmax(1)
    wrong = torch.rand(SAMPLES, generator=generator) < 0.2
    wrong[:16] = True  # the samples the padding repeats
    labels[wrong] = (labels[wrong] + 1) % CLASSES
    loader = accelerator.prepare(DataLoader(TensorDataset(logits, labels), batch_size=BATCH_SIZE))

    ways = {"own rows, synced": True, "gathered rows, synced": True, "gathered rows, sync_on_compute=False": False}
    metrics = {way: (Accuracy(task="multiclass", num_classes=CLASSES, sync_on_compute=sync),
                     SumMetric(sync_on_compute=sync)) for way, sync in ways.items()}
    for batch_logits, batch_labels in loader:
        gathered_logits, gathered_labels = accelerator.gather_for_metrics((batch_logits, batch_labels))
        for way, (accuracy, count) in metrics.items():
            rows = (batch_logits, batch_labels) if way.startswith("own") else (gathered_logits, gathered_labels)
            accuracy.update(*rows)
            count.update(torch.tensor(float(len(rows[1]))))
    results = {way: (accuracy.compute().item(), int(count.compute().item())) for way, (accuracy, count) in
               metrics.items()}
    return {"ways": results, "exact_accuracy": (logits.argmax(1) == labels).double().mean().item()}


def warmup(steps: int):
    """A linear warm-up to the full learning rate over `steps` scheduler steps (transformers' linear warm-up)."""
    return lambda step: min(1.0, step / steps)


def warmup_learning_rates(accelerator) -> dict:
    """{way: the learning rate after each of STEPS optimizer steps}."""
    ways = {"built W long, prepared": (WARMUP, True),
            "built W x num_processes long, prepared": (WARMUP * accelerator.num_processes, True),
            "built W long, not prepared": (WARMUP, False)}
    schedules = {}
    for way, (length, prepared) in ways.items():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(length))
        if prepared:
            optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        else:
            optimizer = accelerator.prepare(optimizer)
        schedules[way] = optimizer, scheduler
    learning_rates = {way: [] for way in ways}
    for _ in range(STEPS):
        for way, (optimizer, scheduler) in schedules.items():
            optimizer.step()
            scheduler.step()
            learning_rates[way].append(optimizer.param_groups[0]["lr"])
    return learning_rates


def deepspeed_warmup_learning_rates(accelerator) -> dict:
    """{way: the learning rate after each of DEEPSPEED_STEPS optimizer steps} of the converted DeepSpeed script's
    WarmupLR, prepared with Accelerate's default and with step_scheduler_with_optimizer=False."""
    spec = importlib.util.spec_from_file_location("converted_deepspeed_style", DEEPSPEED_AFTER)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its definitions only: main() runs under __main__
    learning_rates = {}
    for way, step_with_optimizer in (("prepared, step_scheduler_with_optimizer=True", True),
                                     ("prepared, step_scheduler_with_optimizer=False", False)):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=DEEPSPEED_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, script.warmup_lr_lambda(DEEPSPEED_WARMUP))
        accelerator.step_scheduler_with_optimizer = step_with_optimizer  # read by prepare()
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        learning_rates[way] = []
        for _ in range(DEEPSPEED_STEPS):
            optimizer.step()
            scheduler.step()
            learning_rates[way].append(scheduler.get_last_lr()[0])
    accelerator.step_scheduler_with_optimizer = True
    return learning_rates


def main(out) -> None:
    accelerator = Accelerator(cpu=True)
    numbers = {"num_processes": accelerator.num_processes, "metrics": metric_counts(accelerator),
               "warmup": warmup_learning_rates(accelerator),
               "deepspeed_warmup": deepspeed_warmup_learning_rates(accelerator)}
    with open(f"{out}.rank{accelerator.process_index}", "w") as file:
        json.dump(numbers, file)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
