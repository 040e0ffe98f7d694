"""--model_ema (issue 23): a moving average of the weights, kept by every process from its own replica after each
optimizer step, evaluated each epoch beside the weights (eval_ema_*), saved in every checkpoint and resumed bit for
bit, written as model_ema.safetensors, selectable for best/ and by predict.py's --weights ema. The update rule step
by step; real runs of train_mnist.py on 2 processes with gradient accumulation, and of train_image_classifier.py
under --compile. Every run is a job of one launch per process count (tests/jobs.py's launch_jobs, each process
importing torch and Accelerate once): on 2 processes the runs with and without
the average and the resume, then on 1 process, started by plain python as accelerate's one-process launcher would run
it (one process less), the evaluation of best/, predict.py's and the classifier's runs; the 3-process --eval_only is
a launch of its own (the only 3-process run here)."""

import csv
import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    REPO,
    TRAIN_MNIST,
    assert_clean_user_error,
    launch,
    launcher_args,
    load_script,
    make_synthetic_mnist,
    results,
    run_folder_of,
)
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file
from test_output_files import documented_files

from utils.data.mnist import load_mnist_idx, to_tensor_dataset
from utils.errors import UserError
from utils.models import ConvNet
from utils.output_files import EMA_CHECKPOINT_FILE, EMA_WEIGHTS
from utils.predict.trained_run import read_trained_run
from utils.run.ema import ModelEma, build_model_ema, decay_at
from utils.run.run_folder import check_output_dir

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PREDICT = REPO / "scripts" / "predict.py"
# 640 digits, 2 processes x 16 x 2 accumulation steps: 20 batches per process and epoch, 10 optimizer steps
COMMON = ["--epochs", "2", "--batch_size", "16", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "7",
          "--learning_rate", "3e-4"]  # low enough that the accuracies stay below 100%: their comparisons say something
EMA = ["--model_ema", "--model_ema_warmup", "--metric_for_best", "eval_ema_loss"]
STEPS = 20


