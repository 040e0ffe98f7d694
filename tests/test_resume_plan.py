"""utils/run/resume.py in process: which folder --resume_from_checkpoint means, loading it, and the arithmetic of a
resume (the batches of the epoch already trained, the gradient accumulation that keeps the global batch, the epochs
left). The launched resumes (tests/test_resume_other_process_count.py, test_train_mnist.py) show the whole run; these
try the inputs no launch does: an epoch that ends in a partial batch, OUTPUT_DIR/best spelled as a path.
Hypothesis tries the arithmetic over all sizes: tests/test_properties.py."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from accelerate.utils import DistributedType
from safetensors.torch import save_file

from utils.errors import UserError
from utils.output_files import MANIFEST, TRAINING_STATE
from utils.run import resume
from utils.run.checkpoints import save_checkpoint
from utils.run.progress import TrainingProgress
from utils.run.resume import accumulation_keeping, batches_to_skip, epochs_to_train, resolve_checkpoint, resume_point


def shard(batches, num_processes: int, rank: int = 0):
    """This process's part of `batches`, as Accelerate's prepare_data_loader makes it: on one process the batches
    as they are (the last one partial), on more sharded with even_batches (the last round filled from the start)."""
    if num_processes == 1:
        return batches
    return BatchSamplerShard(batches, num_processes=num_processes, process_index=rank, even_batches=True)


def process_batches(size: int, batch_size: int, num_processes: int) -> list:
    """Each process's batches of an epoch of `size` samples, in order."""
    batches = torch.utils.data.BatchSampler(range(size), batch_size, drop_last=False)
    return [list(shard(batches, num_processes, rank)) for rank in range(num_processes)]


def samples_counted(per_process: list, batches_each: int) -> int:
    """TrainingProgress.samples_in_epoch after every process trained its first `batches_each` batches: the training
    loop adds len(labels) of each batch on each process (tests/test_properties.py checks the same for all sizes)."""
    return sum(len(batch) for batches in per_process for batch in batches[:batches_each])


@pytest.mark.parametrize("size, batch_size, num_processes, accumulation", [
    (1003, 24, 1, 1),  # 41 whole batches and one of 19
    (1003, 24, 1, 4),  # and the last accumulation cycle cut short (42 = 10 x 4 + 2)
    (100, 64, 1, 1),  # fewer samples than one batch
    (1003, 24, 2, 1),  # 2 processes: the last batches filled from the start, so whole batches
    (100, 64, 3, 1),
])
def test_a_resume_after_the_epochs_last_partial_batch_trains_nothing_of_that_epoch_again(size, batch_size,
                                                                                          num_processes, accumulation):
    """Issue 43: batches_to_skip rounding down would train the epoch's last, partial batch twice when a checkpoint is
    saved after it (--checkpointing_steps at the epoch's last step, --save_on_signal there, --max_steps' end)."""
    per_process = process_batches(size, batch_size, num_processes)
    batches_each = len(per_process[0])
    progress = TrainingProgress(samples_in_epoch=samples_counted(per_process, batches_each),
                                global_batch_size=num_processes * batch_size * accumulation)
    skip = batches_to_skip(progress, num_processes, batch_size)
    assert skip == batches_each
    batches = torch.utils.data.BatchSampler(range(size), batch_size, drop_last=False)
    assert list(SkipBatchSampler(shard(batches, num_processes), skip)) == []


@pytest.mark.parametrize("steps_done", [0, 1, 5, 13])
def test_a_resume_inside_the_epoch_skips_exactly_the_batches_trained(steps_done):
    """Checkpoints inside an epoch are whole global batches: on the same processes, those batches; on others, the
    batches that hold the same samples (2 x 24 x 3 = 144 samples = 3 processes x 48 = 6 processes x 8 x 3)."""
    progress = TrainingProgress(samples_in_epoch=steps_done * 144, global_batch_size=144)
    assert batches_to_skip(progress, 2, 24) == steps_done * 3
    assert batches_to_skip(progress, 3, 48) == steps_done
    assert batches_to_skip(progress, 6, 8) == steps_done * 3
    assert batches_to_skip(progress, 1, 144) == steps_done


