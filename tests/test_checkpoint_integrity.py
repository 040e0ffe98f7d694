"""Issue 23, failures: a damaged checkpoint is found by its manifest (sizes and sha256 hashes), a full disk
during a save ends with one line and loses nothing complete, and a save is durable (fsync before rename)."""

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate import PartialState
from helpers import REPO, assert_clean_user_error, launch, run_alone, skip_or_fail_in_ci

import utils.run.checkpoints as checkpoints
import utils.run.resume as resume
from utils.errors import UserError
from utils.output_files import MANIFEST
from utils.run.checkpoints import save_checkpoint
from utils.run.progress import TrainingProgress

# 64 samples / 16 per batch: 4 optimizer steps in the one epoch. A checkpoint is about 0.37 MB
# (optimizer.bin 241,361 bytes, model.safetensors 117,824, random_states_0.pkl 14,497, the rest under 4 kB).
SHORT = ["--max_train_samples", "64", "--batch_size", "16", "--epochs", "1"]


# A truncated checkpoint skipped by `latest` in a real run, and refused by name:
# test_resume_other_process_count.py::test_latest_skips_a_truncated_checkpoint_and_a_named_one_is_refused, on the
# launch of its resume on 1 process.


def _write_checkpoint(output_dir: Path, step: int, total_limit=None) -> Path:
    """A real checkpoint folder as save_checkpoint writes it, with one process and no Accelerator."""
    PartialState(cpu=True)  # accelerate's logger needs it
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)

    def write_into(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes([step]) * 4096)

    return save_checkpoint(accelerator, output_dir, f"step_{step}", TrainingProgress(global_step=step), total_limit,
                           write_into=write_into)


def test_total_limit_keeps_the_last_good_checkpoint_while_newer_ones_are_damaged(tmp_path):
    for step in (1, 2, 3):
        _write_checkpoint(tmp_path, step)
    (tmp_path / "step_3" / "model.safetensors").write_bytes(b"\0" * 4096)  # same size, other bytes
    checkpoints.delete_old_checkpoints(tmp_path, total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"], "step_2 is what a resume needs"
    # Once a newer one checks out, the limit applies as usual.
    _write_checkpoint(tmp_path, 4, total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def test_total_limit_deletes_nothing_for_a_new_checkpoint_that_does_not_check_out(tmp_path, monkeypatch):
    """The save itself: the new checkpoint is damaged once published (a bad disk, another writer)."""
    _write_checkpoint(tmp_path, 1)
    real_rename = Path.rename

    def rename_then_damage(self, target):
        real_rename(self, target)
        if Path(target).name == "step_2":
            (Path(target) / "model.safetensors").write_bytes(b"\0" * 4096)

    monkeypatch.setattr(Path, "rename", rename_then_damage)
    _write_checkpoint(tmp_path, 2, total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]


def test_a_truncated_training_state_is_skipped_by_latest_and_refused_by_name(tmp_path, caplog):
    for step in (1, 2):
        _write_checkpoint(tmp_path, step)
    state = tmp_path / "step_2" / "training_state.json"
    size = state.stat().st_size
    state.write_text(state.read_text()[:10])  # no longer JSON: list_checkpoints cannot even order it
    assert resume.resolve_checkpoint("latest", tmp_path) == tmp_path / "step_1"
    assert [r.getMessage() for r in caplog.records] == [
        f"--resume_from_checkpoint latest: skipping damaged checkpoint step_2 (training_state.json has 10 bytes, "
        f"{size} when saved); resuming from {tmp_path / 'step_1'}"]
    with pytest.raises(UserError, match=f"step_2 is damaged .*; resume from the newest good one, {tmp_path / 'step_1'}$"):
        resume.resolve_checkpoint(str(tmp_path / "step_2"), tmp_path)


def test_latest_is_the_newest_good_checkpoint_of_several(tmp_path):
    """Four good checkpoints: 'latest' is step_4; with step_4 damaged, step_3 (the newest good one, not the oldest)."""
    for step in (1, 2, 3, 4):
        _write_checkpoint(tmp_path, step)
    assert resume.resolve_checkpoint("latest", tmp_path) == tmp_path / "step_4"
    (tmp_path / "step_4" / "model.safetensors").write_bytes(b"\0" * 4096)  # same size, other bytes
    assert resume.resolve_checkpoint("latest", tmp_path) == tmp_path / "step_3"
    assert checkpoints.newest_good_checkpoint(tmp_path) == tmp_path / "step_3"


def test_a_checkpoint_without_a_manifest_loads_with_one_warning(tmp_path, caplog):
    _write_checkpoint(tmp_path, 1)
    (tmp_path / "step_1" / MANIFEST).unlink()  # as saved before manifests existed
    assert resume.resolve_checkpoint("latest", tmp_path) == tmp_path / "step_1"
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'step_1'} has no {MANIFEST} (saved by an older version): its files cannot be checked; "
        f"loading it as it is"]


