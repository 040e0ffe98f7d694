"""One --output_dir holds one run (issue 19): each run records what defines it in run.json, with every
checkpoint; a new run refuses another run's checkpoints unless --overwrite_output_dir; a resume refuses a
checkpoint of a different run and trains nothing (writing nothing) when none is left; --eval_only writes its
own eval_results.json about the checkpoint it evaluated, never the training run's results.json.

One train_mnist.py run (mnist_run) serves every test; those that change its folder work on a copy. A script decides
all of this before it trains: one launched process per kind of decision shows the whole path, nothing written
included (a refusal; nothing left to train, on 2 processes); the other decisions are asked in this process (decide),
as the scripts' shared `resume or not` block asks them."""

import json
import logging
import re
import shutil

import pytest
from helpers import (
    REPO,
    TRAIN_MNIST,
    assert_clean_user_error,
    launch,
    load_script,
    results,
    run_alone,
    run_folder_of,
    snapshot,
)
from image_data import make_split_image_folder

from utils.errors import UserError
from utils.run.resume import resolve_checkpoint, resume_point
from utils.run.run_folder import check_output_dir, nothing_left_to_train

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
TINY = ["--epochs", "1", "--max_train_samples", "64", "--max_eval_samples", "64", "--batch_size", "16"]
FAST_CLASSIFIER = ["--model", "resnet18", "--image_size", "32", "--stem", "imagenet", "--optimizer", "adamw",
                   "--warmup_epochs", "0", "--num_workers", "0"]
NOTHING_LEFT = re.compile(r"Nothing left to train: (.*?); model.safetensors and results.json left as they are")


def read_json(path) -> dict:
    return json.loads(path.read_text())


def decide(script, argv, caplog) -> list:
    """What `script` decides with `argv` before it writes anything, asked in this process as its `# shared: resume or
    not` block asks it: raises the UserError it would print; else returns why there is nothing left to train ([] when
    there is something). (Test helper, also used by tests/test_step_based_runs.py.)"""
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's logger needs it
    module = load_script(script)
    args = module.parse_args(["--cpu", *map(str, argv)])
    checkpoint, progress = resume_point(args.resume_from_checkpoint, args.output_dir, args.eval_only)
    folder = run_folder_of(module, args)
    check_output_dir(folder, checkpoint, args.resume_from_checkpoint)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="utils.run.run_folder"):
        left = nothing_left_to_train(folder, progress, checkpoint, args.metric_for_best)
    said = [m.group(1) for record in caplog.records for m in [NOTHING_LEFT.search(record.getMessage())] if m]
    assert bool(said) == left and len(said) <= 1, said
    return said


@pytest.fixture(scope="module")
def mnist_run(synthetic_mnist, tmp_path_factory):
    """(output_dir, its flags): train_mnist.py on 1 process, 4 optimizer steps of 16, best/ by --metric_for_best, a
    checkpoint after step 3 only (so its last checkpoint is not its end), started with --resume_from_checkpoint latest
    in an empty folder (what a restart loop runs every time). Tests that change the folder change a copy."""
    out = tmp_path_factory.mktemp("mnist_run") / "out"
    flags = ["--data_dir", synthetic_mnist, *TINY, "--metric_for_best", "eval_accuracy"]
    launch([*flags, "--output_dir", out, "--checkpointing_steps", "3", "--resume_from_checkpoint", "latest"])
    return out, flags


def copy_of(mnist_run, folder):
    out, flags = mnist_run
    shutil.copytree(out, folder)
    return folder, [*flags, "--output_dir", folder]


