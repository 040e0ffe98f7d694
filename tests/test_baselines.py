"""The baselines (scripts/baselines/) train what train_mnist.py trains, as well, and exactly.

The one-process runs (plain_mnist.py on the real digits, ddp_mnist.py and train_mnist.py on generated ones,
DataParallel's refusal) are jobs of one process (one_process_runs: tests/jobs.py, torch and Accelerate imported
once, a child forked per run); raw DDP on 2 processes is torchrun's launch, as users type it."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import MNIST_10K, REPO, TRAIN_MNIST, assert_clean_user_error, load_script, requires_mnist_10k, results, run
from jobs import finished_job, launch_jobs
from safetensors.torch import load_file

from utils.data.mnist import load_mnist_idx, to_tensor_dataset
from utils.errors import UserError
from utils.models import ConvNet

BASELINES = REPO / "scripts" / "baselines"
PLAIN, DDP, DATAPARALLEL = (BASELINES / f"{name}_mnist.py" for name in ("plain", "ddp", "dataparallel"))


def torchrun(script, args, nproc: int, **kwargs):
    """torchrun as users type it; --standalone picks a free port, so parallel tests never collide."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc,
                script, "--cpu", *args], **kwargs)


def evaluate_saved_model(output_dir, max_eval_samples=None):
    """Correct predictions and mean loss of model.safetensors, in one plain process."""
    model = ConvNet()
    model.load_state_dict(load_file(output_dir / "model.safetensors"))
    model.eval()
    images, labels = to_tensor_dataset(*load_mnist_idx(MNIST_10K)["test"], max_samples=max_eval_samples).tensors
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in images.split(64)])
    correct = (logits.argmax(-1) == labels).sum().item()
    return correct, F.cross_entropy(logits, labels, reduction="none").double().mean().item()


# Without a GPU pair, DataParallel refuses to start (with one, it would train: that test skips)
REFUSES_DATAPARALLEL = torch.cuda.device_count() < 2


@pytest.fixture(scope="module")
def one_process_runs(synthetic_mnist, tmp_path_factory):
    """The one-process runs, each a child forked from one `python tests/jobs.py`, with the one thread
    accelerate launch gives a CPU process (float sums depend on how many threads share them; quicker on a busy
    machine too), in turn: DataParallel's refusal (dataparallel), raw DDP and train_mnist.py on the generated digits
    (ddp/, accelerate/) and, where the real digits are, plain_mnist.py's full run (plain/). Returns its folder; each
    test reads its run (finished_job)."""
    root = tmp_path_factory.mktemp("baselines_1proc")
    args = ["--data_dir", synthetic_mnist, "--epochs", "2", "--batch_size", "16"]
    # ddp_mnist.py with the environment `torchrun --standalone --nproc_per_node 1` gives its one worker (its port: the
    # job's own), without torchrun's own process: torchrun itself is launched in the 2-process test below and in
    # test_benchmark.py. train_mnist.py without accelerate launch (an Accelerator needs no launcher; the launched runs
    # of it are in test_train_mnist.py).
    torchrun_env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1"}
    jobs = {"ddp": {"argv": [DDP, "--cpu", *args, "--output_dir", root / "ddp"], "env": torchrun_env},
            "accelerate": [TRAIN_MNIST, "--cpu", *args, "--output_dir", root / "accelerate"]}
    if REFUSES_DATAPARALLEL:
        empty = root / "empty"
        empty.mkdir()
        jobs["dataparallel"] = [DATAPARALLEL, "--data_dir", empty, "--output_dir", empty / "out"]
    if not requires_mnist_10k.args[0]:  # the skip's condition: the real digits are absent
        jobs["plain"] = [PLAIN, "--cpu", "--data_dir", MNIST_10K, "--output_dir", root / "plain"]
    launch_jobs(jobs, [sys.executable], root, env={"OMP_NUM_THREADS": "1"})
    return root


@requires_mnist_10k
def test_plain_reaches_98_percent_like_train_mnist(one_process_runs):
    out = one_process_runs / "plain"
    finished_job(out)
    r = results(out)
    assert r["method"] == "plain" and r["num_processes"] == 1 and r["mixed_precision"] == "no"
    assert r["eval_accuracy"] >= 0.98
    assert r["eval_samples"] == 2000
    assert r["global_step"] == 3 * math.ceil(8000 / 64) == 375
    assert r["samples_seen"] == 3 * 8000
    assert 0 < r["train_loss"] < 0.2 and 0 < r["eval_loss"] < 0.1
    assert r["train_samples_per_second"] > 0 and r["train_time_s"] > 0 and r["peak_memory_mb"] > 50
    correct, loss = evaluate_saved_model(out)
    assert correct == round(r["eval_accuracy"] * 2000)
    assert loss == pytest.approx(r["eval_loss"], rel=1e-6)