def read_json(path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- the update rule


def test_the_decay_is_timms_with_and_without_warmup():
    assert decay_at(0, 0.9998, warmup=False) == decay_at(0, 0.9998, warmup=True) == 0.0  # the first update copies
    assert decay_at(1, 0.9998, warmup=False) == decay_at(10**6, 0.9998, warmup=False) == 0.9998
    # timm's ModelEmaV3(use_warmup=True).get_decay(step) for its step = updates done + 1: 1 - step ** -2/3
    for updates_done, expected in ((1, 0.370), (99, 0.9536), (999, 0.9900)):
        assert decay_at(updates_done, 0.9998, warmup=True) == pytest.approx(expected, abs=5e-4)
        assert decay_at(updates_done, 0.9998, warmup=True) == 1 - (1 + updates_done) ** (-2 / 3)
    assert decay_at(10**6, 0.9998, warmup=True) == 0.9998  # capped at --model_ema_decay


def test_the_average_starts_as_a_copy_then_moves_by_one_minus_decay_and_copies_counts():
    """Values that halve exactly, so the expected averages are exact: weights 1, 3, 7 with decay 0.5 average to
    1, then 2, then 4.5. BatchNorm's running mean is averaged the same way; its batch count is copied."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.5, warmup=False)
    for value, count, expected in ((1.0, 10, 1.0), (3.0, 20, 2.0), (7.0, 30, 4.5)):
        with torch.no_grad():
            for tensor in [*model.parameters(), model[1].running_mean]:
                tensor.fill_(value)
            model[1].num_batches_tracked.fill_(count)
        ema.update()
        averaged = ema.module
        assert all(torch.all(t == expected) for t in [*averaged.parameters(), averaged[1].running_mean]), value
        assert averaged[1].num_batches_tracked.item() == count  # torch's own rule would give int(0.5 x 20 + 0.5 x 30)
    assert ema.updates == 3 and not any(p.requires_grad for p in ema.module.parameters())
    assert ema.module.state_dict().keys() == model.state_dict().keys()  # the plain model's names

    restored = ModelEma(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)), decay=0.5, warmup=False)
    restored.load_state_dict(ema.state_dict())  # what a checkpoint holds
    assert restored.updates == 3
    assert all(torch.equal(a, b) for a, b in zip(restored.module.state_dict().values(), averaged.state_dict().values()))


def test_the_warmup_decay_is_that_of_the_updates_done_before_this_one():
    """--model_ema_warmup, weights 1, 3, 7, 15: decays 0 (a copy), 1 - 2^-2/3, 1 - 3^-2/3, 1 - 4^-2/3 (timm's for its
    steps 1, 2, 3, 4), so the average reads 1, 2.2599, 4.5387, 8.6903 (one update off: 1, 1.9615, 3.961, 7.7363)."""
    model = torch.nn.Linear(1, 1, bias=False)
    ema = ModelEma(model, decay=0.9998, warmup=True)
    averages = []
    for value in (1.0, 3.0, 7.0, 15.0):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update()
        averages.append(ema.module.weight.item())
    assert averages == pytest.approx([1.0, 2.2599, 4.5387, 8.6903], abs=1e-4)


# ---------------------------------------------------------------- flags


# Its wrong flags end with one line like every other flag's: tests/test_bad_inputs.py, test_bad_flag_values.


def test_the_default_decay_is_timms_and_the_warmup_off():
    args = load_script(TRAIN_MNIST).parse_args(["--model_ema"])
    assert (args.model_ema_decay, args.model_ema_warmup) == (0.9998, False)
    assert load_script(TRAIN_MNIST).parse_args([]).model_ema_decay is None


# ---------------------------------------------------------------- train_mnist.py on 2 processes


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return make_synthetic_mnist(tmp_path_factory.mktemp("ema_digits"))


@pytest.fixture(scope="module")
def two_process_runs(digits, tmp_path_factory):
    """The 2-process launch: 2 epochs with the average (timm's warmup), best/ kept by its eval loss (with_ema/); the
    same without it (without_ema/); then with_ema's step_7 resumed (resumed/). Returns its folder."""
    root = tmp_path_factory.mktemp("ema_2proc")
    train = [TRAIN_MNIST, "--cpu", "--data_dir", digits, *COMMON]
    launch_jobs({
        "with_ema": [*train, *EMA, "--output_dir", root / "with_ema"],
        "without_ema": [*train, "--output_dir", root / "without_ema"],
        # mid-epoch 0: 7 of its 10 optimizer steps done
        "resumed": [*train, *EMA, "--output_dir", root / "resumed", "--resume_from_checkpoint",
                    root / "with_ema" / "step_7"],
    }, launcher_args(2), root)
    return root


@pytest.fixture(scope="module")
def with_ema(two_process_runs):
    """(output_dir, log): log, what both processes printed."""
    return two_process_runs / "with_ema", finished_job(two_process_runs / "with_ema", 2).stdout


@pytest.fixture(scope="module")
def without_ema(two_process_runs):
    finished_job(two_process_runs / "without_ema", 2)
    return two_process_runs / "without_ema"


@pytest.fixture(scope="module")
def one_process_runs(with_ema, without_ema, digits, tmp_path_factory):
    """The 1-process launch, after the 2-process one: --eval_only of with_ema's best/ (eval/), predict.py --weights
    ema on with_ema (ema.csv) and on without_ema (refused: no.csv), and the classifier under --compile with the
    average (classifier/). Each test reads its job (jobs.finished_job). Returns its folder."""
    root = tmp_path_factory.mktemp("ema_1proc")
    (root / "eval").mkdir()
    (root / "eval" / "best").symlink_to(with_ema[0] / "best")
    images = make_split_image_folder(root / "images", train_per_class=8, val_per_class=3)
    jobs = {
        "eval_best": [TRAIN_MNIST, "--cpu", "--data_dir", digits, "--output_dir", root / "eval", "--eval_only",
                      "--resume_from_checkpoint", "best", "--batch_size", "16"],
        "predict_ema": [PREDICT, "--cpu", "--model_dir", with_ema[0], "--data_dir", digits, "--output_file",
                        root / "ema.csv", "--weights", "ema"],
        "predict_without_ema": [PREDICT, "--cpu", "--model_dir", without_ema, "--data_dir", digits, "--output_file",
                                root / "no.csv", "--weights", "ema"],
        # 4 classes x 8 images, batches of 4, 2 per optimizer step: 4 steps per epoch
        "classifier": [CLASSIFIER, "--cpu", "--data_dir", images, "--output_dir", root / "classifier", "--model",
                       "tests.tiny_model:tiny_cnn", "--image_size", "16", "--num_workers", "0", "--batch_size",
                       "4", "--gradient_accumulation_steps", "2", "--epochs", "2", "--optimizer", "adamw",
                       "--learning_rate", "0.002", "--compile", "--model_ema", "--metric_for_best",
                       "eval_ema_accuracy"],
    }
    # started by python with the one thread the launcher would give: accelerate launch's own process adds nothing to
    # one process (the scripts' launched 1-process runs: test_train_mnist.py, test_predict.py and
    # test_image_classifier.py)
    launch_jobs(jobs, [sys.executable], root, env={"OMP_NUM_THREADS": "1"})
    return root


def evaluate_alone(weights: dict, digits, batch_size: int) -> tuple:
    """Plain PyTorch, one process, no Accelerate: correct predictions and mean loss of `weights` on the 203 test
    digits, in batches as the run's evaluation."""
    model = ConvNet()
    model.load_state_dict(weights)
    model.eval()
    images, labels = to_tensor_dataset(*load_mnist_idx(digits)["test"]).tensors
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in images.split(batch_size)])
    loss = F.cross_entropy(logits, labels, reduction="none").double().mean().item()
    return (logits.argmax(-1) == labels).sum().item(), loss


