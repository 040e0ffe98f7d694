"""The run-folder decisions of utils/run/run_folder.py, asked in this process on folders written here: which
--output_dir a command may train into, when it has nothing left to train, what --overwrite_output_dir deletes, and the
lock's folder. (tests/test_run_records.py launches the scripts through the same decisions; these take milliseconds
each, so that the mutation run of docs/testing.md, "Mutation testing", can run them for every mutant.)"""

import json
import logging
import multiprocessing
import os
import re
import socket

import pytest

from utils.errors import UserError
from utils.output_files import LOCK
from utils.run.progress import TrainingProgress
from utils.run.run_folder import (
    RunFolder,
    check_output_dir,
    differences,
    nothing_left_to_train,
    one_training_at_a_time,
    read_results,
    run_files_held,
    start_output_dir,
)

RUN = {"script": "train_mnist.py", "model": "ConvNet", "seed": 42, "learning_rate": 0.003}
NOTHING_LEFT = re.compile(r"^Nothing left to train: (.*); model.safetensors and results.json left as they are \(to "
                          r"train further: (.*)\)$")


@pytest.fixture(autouse=True)
def main_process(accelerate_state, monkeypatch):
    """Accelerate's logger has its state (conftest); RANK unset: this process is a run's main process."""
    monkeypatch.delenv("RANK", raising=False)


def message(record) -> str:
    """A log record's line without the "[RANK 0] " that Accelerate's logger puts before it."""
    return re.sub(r"^\[RANK \d+\] ", "", record.getMessage())