def test_train_mnist_keeps_one_run_per_output_dir(mnist_run, synthetic_mnist, caplog):
    out, flags = mnist_run
    common = [*flags, "--output_dir", out]
    assert sorted(p.name for p in out.iterdir()) == [
        "best", "model.safetensors", "results.json", "run.json", "run.lock", "step_3"]
    assert (out / "run.lock").read_bytes() == b""  # no training holds it
    record = read_json(out / "step_3" / "run.json")
    assert record == read_json(out / "run.json") == results(out)["run"]
    assert record["script"] == "train_mnist.py" and record["data"] == str(synthetic_mnist.resolve())
    assert (record["epochs"], record["seed"], record["max_train_samples"], record["learning_rate"]) == (1, 42, 64, 3e-3)
    # (a 2-process run's record: tests/test_step_based_runs.py)
    assert (record["num_processes"], record["batch_size_per_process"], record["global_batch_size"]) == (1, 16, 16)
    first_run = snapshot(out)

    # another run into it: one line naming the folder, what it holds, how the runs differ and the fixes; nothing written
    proc = launch([*common, "--seed", "7"], check=False)
    assert_clean_user_error(proc, f"--output_dir {out} already holds a finished run's files (step_3, best, "
                            "model.safetensors, results.json) of other flags: seed 42 -> 7",
                            "--overwrite_output_dir", "another --output_dir")
    assert snapshot(out) == first_run

    # a resume of it that changes what cannot change: the differences named
    with pytest.raises(UserError, match=r"step_3 was saved by a different run \(max_train_samples 64 -> 32; "
                                        r"seed 42 -> 7\)"):
        decide(TRAIN_MNIST, [*common, "--max_train_samples", "32", "--seed", "7", "--resume_from_checkpoint", "latest"],
               caplog)
    assert snapshot(out) == first_run


def test_a_finished_run_is_left_as_it_is_by_its_own_command_and_refused_to_another(mnist_run, tmp_path, caplog):
    """Issue 29: a restart of a finished run trains nothing, by its record, whatever its last checkpoint: here step_3
    of 4 steps (--checkpointing_steps 3), with or without --resume_from_checkpoint latest (what a restart loop, a
    requeue or scripts/sweep.py run again), on any number of processes: launched on 2, it is said once. A finished
    run without checkpoints (here the one deleted) is refused to another run, also where it left only best/.
    (--overwrite_output_dir deletes all of it, best/ included: the test below.)"""
    out, common = copy_of(mnist_run, tmp_path / "out")
    finished = snapshot(out)
    restart = [*common, "--checkpointing_steps", "3", "--resume_from_checkpoint", "latest"]
    proc = launch(restart, num_processes=2)
    said = re.findall(r"Nothing left to train: (\S+) reports this run finished after step (\d+);", proc.stderr)
    assert said == [(str(out / "results.json"), "4")], proc.stderr[-3000:]
    assert "Resumed from" not in proc.stderr and snapshot(out) == finished
    assert decide(TRAIN_MNIST, common, caplog) == [f"{out / 'results.json'} reports this run finished after step 4"]
    assert snapshot(out) == finished

    shutil.rmtree(out / "step_3")  # no checkpoints: as a run that saved none
    finished = snapshot(out)
    with pytest.raises(UserError, match=re.escape(
            f"--output_dir {out} already holds a finished run's files (best, model.safetensors, results.json) of other "
            "flags: learning_rate 0.003 -> 0.001; pass --overwrite_output_dir")):
        decide(TRAIN_MNIST, [*common, "--learning_rate", "1e-3"], caplog)
    assert snapshot(out) == finished
    # --eval_only evaluates checkpoints: for a finished run's weights it names predict.py
    with pytest.raises(UserError, match=rf"no complete checkpoint in {out}; its model.safetensors .* is evaluated by "
                                        rf"scripts/predict.py --model_dir {out}"):
        resolve_checkpoint("latest", out, eval_only=True)

    # only another run's best/ left (its files deleted by hand): a new run, even with 'latest', is refused
    only_best = tmp_path / "only_best"
    shutil.copytree(out / "best", only_best / "best")
    mnist = load_script(TRAIN_MNIST)
    args = mnist.parse_args([*map(str, common), "--output_dir", str(only_best), "--seed", "7",
                             "--resume_from_checkpoint", "latest"])
    with pytest.raises(UserError, match=r"already holds another run's files \(best\) of other flags: seed 42 -> 7"):
        check_output_dir(run_folder_of(mnist, args), None, args.resume_from_checkpoint)


