"""utils/run/checkpoints.py and utils/run/best.py in process, one process and no launcher: which checkpoint is the
newest (good) one, what a manifest finds, what a save leaves, how a failed save is told, and when best/ is replaced or
counts one more evaluation without improvement. Launched: tests/test_checkpoint_integrity.py (a real full disk, two processes),
test_training_features.py (--metric_for_best, --early_stopping_patience)."""

import dataclasses
import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from utils.errors import UserError
from utils.run import checkpoints
from utils.output_files import BEST, MANIFEST, RUN_RECORD, TRAINING_STATE
from utils.run.best import save_if_best
from utils.run.checkpoints import TMP_PREFIX, save_checkpoint
from utils.run.progress import TrainingProgress


pytestmark = pytest.mark.usefixtures("accelerate_state")  # conftest: accelerate's logger needs a state


def one_process(**more):
    """The part of an Accelerator that save_checkpoint uses, on one process."""
    return SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None, **more)


def write_weights(folder: Path, content: bytes = b"w" * 100) -> None:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    (folder / "sub").mkdir()
    (folder / "sub" / "optimizer.bin").write_bytes(b"o" * 30)


def saved(output_dir: Path, name: str, step: int, samples_in_epoch: int = 0, total_limit=None) -> Path:
    return save_checkpoint(one_process(), output_dir, name,
                           TrainingProgress(global_step=step, samples_in_epoch=samples_in_epoch), total_limit,
                           write_into=lambda folder: write_weights(folder, bytes([step % 256]) * 100))


def test_a_save_publishes_the_files_a_manifest_and_the_runs_record_and_leaves_nothing_else(tmp_path, caplog):
    (tmp_path / RUN_RECORD).write_text('{"run": 1}')
    (tmp_path / f"{TMP_PREFIX}step_3").mkdir()  # left by a save that was killed
    (tmp_path / f"{TMP_PREFIX}step_3" / "stale").write_text("x")
    progress = TrainingProgress(epoch=1, global_step=3, samples_in_epoch=48)
    with caplog.at_level("INFO"):
        final = save_checkpoint(one_process(), tmp_path, "step_3", progress, write_into=write_weights)
    assert final == tmp_path / "step_3"
    assert sorted(path.name for path in tmp_path.iterdir()) == [RUN_RECORD, "step_3"]
    files = sorted(path.relative_to(final).as_posix() for path in final.rglob("*") if path.is_file())
    assert files == [MANIFEST, "model.safetensors", RUN_RECORD, "sub/optimizer.bin", TRAINING_STATE]
    assert (final / RUN_RECORD).read_text() == '{"run": 1}'
    assert json.loads((final / TRAINING_STATE).read_text()) == dataclasses.asdict(progress)
    manifest = json.loads((final / MANIFEST).read_text())["files"]
    assert sorted(manifest) == files[1:]
    assert manifest["sub/optimizer.bin"] == {"size": 30, "sha256": hashlib.sha256(b"o" * 30).hexdigest()}
    assert checkpoints.check_checkpoint(final) is None
    assert f"Saved {final}: {MANIFEST}, model.safetensors, run.json, sub, training_state.json" in caplog.text
    # a checkpoint saved without OUTPUT_DIR/run.json (best/ of an older run) has none
    (tmp_path / RUN_RECORD).unlink()
    again = save_checkpoint(one_process(), tmp_path, "step_3", progress, write_into=write_weights)
    assert not (again / RUN_RECORD).exists() and checkpoints.check_checkpoint(again) is None