def accumulation_for(saved_processes, saved_batch, saved_accumulation, num_processes, batch_size, accumulation):
    progress = TrainingProgress().with_batch(saved_processes, saved_batch, saved_accumulation)
    return accumulation_keeping(progress, num_processes, batch_size, accumulation)


def test_the_accumulation_that_keeps_the_checkpoints_global_batch(caplog):
    assert accumulation_keeping(None, 3, 24, 5) == 5  # nothing to keep: the flag as given
    with caplog.at_level("INFO"):
        assert accumulation_for(2, 24, 3, 2, 24, 3) == 3
        assert caplog.records == []  # kept as given: nothing to say
        kept = accumulation_for(2, 24, 3, 4, 18, 1)
    assert kept == 2 and type(kept) is int  # Accelerator(gradient_accumulation_steps=...) counts batches
    assert caplog.records[-1].getMessage().endswith("resuming on 4 processes: --gradient_accumulation_steps 2 keeps "
                                                    "the checkpoint's global batch of 144 samples")
    assert accumulation_for(2, 24, 3, 2, 24, 3) == 3  # the same run
    assert accumulation_for(2, 24, 3, 2, 24, 1) == 3  # the flag left at its default: the checkpoint's
    assert accumulation_for(2, 24, 3, 4, 18, 3) == 2  # 144 = 4 x 18 x 2
    assert accumulation_for(2, 24, 3, 1, 24, 3) == 6
    assert accumulation_for(2, 24, 3, 3, 48, 7) == 1
    assert accumulation_for(1, 64, 1, 1, 32, 1) == 2


@pytest.mark.parametrize("saved, now, message", [
    # 144 samples over 5 processes: none keeps it
    ((2, 24, 3), (5, 24, 1), "the checkpoint's global batch of 144 samples cannot be split over 5 processes; resume on "
                             "a number of processes that divides 144"),
    # 144 = 4 x 36: 36 per process, of which batch 18 x 2 fits under --batch_size 20
    ((2, 24, 3), (4, 20, 1), "the checkpoint's global batch is 144 samples (2 processes); on 4 processes --batch_size "
                             "20 cannot keep it: use --batch_size 18 --gradient_accumulation_steps 2"),
    # 16 per process: batch 8 x 2 is the largest under --batch_size 10
    ((1, 48, 3), (9, 10, 1), "the checkpoint's global batch is 144 samples (1 processes); on 9 processes --batch_size "
                             "10 cannot keep it: use --batch_size 8 --gradient_accumulation_steps 2"),
    # 16 per process: --batch_size 15 is one short of 16, so the largest that fits under it is 8
    ((1, 48, 3), (9, 15, 1), "the checkpoint's global batch is 144 samples (1 processes); on 9 processes --batch_size "
                             "15 cannot keep it: use --batch_size 8 --gradient_accumulation_steps 2"),
    ((1, 7, 1), (1, 5, 1), "the checkpoint's global batch is 7 samples (1 processes); on 1 processes --batch_size 5 "
                           "cannot keep it: use --batch_size 1 --gradient_accumulation_steps 7"),
])
def test_a_global_batch_that_cannot_be_kept_names_flags_that_keep_it(saved, now, message):
    with pytest.raises(UserError) as refused:
        accumulation_for(*saved, *now)
    assert str(refused.value) == message


def write_checkpoint(output_dir: Path, name: str, progress: TrainingProgress, weights_only: bool = False) -> Path:
    """A checkpoint folder as save_checkpoint writes it (training state, manifest), on one process without an
    Accelerator: the weights alone (`best`), or the weights and an optimizer state file."""
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)

    def write_into(folder):
        folder.mkdir()
        save_file({"weight": torch.ones(2)}, folder / "model.safetensors")
        if not weights_only:
            (folder / "optimizer.bin").write_bytes(b"\1" * 64)

    return save_checkpoint(accelerator, output_dir, name, progress, write_into=write_into)