def test_train_image_classifier_keeps_one_run_per_output_dir(mnist_run, tmp_path, caplog):
    """The image script's run records itself; with --overwrite_output_dir it replaces the MNIST run in its folder
    (nothing of it left, best/ included); its own decisions, and --eval_only's file, as train_mnist.py's above."""
    folder = make_split_image_folder(tmp_path / "images")
    out, _ = copy_of(mnist_run, tmp_path / "out")
    common = [*FAST_CLASSIFIER, "--data_dir", folder, "--output_dir", out, *TINY, "--seed", "7"]

    # --overwrite_output_dir: nothing of the old run is left, best/ included; its checkpoints gone, 'latest' can only
    # find the new run's
    launch([*common, "--checkpointing_steps", "epoch", "--overwrite_output_dir"], script=CLASSIFIER)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "model.safetensors", "results.json", "run.json",
                                                     "run.lock"]
    record = read_json(out / "epoch_0" / "run.json")
    assert record == read_json(out / "run.json") and record["seed"] == 7 and record["num_processes"] == 1
    assert record["script"] == "train_image_classifier.py" and record["model"] == "resnet18"
    assert (record["image_size"], record["augmentation"], record["epochs"], record["global_batch_size"]) == (
        32, "small", 1, 16)
    trained = results(out)
    assert trained["seed"] == 7 and trained["global_step"] == 4  # 64 samples / 16 on one process
    first_run = snapshot(out)

    # --epochs may change on a resume (the cosine is recomputed from it), --image_size may not
    with pytest.raises(UserError) as refused:
        decide(CLASSIFIER, [*common, "--image_size", "48", "--epochs", "3", "--resume_from_checkpoint", "latest"],
               caplog)
    assert "epoch_0" in str(refused.value) and "image_size 32 -> 48" in str(refused.value)
    assert "epochs" not in str(refused.value)
    # a resume with nothing left, by its checkpoint (launched, on another process count: the test above)
    assert decide(CLASSIFIER, [*common, "--resume_from_checkpoint", "latest"], caplog) == [
        f"{out / 'epoch_0'} has 1 epochs done (step 4) and --epochs is 1"]
    assert snapshot(out) == first_run

    # --eval_only (with the script's default --epochs): its own file about the checkpoint, and its numbers printed
    # (run alone: launched --eval_only runs are in tests/test_train_mnist.py and tests/test_model_ema.py)
    proc = run_alone([*FAST_CLASSIFIER, "--data_dir", folder, "--output_dir", out, "--max_eval_samples", "64",
                      "--eval_only", "--resume_from_checkpoint", "latest"], script=CLASSIFIER)
    evaluated = read_json(out / "eval_results.json")
    assert {k: v for k, v in snapshot(out).items() if k != "eval_results.json"} == first_run
    assert evaluated["checkpoint"] == str(out / "epoch_0")
    assert (evaluated["checkpoint_epochs_done"], evaluated["checkpoint_global_step"]) == (1, 4)
    assert evaluated["run"] == read_json(out / "run.json") and evaluated["run"]["epochs"] == 1
    assert evaluated["run"]["seed"] == 7 and "epochs" not in evaluated
    assert "lr_scheduler_steps" not in evaluated and "train_loss" not in evaluated and "train_time_s" not in evaluated
    assert (evaluated["eval_samples"], evaluated["num_processes"]) == (64, 1)
    assert evaluated["eval_top5_accuracy"] == 1.0  # 4 classes: top-5 holds them all
    # the same weights on the same 64 images as the training run's own last evaluation
    assert evaluated["eval_accuracy"] == trained["eval_accuracy"]
    printed = re.findall(r"Evaluated (\S+) \(after 1 epochs, step 4\): eval_accuracy ([\d.]+), eval_top5_accuracy "
                         r"1.0000, eval_loss ([\d.]+) on 64 samples", proc.stdout)
    assert printed == [(str(out / "epoch_0"), f"{evaluated['eval_accuracy']:.4f}", f"{evaluated['eval_loss']:.4f}")]

    # its own command again, where no checkpoint is left: nothing trained (by its record)
    shutil.rmtree(out / "epoch_0")
    (out / "eval_results.json").unlink()
    assert decide(CLASSIFIER, [*common, "--checkpointing_steps", "epoch", "--resume_from_checkpoint", "latest"],
                  caplog) == [f"{out / 'results.json'} reports this run finished after step 4"]


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
