"""One --output_dir holds one run (issue 19): each run records what defines it in run.json, with every
checkpoint; a new run refuses another run's checkpoints unless --overwrite_output_dir; a resume refuses a
checkpoint of a different run and trains nothing (writing nothing) when none is left; --eval_only writes its
own eval_results.json about the checkpoint it evaluated, never the training run's results.json."""

import json
import re
import shutil

import pytest
from helpers import (
    REPO,
    TRAIN_MNIST,
    assert_clean_user_error,
    error_lines,
    launch,
    load_script,
    results,
    run_alone,
    run_folder_of,
    snapshot,
)
from image_data import make_split_image_folder

from utils.errors import UserError
from utils.run.resume import resolve_checkpoint
from utils.run.run_folder import check_output_dir

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
TINY = ["--epochs", "1", "--max_train_samples", "64", "--max_eval_samples", "64", "--batch_size", "16"]
FAST_CLASSIFIER = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
                   "--warmup_epochs", "0", "--num_workers", "0"]


def read_json(path) -> dict:
    return json.loads(path.read_text())


def test_train_mnist_keeps_one_run_per_output_dir(synthetic_mnist, tmp_path):
    out = tmp_path / "out"
    common = ["--data_dir", synthetic_mnist, "--output_dir", out, *TINY]

    # 2 processes x 16: 2 optimizer steps, a checkpoint after each; best/ by --metric_for_best
    launch([*common, "--checkpointing_steps", "1", "--metric_for_best", "eval_accuracy"], num_processes=2)
    assert sorted(p.name for p in out.iterdir()) == [
        "best", "model.safetensors", "results.json", "run.json", "run.lock", "step_1", "step_2"]
    assert (out / "run.lock").read_bytes() == b""  # no training holds it
    record = read_json(out / "step_2" / "run.json")
    assert record == read_json(out / "run.json") == results(out)["run"]
    assert record["script"] == "train_mnist.py" and record["data"] == str(synthetic_mnist.resolve())
    assert (record["epochs"], record["seed"], record["max_train_samples"], record["learning_rate"]) == (1, 42, 64, 3e-3)
    assert (record["num_processes"], record["batch_size_per_process"], record["global_batch_size"]) == (2, 16, 32)
    first_run = snapshot(out)

    # another run into it: one line naming the folder, what it holds, how the runs differ and the fixes; nothing written
    proc = launch([*common, "--seed", "7"], check=False)
    assert_clean_user_error(proc, f"--output_dir {out} already holds a finished run's files (step_1, step_2, "
                            "best, model.safetensors, results.json) of other flags: seed 42 -> 7",
                            "--overwrite_output_dir", "another --output_dir")
    assert snapshot(out) == first_run

    # a resume of it that changes what cannot change: the differences named, nothing written
    proc = launch([*common, "--max_train_samples", "32", "--seed", "7", "--resume_from_checkpoint", "latest"],
                  check=False)
    assert_clean_user_error(proc, "step_2", "max_train_samples 64 -> 32", "seed 42 -> 7")
    assert snapshot(out) == first_run

    # --overwrite_output_dir: nothing of the old run is left, best/ included; its checkpoints gone, 'latest' can only
    # find the new run's
    launch([*common, "--overwrite_output_dir", "--checkpointing_steps", "epoch", "--seed", "7"])
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "model.safetensors", "results.json", "run.json",
                                                     "run.lock"]
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


def test_a_finished_run_is_left_as_it_is_by_its_own_command_and_refused_to_another(synthetic_mnist, tmp_path):
    """Issue 29: a restart of a finished run trains nothing, by its record, whatever its last checkpoint: here step_3
    of 4 steps (--checkpointing_steps 3), with or without --resume_from_checkpoint latest (what a restart loop, a
    requeue or scripts/sweep.py run again). A finished run without checkpoints (here the one deleted) is refused to
    another run, also where it left only best/. (--overwrite_output_dir deletes all of it, best/ included: the test
    above.) The launched forms of the decisions run alone here: the test above."""
    out = tmp_path / "out"
    # 1 process: 4 optimizer steps of 16; best/ by --metric_for_best
    common = ["--data_dir", synthetic_mnist, "--output_dir", out, *TINY, "--metric_for_best", "eval_accuracy"]
    launch([*common, "--checkpointing_steps", "3", "--resume_from_checkpoint", "latest"])
    assert sorted(p.name for p in out.iterdir()) == ["best", "model.safetensors", "results.json", "run.json",
                                                     "run.lock", "step_3"]
    finished = snapshot(out)
    for again, start in ((["--checkpointing_steps", "3", "--resume_from_checkpoint", "latest"], launch),
                         ([], run_alone)):
        proc = start([*common, *again])
        said = re.findall(r"Nothing left to train: (\S+) reports this run finished after step (\d+);", proc.stderr)
        assert said == [(str(out / "results.json"), "4")], proc.stderr[-3000:]
        assert "Resumed from" not in proc.stderr and snapshot(out) == finished

    shutil.rmtree(out / "step_3")  # no checkpoints: as a run that saved none
    finished = snapshot(out)
    proc = run_alone([*common, "--learning_rate", "1e-3"], check=False)
    assert_clean_user_error(proc, f"--output_dir {out} already holds a finished run's files (best, "
                            "model.safetensors, results.json) of other flags: learning_rate 0.003 -> 0.001",
                            "--overwrite_output_dir")
    assert snapshot(out) == finished
    # --eval_only evaluates checkpoints: for a finished run's weights it names predict.py
    with pytest.raises(UserError, match=rf"no complete checkpoint in {out}; its model.safetensors .* is evaluated by "
                                        rf"scripts/predict.py --model_dir {out}"):
        resolve_checkpoint("latest", out, eval_only=True)

    # only another run's best/ left (its files deleted by hand): a new run, even with 'latest', is refused
    only_best = tmp_path / "only_best"
    shutil.copytree(out / "best", only_best / "best")
    mnist = load_script(TRAIN_MNIST)
    args = mnist.parse_args(["--data_dir", str(synthetic_mnist), "--output_dir", str(only_best), *map(str, TINY),
                             "--seed", "7", "--resume_from_checkpoint", "latest"])
    with pytest.raises(UserError, match=r"already holds another run's files \(best\) of other flags: seed 42 -> 7"):
        check_output_dir(run_folder_of(mnist, args), None, args.resume_from_checkpoint)


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

    # (a new run refused and a resume with nothing left: the shared blocks, tested on train_mnist.py above; those
    # launched there, the decisions below run the script alone)
    # --epochs may change on a resume (the cosine is recomputed from it), --image_size may not
    proc = run_alone([*common, "--image_size", "48", "--epochs", "3", "--resume_from_checkpoint", "latest"],
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

    # its own command again, where no checkpoint is left: nothing trained, nothing written (by its record)
    shutil.rmtree(out / "epoch_0")
    (out / "eval_results.json").unlink()
    finished = snapshot(out)
    proc = run_alone([*common, "--checkpointing_steps", "epoch", "--resume_from_checkpoint", "latest"],
                     script=CLASSIFIER)
    assert f"Nothing left to train: {out / 'results.json'} reports this run finished after step 4" in proc.stderr
    assert snapshot(out) == finished


def test_overwrite_output_dir_and_resume_are_one_line_together(capsys):
    from utils.launch.flags import build_mnist_parser, check_flag_combinations

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
