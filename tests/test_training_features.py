"""The features users of accelerate's by_feature examples expect, in both training scripts: gradient clipping,
early stopping with the best model kept, the profiler, trackers beyond TensorBoard (MLflow, W&B), and a batch
size that backs off on out-of-memory.

Processes: the two 2-process runs, the early-stopped MNIST run and the classifier's --auto_find_batch_size, are the
jobs of one launch (`two_process_runs`: tests/jobs.py's launch_jobs, each launched process importing torch and
Accelerate once, then forking one child per job); the 1-process --eval_only of best/ runs alone (run_alone: no
launcher around it)."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from helpers import REPO, TRAIN_MNIST, assert_clean_user_error, launcher_args, results, run_alone
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs
from oom_model import FITS, OutOfMemoryAboveBatchSize
from safetensors.torch import load_file

from utils.report.meters import GradNorms

TRAIN_IMAGE_CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PATIENCE = 1
STEPS_PER_EPOCH = 640 // (2 * 16 * 2)  # synthetic_mnist: 640 samples; 2 processes x 16 x 2 accumulation steps


MLFLOW_MISSING = "MLflow is an optional install: pip install -r requirements-trackers.txt"


@pytest.fixture(scope="module")
def two_process_runs(synthetic_mnist, tmp_path_factory):
    """The one 2-process launch: early_stopped/ (below; only where MLflow is installed), then the classifier with
    --auto_find_batch_size (auto_batch/). The trackers' variables are the launch's: only early_stopped reports to them.
    Returns its folder; each test reads its job (jobs.finished_job: every process exited 0)."""
    root = tmp_path_factory.mktemp("features_2proc")
    out = root / "early_stopped"
    out.mkdir()  # W&B writes into it (WANDB_DIR)
    jobs = {}
    if importlib.util.find_spec("mlflow") is not None:  # else early_stopped skips its tests, and only this one runs
        jobs["early_stopped"] = [
            TRAIN_MNIST, "--cpu", "--data_dir", synthetic_mnist, "--output_dir", out, "--epochs", "12", "--batch_size",
            "16", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.001", "--metric_for_best",
            "eval_accuracy", "--early_stopping_patience", PATIENCE, "--profile", "--report_to", "all",
            "--lr_scheduler_type", "onecycle", "--warmup_steps", "18"]
    data = make_split_image_folder(root / "images", train_per_class=40, val_per_class=4)
    jobs["auto_batch"] = [
        TRAIN_IMAGE_CLASSIFIER, "--cpu", "--data_dir", data, "--output_dir", root / "auto_batch", "--model",
        "tests.oom_model:small_cnn_out_of_memory_above_16", "--image_size", "32", "--epochs", "1", "--num_workers", "0",
        "--batch_size", "32", "--auto_find_batch_size", "--max_grad_norm", "1.0", "--metric_for_best", "eval_loss"]
    launch_jobs(jobs, launcher_args(2), root, env={"MLFLOW_TRACKING_URI": mlflow_store(root), "WANDB_MODE": "offline",
                                    "WANDB_DIR": str(out), "WANDB_SILENT": "true"})
    return root


def mlflow_store(root) -> str:
    """early_stopped's MLflow store: a local SQLite file beside its output folder."""
    return f"sqlite:///{root / 'early_stopped-mlflow.db'}"


@pytest.fixture(scope="module")
def early_stopped(two_process_runs, synthetic_mnist):
    """2 processes, clipping every step, the best accuracy kept, stopping once it stops improving (the synthetic
    digits reach 100% within a few epochs), profiled, logged to every tracker installed: TensorBoard, MLflow in a
    local SQLite store, W&B offline (CI installs requirements-trackers.txt). The schedule's flags are the defaults,
    said (onecycle, 15% of 120 steps = 18 of warmup: the same rates bit for bit), for test_lr_schedules.py's claim
    that run.json records them (one launch fewer). (output_dir, what both processes printed, store, data)."""
    pytest.importorskip("mlflow", reason=MLFLOW_MISSING)
    output = finished_job(two_process_runs / "early_stopped", 2).stdout
    return two_process_runs / "early_stopped", output, mlflow_store(two_process_runs), synthetic_mnist


