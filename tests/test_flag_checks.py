"""The checks of utils/launch/flags.py that look at several flags at once, in process: what is refused together (one
`error:` line, status 2), the normal forms they leave (trackers, warmup, --metric_for_best, --model_ema_decay), the
baselines' refusals, the trackers' config and the DataLoader workers per process. tests/test_bad_inputs.py parses the
scripts' own command lines."""

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from utils.launch import flags

TRACKERS_INSTALLED = ["mlflow", "tensorboard"]  # as if wandb were not installed


@pytest.fixture(autouse=True)
def trackers(monkeypatch):
    """importlib.util.find_spec as flags.py asks it: TRACKERS_INSTALLED are installed, the other trackers not."""
    real_find_spec = flags.importlib.util.find_spec
    monkeypatch.setattr(flags.importlib.util, "find_spec",
                        lambda name: object() if name in TRACKERS_INSTALLED else None if name in flags.TRACKERS
                        else real_find_spec(name))


def training_parser() -> flags.ArgumentParser:
    """The flags train_image_classifier.py has: the shared ones, the schedule's, --model_ema's, the step flags', and
    its own mixing flags and --streaming."""
    parser = flags.build_parser("t", epochs=2, batch_size=8, learning_rate=0.1)
    flags.add_lr_scheduler_flags(parser, lr_scheduler_type="cosine", warmup_epochs=1.0)
    flags.add_model_ema_flags(parser)
    flags.add_step_flags(parser)
    for flag in ("--mixup_alpha", "--cutmix_alpha"):
        parser.add_argument(flag, type=flags.non_negative_float, default=0.0)
    parser.add_argument("--streaming", action="store_true")
    return parser


def checked(*argv, check=flags.check_flag_combinations):
    """The args after `check`, or the one line it stopped with (status 2)."""
    parser = training_parser()
    args = parser.parse_args(argv)
    try:
        check(parser, args)
    except SystemExit as stopped:
        assert stopped.code == 2
        return stopped.line
    return args


@pytest.fixture(autouse=True)
def one_line(monkeypatch):
    """parser.error's line, kept on the SystemExit (exit_with_error writes it to stderr)."""
    def exit_with_error(message, status=1):
        stopped = SystemExit(status)
        stopped.line = f"error: {message}"
        raise stopped

    monkeypatch.setattr(flags, "exit_with_error", exit_with_error)


def refusal(flag_words: str) -> str:
    return f"error: {flags.ArgumentParser().prog}: {flag_words} (see --help)"


@pytest.mark.parametrize("argv, message", [
    (["--eval_only"], "--eval_only needs --resume_from_checkpoint {latest,best,PATH} to know what to evaluate"),
    (["--resume_from_checkpoint", "best"], "--resume_from_checkpoint best holds the best weights only (no optimizer "
     "state): evaluate them with --eval_only, or resume training from 'latest' or a step_N/epoch_N folder"),
    (["--overwrite_output_dir", "--resume_from_checkpoint", "latest"],
     "--overwrite_output_dir starts afresh and --resume_from_checkpoint continues a run: pass one"),
    (["--eval_only", "--resume_from_checkpoint", "latest", "--eval_steps", "5"], "--eval_steps says when a training "
     "run does something every N optimizer steps, and --eval_only trains nothing: drop --eval_steps"),
    (["--eval_only", "--resume_from_checkpoint", "latest", "--logging_steps", "5"], "--logging_steps says when a "
     "training run does something every N optimizer steps, and --eval_only trains nothing: drop --logging_steps"),
    (["--metric_for_best", "eval_ema_loss"], "--metric_for_best eval_ema_loss measures --model_ema's average: add "
                                             "--model_ema"),
    (["--model_ema_decay", "0.99"], "--model_ema_decay sets up --model_ema's average: add --model_ema"),
    (["--model_ema_warmup"], "--model_ema_warmup sets up --model_ema's average: add --model_ema"),
    (["--report_to", "wandb"], "--report_to wandb: the wandb package is not installed; pip install -r "
                               "requirements-trackers.txt"),
])
def test_flags_that_are_wrong_together_stop_with_one_line(argv, message):
    assert checked(*argv) == refusal(message)