def test_every_process_holds_the_same_average_updated_once_per_optimizer_step(with_ema):
    out, log = with_ema
    r = results(out)
    assert r["num_processes"] == 2 and r["global_step"] == STEPS
    assert r["ema_updates"] == STEPS  # not once per batch: 2 batches per step
    assert (r["model_ema_decay"], r["model_ema_warmup"]) == (0.9998, True)
    assert len(r["ema_parameter_fingerprints"]) == 2 and len(set(r["ema_parameter_fingerprints"])) == 1
    assert len(set(r["ema_buffer_fingerprints"])) == 1  # BatchNorm statistics: rank 0's on both, see utils/run/ema.py
    assert r["ema_parameter_fingerprints"] != r["parameter_fingerprints"]  # an average, not the last weights
    assert 0 < r["eval_ema_loss"] != r["eval_loss"] and 0 < r["eval_ema_accuracy"] <= 1
    assert "averages over about" not in log  # no warning: the warmup suits a 20-step run
    # every checkpoint holds the average, and every file is documented; no log line names a temporary folder
    assert all((out / name / EMA_CHECKPOINT_FILE).is_file() for name in ("step_7", "step_14"))
    assert EMA_CHECKPOINT_FILE in read_json(out / "step_7" / "manifest.json")["files"]  # checked on a resume
    written = sorted(path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file())
    patterns = documented_files()  # the doc's rows for epoch_N/ files are those of step_N/ too
    as_documented = [re.sub(r"^step_(\d+)/", r"epoch_\1/", name) for name in written]
    assert [name for name in as_documented if not any(p.fullmatch(name) for p in patterns)] == []
    assert EMA_WEIGHTS in written and ".tmp-" not in log


def test_the_average_changes_nothing_of_the_training(with_ema, without_ema):
    with_average, without = results(with_ema[0]), results(without_ema)
    for key in ("parameter_fingerprints", "buffer_fingerprints", "train_loss", "eval_accuracy", "eval_loss"):
        assert with_average[key] == without[key], key
    assert (with_ema[0] / "model.safetensors").read_bytes() == (without_ema / "model.safetensors").read_bytes()
    # without --model_ema: no key, no file, no run.json entry of it
    assert not [key for key in without if "ema" in key] and not (without_ema / EMA_WEIGHTS).exists()
    assert sorted(p.name for p in (with_ema[0] / "step_7").iterdir()) == sorted(
        [EMA_CHECKPOINT_FILE, *(p.name for p in (without_ema / "step_7").iterdir())])
    assert "model_ema_decay" not in (without_ema / "run.json").read_text()