def test_the_sha256_is_the_files_whatever_its_size(tmp_path):
    path = tmp_path / "big"
    content = os.urandom((1 << 20) + 17)  # more than one 1 MiB chunk
    path.write_bytes(content)
    assert checkpoints.sha256_of(path) == hashlib.sha256(content).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert checkpoints.sha256_of(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_the_manifest_finds_every_kind_of_damage(tmp_path):
    final = saved(tmp_path, "step_1", 1)
    assert checkpoints.check_checkpoint(final) is None
    (final / "sub" / "optimizer.bin").write_bytes(b"o" * 29)
    assert checkpoints.check_checkpoint(final) == "sub/optimizer.bin has 29 bytes, 30 when saved"
    (final / "sub" / "optimizer.bin").write_bytes(b"O" * 30)
    assert checkpoints.check_checkpoint(final) == "sub/optimizer.bin differs from its sha256 when saved"
    (final / "sub" / "optimizer.bin").unlink()
    (final / "sub" / "optimizer.bin").mkdir()  # not a file
    assert checkpoints.check_checkpoint(final) == "sub/optimizer.bin is missing"
    for text in ("{", "[]", '{"file": {}}', '{"files": {"a": 1}}', '{"files": {"a": {"size": 1}}}'):
        (final / MANIFEST).write_text(text)
        problem = checkpoints.check_checkpoint(final)
        assert problem == f"its {MANIFEST} is unreadable" or problem == "a is missing", text
    (final / MANIFEST).write_text('{"files": {}}')
    assert checkpoints.check_checkpoint(final) is None
    (final / MANIFEST).unlink()
    assert checkpoints.check_checkpoint(final) is None  # saved before manifests: nothing to check


def test_sizes_are_checked_before_any_file_is_read(tmp_path, monkeypatch):
    final = saved(tmp_path, "step_1", 1)
    (final / "sub" / "optimizer.bin").write_bytes(b"o")
    monkeypatch.setattr(checkpoints, "sha256_of", lambda path: pytest.fail(f"read {path}"))
    assert checkpoints.check_checkpoint(final) == "sub/optimizer.bin has 1 bytes, 30 when saved"


def test_checkpoints_are_ordered_by_steps_an_epochs_end_last(tmp_path):
    assert checkpoints.list_checkpoints(tmp_path / "missing") == []
    assert checkpoints.find_latest_checkpoint(tmp_path / "missing") is None
    saved(tmp_path, "step_100", 100, samples_in_epoch=6400)
    saved(tmp_path, "epoch_0", 100)  # the same step at the epoch's end: later
    saved(tmp_path, "step_20", 20, samples_in_epoch=1280)  # after step_100 by name, before it by steps
    saved(tmp_path, "best", 300)  # not a checkpoint to resume
    saved(tmp_path, "step_7x", 400)
    (tmp_path / "step_300").mkdir()  # no training state: killed before it was complete
    (tmp_path / "step_500").write_text("a file")
    assert checkpoints.list_checkpoints(tmp_path) == [tmp_path / n for n in ("step_20", "step_100", "epoch_0")]
    assert checkpoints.find_latest_checkpoint(tmp_path) == tmp_path / "epoch_0"
    (tmp_path / "step_20" / TRAINING_STATE).write_text("{")
    with pytest.raises(UserError, match="training_state.json is unreadable"):
        checkpoints.list_checkpoints(tmp_path)
    unreadable = []
    assert checkpoints.list_checkpoints(tmp_path, unreadable) == [tmp_path / "step_100", tmp_path / "epoch_0"]
    assert unreadable == [tmp_path / "step_20"]


def test_the_newest_good_checkpoint_and_the_line_that_names_the_ones_passed_over(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        saved(tmp_path, f"step_{step}", step, samples_in_epoch=16)
    assert checkpoints.newest_good_checkpoint(tmp_path, say_skipped=True) == tmp_path / "step_4"
    assert caplog.records == []
    (tmp_path / "step_4" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "step_2" / TRAINING_STATE).write_text("{")  # unreadable: not even ordered
    (tmp_path / "step_3" / "model.safetensors").unlink()
    assert checkpoints.newest_good_checkpoint(tmp_path) == tmp_path / "step_1"
    assert caplog.records == []  # only when asked
    assert checkpoints.newest_good_checkpoint(tmp_path, say_skipped=True) == tmp_path / "step_1"
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("--resume_from_checkpoint latest: skipping damaged checkpoint step_2 (training_state.json "
                           "has 1 bytes, ")
    assert line.endswith(" when saved); step_4 (model.safetensors has 1 bytes, 100 when saved); step_3 "
                         f"(model.safetensors is missing); resuming from {tmp_path / 'step_1'}")
    (tmp_path / "step_1" / "model.safetensors").unlink()
    caplog.clear()
    assert checkpoints.newest_good_checkpoint(tmp_path, say_skipped=True) is None
    assert caplog.records[0].getMessage().endswith("resuming from scratch (no good checkpoint left)")


def test_an_unreadable_training_state_with_a_good_manifest_is_named_as_such(tmp_path, caplog):
    final = saved(tmp_path, "step_1", 1)
    state = json.loads((final / MANIFEST).read_text())
    (final / TRAINING_STATE).write_text("{}")  # readable JSON, another layout
    state["files"][TRAINING_STATE] = {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (final / MANIFEST).write_text(json.dumps(state))
    assert checkpoints.newest_good_checkpoint(tmp_path, say_skipped=True) is None
    assert caplog.records[0].getMessage() == (
        "--resume_from_checkpoint latest: skipping damaged checkpoint step_1 (its training_state.json is unreadable); "
        "resuming from scratch (no good checkpoint left)")


def test_only_the_main_process_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    checkpoints.main_process_warning("from rank 1")
    checkpoints.warn_if_unverifiable(tmp_path)
    monkeypatch.setenv("RANK", "0")
    checkpoints.main_process_warning("from rank 0")
    monkeypatch.delenv("RANK")
    checkpoints.warn_if_unverifiable(None)
    checkpoints.warn_if_unverifiable(saved(tmp_path, "step_1", 1))
    checkpoints.warn_if_unverifiable(tmp_path)
    assert {record.name for record in caplog.records} == {"utils.run.checkpoints"}
    assert [(record.levelno, record.getMessage()) for record in caplog.records] == [
        (logging.WARNING, "from rank 0"),
        (logging.WARNING, f"{tmp_path} has no {MANIFEST} (saved by an older version): its files cannot be checked; "
                          f"loading it as it is")]


def test_the_total_limit_keeps_the_newest_and_the_newest_good_one(tmp_path):
    for step in (1, 2, 3):
        saved(tmp_path, f"step_{step}", step, samples_in_epoch=16)
    saved(tmp_path, "step_4", 4, samples_in_epoch=16, total_limit=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_3", "step_4"]
    (tmp_path / "step_4" / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "step_3" / "model.safetensors").write_bytes(b"x" * 100)
    saved(tmp_path, "step_5", 5, samples_in_epoch=16)
    (tmp_path / "step_5" / "model.safetensors").unlink()
    checkpoints.delete_old_checkpoints(tmp_path, total_limit=1)  # no good one left: the limit alone
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_5"]
    for step in (6, 7):
        saved(tmp_path, f"step_{step}", step, samples_in_epoch=16)
    (tmp_path / "step_7" / "model.safetensors").unlink()
    checkpoints.delete_old_checkpoints(tmp_path, total_limit=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_6", "step_7"]


def test_a_checkpoint_of_the_same_name_is_replaced(tmp_path):
    saved(tmp_path, "step_2", 2)
    (tmp_path / "step_2" / "extra").write_text("from the first save")
    saved(tmp_path, "step_2", 2)
    assert not (tmp_path / "step_2" / "extra").exists() and checkpoints.check_checkpoint(tmp_path / "step_2") is None


@pytest.mark.parametrize("error, free, full", [
    (OSError(errno.ENOSPC, "No space left on device"), 10**9, True),
    (OSError(errno.EACCES, "Permission denied"), 0, False),
    (RuntimeError("safetensors: No space left on device (os error 28)"), 10**9, True),
    (RuntimeError("basic_ios::clear: iostream error"), 99, True),
    (RuntimeError("basic_ios::clear: iostream error"), 100, False),
    (RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64 vs 32"), 0, True),
    (ValueError("unexpected pos"), 0, False),
    (None, 0, False),
])
def test_a_full_disk_is_told_from_other_failures(error, free, full):
    assert checkpoints.is_disk_full(error, free, needed=100) is full


def test_a_full_disk_found_in_the_errors_context():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("while saving")  # noqa: B904 (the context is the point)
    except RuntimeError as error:
        assert checkpoints.is_disk_full(error, free=10**9, needed=1)
        assert not checkpoints.is_disk_full(RuntimeError("while saving"), free=0, needed=1)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """tmp_path as the disk mounted at /mnt/disk, 3 MiB free of 10."""
    def disk_usage(path):
        assert Path(path) == tmp_path
        return SimpleNamespace(free=3 * 2**20, total=10 * 2**20)

    monkeypatch.setattr(checkpoints, "mount_point", lambda path: Path("/mnt/disk") if Path(path) == tmp_path else None)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", disk_usage)
    return tmp_path


def fill_the_disk(folder):
    write_weights(folder)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_ends_the_save_with_one_line_and_no_partial_folder(small_disk):
    tmp_path = small_disk
    save_checkpoint(one_process(), tmp_path, "step_1", TrainingProgress(global_step=1, samples_in_epoch=16),
                    write_into=lambda folder: write_weights(folder, b"w" * (3 * 2**19)))  # 1.5 MiB
    (tmp_path / "step_0").mkdir()
    (tmp_path / "step_0" / TRAINING_STATE).write_text("{")  # unreadable: neither the last checkpoint nor a failure
    with pytest.raises(UserError) as refused:
        save_checkpoint(one_process(), tmp_path, "step_2", TrainingProgress(global_step=2), write_into=fill_the_disk)
    assert str(refused.value) == (
        f"the disk mounted at /mnt/disk (holding {tmp_path}) is full: 3.00 MiB free of 10.00 MiB, and saving step_2 "
        f"needs about 1.50 MiB, the size of step_1; its partial folder was removed and the last complete checkpoint is "
        f"{tmp_path / 'step_1'}; free some space or move --output_dir, then continue with --resume_from_checkpoint "
        f"latest")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_0", "step_1"]
    (tmp_path / "step_1" / TRAINING_STATE).unlink()  # no complete checkpoint left: the partial one's size
    with pytest.raises(UserError) as refused:
        save_checkpoint(one_process(), tmp_path, "step_2", TrainingProgress(global_step=2), write_into=fill_the_disk)
    assert "saving step_2 needs over 0.00 MiB; its partial folder was removed and there is no complete checkpoint " \
           "yet; free" in str(refused.value)


def test_a_save_that_fails_before_its_folder_exists_is_told_as_well(small_disk):
    def nothing_written(folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="saving step_1 needs over 0.00 MiB"):
        save_checkpoint(one_process(), small_disk, "step_1", TrainingProgress(), write_into=nothing_written)
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("needed_mib, full", [(4, True), (2, False)])
def test_torch_saves_iostream_error_is_a_full_disk_when_less_is_free_than_a_checkpoint_needs(small_disk, needed_mib,
                                                                                             full):
    """torch.save on a full disk raises only "basic_ios::clear": the space left decides (3 MiB free here)."""
    save_checkpoint(one_process(), small_disk, "step_1", TrainingProgress(global_step=1, samples_in_epoch=16),
                    write_into=lambda folder: write_weights(folder, b"w" * (needed_mib * 2**20)))

    def torch_save(folder):
        folder.mkdir()
        raise RuntimeError("basic_ios::clear: iostream error")

    with pytest.raises(UserError if full else RuntimeError) as failed:
        save_checkpoint(one_process(), small_disk, "step_2", TrainingProgress(global_step=2), write_into=torch_save)
    assert ("is full: 3.00 MiB free" in str(failed.value)) is full
    assert sorted(path.name for path in small_disk.iterdir()) == ["step_1"]


def several_processes(monkeypatch, codes, index, main_message=None):
    """This process, process `index` among len(codes) processes, whose failure codes (0 none, 1 full disk, 2 other)
    gather_object returns, its own included; broadcast_object_list hands out the main process's message."""
    is_main_process = index == 0

    def gather_object(objects):
        assert objects == [codes[index]]
        return codes

    def broadcast_object_list(objects):
        assert len(objects) == 1 and (objects[0] is not None) is (is_main_process and 1 in codes)
        return [objects[0] if is_main_process else main_message]

    monkeypatch.setattr(checkpoints, "gather_object", gather_object)
    monkeypatch.setattr(checkpoints, "broadcast_object_list", broadcast_object_list)
    return SimpleNamespace(is_main_process=is_main_process, num_processes=len(codes), wait_for_everyone=lambda: None)


@pytest.mark.parametrize("num_processes", [2, 3])
def test_every_process_learns_that_another_failed_and_which(tmp_path, monkeypatch, num_processes):
    codes = [0] * (num_processes - 1) + [2]
    for index in range(num_processes - 1):  # those that did not fail
        is_main_process = index == 0
        accelerator = several_processes(monkeypatch, codes, index)
        (tmp_path / f"{TMP_PREFIX}step_1").mkdir(exist_ok=True)
        with pytest.raises(UserError) as refused:
            checkpoints.stop_if_any_failed(accelerator, None, tmp_path, tmp_path / f"{TMP_PREFIX}step_1")
        assert str(refused.value) == (f"process {num_processes - 1} failed to write checkpoint "
                                      f"{tmp_path / f'{TMP_PREFIX}step_1'}: see its error above")
        assert (tmp_path / f"{TMP_PREFIX}step_1").exists() is not is_main_process  # the main process removes it
    accelerator = several_processes(monkeypatch, [0] * num_processes, 0)
    checkpoints.stop_if_any_failed(accelerator, None, tmp_path, tmp_path / "none")  # none failed: nothing happens


def test_a_full_disk_on_any_process_is_the_main_processes_line_on_every_process(small_disk, monkeypatch):
    tmp = small_disk / f"{TMP_PREFIX}step_1"
    tmp.mkdir()
    for codes in ([0, 1, 0], [1, 0]):
        accelerator = several_processes(monkeypatch, codes, index=len(codes) - 1, main_message="the disk is full")
        with pytest.raises(UserError, match="^the disk is full$"):
            checkpoints.stop_if_any_failed(accelerator, None, small_disk, tmp)
    accelerator = several_processes(monkeypatch, [0, 1, 2], index=0)
    with pytest.raises(UserError, match="^the disk mounted at /mnt/disk .* is full: "):
        checkpoints.stop_if_any_failed(accelerator, None, small_disk, tmp)
    assert not tmp.exists()
    # the process whose own save failed otherwise raises its own error
    accelerator = several_processes(monkeypatch, [0, 2], index=1)
    with pytest.raises(KeyError):
        checkpoints.stop_if_any_failed(accelerator, KeyError("its own"), small_disk, tmp)


def test_a_save_through_accelerate_writes_into_the_temporary_folder(tmp_path):
    written = []

    def save_state(folder):
        written.append(folder)
        write_weights(Path(folder))

    final = save_checkpoint(one_process(save_state=save_state), tmp_path, "step_1", TrainingProgress())
    assert written == [str(tmp_path / f"{TMP_PREFIX}step_1")] and (final / "model.safetensors").is_file()


def test_every_file_and_folder_is_fsynced_before_the_rename_files_before_their_folders(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(checkpoints, "fsync_path", synced.append)
    final = saved(tmp_path, "step_1", 1)
    tmp = tmp_path / f"{TMP_PREFIX}step_1"
    inside = {tmp / path.relative_to(final) for path in final.rglob("*")}
    assert set(synced[:len(inside)]) == inside and synced[len(inside):] == [tmp, tmp_path]
    for path in inside:  # each folder after what it holds
        assert all(synced.index(child) < synced.index(path) for child in inside if child.parent == path)


def test_the_total_limit_leaves_an_unreadable_checkpoint_alone(tmp_path):
    for step in (1, 2, 3):
        saved(tmp_path, f"step_{step}", step, samples_in_epoch=16)
    (tmp_path / "step_1" / TRAINING_STATE).write_text("{")
    checkpoints.delete_old_checkpoints(tmp_path, total_limit=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_1", "step_3"]


def test_another_failure_of_the_save_is_raised_as_it_is(tmp_path, monkeypatch):
    def fail(folder):
        folder.mkdir()
        raise KeyError("not a disk")

    with pytest.raises(KeyError, match="not a disk"):
        save_checkpoint(one_process(), tmp_path, "step_1", TrainingProgress(), write_into=fail)
    assert list(tmp_path.iterdir()) == []
    def fail_to_write(folder):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(checkpoints, "write_manifest", fail_to_write)
    with pytest.raises(OSError, match="I/O"):
        save_checkpoint(one_process(), tmp_path, "step_1", TrainingProgress(), write_into=write_weights)
    assert list(tmp_path.iterdir()) == []


def test_sizes_and_mount_points(tmp_path):
    write_weights(tmp_path / "c")
    assert checkpoints.folder_size(tmp_path / "c") == 130
    assert checkpoints.mib(3 * 2**20 + 2**19) == "3.50 MiB" and checkpoints.mib(0) == "0.00 MiB"
    mount = checkpoints.mount_point(tmp_path / "c" / "sub")
    assert os.path.ismount(mount) and (tmp_path / "c" / "sub").resolve().is_relative_to(mount)
    assert checkpoints.mount_point(Path("/")) == Path("/")


@pytest.mark.parametrize("checkpointing_steps, step, due", [
    (5, 10, True), (5, 11, False), (1, 7, True), ("epoch", 10, False), (None, 10, False), (3, 0, True),
])
def test_a_step_checkpoint_is_due_every_n_steps(checkpointing_steps, step, due):
    assert checkpoints.step_checkpoint_due(checkpointing_steps, step) is due


class Model:
    """What save_if_best saves: a name, so that the test can tell which weights were saved."""

    def __init__(self, name):
        self.name = name


def best_run(tmp_path):
    saves = []

    def save_model(model, folder):
        folder.mkdir()
        (folder / "model.safetensors").write_text(model.name)
        saves.append(model.name)

    # torch.compile's wrapper unwrapped too: its state dict's keys would carry _orig_mod.
    accelerator = one_process(unwrap_model=lambda model, keep_torch_compile: Model(
        f"{'compiled' if keep_torch_compile else 'unwrapped'} {model.name}"), save_model=save_model,
        distributed_type="NO")  # not DeepSpeed, whose engine save_model takes as it is (run/deepspeed.py)
    return accelerator, saves


@pytest.mark.parametrize("metric, values, bests, counts", [
    # lower is better; a tie is not better
    ("eval_loss", [0.5, 0.6, 0.5, 0.4, 0.45], [0.5, 0.5, 0.5, 0.4, 0.4], [0, 1, 2, 0, 1]),
    ("eval_accuracy", [0.5, 0.4, 0.5, 0.7, 0.6], [0.5, 0.5, 0.5, 0.7, 0.7], [0, 1, 2, 0, 1]),
    ("eval_ema_loss", [0.3, 0.2], [0.3, 0.2], [0, 0]),
    ("eval_ema_accuracy", [0.3, 0.2, 0.1], [0.3, 0.3, 0.3], [0, 1, 2]),
])
def test_best_keeps_the_best_evaluation_and_counts_the_others(tmp_path, caplog, metric, values, bests, counts):
    accelerator, saves = best_run(tmp_path)
    progress = TrainingProgress()
    without_improvement = []
    for step, value in enumerate(values, start=1):
        progress.global_step = step
        with caplog.at_level("INFO"):
            improved = save_if_best(accelerator, Model("model"), progress, {metric: value, "other": 0.0}, step // 2,
                                    metric, tmp_path, ema=SimpleNamespace(module=Model("average")))
        assert improved is (progress.best_step == step)
        without_improvement.append(progress.evaluations_without_improvement)
        assert progress.best_metric == bests[step - 1]
    best_step = min(step for step, value in enumerate(values, start=1) if value == bests[-1])
    assert (progress.best_step, progress.best_epoch) == (best_step, best_step // 2)
    assert without_improvement == counts
    weights = "average" if metric.startswith("eval_ema_") else "unwrapped model"
    assert saves == [weights] * len(set(bests))
    assert (tmp_path / BEST / "model.safetensors").read_text() == weights
    saved_progress = json.loads((tmp_path / BEST / TRAINING_STATE).read_text())
    assert (saved_progress["best_step"], saved_progress["best_metric"]) == (best_step, bests[-1])
    assert f"step {best_step} (epoch {best_step // 2}): best {metric} so far ({bests[-1]:.4f}), saved to " \
           f"{tmp_path / BEST}" in caplog.text


def test_without_a_metric_for_best_nothing_is_kept(tmp_path):
    accelerator, saves = best_run(tmp_path)
    progress = TrainingProgress()
    assert save_if_best(accelerator, Model("m"), progress, {"eval_loss": 0.1}, 0, None, tmp_path) is False
    assert progress == TrainingProgress() and saves == [] and list(tmp_path.iterdir()) == []


def test_the_best_line_is_the_main_processes_alone(tmp_path, caplog, another_process):
    accelerator, saves = best_run(tmp_path)
    with caplog.at_level("INFO"):
        assert save_if_best(accelerator, Model("m"), TrainingProgress(), {"eval_loss": 0.1}, 0, "eval_loss", tmp_path)
    assert saves == ["unwrapped m"] and caplog.records == []