def test_what_the_checks_leave_in_args():
    args = checked()
    assert (args.report_to, args.metric_for_best, args.warmup_epochs, args.model_ema_decay) == ([], None, 1.0, None)
    args = checked("--with_tracking", "--warmup_steps", "0", "--early_stopping_patience", "2", "--model_ema")
    assert (args.report_to, args.warmup_epochs, args.warmup_steps) == (["tensorboard"], None, 0)
    assert (args.metric_for_best, args.model_ema_decay) == ("eval_loss", flags.DEFAULT_EMA_DECAY)
    args = checked("--report_to", "all", "--with_tracking", "--metric_for_best", "eval_ema_accuracy",
                   "--early_stopping_patience", "2", "--model_ema", "--model_ema_decay", "0.5", "--model_ema_warmup",
                   "--eval_only", "--resume_from_checkpoint", "best")
    assert (args.report_to, args.metric_for_best, args.model_ema_decay) == (TRACKERS_INSTALLED, "eval_ema_accuracy",
                                                                            0.5)
    assert checked("--report_to", "mlflow").report_to == ["mlflow"]
    assert checked("--report_to", "none", "--eval_only", "--resume_from_checkpoint", "out/best").report_to == []


@pytest.mark.parametrize("argv, message", [
    ([], "--streaming needs --max_steps (a stream's length is unknown, so the run is counted in steps)"),
    (["--max_steps", "4", "--max_train_samples", "8"],
     "--max_train_samples does not work with --streaming (it needs a dataset of known length); drop it"),
    (["--max_steps", "4", "--auto_find_batch_size"],
     "--auto_find_batch_size does not work with --streaming (it needs a dataset of known length); drop it"),
    *[(["--max_steps", "4", flag, "0.2"], "--mixup_alpha and --cutmix_alpha do not work with --streaming yet (each "
       "image's partner is drawn by its index in the data set, which a stream does not have); drop them")
      for flag in ("--mixup_alpha", "--cutmix_alpha")],
    (["--max_steps", "4", "--warmup_epochs", "2"], "--warmup_epochs does not work with --streaming (an epoch's length "
                                                   "is unknown beforehand); use --warmup_steps"),
])
def test_flags_a_stream_cannot_serve_stop_with_one_line(argv, message):
    assert checked("--streaming", *argv, check=flags.check_streaming_flags) == refusal(message)


def test_a_stream_has_no_warmup_in_epochs():
    assert checked("--streaming", "--max_steps", "4", check=flags.check_streaming_flags).warmup_epochs is None
    args = checked("--streaming", "--max_steps", "4", "--warmup_steps", "3", "--mixup_alpha", "0",
                   check=flags.check_streaming_flags)
    assert (args.warmup_epochs, args.warmup_steps) == (None, 3)


@pytest.mark.parametrize("name", flags.FLAGS_THE_BASELINES_LACK)
def test_the_baselines_refuse_each_flag_only_train_mnist_has(name):
    parser = flags.build_mnist_parser("t")
    args = parser.parse_args([])
    flags.reject_flags_the_baselines_lack(parser, args)  # the defaults pass
    setattr(args, name, "a value")
    with pytest.raises(SystemExit) as stopped:
        flags.reject_flags_the_baselines_lack(parser, args)
    assert stopped.value.line == refusal(f"--{name}: the baselines leave it out to stay short; scripts/train_mnist.py "
                                         f"has it")


def test_the_mnist_scripts_share_one_set_of_defaults():
    parser = flags.build_mnist_parser("MNIST")
    args = parser.parse_args([])
    assert (args.epochs, args.batch_size, args.learning_rate, args.data_dir) == (3, 64, 3e-3, None)
    assert parser.description == "MNIST" and parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    assert parser.parse_args(["--data_dir", "d"]).data_dir == "d"


def test_the_trackers_get_the_flags_as_scalars_and_strings():
    args = argparse.Namespace(epochs=3, learning_rate=0.1, name="x", cpu=True, output_dir=Path("out/run"),
                              report_to=["mlflow", "tensorboard"], max_grad_norm=None, shape=(1, 2), extra={"a": 1})
    assert flags.tracker_config(args) == {"epochs": 3, "learning_rate": 0.1, "name": "x", "cpu": True,
                                          "output_dir": "out/run", "report_to": "mlflow,tensorboard"}


