"""One --output_dir holds one run (issue 19): each run records what defines it in run.json, with every
checkpoint; a new run refuses another run's checkpoints unless --overwrite_output_dir; a resume refuses a
checkpoint of a different run and trains nothing (writing nothing) when none is left; --eval_only writes its
own eval_results.json about the checkpoint it evaluated, never the training run's results.json."""

import json
import re

from helpers import REPO, assert_clean_user_error, error_lines, launch, results, snapshot
from image_data import make_split_image_folder

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
TINY = ["--epochs", "1", "--max_train_samples", "64", "--max_eval_samples", "64", "--batch_size", "16"]
FAST_CLASSIFIER = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
                   "--warmup_epochs", "0", "--num_workers", "0"]


def read_json(path) -> dict:
    return json.loads(path.read_text())


def test_train_mnist_keeps_one_run_per_output_dir(synthetic_mnist, tmp_path):
    out = tmp_path / "out"
    common = ["--data_dir", synthetic_mnist, "--output_dir", out, *TINY]

    # 2 processes x 16: 2 optimizer steps, a checkpoint after each
    launch([*common, "--checkpointing_steps", "1"], num_processes=2)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "results.json", "run.json", "step_1", "step_2"]
    record = read_json(out / "step_2" / "run.json")
    assert record == read_json(out / "run.json")
    assert record["script"] == "train_mnist.py" and record["data"] == str(synthetic_mnist.resolve())
    assert (record["epochs"], record["seed"], record["max_train_samples"], record["learning_rate"]) == (1, 42, 64, 3e-3)
    assert (record["num_processes"], record["batch_size_per_process"], record["global_batch_size"]) == (2, 16, 32)
    first_run = snapshot(out)

    # a new run into it: one line naming the folder and both fixes, nothing written
    proc = launch(common, check=False)
    assert_clean_user_error(proc, str(out), "step_1, step_2", "--overwrite_output_dir", "--resume_from_checkpoint latest")
    assert snapshot(out) == first_run

    # a resume of it that changes what cannot change: the differences named, nothing written
    proc = launch([*common, "--max_train_samples", "32", "--seed", "7", "--resume_from_checkpoint", "latest"],
                  check=False)
    assert_clean_user_error(proc, "step_2", "max_train_samples 64 -> 32", "seed 42 -> 7")
    assert snapshot(out) == first_run

    # --overwrite_output_dir: the old run's checkpoints are gone, so 'latest' can only find the new run's
    launch([*common, "--overwrite_output_dir", "--checkpointing_steps", "epoch", "--seed", "7"])
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "model.safetensors", "results.json", "run.json"]
    assert read_json(out / "epoch_0" / "run.json")["seed"] == 7 and read_json(out / "run.json")["num_processes"] == 1
    trained = results(out)
    assert trained["seed"] == 7 and trained["global_step"] == 4  # 64 samples / 16 on one process
    second_run = snapshot(out)

    # a resume with nothing left (on 2 processes: the process count may change): said once, exit 0, nothing written
    proc = launch([*common, "--seed", "7", "--resume_from_checkpoint", "latest"], num_processes=2)
    said = re.findall(r"Nothing left to train: (\S+) has (\d+) epochs done \(step (\d+)\) and --epochs is (\d+)",
                      proc.stdout + proc.stderr)
    assert said == [(str(out / "epoch_0"), "1", "4", "1")]
    assert snapshot(out) == second_run

    # --eval_only (with the default --epochs 3): its own file about the checkpoint, and its numbers printed
    proc = launch(["--data_dir", synthetic_mnist, "--output_dir", out, "--max_eval_samples", "64", "--eval_only",
                   "--resume_from_checkpoint", "latest"])
    evaluated = read_json(out / "eval_results.json")
    assert {k: v for k, v in snapshot(out).items() if k != "eval_results.json"} == second_run
    assert evaluated["checkpoint"] == str(out / "epoch_0")
    assert (evaluated["checkpoint_epochs_done"], evaluated["checkpoint_global_step"]) == (1, 4)
    assert evaluated["run"]["epochs"] == 1 and evaluated["run"]["seed"] == 7 and "epochs" not in evaluated
    assert "train_loss" not in evaluated and "train_time_s" not in evaluated
    assert (evaluated["eval_samples"], evaluated["num_processes"]) == (64, 1)
    # the same weights on the same 64 samples as the training run's own last evaluation
    assert evaluated["eval_accuracy"] == trained["eval_accuracy"]
    printed = re.findall(r"Evaluated (\S+) \(after 1 epochs, step 4\): eval_accuracy ([\d.]+), eval_loss ([\d.]+) "
                         r"on 64 samples", proc.stdout)
    assert printed == [(str(out / "epoch_0"), f"{evaluated['eval_accuracy']:.4f}", f"{evaluated['eval_loss']:.4f}")]


def test_train_image_classifier_keeps_one_run_per_output_dir(tmp_path):
    folder = make_split_image_folder(tmp_path / "images")
    out = tmp_path / "out"
    common = [*FAST_CLASSIFIER, "--data_dir", folder, "--output_dir", out, *TINY]

    launch([*common, "--checkpointing_steps", "epoch"], script=CLASSIFIER)
    record = read_json(out / "epoch_0" / "run.json")
    assert record["script"] == "train_image_classifier.py" and record["model"] == "resnet18"
    assert (record["image_size"], record["augmentation"], record["epochs"], record["global_batch_size"]) == (
        32, "small", 1, 16)
    first_run = snapshot(out)

    # (a new run refused and a resume with nothing left: the shared blocks, tested on train_mnist.py above)
    # --epochs may change on a resume (the cosine is recomputed from it), --image_size may not
    proc = launch([*common, "--image_size", "48", "--epochs", "3", "--resume_from_checkpoint", "latest"],
                  script=CLASSIFIER, check=False)
    assert_clean_user_error(proc, "epoch_0", "image_size 32 -> 48")
    assert "epochs" not in error_lines(proc)[0]
    assert snapshot(out) == first_run

    proc = launch([*FAST_CLASSIFIER, "--data_dir", folder, "--output_dir", out, "--max_eval_samples", "64",
                   "--eval_only", "--resume_from_checkpoint", "latest"], script=CLASSIFIER)
    evaluated = read_json(out / "eval_results.json")
    assert {k: v for k, v in snapshot(out).items() if k != "eval_results.json"} == first_run
    assert (evaluated["checkpoint"], evaluated["checkpoint_global_step"]) == (str(out / "epoch_0"), 4)
    assert evaluated["run"] == read_json(out / "run.json") and evaluated["run"]["epochs"] == 1
    assert "lr_scheduler_steps" not in evaluated and "train_loss" not in evaluated
    assert evaluated["eval_top5_accuracy"] == 1.0  # 4 classes: top-5 holds them all
    assert evaluated["eval_accuracy"] == results(out)["eval_accuracy"]  # the same weights, the same 64 images
    assert f"eval_accuracy {evaluated['eval_accuracy']:.4f}" in proc.stdout


def test_overwrite_output_dir_and_resume_are_one_line_together(capsys):
    from utils.flags import build_mnist_parser, check_flag_combinations

    parser = build_mnist_parser("test")
    for checkpoint in ("latest", "outputs/step_4"):  # 'latest', or a checkpoint by name
        args = parser.parse_args(["--overwrite_output_dir", "--resume_from_checkpoint", checkpoint])
        try:
            check_flag_combinations(parser, args)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"--overwrite_output_dir with --resume_from_checkpoint {checkpoint} was accepted")
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and "--overwrite_output_dir" in line and "--resume_from_checkpoint" in line