def test_save_fsyncs_every_file_and_folder_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, target: (events.append(("rename", str(self))),
                                                              real_rename(self, target))[1])
    final = _write_checkpoint(tmp_path, 7)
    (rename,) = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert events[rename] == ("rename", str(tmp_path / ".tmp-step_7"))
    synced_before = {path for kind, path in events[:rename] if kind == "fsync"}
    tmp = tmp_path / ".tmp-step_7"
    expected = {str(tmp)} | {str(tmp / p.name) for p in final.iterdir()}
    assert {p.name for p in final.iterdir()} >= {"model.safetensors", "training_state.json", MANIFEST}
    assert expected <= synced_before, expected - synced_before
    assert ("fsync", str(tmp_path)) in events[rename:], "the rename itself is made durable"


def test_the_docs_say_what_a_power_loss_can_and_cannot_lose():
    page = (REPO / "docs" / "reliability.md").read_text()
    assert "**A power loss**" in page
    section = " ".join(page.split("**A power loss**", 1)[1].split("\n\n", 1)[0].split())  # one line
    for words in ("fsync", "cannot lose", "can lose", "manifest.json"):
        assert words in section, words


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs): two checkpoints and run.json fit, a third does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        skip_or_fail_in_ci(f"a 1 MiB tmpfs cannot be mounted here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_stops_both_processes_with_one_line_and_keeps_every_complete_checkpoint(synthetic_mnist, small_disk,
                                                                                          tmp_path):
    """Only the main process decides and words the line (the others would measure the disk at another moment),
    and every process learns of a failure on any: none waits forever in the next collective. What is left
    resumes (here on one process, the script alone: 2 x 16 per step is 16 x 2 there)."""
    out = small_disk / "out"
    args = ["--data_dir", synthetic_mnist, "--max_train_samples", "128", *SHORT[2:]]  # 4 optimizer steps
    proc = launch([*args, "--output_dir", out, "--checkpointing_steps", "1"], num_processes=2, check=False,
                  timeout=180)
    assert_clean_user_error(proc, f"the disk mounted at {small_disk} (holding {out}) is full", "MiB free of 1.00 MiB",
                            "saving step_3 needs about 0.37 MiB, the size of step_2",
                            f"the last complete checkpoint is {out / 'step_2'}")
    # said once per machine, by its first process; the launcher ends the other in its wait (utils/errors.py)
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1
    output = proc.stdout + proc.stderr
    assert "basic_ios" not in output and "unexpected pos" not in output, output
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "run.lock", "step_1", "step_2"], "no .tmp-step_3 left"
    assert checkpoints.check_checkpoint(out / "step_2") is None

    bigger = tmp_path / "bigger"
    shutil.copytree(out, bigger)
    resumed = run_alone([*args, "--output_dir", bigger, "--resume_from_checkpoint", "latest"])
    assert f"Resumed from {bigger / 'step_2'}: epoch 0, step 2" in resumed.stdout + resumed.stderr
    assert (bigger / "model.safetensors").is_file()
