"""--max_steps, --eval_steps, --logging_steps (issue 23), with the Hugging Face Trainer's meanings, in both training
scripts: a run that ends after step N inside an epoch, with its schedule, final evaluation and report; evaluations and
training-loss logs every N steps, to the trackers and the log, exact over all processes; best/ and early stopping by
evaluation; a resume from a step checkpoint that ends as the uninterrupted run, and one after the end that trains
nothing. The plan step by step, and the checkpoints saved before these fields existed.

Processes: the 2-process runs are the jobs of one launch (`two_process_runs`: tests/jobs.py's launch_jobs,
each launched process importing torch and Accelerate once, then forking one child
per job): the 7-step run, its resume from step 5 right after it, the same steps without step evaluations or logs, and
the classifier's early stopping. The 1-process resume from step 7 runs alone (run_alone: no launcher around it)."""

import ast
import dataclasses
import json
import re
import shutil

import pytest
from helpers import (
    REPO,
    TRAIN_MNIST,
    launcher_args,
    make_synthetic_mnist,
    results,
    run_alone,
    snapshot,
    tensorboard_scalars,
)
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs
from test_run_records import decide

from utils.launch.flags import HIGHER_IS_BETTER
from utils.output_files import TRAINING_STATE
from utils.run.progress import ADDED_FIELDS, TrainingProgress, read_training_state
from utils.run.steps import StepPlan

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
# 64 digits, 2 processes x 8: 4 optimizer steps of 16 samples per epoch; 7 steps end 3 steps into the second epoch
MNIST_RUN = ["--max_train_samples", "64", "--max_eval_samples", "37", "--batch_size", "8", "--max_steps", "7",
             "--lr_scheduler_type", "linear", "--eval_steps", "3", "--logging_steps", "2", "--metric_for_best",
             "eval_loss", "--checkpointing_steps", "1", "--with_tracking"]
LOGGED = re.compile(r"INFO \[RANK 0\] (step|epoch) (\d+): (\{.*\})$")


def logged(output: str) -> list:
    """The (step or epoch, number, metrics) lines the run logged, in order, with their exact values."""
    return [(kind, int(n), ast.literal_eval(metrics)) for line in output.splitlines()
            for kind, n, metrics in [m.groups() for m in [LOGGED.search(line)] if m]]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("step_digits"))


@pytest.fixture(scope="module")
def two_process_runs(digits, tmp_path_factory):
    """The one 2-process launch, its jobs in this order: train_mnist.py for 7 optimizer steps, evaluated every 3,
    logged every 2 (seven_steps/); its step_5 resumed in a new folder (resumed/; the checkpoint named, not copied
    there for 'latest': it is saved only by the job before, inside the launch); the same 7 steps evaluated at the
    epochs' ends only, without logs or checkpoints (plain/); the classifier's early stopping (early_stopping/).
    Returns its folder; each test reads its job (jobs.finished_job: every process exited 0)."""
    root = tmp_path_factory.mktemp("step_runs")
    # the classifier evaluated after every step on 1 image (test_early_stopping_counts_evaluations_...)
    images = make_split_image_folder(root / "images", train_per_class=8, val_per_class=2)
    launch_jobs({
        "seven_steps": [TRAIN_MNIST, "--cpu", "--data_dir", digits, "--output_dir", root / "seven_steps", *MNIST_RUN],
        "resumed": [TRAIN_MNIST, "--cpu", "--data_dir", digits, "--output_dir", root / "resumed", *MNIST_RUN,
                    "--resume_from_checkpoint", root / "seven_steps" / "step_5"],
        "plain": [TRAIN_MNIST, "--cpu", "--data_dir", digits, "--output_dir", root / "plain", "--max_train_samples",
                  "64", "--max_eval_samples", "37", "--batch_size", "8", "--max_steps", "7", "--lr_scheduler_type",
                  "linear", "--with_tracking"],
        "early_stopping": [CLASSIFIER, "--cpu", "--data_dir", images, "--output_dir", root / "early_stopping",
                           "--model", "tests.tiny_model:tiny_cnn", "--image_size", "16", "--num_workers", "0",
                           "--batch_size", "4", "--optimizer", "adamw", "--learning_rate", "0.01", "--max_steps", "12",
                           "--eval_steps", "1", "--max_eval_samples", "1", "--metric_for_best", "eval_accuracy",
                           "--early_stopping_patience", "2", "--logging_steps", "2", "--with_tracking"],
    }, launcher_args(2), root)
    return root


