"""docs/output_files.md explains every file a run writes, and the run's log says truly what it saved:
no line about files Accelerate did not write (pytorch_model.bin, sampler.bin) or about the temporary
folder a checkpoint is written into, and no profiler ERROR line in a successful CPU run."""

import re

from helpers import REPO, launch, results

DOC = (REPO / "docs" / "output_files.md").read_text()


def documented_files() -> list:
    """The paths in the first column of the doc's tables, as regular expressions (N: a number, SCRIPT:
    the script's name, TIME: a Unix time, *: anything within one name); folders (ending in /) left out."""
    patterns = []
    for row in re.findall(r"^\| (.+?) \|", DOC, flags=re.M):
        for name in re.findall(r"`([^`]+)`", row):
            if not name.endswith("/"):
                regex = re.escape(name).replace("N", r"\d+").replace("SCRIPT", r"\w+").replace("TIME", r"[\d.]+")
                patterns.append(re.compile(regex.replace(r"\*", r"[^/]*")))
    return patterns


def test_a_run_writes_only_documented_files_and_logs_them_truly(synthetic_mnist, tmp_path):
    out = tmp_path / "out"
    # 32 batches of 2: --profile traces batches 13-17; a checkpoint and best/ after the epoch
    proc = launch(["--data_dir", synthetic_mnist, "--max_train_samples", "64", "--batch_size", "2", "--epochs", "1",
                   "--checkpointing_steps", "epoch", "--metric_for_best", "eval_accuracy", "--profile",
                   "--with_tracking", "--output_dir", out])
    log = proc.stdout + proc.stderr

    written = sorted(path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file())
    patterns = documented_files()
    assert len(patterns) > 15
    undocumented = [name for name in written if not any(p.fullmatch(name) for p in patterns)]
    assert not undocumented, f"add them to docs/output_files.md: {undocumented}"
    for expected in ("model.safetensors", "results.json", "run.json", "epoch_0/optimizer.bin", "epoch_0/scheduler.bin",
                     "epoch_0/random_states_0.pkl", "epoch_0/training_state.json", "best/model.safetensors"):
        assert expected in written, expected
    assert len([name for name in written if name.startswith("profile/rank0.")]) == 1
    # TensorBoard's hyperparameters and Accelerate's hparams.yml: each in a TIME folder of its own (the doc says so)
    hparams = [name.split("/")[1] for name in written if re.fullmatch(r"train_mnist/[\d.]+/[^/]+", name)]
    assert len(hparams) == 2 and len(set(hparams)) == 2, written

    # One true line per checkpoint, naming exactly the files in it; Accelerate's per-file lines are gone.
    checkpoint_files = sorted(path.name for path in (out / "epoch_0").iterdir())
    assert f"Saved {out / 'epoch_0'}: {', '.join(checkpoint_files)}" in log
    assert len(checkpoint_files) == 7 and "manifest.json" in checkpoint_files, checkpoint_files
    for untrue in ("pytorch_model.bin", "sampler", ".tmp-"):
        assert untrue not in log, untrue
    assert f"Model weights saved in {out / 'model.safetensors'}" in log  # save_model's line, made true
    # The profiler's failed GPU query (a CUDA build of torch without a driver) is not shown.
    assert "gpuGetDeviceCount" not in log and not re.search(r"^ERROR", log, flags=re.M)
    assert results(out)["train_samples_per_second_over"] == "steady_state"
    assert results(out)["train_samples_per_second"] > 0


def test_accelerates_fsdp_save_lines_are_hidden_as_the_others(tmp_path, caplog):
    """In-process: the lines Accelerate logs while save_state writes an FSDP checkpoint (accelerator.py and
    utils/fsdp_utils.py, Accelerate 1.15's wording, through the loggers utils/run/checkpoints.py filters) name the
    temporary folder or none: all hidden; a line about a real file and any warning pass. tests/test_fsdp.py checks a
    real FSDP run's log."""
    import logging

    import utils.run.checkpoints  # noqa: F401  installs the filters

    tmp, final = tmp_path / ".tmp-step_2", tmp_path / "model.safetensors"
    final.touch()
    said = {
        "accelerate.accelerator": ["Saving FSDP model", f"FSDP Model saved to output dir {tmp}", "Saving FSDP Optimizer",
                                   f"FSDP Optimizer saved to output dir {tmp}", f"Model weights saved in {final}"],
        "accelerate.utils.fsdp_utils": [f"Saving model to {tmp}/pytorch_model_fsdp_0",
                                        f"Model saved to {tmp}/pytorch_model_fsdp_0",
                                        f"Saving Optimizer state to {tmp}/optimizer_0",
                                        f"Optimizer state saved in {tmp}/optimizer_0"],
    }
    with caplog.at_level(logging.INFO):
        for name, lines in said.items():
            for line in lines:  # as Accelerate's get_logger(name).info(line) logs it on process 0
                logging.getLogger(name).info(f"[RANK 0] {line}")
        logging.getLogger("accelerate.utils.fsdp_utils").warning(f"[RANK 0] Saving model to {tmp}")
    assert [record.getMessage() for record in caplog.records] == [
        f"[RANK 0] Model weights saved in {final}", f"[RANK 0] Saving model to {tmp}"]