def write_json(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def run_json(folder: RunFolder, num_processes=1) -> dict:
    """OUTPUT_DIR/run.json as start_output_dir writes it (batch 16 per process, no accumulation)."""
    return {**folder.record, "num_processes": num_processes, "batch_size_per_process": 16,
            "gradient_accumulation_steps": 1, "global_batch_size": 16 * num_processes}


def checkpoint(out, name, record, **progress) -> object:
    """A complete checkpoint of the run `record` (training_state.json, run.json; no manifest: loads as it is)."""
    write_json(out / name / "training_state.json", vars(TrainingProgress(**progress)))
    if record is not None:
        write_json(out / name / "run.json", record)
    return out / name


def trained(folder: RunFolder, finished=True, **progress) -> dict:
    """A run of `folder`'s command in its folder, as the scripts leave it: run.json, checkpoint step_N (N:
    progress's global_step), and when finished model.safetensors and results.json (whose `run` is run.json)."""
    out, record = folder.path, run_json(folder)
    write_json(out / "run.json", record)
    checkpoint(out, f"step_{progress.get('global_step', 0)}", record, **progress)
    if finished:
        (out / "model.safetensors").write_bytes(b"weights")
        write_json(out / "results.json", {"run": record, "global_step": progress.get("global_step", 0)})
    return record


def said_nothing_left(caplog, folder, progress, checkpoint_=None, metric="eval_accuracy"):
    """nothing_left_to_train's answer and its line, (why, to train further), or None where it says none."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="utils.run.run_folder"):
        left = nothing_left_to_train(folder, progress, checkpoint_, metric)
    lines = [NOTHING_LEFT.match(message(record)) for record in caplog.records]
    assert all(lines) and len(lines) == int(left), [message(record) for record in caplog.records]
    return lines[0].groups() if lines else None


def refused(folder, checkpoint_=None, resume=None) -> str:
    with pytest.raises(UserError) as error:
        check_output_dir(folder, checkpoint_, resume)
    return str(error.value)


# --overwrite_output_dir, and what a run records


def test_overwrite_deletes_every_file_of_the_old_run_the_average_included_and_nothing_of_the_users(tmp_path, caplog):
    """Issue 43 #4: a --model_ema run overwritten by a run without it must not leave its model_ema.safetensors, which
    `predict.py --weights ema` would read as the new run's. The user's own files stay."""
    out = tmp_path / "out"
    old = RunFolder(out, {**RUN, "model_ema": 0.999}, epochs=2)
    trained(old, global_step=8)
    checkpoint(out, "epoch_1", run_json(old), epoch=1, global_step=4)
    checkpoint(out, "best", run_json(old), epoch=1, global_step=4)
    (out / ".tmp-step_9").mkdir()
    for name in ("model_ema.safetensors", "eval_results.json", "notes.txt", "step_x", "step_3.bak"):
        (out / name).write_text("x")
    (out / "logs").mkdir()
    new = RunFolder(out, RUN, epochs=3, max_steps=None, early_stopping_patience=None, overwrite=True)
    with caplog.at_level(logging.INFO, logger="utils.run.run_folder"):
        start_output_dir(new, TrainingProgress().with_batch(2, 16, 3), batch_size=16, accumulation=3)
    assert sorted(path.name for path in out.iterdir()) == ["logs", "notes.txt", "run.json", "step_3.bak", "step_x"]
    assert [message(record) for record in caplog.records] == [
        f"--overwrite_output_dir: deleted .tmp-step_9, best, epoch_1, eval_results.json, model.safetensors, "
        f"model_ema.safetensors, results.json, run.json, step_8 in {out}"]
    assert json.loads((out / "run.json").read_text()) == {
        **RUN, "epochs": 3, "max_steps": None, "early_stopping_patience": None, "num_processes": 2,
        "batch_size_per_process": 16, "gradient_accumulation_steps": 3, "global_batch_size": 96}


def test_a_new_folder_is_made_and_recorded_and_eval_only_records_nothing(tmp_path, caplog):
    new = RunFolder(tmp_path / "a" / "out", RUN, epochs=1, max_steps=5, early_stopping_patience=2, overwrite=True)
    with caplog.at_level(logging.INFO, logger="utils.run.run_folder"):
        start_output_dir(new, TrainingProgress().with_batch(1, 8, 1), batch_size=8, accumulation=1)
    assert caplog.records == []  # nothing deleted: nothing said
    assert json.loads((new.path / "run.json").read_text()) == {
        **RUN, "epochs": 1, "max_steps": 5, "early_stopping_patience": 2, "num_processes": 1,
        "batch_size_per_process": 8, "gradient_accumulation_steps": 1, "global_batch_size": 8}
    evaluation = RunFolder(tmp_path / "eval", RUN, epochs=1, eval_only=True)
    start_output_dir(evaluation, TrainingProgress(), batch_size=8, accumulation=1)
    assert evaluation.path.is_dir() and list(evaluation.path.iterdir()) == []


# check_output_dir: which folder a command may train into


def test_the_run_folder_of_a_resume_is_the_checkpoints_folder_however_either_is_spelled(tmp_path, monkeypatch):
    """Issue 43 #11: `--output_dir out --resume_from_checkpoint $PWD/out/step_2` continues the run in out (the
    paths compared resolved), as do `./out/`, and a link to out; a checkpoint of another folder is refused."""
    monkeypatch.chdir(tmp_path)
    record = trained(RunFolder(tmp_path / "out", RUN, epochs=2), finished=False, global_step=2)
    (tmp_path / "link").symlink_to(tmp_path / "out")
    for output_dir, step_2 in (("out", tmp_path / "out" / "step_2"), ("./out/", "out/step_2"),
                               (tmp_path / "out", "./out/../out/step_2"), ("link", "out/step_2")):
        check_output_dir(RunFolder(output_dir, RUN, epochs=2), step_2, str(step_2))
    elsewhere = checkpoint(tmp_path / "other", "step_2", record, global_step=2)
    assert refused(RunFolder("out", RUN, epochs=2), elsewhere, str(elsewhere)) == (
        f"--output_dir out already holds another run's files (step_2); continue {elsewhere} in another --output_dir")


def test_a_new_run_is_refused_a_folder_holding_another_runs_files(tmp_path):
    out = tmp_path / "out"
    trained(RunFolder(out, RUN, epochs=2), finished=False, global_step=2)
    other = RunFolder(out, {**RUN, "seed": 7}, epochs=2)
    for resume in (None, "latest"):
        assert refused(other, resume=resume) == (
            f"--output_dir {out} already holds another run's files (step_2) of other flags: seed 42 -> 7; pass "
            f"--overwrite_output_dir to delete them and start afresh, or choose another --output_dir")
    for name in ("model.safetensors", "model_ema.safetensors", "results.json"):  # each alone, even unreadable
        (out / name).write_text("x")
    checkpoint(out, "best", None, global_step=1)
    assert refused(other).startswith(f"--output_dir {out} already holds another run's files (step_2, best, "
                                     f"model.safetensors, model_ema.safetensors, results.json) of other flags: seed")
    check_output_dir(RunFolder(out, {**RUN, "seed": 7}, epochs=2, overwrite=True), None, None)  # deleted later
    check_output_dir(RunFolder(out, {**RUN, "seed": 7}, epochs=2, eval_only=True), None, None)  # writes its own file


def test_each_file_of_a_run_alone_is_held_and_nothing_else_is(tmp_path):
    out = tmp_path / "out"
    assert run_files_held(out) == []
    out.mkdir()
    for name in ("notes.txt", "run.json", "eval_results.json", "run.lock", "step_3.tmp", ".tmp-step_4"):
        (out / name).write_text("x")
    (out / "best").mkdir()  # a best/ without its training_state.json: an interrupted copy, not a run's
    (out / "step_5").mkdir()
    assert run_files_held(out) == []
    for name in ("model.safetensors", "model_ema.safetensors", "results.json"):
        (out / name).write_text("x")
        assert run_files_held(out)[-1] == name
        (out / name).unlink()
    (out / "epoch_2").mkdir()
    (out / "epoch_2" / "training_state.json").write_text("damaged")  # a damaged checkpoint is a run's too
    checkpoint(out, "step_1", None, global_step=1)
    checkpoint(out, "best", None, global_step=1)
    assert sorted(run_files_held(out)) == ["best", "epoch_2", "step_1"]


def test_this_runs_unfinished_checkpoints_are_continued_only_with_latest(tmp_path):
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=2)
    record = trained(folder, finished=False, global_step=2)
    checkpoint(out, "step_1", record, global_step=1)
    assert refused(folder) == (
        f"--output_dir {out} already holds this run's checkpoints (step_1, step_2); continue it with "
        f"--resume_from_checkpoint latest, or pass --overwrite_output_dir to delete them and start afresh")
    check_output_dir(folder, out / "step_2", "latest")
    # a restart with 'latest' before the first good checkpoint (the checkpoint damaged: none to resume from)
    check_output_dir(folder, None, "latest")
    check_output_dir(RunFolder(out, RUN, epochs=3), None, "latest")  # its length may change
    assert "of other flags: seed 42 -> 7" in refused(RunFolder(out, {**RUN, "seed": 7}, epochs=2), None, "latest")
    assert refused(folder, None, str(out / "step_2")).startswith(f"--output_dir {out} already holds this run's")
    (out / "model.safetensors").write_text("x")  # it had ended (its results.json lost): not a restart
    assert refused(folder, None, "latest").startswith(f"--output_dir {out} already holds this run's checkpoints")


def test_the_record_of_a_folder_is_its_results_else_its_run_json_else_best(tmp_path):
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=2)
    checkpoint(out, "best", run_json(RunFolder(out, {**RUN, "seed": 1}, epochs=2)), global_step=1)
    assert refused(folder).endswith("(best) of other flags: seed 1 -> 42; pass --overwrite_output_dir to delete them "
                                    "and start afresh, or choose another --output_dir")
    write_json(out / "run.json", run_json(RunFolder(out, {**RUN, "seed": 2}, epochs=2)))
    assert "of other flags: seed 2 -> 42;" in refused(folder)
    write_json(out / "results.json", {"run": run_json(RunFolder(out, {**RUN, "seed": 3}, epochs=2))})
    assert "a finished run's files (best, results.json) of other flags: seed 3 -> 42;" in refused(folder)
    write_json(out / "results.json", {"run": None})  # a results.json without a record: best/'s
    assert "a finished run's files (best, results.json) of other flags: seed 2 -> 42;" in refused(folder)
    (out / "run.json").unlink()
    (out / "best" / "run.json").unlink()  # no record anywhere: every key of this run's is named
    assert refused(folder) == (
        f"--output_dir {out} already holds a finished run's files (best, results.json) of other flags: script None -> "
        f"'train_mnist.py'; model None -> 'ConvNet'; seed None -> 42; learning_rate None -> 0.003; epochs None -> 2; "
        f"pass --overwrite_output_dir to delete them and "
        f"start afresh, or choose another --output_dir")


def test_a_checkpoint_of_another_run_is_refused_and_one_without_a_record_warned_about(tmp_path, caplog):
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=2)
    theirs = checkpoint(tmp_path / "theirs", "step_4", {**RUN, "seed": 7, "model_ema": 0.9, "num_processes": 8},
                        global_step=4)
    with pytest.raises(UserError) as error:
        check_output_dir(folder, theirs, str(theirs))
    assert str(error.value) == (f"{theirs} was saved by a different run (seed 7 -> 42; model_ema 0.9 -> None); resume "
                                f"with its values, or start a new run in another --output_dir")
    ours = checkpoint(tmp_path / "ours", "step_4", {**RUN, "epochs": 1, "num_processes": 8}, global_step=4)
    check_output_dir(folder, ours, str(ours))  # what a resume may change differs only
    old = checkpoint(tmp_path / "old", "step_4", None, global_step=4)
    with caplog.at_level(logging.WARNING):
        check_output_dir(folder, old, str(old))
    assert [message(record) for record in caplog.records] == [
        f"{old} has no run.json (saved by an older version): cannot check that it is of this run"]


def test_differences_name_each_changed_key_and_each_key_only_the_recorded_run_has_bar_the_resumable():
    assert differences({"a": 1, "b": "x", "c": 3, "num_processes": 2, "epochs": 4},
                       {"a": 1, "b": "y", "d": None, "e": 0}) == ["b 'x' -> 'y'", "e None -> 0", "c 3 -> None"]
    assert differences({}, {}) == [] and differences({"a": 0.0}, {"a": 0}) == []


def test_results_are_read_only_when_they_are_a_json_object(tmp_path):
    assert read_results(tmp_path) is None
    for text, expected in (("[1]", None), ("{", None), ('{"global_step": 3}', {"global_step": 3})):
        (tmp_path / "results.json").write_text(text)
        assert read_results(tmp_path) == expected
    (tmp_path / "results.json").unlink()
    (tmp_path / "results.json").mkdir()
    assert read_results(tmp_path) is None


# nothing_left_to_train: a command whose run is done says so and writes nothing


def test_a_finished_run_is_done_for_its_own_command_only_with_its_own_length(tmp_path, caplog):
    """Issue 43 #5: a run that stopped early, started again with a higher --early_stopping_patience (what its own
    line tells users to do), trains on; the same command has nothing left. Likewise its --epochs and --max_steps."""
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=5, max_steps=None, early_stopping_patience=2)
    trained(folder, epoch=3, global_step=12, evaluations_without_improvement=2, best_epoch=0)
    step_12 = out / "step_12"
    stopped = TrainingProgress(epoch=3, global_step=12, evaluations_without_improvement=2, best_epoch=0)
    check_output_dir(folder, None, None)
    assert said_nothing_left(caplog, folder, TrainingProgress()) == (
        f"{out / 'results.json'} reports this run finished after step 12", "train_image_classifier.py continues from "
        "the last checkpoint with a higher --epochs or --max_steps; to train it again, --overwrite_output_dir or "
        "another --output_dir")
    assert said_nothing_left(caplog, folder, stopped, step_12, "eval_loss") == (
        f"{step_12} stopped early: eval_loss has not improved for 2 evaluations (--early_stopping_patience 2)",
        "a higher --early_stopping_patience")
    longer = RunFolder(out, RUN, epochs=5, early_stopping_patience=3)
    check_output_dir(longer, step_12, "latest")
    assert said_nothing_left(caplog, longer, stopped, step_12) is None
    for more in (RunFolder(out, RUN, epochs=6, early_stopping_patience=2),
                 RunFolder(out, RUN, epochs=5, max_steps=20, early_stopping_patience=2)):
        check_output_dir(more, step_12, "latest")  # not this run's end by its results: by its checkpoint, stopped
        assert said_nothing_left(caplog, more, stopped, step_12)[0].startswith(f"{step_12} stopped early"), more
    for other in (longer, RunFolder(out, RUN, epochs=6, early_stopping_patience=2)):
        assert "a finished run's files (step_12, model.safetensors, results.json) of other flags: " in refused(other)
    assert refused(RunFolder(out, RUN, epochs=5, early_stopping_patience=3)).endswith(
        "of other flags: early_stopping_patience 2 -> 3; pass --overwrite_output_dir to delete them and start afresh, "
        "or choose another --output_dir")
    # the same run's files, unfinished: said by the checkpoint only
    (out / "results.json").unlink()
    assert said_nothing_left(caplog, folder, TrainingProgress()) is None
    assert said_nothing_left(caplog, RunFolder(out, RUN, epochs=5, early_stopping_patience=3), stopped, step_12) is None


def test_overwrite_and_eval_only_always_have_something_to_do(tmp_path, caplog):
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=1)
    trained(folder, epoch=1, global_step=4)
    assert said_nothing_left(caplog, folder, TrainingProgress()) is not None
    for again in (RunFolder(out, RUN, epochs=1, overwrite=True), RunFolder(out, RUN, epochs=1, eval_only=True)):
        assert said_nothing_left(caplog, again, TrainingProgress(epoch=1, global_step=4), out / "step_4") is None


@pytest.mark.parametrize("epochs, max_steps, patience, progress, done", [
    # by --epochs (only without --max_steps)
    (2, None, None, dict(epoch=2, global_step=8), "has 2 epochs done (step 8) and --epochs is 2"),
    (2, None, None, dict(epoch=3, global_step=12), "has 3 epochs done (step 12) and --epochs is 2"),
    (2, None, None, dict(epoch=1, global_step=4), None),
    (2, 9, None, dict(epoch=2, global_step=8), None),
    # by --max_steps: past it, or at it with its epoch ended (or reported done)
    (2, 8, None, dict(epoch=1, global_step=9, samples_in_epoch=16), "has 9 optimizer steps done and --max_steps is 8"),
    (2, 8, None, dict(epoch=2, global_step=8), "has 8 optimizer steps done and --max_steps is 8"),
    (2, 8, None, dict(epoch=1, global_step=8, samples_in_epoch=16), None),
    (2, 8, None, dict(epoch=1, global_step=7), None),
    # by --early_stopping_patience: spent, at an epoch's end
    (5, None, 2, dict(epoch=2, global_step=8, evaluations_without_improvement=2), "stopped early"),
    (5, None, 2, dict(epoch=2, global_step=8, evaluations_without_improvement=3), "stopped early"),
    (5, None, 2, dict(epoch=2, global_step=8, evaluations_without_improvement=1), None),
    (5, None, 2, dict(epoch=2, global_step=8, samples_in_epoch=16, evaluations_without_improvement=2), None),
    (5, None, None, dict(epoch=2, global_step=8, evaluations_without_improvement=2), None),
])
def test_a_checkpoint_at_the_end_of_its_run_leaves_nothing(tmp_path, caplog, epochs, max_steps, patience, progress,
                                                          done):
    out = tmp_path / "out"
    step = checkpoint(out, "step_x", None, **progress)
    said = said_nothing_left(caplog, RunFolder(out, RUN, epochs, max_steps, patience), TrainingProgress(**progress),
                             step, "eval_loss")
    if done is None:
        assert said is None
    elif done == "stopped early":
        assert said == (f"{step} stopped early: eval_loss has not improved for "
                        f"{progress['evaluations_without_improvement']} evaluations (--early_stopping_patience "
                        f"{patience})", "a higher --early_stopping_patience")
    else:
        flag = "--epochs" if max_steps is None else "--max_steps"
        assert said == (f"{step} {done}", f"train_image_classifier.py takes a higher {flag}; train_mnist.py's run "
                        f"includes its {flag}, so start a new run in another --output_dir")


def test_a_checkpoint_inside_its_last_epoch_is_done_once_results_report_its_step(tmp_path, caplog):
    """--max_steps reached mid-epoch (a checkpoint before the end's evaluation and report): something left, unless
    results.json reports that very step (it was done; its record may differ, say another process count)."""
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=3, max_steps=6, early_stopping_patience=1)
    at_6 = TrainingProgress(epoch=1, global_step=6, samples_in_epoch=32, evaluations_without_improvement=1)
    step_6 = checkpoint(out, "step_6", None, **vars(at_6))
    assert said_nothing_left(caplog, folder, at_6, step_6) is None
    write_json(out / "results.json", {"run": {}, "global_step": 5})
    assert said_nothing_left(caplog, folder, at_6, step_6) is None
    write_json(out / "results.json", {"run": {}, "global_step": 6})
    assert said_nothing_left(caplog, folder, at_6, step_6)[0] == (
        f"{step_6} has 6 optimizer steps done and --max_steps is 6")
    early = RunFolder(out, RUN, epochs=3, max_steps=None, early_stopping_patience=1)
    assert said_nothing_left(caplog, early, at_6, step_6)[0].startswith(f"{step_6} stopped early")


def test_results_of_another_run_or_without_a_record_are_not_this_runs_end(tmp_path, caplog):
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=1)
    for results in ({"global_step": 4}, {"run": None, "global_step": 4}, {"run": [], "global_step": 4},
                    {"run": {**run_json(folder), "seed": 7}, "global_step": 4}):
        write_json(out / "results.json", results)
        assert said_nothing_left(caplog, folder, TrainingProgress()) is None, results
    write_json(out / "results.json", {"run": {**run_json(folder, num_processes=4)}, "global_step": 4})
    assert said_nothing_left(caplog, folder, TrainingProgress()) is not None  # on another process count: the same run


def test_what_is_said_is_said_by_the_main_process_only(tmp_path, caplog, another_process):
    """Every process decides the same; only the main process says so (once per run, not once per process)."""
    out = tmp_path / "out"
    folder = RunFolder(out, RUN, epochs=1)
    trained(folder, epoch=1, global_step=4)
    with caplog.at_level(logging.INFO, logger="utils.run.run_folder"):
        assert nothing_left_to_train(folder, TrainingProgress(), None, "eval_accuracy")
        start_output_dir(RunFolder(out, RUN, epochs=1, overwrite=True), TrainingProgress(), 16, 1)
    assert caplog.records == [] and not (out / "results.json").exists()


# one_training_at_a_time: the lock, and the folder it made


def test_a_run_that_stops_before_writing_removes_only_the_folder_it_made(tmp_path):
    """Issue 43 #15: `mkdir out` beforehand, then a run that stops with an error before writing: out stays (only
    the lock's file in it); a folder the run made itself is removed; one the run wrote into stays."""
    made_by_the_user = tmp_path / "out"
    made_by_the_user.mkdir()
    with pytest.raises(UserError), one_training_at_a_time(made_by_the_user, eval_only=False):
        raise UserError("stopped")
    assert [path.name for path in made_by_the_user.iterdir()] == [LOCK]
    assert (made_by_the_user / LOCK).read_bytes() == b""
    new = tmp_path / "new" / "out"
    with pytest.raises(UserError), one_training_at_a_time(new, eval_only=False):
        assert (new / LOCK).read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
        raise UserError("stopped")
    assert not new.exists() and (tmp_path / "new").is_dir()
    with one_training_at_a_time(new, eval_only=False):
        (new / "run.json").write_text("{}")
    assert sorted(path.name for path in new.iterdir()) == ["run.json", LOCK] and (new / LOCK).read_bytes() == b""


def test_eval_only_and_the_other_processes_take_no_lock(tmp_path, monkeypatch):
    with one_training_at_a_time(tmp_path / "eval", eval_only=True):
        pass
    monkeypatch.setenv("RANK", "1")
    with one_training_at_a_time(tmp_path / "rank_1", eval_only=False):
        pass
    assert not (tmp_path / "eval").exists() and not (tmp_path / "rank_1").exists()
    monkeypatch.setenv("RANK", "0")
    with one_training_at_a_time(tmp_path / "rank_0", eval_only=False):
        assert (tmp_path / "rank_0" / LOCK).is_file()


def hold(output_dir, held, release) -> None:
    """In a forked child: a training's main process holding the lock until told to end."""
    with one_training_at_a_time(output_dir, eval_only=False):
        held.set()
        release.wait(60)


def test_a_second_training_is_refused_naming_the_first_and_a_lock_file_that_cannot_be_opened_is_named(tmp_path):
    out = tmp_path / "out"
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()
    holder = fork.Process(target=hold, args=(out, held, release))
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(UserError) as error, one_training_at_a_time(out, eval_only=False):
            pass
        assert re.fullmatch(rf"--output_dir {out} is in use by another training \(pid {holder.pid} on "
                            rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it "
                            rf"to end or stop it, or choose another --output_dir", str(error.value)), str(error.value)
    finally:
        release.set()
        holder.join(30)
    assert holder.exitcode == 0 and not out.exists()  # the holder made it, and wrote nothing into it
    with one_training_at_a_time(out, eval_only=False):  # free again
        pass
    (tmp_path / "locked" / LOCK).mkdir(parents=True)
    with pytest.raises(UserError) as error, one_training_at_a_time(tmp_path / "locked", eval_only=False):
        pass
    assert str(error.value) == (f"cannot write into --output_dir {tmp_path / 'locked'} (Is a directory); choose a "
                                f"writable folder")