def test_a_resumed_run_ends_with_the_uninterrupted_runs_average_bit_for_bit(with_ema, two_process_runs):
    full, resumed = with_ema[0], two_process_runs / "resumed"
    finished_job(two_process_runs / "resumed", 2)
    r, rr = results(full), results(resumed)
    assert rr["resumed_from"].endswith("step_7") and rr["ema_updates"] == STEPS
    assert (resumed / EMA_WEIGHTS).read_bytes() == (full / EMA_WEIGHTS).read_bytes()
    for key in ("ema_parameter_fingerprints", "ema_buffer_fingerprints", "eval_ema_accuracy", "eval_ema_loss",
                "best_epoch", "best_eval_ema_loss"):
        assert rr[key] == r[key], key
    assert (resumed / "best" / "model.safetensors").read_bytes() == (full / "best" / "model.safetensors").read_bytes()


def test_best_holds_the_average_that_one_process_evaluates_as_two_did(with_ema, digits, one_process_runs):
    """best/ keeps the average of the epoch with the lowest eval_ema_loss (here the last), as model.safetensors:
    --eval_only on one process (eval/, its best/ a link to with_ema's) evaluates it as the 2-process run did; and
    plain PyTorch finds the same in model_ema.safetensors."""
    out = with_ema[0]
    r = results(out)
    assert (r["metric_for_best"], r["best_epoch"], r["best_eval_ema_loss"]) == ("eval_ema_loss", 1, r["eval_ema_loss"])
    best, average = load_file(out / "best" / "model.safetensors"), load_file(out / EMA_WEIGHTS)
    assert best.keys() == average.keys() == load_file(out / "model.safetensors").keys()
    assert all(torch.equal(best[key], average[key]) for key in best)

    finished_job(one_process_runs / "eval_best", 1)
    evaluated = read_json(one_process_runs / "eval" / "eval_results.json")
    assert evaluated["eval_accuracy"] == r["eval_ema_accuracy"] < 1 and evaluated["eval_samples"] == 203
    # the loss to the 9th digit: on 2 processes the last batch of 11 digits is padded to 16, and the Linear layer
    # rounds a batch of 16 differently (docs/image_classification.md, results.json)
    assert evaluated["eval_loss"] == pytest.approx(r["eval_ema_loss"], rel=1e-8)

    correct, loss = evaluate_alone(average, digits, batch_size=16)
    assert correct == round(r["eval_ema_accuracy"] * 203) and loss == pytest.approx(r["eval_ema_loss"], rel=1e-5)


def test_eval_only_with_model_ema_evaluates_a_checkpoints_average_on_3_processes(with_ema, digits, tmp_path):
    checkpoint = with_ema[0] / "step_14"
    launch(["--data_dir", digits, "--output_dir", tmp_path, "--eval_only", "--model_ema", "--resume_from_checkpoint",
            checkpoint], num_processes=3)
    evaluated = read_json(tmp_path / "eval_results.json")
    assert evaluated["num_processes"] == 3 and evaluated["eval_samples"] == 203
    state = torch.load(checkpoint / EMA_CHECKPOINT_FILE, weights_only=True)  # AveragedModel's: module.*, n_averaged
    assert state["n_averaged"].item() == 14
    weights = {key.removeprefix("module."): value for key, value in state.items() if key != "n_averaged"}
    correct, loss = evaluate_alone(weights, digits, batch_size=64)
    assert correct == round(evaluated["eval_ema_accuracy"] * 203)
    assert loss == pytest.approx(evaluated["eval_ema_loss"], rel=1e-5)