@pytest.fixture(scope="module")
def seven_steps(two_process_runs):
    """(output_dir, log) of train_mnist.py on 2 processes, 7 optimizer steps, evaluated every 3, logged every 2; log:
    what both processes printed."""
    return two_process_runs / "seven_steps", finished_job(two_process_runs / "seven_steps", 2).stdout


# ---------------------------------------------------------------- the plan, and old checkpoints


def test_the_plan_counts_the_run_and_its_evaluations_in_optimizer_steps():
    by_epochs = StepPlan.of(steps_per_epoch=4, epochs=3)
    assert (by_epochs.max_steps, by_epochs.epochs) == (12, 3)
    assert [s for s in range(1, 13) if by_epochs.evaluation_due(s)] == []  # at the epochs' ends only
    assert by_epochs.evaluation_due(5, epoch_end=True) and not by_epochs.logging_due(4)
    plan = StepPlan.of(4, epochs=3, max_steps=7, eval_steps=3, logging_steps=2)
    assert (plan.max_steps, plan.epochs) == (7, 2)  # --max_steps overrides --epochs, as the Trainer
    assert [s for s in range(1, 8) if plan.evaluation_due(s)] == [3, 6]
    assert [s for s in (4, 6, 7) if plan.evaluation_due(s, epoch_end=True)] == [7]  # the end, not an eval step
    assert not StepPlan.of(4, epochs=3, max_steps=6, eval_steps=3).evaluation_due(6, True)
    assert [s for s in range(1, 8) if plan.logging_due(s)] == [2, 4, 6]
    patient = dataclasses.replace(plan, early_stopping_patience=2)
    assert not patient.training_over(TrainingProgress(global_step=6, evaluations_without_improvement=1))
    assert patient.training_over(TrainingProgress(global_step=6, evaluations_without_improvement=2))
    assert plan.training_over(TrainingProgress(global_step=7))


def test_a_checkpoint_saved_before_the_step_fields_loads_with_their_defaults(tmp_path):
    """Its run evaluated after every epoch: the evaluations since its best are the epochs ended since."""
    old = {key: value for key, value in dataclasses.asdict(TrainingProgress(epoch=5, best_epoch=2, best_metric=0.5,
                                                                            global_step=50)).items()
           if key not in ADDED_FIELDS}
    (tmp_path / "epoch_4").mkdir()
    (tmp_path / "epoch_4" / TRAINING_STATE).write_text(json.dumps(old))
    progress = read_training_state(tmp_path / "epoch_4")
    assert (progress.evaluations_without_improvement, progress.best_step, progress.logging_samples) == (2, -1, 0)
    (tmp_path / "epoch_4" / TRAINING_STATE).write_text(json.dumps({**old, "evaluations_since_best": 2}))
    with pytest.raises(Exception, match="not in this version's layout"):  # an unknown key is still refused
        read_training_state(tmp_path / "epoch_4")


# ---------------------------------------------------------------- --max_steps, --eval_steps, --logging_steps