def mlflow_run(store: str, experiment: str):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    (run_,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run_


def test_early_stopping_stops_every_process_after_patience_epochs_without_improvement(early_stopped):
    out, _, store, _ = early_stopped
    r = results(out)
    client, run_ = mlflow_run(store, "train_mnist")
    accuracy = [m.value for m in sorted(client.get_metric_history(run_.info.run_id, "eval_accuracy"),
                                        key=lambda m: m.step)]
    epochs_trained = len(accuracy)
    assert r["stopped_early"] and epochs_trained < 12, accuracy
    assert r["best_eval_accuracy"] == max(accuracy) and r["best_epoch"] == accuracy.index(max(accuracy)), accuracy
    assert epochs_trained == r["best_epoch"] + 1 + PATIENCE  # stopped after exactly PATIENCE epochs without a gain
    assert r["global_step"] == epochs_trained * STEPS_PER_EPOCH and r["samples_seen"] == epochs_trained * 640
    assert r["eval_accuracy"] == accuracy[-1]  # the last epoch's, while best/ holds the best one
    assert len(set(r["parameter_fingerprints"])) == 1  # both processes stopped after the same epoch, in step


def test_train_mnist_counts_the_schedule_in_optimizer_steps(early_stopped):
    """(test_lr_schedules.py's claim, on this module's run.) 640 samples, 2 processes x 16 x 2 accumulation steps: 10
    optimizer steps per epoch, 120 in the 12 epochs the schedule is sized for. The rate after the last step taken is
    OneCycleLR's after as many steps of 120 (18 of warmup) only if the schedule was sized and stepped in optimizer
    steps (sized in batches: 240)."""
    out, _, _, _ = early_stopped
    r = results(out)
    run = json.loads((out / "run.json").read_text())
    assert r["num_processes"] == 2 and r["global_step"] == r["lr_scheduler_steps"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=run["learning_rate"], momentum=0.9)
    recipe = torch.optim.lr_scheduler.OneCycleLR(optimizer, run["learning_rate"], 12 * STEPS_PER_EPOCH, pct_start=0.15)
    for _ in range(r["global_step"]):
        optimizer.step()
        recipe.step()
    assert r["current_learning_rate"] == recipe.get_last_lr()[0], (r["global_step"], r["current_learning_rate"])
    assert (run["lr_scheduler_type"], run["warmup_steps"], run["warmup_epochs"]) == ("onecycle", 18, None)


def test_gradients_are_clipped_once_per_optimizer_step_and_their_norms_logged(early_stopped):
    out, _, store, _ = early_stopped
    r = results(out)
    # 20 batches per process and epoch, 10 optimizer steps: clipped on the sync steps only (a few steps of the
    # converged model have gradients below even 0.001)
    assert STEPS_PER_EPOCH // 2 < r["steps_clipped"] <= STEPS_PER_EPOCH, r
    assert r["max_grad_norm"] == 0.001 and r["grad_norm_max"] >= r["grad_norm_mean"] > 0.001, r
    client, run_ = mlflow_run(store, "train_mnist")
    assert run_.data.metrics["grad_norm_mean"] == r["grad_norm_mean"]


def test_mlflow_holds_the_flags_and_every_epochs_metrics(early_stopped):
    out, _, store, _ = early_stopped
    r = results(out)
    client, run_ = mlflow_run(store, "train_mnist")
    assert run_.data.params["max_grad_norm"] == "0.001" and "mlflow" in run_.data.params["report_to"].split(",")
    losses = client.get_metric_history(run_.info.run_id, "eval_loss")
    assert sorted(m.step for m in losses) == list(range(STEPS_PER_EPOCH, r["global_step"] + 1, STEPS_PER_EPOCH))
    assert run_.data.metrics["eval_loss"] == r["eval_loss"] and run_.data.metrics["train_loss"] == r["train_loss"]


def test_best_holds_the_best_epochs_plain_weights_and_eval_only_evaluates_them(early_stopped, tmp_path):
    out, _, _, data = early_stopped
    r = results(out)
    best, final = load_file(out / "best" / "model.safetensors"), load_file(out / "model.safetensors")
    assert best.keys() == final.keys() and not any(k.startswith(("module.", "_orig_mod.")) for k in best)
    assert json.loads((out / "best" / "training_state.json").read_text())["best_epoch"] == r["best_epoch"]
    # evaluated alone, on another process count, best/ gives the accuracy it was kept for (one process without the
    # launcher around it: a launcher process fewer; launched --eval_only runs: test_train_mnist.py)
    eval_out = tmp_path / "eval"
    eval_out.mkdir()
    (eval_out / "best").symlink_to(out / "best")
    run_alone(["--data_dir", data, "--output_dir", eval_out, "--eval_only", "--resume_from_checkpoint", "best"])
    evaluated = json.loads((eval_out / "eval_results.json").read_text())  # --eval_only's own file
    assert evaluated["eval_accuracy"] == r["best_eval_accuracy"]
    assert evaluated["checkpoint_epochs_done"] == r["best_epoch"] + 1 and evaluated["run"]["epochs"] == 12


def test_profile_writes_one_trace_per_process_and_prints_the_top_operators(early_stopped):
    out, output, _, _ = early_stopped
    traces = sorted((out / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        steps = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]
                 if e.get("name", "").startswith("ProfilerStep#")}
        assert len(steps) == 5, steps  # the active window, after the warm-up the meter also leaves out
    assert "top operators by self cpu time total" in output and "aten::" in output


def test_resume_from_best_without_eval_only_is_one_line(capsys):
    from utils.launch.flags import build_mnist_parser, check_flag_combinations

    parser = build_mnist_parser("test")
    with pytest.raises(SystemExit):
        check_flag_combinations(parser, parser.parse_args(["--resume_from_checkpoint", "best"]))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and ": --resume_from_checkpoint best holds the best weights only" in line
    assert "evaluate them with --eval_only" in line


def test_early_stopping_alone_watches_the_eval_loss_as_the_trainer():
    from utils.launch.flags import build_mnist_parser, check_flag_combinations

    parser = build_mnist_parser("test")
    for flags, metric in ((["--early_stopping_patience", "2"], "eval_loss"),
                          (["--early_stopping_patience", "2", "--metric_for_best", "eval_accuracy"], "eval_accuracy"),
                          ([], None)):
        args = parser.parse_args(flags)
        check_flag_combinations(parser, args)
        assert args.metric_for_best == metric, flags


def test_a_tracker_that_is_not_installed_is_one_line(monkeypatch, capsys):
    import importlib.util

    from utils.launch.flags import build_mnist_parser, check_flag_combinations

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    parser = build_mnist_parser("test")
    with pytest.raises(SystemExit) as exit_:
        check_flag_combinations(parser, parser.parse_args(["--report_to", "wandb"]))
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and line.endswith(
        ": --report_to wandb: the wandb package is not installed; pip install -r requirements-trackers.txt (see --help)")


def test_with_tracking_is_report_to_tensorboard_and_all_is_every_installed_tracker(monkeypatch):
    import utils.launch.flags
    from utils.launch.flags import build_mnist_parser, check_flag_combinations

    # W&B's login check has tests of its own (below), in processes of their own: wandb keeps its settings per process
    monkeypatch.setattr(utils.launch.flags, "check_wandb_login", lambda parser, report_to: None)
    parser = build_mnist_parser("test")
    for argv, expected in ((["--with_tracking"], ["tensorboard"]), ([], []),
                           (["--report_to", "mlflow", "--with_tracking"], ["mlflow", "tensorboard"])):
        args = parser.parse_args(argv)
        check_flag_combinations(parser, args)
        assert args.report_to == expected, argv
    args = parser.parse_args(["--report_to", "all"])
    check_flag_combinations(parser, args)
    assert "tensorboard" in args.report_to and set(args.report_to) <= {"tensorboard", "mlflow", "wandb"}


def without_wandb_credentials(monkeypatch, home):
    """This process's environment as a new user's who installed W&B but never logged in: an empty HOME (no ~/.netrc,
    no W&B settings), no WANDB_* variables (WANDB_MODE unset: online), and W&B's server at a closed local port, so
    that nothing can wait on the network."""
    for name in [name for name in os.environ if name.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.chdir(home)  # W&B's workspace settings (./wandb/settings) and MLflow's default store: here


def test_wandb_without_credentials_is_one_line_before_any_tracker_starts(monkeypatch, tmp_path, synthetic_mnist):
    """`--report_to all` with W&B installed, never logged in: one `error:` line naming the fixes, before anything is
    written: no output folder, no MLflow run (before: wandb's UsageError traceback in init_trackers, and an empty
    MLflow run, FINISHED, in mlflow.db)."""
    pytest.importorskip("wandb", reason="wandb is an optional install: pip install -r requirements-trackers.txt")
    pytest.importorskip("mlflow", reason=MLFLOW_MISSING)
    home = tmp_path / "home"
    without_wandb_credentials(monkeypatch, home)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's default store: mlflow.db in the working folder
    proc = run_alone(["--data_dir", synthetic_mnist, "--output_dir", tmp_path / "out", "--epochs", "1",
                      "--max_train_samples", "64", "--report_to", "all"], check=False, timeout=300, cwd=home)
    assert_clean_user_error(proc, "--report_to all: W&B cannot log online: it has no API key here (not logged in)",
                            "`wandb login`", "WANDB_MODE=offline", "another --report_to")
    assert proc.returncode == 2 and not (tmp_path / "out").exists(), proc.stderr
    assert not {"mlflow.db", "mlruns", "wandb"} & {path.name for path in home.iterdir()}, list(home.iterdir())


WANDB_CHECK = ("from utils.launch.flags import build_mnist_parser, check_flag_combinations; "
               "parser = build_mnist_parser('t'); args = parser.parse_args(['--report_to', 'wandb']); "
               "check_flag_combinations(parser, args); import psutil; "
               "print(args.report_to, [child.name() for child in psutil.Process().children(recursive=True)])")


@pytest.mark.parametrize("case, status, said", [
    ("malformed WANDB_API_KEY", 2, "W&B cannot log online: WANDB_API_KEY invalid: API key must have 40+ characters"),
    ("an API key in ~/.netrc", 0, "['wandb'] []"),
    ("WANDB_MODE=offline", 0, "['wandb'] []"),
])
def test_wandb_logs_online_only_with_credentials_and_offline_without(monkeypatch, tmp_path, case, status, said):
    """The check alone, in a process of its own (wandb reads its settings once per process), without the network
    (no credentials at all: the test above). WANDB_MODE=dryrun and disabled are read as offline is, by wandb. The
    check starts no process: wandb.login's "logged in as" line starts W&B's service (wandb-core) to ask the server,
    and its exit once hung past 120 s in CI."""
    pytest.importorskip("wandb", reason="wandb is an optional install: pip install -r requirements-trackers.txt")
    home = tmp_path / "home"
    without_wandb_credentials(monkeypatch, home)
    if case == "malformed WANDB_API_KEY":
        monkeypatch.setenv("WANDB_API_KEY", "abc")
    elif case == "an API key in ~/.netrc":
        # as `wandb login` writes it: the server's host and port, the key as password
        (home / ".netrc").write_text(f"machine 127.0.0.1:9 login user password {'0' * 40}\n")
        (home / ".netrc").chmod(0o600)
    elif case.startswith("WANDB_MODE="):
        monkeypatch.setenv("WANDB_MODE", case.split("=")[1])
    proc = subprocess.run([sys.executable, "-c", WANDB_CHECK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == status, proc.stdout + proc.stderr
    if status:
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("error: ") and said in line, line
    else:
        assert proc.stdout.strip().splitlines()[-1] == said, proc.stdout + proc.stderr


def wandb_records(path):
    """The records of a W&B offline run file (LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte
    header; W&B puts its own 7-byte header first). wandb >= 0.19 no longer ships a Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_every_epochs_metrics(early_stopped):
    pytest.importorskip("wandb", reason="wandb is an optional install: pip install -r requirements-trackers.txt")
    out, _, _, _ = early_stopped
    r = results(out)
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
               for record in wandb_records(run_file) if record.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == list(range(STEPS_PER_EPOCH, r["global_step"] + 1, STEPS_PER_EPOCH))
    assert history[-1]["eval_accuracy"] == r["eval_accuracy"] and history[-1]["grad_norm_mean"] == r["grad_norm_mean"]


def test_auto_find_batch_size_halves_until_a_step_fits_and_keeps_the_global_batch(two_process_runs):
    """Job auto_batch: a model that runs out of memory above 16 images, asked for 32 per process."""
    proc = finished_job(two_process_runs / "auto_batch", 2)
    out = two_process_runs / "auto_batch"
    r = results(out)
    assert r["batch_size_per_process"] == FITS and r["gradient_accumulation_steps"] == 32 // FITS
    assert r["global_batch_size"] == 2 * 32 and r["global_step"] == r["train_size"] // 64 == 2
    assert r["samples_seen"] == 2 * 64 and r["eval_samples"] == 16
    assert "--batch_size 32 runs out of memory, 16 fits (tried [32, 16])" in proc.stdout  # both processes' output
    assert 0 < r["grad_norm_mean"] and r["steps_clipped"] <= r["global_step"]
    assert r["best_epoch"] == 0 and r["best_eval_loss"] == r["eval_loss"] and not r["stopped_early"]
    assert load_file(out / "best" / "model.safetensors").keys() == load_file(out / "model.safetensors").keys()


def test_auto_find_batch_size_says_so_when_not_even_one_sample_fits():
    from accelerate import Accelerator

    from utils.errors import UserError
    from utils.launch.flags import build_mnist_parser
    from utils.run.batch_size import fit_batch_size

    args = build_mnist_parser("test").parse_args(["--batch_size", "8", "--cpu"])
    accelerator = Accelerator(cpu=True)
    model = OutOfMemoryAboveBatchSize(num_classes=10, fits=0)
    optimizer = torch.optim.AdamW(model.parameters())
    dataset = [(torch.zeros(3, 8, 8), 0)] * 4
    with pytest.raises(UserError, match="even a batch of 1 runs out of memory"):
        fit_batch_size(accelerator, model, optimizer, dataset, args.batch_size, args.gradient_accumulation_steps)
    assert args.batch_size == 8  # the helper returns its choice; it never rewrites the flags


def test_auto_find_batch_size_takes_the_smallest_size_any_process_fits_and_undoes_its_probe():
    """In-process, one process standing for two: the other fits only 8 (its gathered size). All take 8, with the
    accumulation that keeps 32 x 2 per process; the probe's step leaves neither weights nor optimizer state behind."""
    from accelerate import Accelerator

    from utils.launch.flags import build_mnist_parser
    from utils.run.batch_size import fit_batch_size

    args = build_mnist_parser("test").parse_args(["--batch_size", "32", "--gradient_accumulation_steps", "2", "--cpu"])
    accelerator = Accelerator(cpu=True)
    accelerator.gather = lambda fits: torch.cat([fits, torch.tensor([8])])  # this process's size, the other's
    model = OutOfMemoryAboveBatchSize(num_classes=10)  # fits 16
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    dataset = [(torch.rand(3, 8, 8), i % 10) for i in range(40)]
    assert fit_batch_size(accelerator, model, optimizer, dataset, args.batch_size, 2) == (8, 32 * 2 // 8)
    assert not optimizer.state  # no Adam moments or step count from the probe
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())


def test_grad_norms_count_finite_norms_and_clipped_steps():
    norms = GradNorms(torch.device("cpu"), max_norm=1.0)
    for value in (0.5, 3.0, float("inf"), 2.0):
        norms.add(torch.tensor(value))
    assert norms.take() == {"grad_norm_mean": pytest.approx(5.5 / 3), "grad_norm_max": 3.0, "steps_clipped": 2}
    assert norms.take()["grad_norm_mean"] is None  # taken: the next epoch starts afresh
    assert GradNorms(torch.device("cpu"), max_norm=None).take() == {}