def test_predict_with_weights_ema_has_the_averages_accuracy_and_refuses_a_run_without_one(with_ema, one_process_runs):
    """One process, jobs of the 1-process launch (predict.py's runs on several: tests/test_predict.py)."""
    out = with_ema[0]
    finished_job(one_process_runs / "predict_ema", 1)
    with open(one_process_runs / "ema.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert sum(row["class_1"] == row["label"] for row in table) / len(table) == results(out)["eval_ema_accuracy"]

    # refused before any work: the one predict.py process that prints a --model_dir refusal (test_predict.py asks its
    # others of main() in the test process; its other refusal in a process: --on_error stop)
    proc = finished_job(one_process_runs / "predict_without_ema", 1, fails=True)
    assert_clean_user_error(proc, f"has no {EMA_WEIGHTS}", "trained without --model_ema", "drop --weights ema")
    assert not (one_process_runs / "no.csv").exists()
    with pytest.raises(UserError, match="or it is a best/ folder"):
        read_trained_run(out / "best", EMA_WEIGHTS)


def test_a_checkpoint_and_the_flags_that_disagree_about_the_average_are_one_line(with_ema, without_ema, digits):
    with pytest.raises(UserError, match="step_7 holds a --model_ema average: add --model_ema to load it too"):
        build_model_ema(None, None, with_ema[0] / "step_7", STEPS, False, None, False)  # --eval_only of it, say
    with pytest.raises(UserError, match=r"step_7 holds no --model_ema average .*; drop --model_ema"):
        build_model_ema(None, None, without_ema / "step_7", STEPS, True, None, False)
    # a resume with another decay (or with or without --model_ema): run.json differs
    mnist = load_script(TRAIN_MNIST)
    args = mnist.parse_args(["--data_dir", str(digits), *COMMON, "--output_dir", str(with_ema[0]), "--model_ema",
                             "--model_ema_decay", "0.99", "--model_ema_warmup"])
    with pytest.raises(UserError, match=r"model_ema_decay 0.9998 -> 0.99\)"):
        check_output_dir(run_folder_of(mnist, args), with_ema[0] / "step_7", args.resume_from_checkpoint)
    # a resume that drops --model_ema (the checkpoint's run.json has keys this run lacks), or adds it
    for out, ema_flags, difference in ((with_ema[0], [], "model_ema_decay 0.9998 -> None"),
                                       (without_ema, ["--model_ema"], "model_ema_decay None -> 0.9998")):
        args = mnist.parse_args(["--data_dir", str(digits), *COMMON, "--output_dir", str(out), *ema_flags])
        with pytest.raises(UserError, match=difference):
            check_output_dir(run_folder_of(mnist, args), out / "step_7", args.resume_from_checkpoint)
    args = mnist.parse_args(["--data_dir", str(digits), *COMMON, "--output_dir", str(without_ema)])
    check_output_dir(run_folder_of(mnist, args), without_ema / "step_7", args.resume_from_checkpoint)  # accepted


# ---------------------------------------------------------------- train_image_classifier.py under --compile


def test_classifier_keeps_the_average_of_the_compiled_model_with_gradient_accumulation(one_process_runs):
    """torch.compile wraps the model; the average is of the plain module inside (the same parameters), saved under
    its names. 4 classes x 8 images, batches of 4, 2 per optimizer step: 4 steps per epoch. The default decay
    without warmup is far too slow for 8 steps: the run says so. One process, a job of the 1-process launch (the
    classifier's runs on several: tests/test_image_classifier.py)."""
    out = one_process_runs / "classifier"
    proc = finished_job(one_process_runs / "classifier", 1)
    r = results(out)
    assert r["compiled"] and r["global_step"] == r["ema_updates"] == 8
    assert {"eval_ema_accuracy", "eval_ema_top5_accuracy", "eval_ema_loss"} <= r.keys()
    assert "--model_ema_decay 0.9998 averages over about 5000 optimizer steps and this run has 8" in \
        proc.stdout + proc.stderr
    average, final = load_file(out / EMA_WEIGHTS), load_file(out / "model.safetensors")
    assert average.keys() == final.keys() and not any(key.startswith("_orig_mod.") for key in average)
    assert not all(torch.equal(average[key], final[key]) for key in average)
    assert load_file(out / "best" / "model.safetensors").keys() == average.keys()