@requires_mnist_10k
def test_raw_ddp_on_2_processes_reaches_97_5_percent_with_exact_eval(tmp_path):
    # 1,999 eval samples: DistributedSampler would pad them to 2,000; the script must not.
    torchrun(DDP, ["--data_dir", MNIST_10K, "--output_dir", tmp_path, "--max_eval_samples", "1999"], nproc=2)
    r = results(tmp_path)
    assert r["method"] == "ddp" and r["num_processes"] == 2
    assert r["eval_accuracy"] >= 0.975
    assert r["eval_samples"] == 1999
    # 8,000 samples: 4,000 per process, 63 batches of up to 64 (DistributedSampler pads nothing here).
    assert r["global_step"] == 3 * 63
    assert r["samples_seen"] == 3 * 8000
    assert len(r["parameter_fingerprints"]) == 2 and len(set(r["parameter_fingerprints"])) == 1
    assert len(set(r["buffer_fingerprints"])) == 1, "BatchNorm statistics differ between ranks at evaluation"
    # The all_reduce'd evaluation equals the saved weights evaluated in one process.
    correct, loss = evaluate_saved_model(tmp_path, max_eval_samples=1999)
    assert correct == round(r["eval_accuracy"] * 1999)
    assert loss == pytest.approx(r["eval_loss"], rel=1e-6)


def test_raw_ddp_on_one_process_trains_bit_for_bit_what_train_mnist_trains(one_process_runs):
    """Same seed, same initial weights, same shuffle (seed + epoch), same schedule: the
    baseline is the same training, so the comparison in the benchmark is fair."""
    for name in ("ddp", "accelerate"):
        finished_job(one_process_runs / name)
    ddp, accelerate = results(one_process_runs / "ddp"), results(one_process_runs / "accelerate")
    assert ddp["parameter_fingerprints"] == accelerate["parameter_fingerprints"]
    assert ddp["global_step"] == accelerate["global_step"] == 2 * 40
    for key in ("eval_accuracy", "eval_loss", "eval_samples", "samples_seen"):
        assert ddp[key] == accelerate[key], key
    assert ddp["train_loss"] == pytest.approx(accelerate["train_loss"], rel=1e-12)
    assert accelerate["eval_accuracy"] >= 0.9  # and it learned something (chance is 0.1)


@pytest.mark.skipif(not REFUSES_DATAPARALLEL, reason="this machine has 2+ GPUs, so DataParallel would train")
def test_dataparallel_without_two_gpus_exits_with_one_clear_line(one_process_runs):
    proc = finished_job(one_process_runs / "dataparallel", fails=True)
    assert_clean_user_error(proc, "nn.DataParallel needs 2 or more CUDA GPUs", "plain_mnist.py")
    assert proc.returncode == 1
    assert not (one_process_runs / "empty" / "out").exists()


def test_user_errors_of_the_baselines(synthetic_mnist, tmp_path, monkeypatch, capsys):
    """Asked in this process (the scripts' main and parse_args): each refusal is decided before any training, and the
    way a refusal leaves a baseline's process (one `error:` line, exit status 1, nothing written) is run above, by
    DataParallel's (a job of one_process_runs), through the same exit_with_error."""
    ddp, plain = load_script(DDP), load_script(PLAIN)
    # ddp_mnist.py needs torchrun ...
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(UserError, match=r"not started by torchrun; run `torchrun --nproc_per_node N "):
        ddp.main(ddp.parse_args(["--cpu", "--data_dir", str(synthetic_mnist), "--output_dir", str(tmp_path / "a")]))
    # ... fp16 needs a GPU (Accelerate would silently train fp32 on the CPU) ...
    with pytest.raises(UserError, match="--mixed_precision fp16 needs a CUDA GPU"):
        plain.main(plain.parse_args(["--cpu", "--mixed_precision", "fp16", "--data_dir", str(synthetic_mnist),
                                     "--output_dir", str(tmp_path / "b")]))
    # ... and a shared flag the baselines leave out is refused, not ignored.
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        plain.parse_args(["--cpu", "--checkpointing_steps", "epoch", "--output_dir", str(tmp_path / "c")])
    (line,) = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and line.startswith("error: ")
    assert "--checkpointing_steps" in line and "scripts/train_mnist.py" in line, line
    assert not any((tmp_path / name).exists() for name in "abc")