@pytest.mark.parametrize("cpus, local_world_size, most, workers", [
    (16, None, 4, 4), (16, "2", 4, 4), (16, "8", 4, 2), (6, "2", 4, 3), (2, "4", 4, 0), (16, "1", 8, 8),
    (1, None, 4, 1),
])
def test_dataloader_workers_share_this_processes_cpus_among_the_machines_processes(monkeypatch, cpus, local_world_size,
                                                                                   most, workers):
    monkeypatch.setattr(flags.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(flags.os, "cpu_count", lambda: 99)  # all CPUs of the machine: not all may be this process's
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert flags.default_num_workers(most) == workers
    if most == 4:
        assert flags.default_num_workers() == workers


@pytest.mark.parametrize("cpu_count, workers", [(3, 3), (None, 1)])
def test_without_cpu_affinity_the_machines_cpus_count(monkeypatch, cpu_count, workers):
    """macOS and Windows have no sched_getaffinity; os.cpu_count() may be None."""
    monkeypatch.delattr(flags.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(flags.os, "cpu_count", lambda: cpu_count)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert flags.default_num_workers() == workers


def test_a_script_without_the_optional_flag_groups_passes_the_checks():
    """The baselines' parser (build_mnist_parser alone) has no --eval_steps, --warmup_steps or --model_ema."""
    parser = flags.build_mnist_parser("t")
    args = parser.parse_args(["--eval_only", "--resume_from_checkpoint", "latest", "--metric_for_best", "eval_loss"])
    flags.check_flag_combinations(parser, args)
    assert (args.metric_for_best, args.report_to) == ("eval_loss", [])
    assert not hasattr(args, "model_ema_decay") and not hasattr(args, "warmup_epochs")


@pytest.fixture
def wandb_login(monkeypatch):
    """wandb's settings mode and login, stubbed (`mode`, and `result`: True, False or an exception to raise), with
    wandb counted as installed: the decision alone, in this process. wandb reads its real settings once per process, so
    tests/test_training_features.py runs the real check in processes of its own."""
    wandb = pytest.importorskip("wandb", reason="wandb is an optional install: pip install -r requirements-trackers.txt")
    from wandb.sdk import wandb_setup

    TRACKERS_INSTALLED.append("wandb")
    stub = SimpleNamespace(mode="online", result=True, calls=[], settings=SimpleNamespace(silent=False))

    def login(**kwargs):
        stub.calls.append({**kwargs, "silent": stub.settings.silent})
        if isinstance(stub.result, Exception):
            raise stub.result
        return stub.result

    def singleton():
        stub.settings.mode = stub.mode
        return SimpleNamespace(settings=stub.settings)

    monkeypatch.setattr(wandb_setup, "singleton", singleton)
    monkeypatch.setattr(wandb, "login", login)
    yield stub
    TRACKERS_INSTALLED.remove("wandb")


W_AND_B_FIX = ("run `wandb login` (or set WANDB_API_KEY), or log offline with WANDB_MODE=offline (`wandb sync` uploads "
               "it later), or choose another --report_to")


def test_wandb_online_needs_credentials_which_login_finds_without_asking(wandb_login):
    assert checked("--report_to", "wandb").report_to == ["wandb"]
    # no prompt, no network: silent, else its "logged in as" line asks W&B's service for the user name
    assert wandb_login.calls == [{"prompt": False, "verify": False, "silent": True}]
    assert wandb_login.settings.silent is False  # as before the check: the run's own W&B output unchanged
    wandb_login.result = False
    assert checked("--report_to", "wandb") == refusal(
        f"--report_to wandb: W&B cannot log online: it has no API key here (not logged in); {W_AND_B_FIX}")
    assert checked("--report_to", "all") == refusal(
        f"--report_to all: W&B cannot log online: it has no API key here (not logged in); {W_AND_B_FIX}")
    import wandb

    wandb_login.result = wandb.errors.Error("WANDB_API_KEY invalid: API key must have 40+ characters\nmore")
    assert checked("--report_to", "wandb") == refusal(
        "--report_to wandb: W&B cannot log online: WANDB_API_KEY invalid: API key must have 40+ characters; "
        f"{W_AND_B_FIX}")


@pytest.mark.parametrize("mode", ["offline", "dryrun", "disabled"])
def test_wandb_offline_needs_no_credentials(wandb_login, mode):
    wandb_login.mode, wandb_login.result = mode, False
    assert checked("--report_to", "wandb").report_to == ["wandb"] and wandb_login.calls == []


def test_no_wandb_check_without_wandb(wandb_login):
    wandb_login.result = False
    assert checked("--report_to", "mlflow", "--with_tracking").report_to == ["mlflow", "tensorboard"]
    assert wandb_login.calls == []