pytestmark = pytest.mark.usefixtures("accelerate_state")  # conftest: accelerate's logger needs a state


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """tmp_path/out with step_2 and best (the best weights, after step 1), the current folder tmp_path."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    write_checkpoint(out, "step_2", TrainingProgress(global_step=2, samples_in_epoch=32))
    write_checkpoint(out, "best", TrainingProgress(global_step=1, best_step=1), weights_only=True)
    return out


@pytest.mark.parametrize("spelling", ["out/best", "out/best/", "./out/best", "out/./best", "out/step_2/../best",
                                      "{absolute}/best", "elsewhere", "linked/best"])
def test_the_best_folder_by_any_path_is_refused_for_training_and_evaluated_with_eval_only(run_folder, spelling):
    """Issue 43: only the flag's literal 'best' was refused (by the flag checks), so a path to OUTPUT_DIR/best
    continued training from the best weights with a fresh optimizer. 'elsewhere': a link to it under another name;
    'linked/best': a link named best to a copy of it."""
    Path("elsewhere").symlink_to(run_folder / "best")
    shutil.copytree(run_folder / "best", "best_copy")
    Path("linked").mkdir()
    Path("linked/best").symlink_to(Path("best_copy").resolve())
    path = spelling.format(absolute=run_folder)
    with pytest.raises(UserError) as refused:
        resolve_checkpoint(path, run_folder)
    assert str(refused.value).endswith("holds the best weights only (no optimizer state): evaluate them with "
                                       "--eval_only, or resume training from 'latest' or a step_N/epoch_N folder")
    assert resolve_checkpoint(path, run_folder, eval_only=True) == Path(path)
    assert resume.weights_only(resolve_checkpoint(path, run_folder, eval_only=True))
    assert not resume.weights_only(run_folder / "step_2")


def test_what_each_resume_from_checkpoint_value_points_at(run_folder):
    assert resume_point(None, run_folder) == (None, TrainingProgress())
    checkpoint, progress = resume_point("latest", run_folder)
    assert checkpoint == run_folder / "step_2" and (progress.global_step, progress.samples_in_epoch) == (2, 32)
    checkpoint, progress = resume_point("best", run_folder, eval_only=True)
    assert checkpoint == run_folder / "best" and progress.best_step == 1
    assert resolve_checkpoint("out/step_2", run_folder) == Path("out/step_2")
    assert resolve_checkpoint("latest", "empty") is None  # the first start of a command that always says latest
    assert resume_point("out/best", run_folder, eval_only=True)[0] == Path("out/best")
    with pytest.raises(UserError, match="holds the best weights only"):
        resume_point("out/best", run_folder)  # training, unless said otherwise


def test_each_resume_from_checkpoint_that_cannot_work_says_why_and_what_works(run_folder, tmp_path, caplog):
    def refusal(*args, **kwargs) -> str:
        with pytest.raises(UserError) as refused:
            resolve_checkpoint(*args, **kwargs)
        return str(refused.value)

    assert refusal("best", tmp_path / "other") == (
        f"--resume_from_checkpoint best: no {tmp_path / 'other' / 'best'} with {TRAINING_STATE}; train with "
        f"--metric_for_best (or --early_stopping_patience) first")
    assert refusal("out/step_9", run_folder) == ("--resume_from_checkpoint out/step_9: no such folder; pass a "
                                                 "checkpoint folder or 'latest'")
    assert refusal("latest", tmp_path / "empty", eval_only=True) == (
        f"--eval_only: no complete checkpoint in {tmp_path / 'empty'}; pass a checkpoint folder")
    (tmp_path / "finished").mkdir()
    (tmp_path / "finished" / "model.safetensors").write_bytes(b"weights")
    assert refusal("latest", tmp_path / "finished", eval_only=True) == (
        f"--eval_only: no complete checkpoint in {tmp_path / 'finished'}; its model.safetensors (the finished run's "
        f"weights) is evaluated by scripts/predict.py --model_dir {tmp_path / 'finished'}, which prints the accuracy "
        f"on the run's evaluation data")
    write_checkpoint(run_folder, "step_3", TrainingProgress(global_step=3, samples_in_epoch=48))
    (run_folder / "step_3" / "optimizer.bin").write_bytes(b"\0" * 64)  # the same size, other bytes
    assert refusal("out/step_3", run_folder) == ("checkpoint out/step_3 is damaged (optimizer.bin differs from its "
                                                 "sha256 when saved); resume from the newest good one, out/step_2")
    caplog.clear()
    assert resolve_checkpoint("latest", run_folder) == run_folder / "step_2"
    assert [record.getMessage() for record in caplog.records] == [
        "--resume_from_checkpoint latest: skipping damaged checkpoint step_3 (optimizer.bin differs from its sha256 "
        f"when saved); resuming from {run_folder / 'step_2'}"]
    for name in ("step_2", "best"):
        (run_folder / name / "model.safetensors").unlink()
    assert refusal("out/step_3", run_folder).endswith("; no good checkpoint is left beside it")


def test_a_checkpoint_without_a_manifest_still_loads_with_a_warning(run_folder, caplog):
    (run_folder / "step_2" / MANIFEST).unlink()
    with caplog.at_level("WARNING"):
        assert resolve_checkpoint("out/step_2", run_folder) == Path("out/step_2")
        assert resolve_checkpoint("latest", run_folder) == run_folder / "step_2"
    assert [record.getMessage() for record in caplog.records] == [
        f"{checkpoint} has no {MANIFEST} (saved by an older version): its files cannot be checked; loading it as it is"
        for checkpoint in ("out/step_2", run_folder / "step_2")]


def test_load_checkpoint_restores_the_state_or_the_best_weights_or_says_it_cannot(tmp_path, caplog):
    """A real Accelerator on the CPU, one process: save_state's folder restores weights and optimizer; best/ (the
    weights alone) restores the weights; a folder of another model: one line."""
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    accelerator.save_state(str(tmp_path / "step_1"))
    (tmp_path / "best").mkdir()
    save_file({name: value * 2 for name, value in saved.items()}, tmp_path / "best" / "model.safetensors")
    progress = TrainingProgress(epoch=1, global_step=1, samples_in_epoch=16)

    with torch.no_grad():
        model.weight.zero_()
    optimizer.state.clear()
    with caplog.at_level("INFO"):
        resume.load_checkpoint(accelerator, model, tmp_path / "step_1", progress, "latest", tmp_path)
    assert torch.equal(model.weight, saved["weight"]) and optimizer.state  # the momentum buffers are back
    assert f"Resumed from {tmp_path / 'step_1'}: epoch 1, step 1, 16 samples into the epoch" in caplog.text
    resume.load_checkpoint(accelerator, model, tmp_path / "best", progress, str(tmp_path / "best"), tmp_path)
    assert torch.equal(model.weight, saved["weight"] * 2)

    caplog.clear()
    with caplog.at_level("INFO"):
        resume.load_checkpoint(accelerator, model, None, TrainingProgress(), None, tmp_path / "fresh")
        assert caplog.records == []  # no --resume_from_checkpoint: nothing to say
        resume.load_checkpoint(accelerator, model, None, TrainingProgress(), "latest", tmp_path / "out")
    (said,) = [record.getMessage() for record in caplog.records]
    assert said.endswith(f"No checkpoint in {tmp_path / 'out'} yet: starting from scratch")
    assert torch.equal(model.weight, saved["weight"] * 2)  # nothing loaded

    (tmp_path / "other").mkdir()
    save_file({"weight": torch.ones(5, 5)}, tmp_path / "other" / "model.safetensors")
    for folder in ("other", "step_1"):
        if folder == "step_1":
            (tmp_path / "step_1" / "model.safetensors").write_bytes(b"not safetensors")
        with pytest.raises(UserError) as refused:
            resume.load_checkpoint(accelerator, model, tmp_path / folder, progress, "latest", tmp_path)
        exception = "SafetensorError" if folder == "step_1" else "RuntimeError"
        assert str(refused.value) == (f"cannot load checkpoint {tmp_path / folder} ({exception}); it is corrupt or "
                                      f"from another model")


class Trigger:
    """The part of an Accelerator epochs_to_train uses, one process: set_trigger, check_trigger (which resets it)."""

    def __init__(self, is_main_process=True):
        self.is_main_process, self.triggered, self.checks = is_main_process, False, 0

    def set_trigger(self):
        self.triggered = True

    def check_trigger(self):
        self.checks += 1
        triggered, self.triggered = self.triggered, False
        return triggered


def epochs_left(progress, max_steps, patience=None, eval_only=False, accelerator=None, end_epoch_after=None):
    """The epochs epochs_to_train yields, each trained by adding a steps_per_epoch of 4 steps (the last cut at
    max_steps), every evaluation after the first counted as no improvement."""
    plan = SimpleNamespace(max_steps=max_steps, early_stopping_patience=patience, metric_for_best="eval_loss")
    accelerator = accelerator or Trigger()
    epochs = []
    for epoch in epochs_to_train(accelerator, progress, plan, eval_only):
        epochs.append(epoch)
        progress.global_step = min(max_steps, progress.global_step + 4 - progress.samples_in_epoch // 16)
        progress.samples_in_epoch, progress.epoch = 0, epoch + 1
        if progress.best_metric is None:  # the first evaluation is the best so far (save_if_best)
            progress.best_metric, progress.best_step, progress.best_epoch = 0.5, progress.global_step, epoch
        else:
            progress.evaluations_without_improvement += 1
        assert len(epochs) < 20
    return epochs


def test_the_epochs_left_to_train():
    assert epochs_left(TrainingProgress(), max_steps=12) == [0, 1, 2]
    assert epochs_left(TrainingProgress(), max_steps=10) == [0, 1, 2]  # the last one cut short
    assert epochs_left(TrainingProgress(epoch=1, global_step=4), max_steps=12) == [1, 2]
    # a resume inside epoch 1 (2 steps of 4 done): that epoch goes on, whatever the step count
    assert epochs_left(TrainingProgress(epoch=1, global_step=6, samples_in_epoch=32), max_steps=12) == [1, 2]
    assert epochs_left(TrainingProgress(epoch=2, global_step=12, samples_in_epoch=16), max_steps=12) == [2]
    assert epochs_left(TrainingProgress(epoch=3, global_step=12), max_steps=12) == []
    assert epochs_left(TrainingProgress(), max_steps=12, eval_only=True) == []


def test_early_stopping_ends_the_epochs_after_patience_evaluations_without_improvement(caplog):
    assert epochs_left(TrainingProgress(), max_steps=40, patience=2) == [0, 1, 2]
    assert epochs_left(TrainingProgress(), max_steps=40, patience=1) == [0, 1]
    # a resume that finds it so stops before training, with one line
    progress = TrainingProgress(epoch=3, global_step=12, best_metric=0.25, best_step=4, best_epoch=0,
                                evaluations_without_improvement=2)
    with caplog.at_level("INFO"):
        assert epochs_left(progress, max_steps=40, patience=2) == []
    assert "Stopping early: eval_loss has not improved for 2 evaluations (best: 0.2500 after step 4, epoch 0)" \
        in caplog.text
    progress.evaluations_without_improvement = 1
    assert epochs_left(progress, max_steps=40, patience=2) == [3]
    # another process does not set the trigger: it learns of it from the main process's (check_trigger's all-reduce)
    other = Trigger(is_main_process=False)
    other.set_trigger()
    assert epochs_left(TrainingProgress(best_metric=0.5), max_steps=40, patience=5, accelerator=other) == []
    assert epochs_left(TrainingProgress(evaluations_without_improvement=9), max_steps=40, patience=5,
                       accelerator=Trigger(is_main_process=False)) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # without a patience no trigger is checked: no collective that the other processes would not join
    accelerator = Trigger()
    assert epochs_left(TrainingProgress(), max_steps=8, accelerator=accelerator) == [0, 1]
    assert accelerator.checks == 0



def test_load_checkpoint_completes_an_fsdp_model_and_loads_best_as_one_full_state_dict(tmp_path, monkeypatch):
    """What only an FSDP run shows (tests/test_fsdp.py launches one): the model goes to complete_fsdp_model, and best/'s
    plain weights load as a full state dict, which each process shards; a plain model loads either way."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    calls = []
    monkeypatch.setattr(resume, "complete_fsdp_model", lambda accelerator, model: calls.append(("complete", model)))
    monkeypatch.setattr(resume, "check_deepspeed_run", lambda accelerator, checkpoint: None)  # not DeepSpeed
    monkeypatch.setattr(resume, "buffers_as_under_ddp", lambda accelerator, model: None)
    monkeypatch.setattr(resume, "all_in_model_dtype", lambda accelerator, model: None)
    real_set = dcp_state_dict.set_model_state_dict
    monkeypatch.setattr(dcp_state_dict, "set_model_state_dict", lambda model, state, options: (
        calls.append(("set", options.full_state_dict)), real_set(model, state, options=options))[1])
    model = torch.nn.Linear(2, 1)
    accelerator = SimpleNamespace(unwrap_model=lambda wrapped: wrapped, distributed_type=DistributedType.FSDP)
    (tmp_path / "best").mkdir()
    save_file({"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, tmp_path / "best" / "model.safetensors")
    resume.load_checkpoint(accelerator, model, tmp_path / "best", TrainingProgress(), "best", tmp_path)
    assert calls == [("complete", model), ("set", True)] and torch.equal(model.weight, torch.ones(1, 2))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_load_checkpoint_gives_deepspeeds_steps_the_prepared_model_and_the_checkpoint_to_check(
        tmp_path, monkeypatch, zero_stage):
    """Under DeepSpeed (tests/test_deepspeed_launched.py and test_deepspeed_checkpoints.py launch the runs): the model
    to the BatchNorm broadcast and the dtype casts, the checkpoint to check_deepspeed_run (None for best/'s weights,
    which any launch reads), and best/ under ZeRO-3 through DeepSpeed's gathering, into the unwrapped model."""
    calls = []
    for step in ("buffers_as_under_ddp", "all_in_model_dtype", "check_deepspeed_run", "complete_fsdp_model"):
        monkeypatch.setattr(resume, step, lambda accelerator, value, step=step: calls.append((step, value)))
    monkeypatch.setattr(resume, "load_whole_weights_under_zero3",
                        lambda model, weights: calls.append(("zero3", model, sorted(weights))))
    plain, engine = torch.nn.Linear(2, 1), object()
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                  unwrap_model=lambda wrapped: plain if wrapped is engine else None,
                                  load_state=lambda folder: calls.append(("load_state", folder)),
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)))
    (tmp_path / "best").mkdir()
    save_file({"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, tmp_path / "best" / "model.safetensors")
    resume.load_checkpoint(accelerator, engine, tmp_path / "step_3", TrainingProgress(), "latest", tmp_path)
    resume.load_checkpoint(accelerator, engine, tmp_path / "best", TrainingProgress(), "best", tmp_path)
    prepared = [("complete_fsdp_model", engine), ("check_deepspeed_run", tmp_path / "step_3"),
                ("buffers_as_under_ddp", engine), ("all_in_model_dtype", engine)]
    best = [("complete_fsdp_model", engine), ("check_deepspeed_run", None), ("buffers_as_under_ddp", engine),
            ("all_in_model_dtype", engine)]
    if zero_stage == 3:
        assert calls == [*prepared, ("load_state", str(tmp_path / "step_3")), *best,
                         ("zero3", plain, ["bias", "weight"])]
    else:  # ZeRO-2: each process holds the whole weights, loaded as under DDP
        assert calls == [*prepared, ("load_state", str(tmp_path / "step_3")), *best]
        assert torch.equal(plain.weight, torch.ones(1, 2))


def test_the_resume_lines_are_the_main_processes_alone(run_folder, another_process, caplog, monkeypatch):
    monkeypatch.setattr(resume, "complete_fsdp_model", lambda accelerator, model: None)
    monkeypatch.setattr(resume, "check_deepspeed_run", lambda accelerator, checkpoint: None)
    monkeypatch.setattr(resume, "buffers_as_under_ddp", lambda accelerator, model: None)
    monkeypatch.setattr(resume, "all_in_model_dtype", lambda accelerator, model: None)
    with caplog.at_level("INFO"):
        resume.load_checkpoint(SimpleNamespace(), None, None, TrainingProgress(), "latest", run_folder)
        resume.load_checkpoint(SimpleNamespace(load_state=lambda folder: None), None, run_folder / "step_2",
                               TrainingProgress(), "latest", run_folder)
        assert accumulation_for(2, 24, 3, 4, 18, 1) == 2
        progress = TrainingProgress(best_metric=0.5, evaluations_without_improvement=3)
        assert epochs_left(progress, max_steps=40, patience=2) == []  # stopped early, said by process 0 only
    assert caplog.records == []
