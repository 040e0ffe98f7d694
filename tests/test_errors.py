"""Mistakes a user can make end with one clear line, a non-zero exit and no traceback."""

import sys

import pytest
import torch
from helpers import (TRAIN_MNIST, assert_clean_user_error, error_lines, launch, launcher_args, make_synthetic_mnist,
                     run, run_alone)

sys.path.insert(0, str(TRAIN_MNIST.parent))
from train_mnist import parse_args  # noqa: E402

from utils.data.mnist import load_mnist  # noqa: E402
from utils.errors import UserError  # noqa: E402
from utils.launch import launch_config  # noqa: E402
from utils.launch.launch_config import check_launch_config  # noqa: E402
from utils.run.resume import resume_point  # noqa: E402


def train(*args, **kwargs):
    """The script in one process, no launcher: the launcher adds its own report to failures."""
    return run_alone(args, check=False, **kwargs)


def assert_one_line_naming(error, *expected_words):
    """In-process half of assert_clean_user_error: a UserError (which the scripts print as one `error:` line, without
    a traceback: the process-running test of the same path shows it) whose message names the problem and the fix."""
    message = " ".join(str(error).split())  # how utils/errors.py's exit_with_error prints it
    for word in expected_words:
        assert word in message, message


@pytest.fixture
def data(tmp_path):
    return make_synthetic_mnist(tmp_path / "data", num_train=64, num_test=32)


# load_mnist refuses these before anything is written (train_mnist's main loads the data before its first write): the
# missing folder is launched (test_missing_data_dir_through_the_launcher_with_two_processes: one line, nothing
# written); the others are the same path, asked in-process.


def test_data_dir_without_mnist_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as err:
        load_mnist(tmp_path / "empty")
    assert_one_line_naming(err.value, "--data_dir", "train-images-idx3-ubyte", "MNIST/raw")


def test_corrupt_idx_file(data):
    target = data / "t10k-images-idx3-ubyte.gz"
    target.write_bytes(target.read_bytes()[:200])  # a download that stopped half-way
    with pytest.raises(UserError) as err:
        load_mnist(data)
    assert_one_line_naming(err.value, str(target), "not a valid MNIST IDX file")