def test_max_steps_ends_inside_an_epoch_with_the_schedule_and_a_final_evaluation(seven_steps):
    out, _ = seven_steps
    r = results(out)
    assert (r["num_processes"], r["global_step"], r["lr_scheduler_steps"], r["max_steps"]) == (2, 7, 7, 7)
    assert r["current_learning_rate"] == 0.0  # the linear schedule spans the 7 steps, not 3 epochs of 4
    assert (r["epochs"], r["steps_per_epoch"], r["samples_seen"]) == (2, 4, 7 * 16)
    assert r["eval_samples"] == 37 and not r["stopped_early"]  # over exactly the eval set, after step 7
    run = json.loads((out / "run.json").read_text())
    assert (run["max_steps"], run["epochs"]) == (7, 3)  # the flags as given: part of train_mnist.py's run
    # the process count and batch split in effect (tests/test_run_records.py: a 1-process run's)
    assert (run["num_processes"], run["batch_size_per_process"], run["global_batch_size"]) == (2, 8, 16)
    assert sorted(p.name for p in out.glob("step_*")) == sorted(f"step_{n}" for n in range(1, 8))


def test_eval_steps_evaluates_every_n_steps_and_at_the_end_with_best_kept_by_step(seven_steps):
    out, log = seven_steps
    r = results(out)
    eval_loss = tensorboard_scalars(out / "train_mnist", "eval_loss")
    assert [step for step, _ in eval_loss] == [3, 6, 7]  # every 3 steps, and after the last one
    assert r["eval_loss"] == pytest.approx(eval_loss[-1][1])  # results.json: the last evaluation's
    best_step, best = min(eval_loss, key=lambda record: record[1])
    assert r["best_step"] == best_step and r["best_eval_loss"] == pytest.approx(best)
    assert json.loads((out / "best" / TRAINING_STATE).read_text())["global_step"] == best_step
    saved_best = [int(n) for n in re.findall(r"step (\d+) \(epoch \d\): best eval_loss so far", log)]
    assert saved_best[-1] == best_step and saved_best == sorted(set(saved_best))
    if best_step == 7:  # then best/ holds the final weights
        assert (out / "best" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # the end of the epoch 0 (step 4) logs its training metrics, without an evaluation
    assert [step for step, _ in tensorboard_scalars(out / "train_mnist", "train_loss")] == [4, 7]


def test_evaluating_and_logging_every_n_steps_change_nothing_of_the_training(seven_steps, two_process_runs):
    """The same 7 steps evaluated at the epochs' ends only (4, and 7: the end of the run) and without logs or
    checkpoints (job plain): the same weights, bit for bit (the model trains on in train mode after each evaluation)."""
    finished_job(two_process_runs / "plain", 2)
    out = two_process_runs / "plain"
    assert (out / "model.safetensors").read_bytes() == (seven_steps[0] / "model.safetensors").read_bytes()
    assert [step for step, _ in tensorboard_scalars(out / "train_mnist", "eval_loss")] == [4, 7]
    r, evaluated_by_steps = results(out), results(seven_steps[0])
    assert (r["global_step"], r["train_loss"]) == (7, evaluated_by_steps["train_loss"])
    assert r["eval_loss"] == evaluated_by_steps["eval_loss"]  # both evaluated the final weights


def test_logging_steps_logs_the_exact_mean_training_loss_of_its_steps(seven_steps):
    out, log = seven_steps
    lines = logged(log)
    losses = {n: metrics["loss"] for kind, n, metrics in lines if kind == "step" and "loss" in metrics}
    assert sorted(losses) == [2, 4, 6]
    assert [step for step, _ in tensorboard_scalars(out / "train_mnist", "loss")] == [2, 4, 6]
    assert [step for step, _ in tensorboard_scalars(out / "train_mnist", "learning_rate")] == [2, 4, 6]
    # steps 1-2 and 3-4 are epoch 0, 16 samples each: their mean is the epoch's exact training loss
    epoch_0 = next(metrics for kind, n, metrics in lines if kind == "epoch" and n == 0)
    assert (losses[2] + losses[4]) / 2 == pytest.approx(epoch_0["train_loss"], rel=1e-12)
    assert tensorboard_scalars(out / "train_mnist", "loss")[0][1] == pytest.approx(losses[2], rel=1e-6)


def test_a_run_resumed_from_a_step_checkpoint_ends_as_the_uninterrupted_one(seven_steps, two_process_runs):
    """Interrupted after step 5 (its checkpoint, continued in a new folder: job resumed), resumed: the same weights,
    the same log of step 6 (the logging window since step 4 was in the checkpoint), the same evaluations and best/."""
    full, full_log = seven_steps
    resumed = two_process_runs / "resumed"
    proc = finished_job(two_process_runs / "resumed", 2)
    assert (resumed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    after_5 = [line for line in logged(full_log) if line[1] >= 6 or line[0] == "epoch" and line[1] == 1]
    assert logged(proc.stdout) == after_5
    r, rr = results(full), results(resumed)
    for key in ("global_step", "train_loss", "eval_loss", "eval_accuracy", "best_step", "best_eval_loss",
                "parameter_fingerprints"):
        assert rr[key] == r[key], key


def test_the_last_steps_checkpoint_resumes_to_the_epochs_end_or_to_nothing_once_reported(seven_steps, digits,
                                                                                         tmp_path, caplog):
    """step_7 was saved after the last step, before the end of its epoch: alone in a new folder it still has the final
    evaluation and the report to do (on 1 process: the process count may change; the script runs alone, as accelerate's
    one-process launcher runs it); where the run reported it, a resume trains nothing (decided before any training:
    asked in this process, as the script asks it; the launched decision, writing nothing: tests/test_run_records.py)."""
    full, _ = seven_steps
    before = snapshot(full)
    said = decide(TRAIN_MNIST, ["--data_dir", digits, "--output_dir", full, *MNIST_RUN, "--resume_from_checkpoint",
                                "latest"], caplog)
    assert said == [f"{full / 'step_7'} has 7 optimizer steps done and --max_steps is 7"]
    assert snapshot(full) == before

    ending = tmp_path / "ending"
    ending.mkdir()
    shutil.copytree(full / "step_7", ending / "step_7")
    run_alone(["--data_dir", digits, "--output_dir", ending, *MNIST_RUN, "--resume_from_checkpoint", "latest"])
    r, rr = results(full), results(ending)
    assert (ending / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert (rr["global_step"], rr["train_loss"], rr["eval_samples"]) == (7, r["train_loss"], 37)
    assert rr["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-6)  # 1 process evaluates in other batches


def test_early_stopping_counts_evaluations_and_stops_every_process_after_the_same_step(two_process_runs):
    """The classifier on 2 processes (job early_stopping), evaluated after every step on 1 image: its accuracy, 0 or 1,
    can improve once at most, so patience 2 ends the run by step 5 of 12, inside an epoch; where, the evaluations
    say."""
    proc = finished_job(two_process_runs / "early_stopping", 2)
    out = two_process_runs / "early_stopping"
    r = results(out)
    accuracy = tensorboard_scalars(out / "train_image_classifier", "eval_accuracy")
    best, without_improvement, stop = None, 0, None
    for step, value in accuracy:
        if best is None or (value > best if HIGHER_IS_BETTER["eval_accuracy"] else value < best):
            best, without_improvement, best_step = value, 0, step
        else:
            without_improvement += 1
        if without_improvement == 2:
            stop = step
            break
    assert stop is not None and stop <= 5 and [step for step, _ in accuracy] == list(range(1, stop + 1))
    assert (r["global_step"], r["stopped_early"], r["best_step"]) == (stop, True, best_step)
    assert (r["epochs"], r["max_steps"], r["steps_per_epoch"], r["eval_samples"]) == (3, 12, 4, 1)
    assert len(set(r["parameter_fingerprints"])) == 1  # both processes stopped after the same step
    assert "Stopping early: eval_accuracy has not improved for 2 evaluations" in proc.stdout  # both processes' output
    logged_steps = [step for step, _ in tensorboard_scalars(out / "train_image_classifier", "loss")]
    assert logged_steps == list(range(2, stop + 1, 2))