@pytest.mark.parametrize("flag, value, words", [
    ("--batch_size", "0", ["--batch_size", "positive integer"]),
    ("--epochs", "two", ["--epochs", "positive integer"]),
    ("--learning_rate", "-1", ["--learning_rate", "positive number"]),
    ("--learning_rate", "nan", ["--learning_rate", "positive number"]),
    ("--learning_rate", "0", ["--learning_rate", "positive number"]),  # a run that cannot learn
    ("--checkpointing_steps", "sometimes", ["--checkpointing_steps", "'epoch' or a positive integer"]),
    ("--gradient_accumulation_steps", "-2", ["--gradient_accumulation_steps", "positive integer"]),
    ("--mixed_precision", "fp8", ["--mixed_precision", "invalid choice: 'fp8'"]),
])
def test_invalid_flag_values(flag, value, words, capsys):
    """Parsed in-process (the same parser the script uses): fast, and the same one line."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--cpu", flag, value])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")
    for word in words:
        assert word in line


def test_a_librarys_error_is_cut_to_its_first_line_or_named_by_its_type():
    from utils.errors import first_line

    assert first_line(RuntimeError("shapes differ\n  at layer 3\n  ...")) == "shapes differ"
    assert first_line(KeyError()) == "KeyError" and first_line(ValueError("  \n")) == "ValueError"
    assert first_line(OSError("x" * 500)) == "x" * 200


def test_offline_without_data_dir_names_the_flag():
    # conftest sets HF_HUB_OFFLINE=1 and an empty HF_HOME: the Hub cannot be reached.
    with pytest.raises(UserError) as err:
        load_mnist(None)  # what main loads without --data_dir
    assert_one_line_naming(err.value, "ylecun/mnist", "--data_dir")


def test_eval_only_needs_a_checkpoint(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--cpu", "--eval_only"])
    (line,) = capsys.readouterr().err.splitlines()
    assert "--eval_only needs --resume_from_checkpoint" in line


# resume_point refuses these before anything is written (main asks it first, before the data): the damaged checkpoint
# runs the script (below), one line and nothing written; the others are the same path, asked in-process.


def test_resume_from_missing_checkpoint(tmp_path):
    with pytest.raises(UserError) as err:
        resume_point(str(tmp_path / "step_9"), str(tmp_path / "out"))
    assert_one_line_naming(err.value, "step_9", "no such folder")
    assert not (tmp_path / "out").exists()


def test_resume_from_corrupt_checkpoint(data, tmp_path):
    out = tmp_path / "out"
    # step_1: the one step of the epoch, saved before the epoch closed, so the resume has something left to do
    train("--data_dir", data, "--epochs", "1", "--checkpointing_steps", "1", "--output_dir", out)
    (out / "step_1" / "model.safetensors").write_bytes(b"\x00" * 64)
    proc = train("--data_dir", data, "--epochs", "1", "--resume_from_checkpoint", out / "step_1",
                 "--output_dir", tmp_path / "out2")
    # its manifest.json finds it before anything loads; there is no good checkpoint left to name
    assert_clean_user_error(proc, "step_1 is damaged", "model.safetensors has 64 bytes", "no good checkpoint")
    assert not (tmp_path / "out2").exists()


def test_resume_from_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "random_folder").mkdir()
    with pytest.raises(UserError) as err:
        resume_point(str(tmp_path / "random_folder"), str(tmp_path / "out"))
    assert_one_line_naming(err.value, "random_folder", "not a complete checkpoint")


def test_unwritable_output_dir(data, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = train("--data_dir", data, "--output_dir", tmp_path / "a_file" / "out")
    assert_clean_user_error(proc, "--output_dir", "writable")


def test_multi_process_launch_without_cpu_flag_is_caught(data, tmp_path):
    """Without GPUs and without --cpu, accelerate would run 2 lone copies of the job. The GPUs are
    hidden so that the case is the same on a GPU machine (where 2 processes would otherwise train)."""
    proc = run([*launcher_args(2), TRAIN_MNIST, "--data_dir", data, "--output_dir", tmp_path / "out"], check=False,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert_clean_user_error(proc, "did not form one group", "--cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")
def test_more_processes_than_gpus_is_caught(data, tmp_path):
    """One process per GPU: a launch of one process more than the visible GPUs ends in one line from
    utils/launch/launch_checks.py check_enough_devices, not in CUDA's "invalid device ordinal"."""
    gpus = torch.cuda.device_count()
    proc = run([*launcher_args(gpus + 1), TRAIN_MNIST, "--data_dir", data, "--output_dir", tmp_path / "out"],
               check=False)
    assert_clean_user_error(proc, f"{gpus + 1} processes on this machine but only {gpus} GPU(s) visible",
                            f"--num_processes {gpus}")
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_machines_other_processes_say_their_line_after_a_wait_that_a_sigterm_ends(monkeypatch, capsys):
    """In-process: LOCAL_RANK 1 waits OTHERS_WAIT_S (the launcher ends it there once the first process has failed,
    whatever handler --save_on_signal installed), then says the line itself: a process that failed alone is heard."""
    import signal

    import utils.errors

    waits = []
    monkeypatch.setattr(utils.errors.time, "sleep", waits.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as --save_on_signal's StopSignal
    try:
        with pytest.raises(SystemExit) as exit_:
            utils.errors.exit_with_error(UserError("disk full"))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.code == 1 and waits == [utils.errors.OTHERS_WAIT_S]
    assert capsys.readouterr().err.strip() == "error: disk full"
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        utils.errors.exit_with_error(UserError("disk full"))
    assert waits == [utils.errors.OTHERS_WAIT_S]  # the first process says it at once


def test_missing_data_dir_through_the_launcher_with_two_processes(tmp_path):
    """Launched as users do, on two processes: both refuse, and the line is said once, by the first process (the
    other waits, and the launcher ends it when the first has failed)."""
    out = tmp_path / "out"
    proc = launch(["--data_dir", tmp_path / "nope", "--output_dir", out], num_processes=2, check=False)
    assert_clean_user_error(proc, "--data_dir", "no such directory")
    assert len(error_lines(proc)) == 1, proc.stdout + proc.stderr
    assert not out.exists(), "nothing may be written for a run that never started"


@pytest.mark.parametrize("text, words", [
    ("distributed_type: MULTI_GPU\nnum_processes: [2\n", ["not valid YAML", "line 3"]),
    ("distributed_type: MULTI_GPU\nnum_processs: 2\n", ["not an accelerate config", "num_processs"]),
    ("distributed_type: MULTI_GPUS\nnum_processes: 2\n", ["not an accelerate config", "MULTI_GPUS"]),
    ("distributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 1\n",
     ["MULTI_CPU without mpirun starts one process"]),
    ("distributed_type: 'NO'\nnum_processes: 2\n", ["'NO' starts one process, not 2"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 3\nnum_machines: 2\nmachine_rank: 2\n",
     ["a multiple of num_machines (2)", "machine_rank (2) must be between 0 and num_machines - 1"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmain_process_port: 80\n", ["main_process_port 80"]),
    ("distributed_type: MULTI_GPU\nnum_processes: two\n", ["num_processes: 'two' is not a whole number"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmain_process_port: abc\n",
     ["main_process_port: 'abc' is not a whole number", "main_process_port: 29500"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp32\n",
     ["mixed_precision: 'fp32' is not one of", "full precision is 'no'"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: maybe\n", ["use_cpu: 'maybe' must be true or false"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\ndynamo_config:\n  dynamo_backend: turbo\n",
     ["dynamo_backend: 'turbo' is not one of"]),
    ("- just\n- a list\n", ["no `key: value` settings"]),
])
def test_malformed_or_inconsistent_launch_config(tmp_path, text, words):
    """accelerate launch answers these with a traceback, or silently starts the wrong number
    of processes; the checker names the problem in one line."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(UserError) as err:
        check_launch_config(config)
    for word in [str(config), *words]:
        assert word in str(err.value)


def test_launch_config_checker_command(tmp_path):
    from helpers import REPO

    configs = sorted((REPO / "accelerate_configs").glob("*.yaml"))
    (tmp_path / "bad.yaml").write_text("distributed_type: 'NO'\nnum_processes: 2\n")
    # no GPU visible, on any machine: the GPU configs say what they do here
    proc = run([sys.executable, "-m", "utils.launch.launch_config", *configs, tmp_path / "bad.yaml"], check=False,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.stdout.count("ok: ") == len(configs)
    assert_clean_user_error(proc, "bad.yaml", "starts one process")
    multi_gpu = next(line for line in proc.stdout.splitlines() if "/multi_gpu.yaml:" in line)
    assert multi_gpu.endswith("no GPU is visible on this machine: here it starts 8 CPU processes, which form one group "
                              "only if the script gets --cpu (as with accelerate_configs/cpu_2proc.yaml); fp16 needs a "
                              "GPU (the scripts stop): launch with --mixed_precision no"), multi_gpu


@pytest.mark.parametrize("gpus", [0, 2])
def test_launch_config_says_what_a_gpu_config_does_on_this_machine(monkeypatch, gpus):
    """On a machine without GPUs a GPU config is still valid (it may be meant for another machine), but it starts CPU
    processes here, which need the script's --cpu; with GPUs, or with a CPU config, nothing is added."""
    from helpers import REPO

    monkeypatch.setattr(launch_config, "visible_gpu_count", lambda: gpus)
    configs = REPO / "accelerate_configs"
    subset = check_launch_config(configs / "multi_gpu_subset.yaml")
    cpu = check_launch_config(configs / "cpu_2proc.yaml")
    assert cpu.endswith("MULTI_GPU, 2 process(es) on 1 machine(s), CPU, mixed precision no")
    if gpus:
        assert subset.endswith("MULTI_GPU, 2 process(es) on 1 machine(s), GPU, mixed precision fp16")
    else:
        assert subset.endswith("GPU, mixed precision fp16; no GPU is visible on this machine: here it starts 2 CPU "
                               "processes, which form one group only if the script gets --cpu (as with "
                               "accelerate_configs/cpu_2proc.yaml); fp16 needs a GPU (the scripts stop): launch with "
                               "--mixed_precision no")
    fsdp = check_launch_config(configs / "fsdp.yaml")
    assert ("FSDP runs on GPUs only" in fsdp) == (not gpus)
