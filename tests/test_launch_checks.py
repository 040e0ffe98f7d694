"""A launch that asked for several processes but started one stops before training, with one line
naming the fix. accelerate's one-process launcher (a MULTI_CPU config without mpirun, `--num_processes 2`
without --multi_gpu) passes the count to nobody; utils/launch/launch_checks.py reads it from the launcher's
own command line and config."""

import sys

import pytest
import yaml
from helpers import TRAIN_MNIST, assert_clean_user_error, run

from utils.launch.launch_checks import _accelerate_launch_args

# What `accelerate config` writes for "This machine, multi-CPU, 1 machine, 2 processes", no mpirun
# (docs/launching.md's answers; tests/test_accelerate_config_questionnaire.py runs the questionnaire).
MULTI_CPU_DEFAULT_CONFIG = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "no",
    "num_machines": 1, "num_processes": 2, "machine_rank": 0, "use_cpu": True, "debug": False,
}


def test_the_multi_cpu_config_of_accelerate_config_is_refused_as_it_starts_one_process(synthetic_mnist, tmp_path):
    """The issue's case: `accelerate config` answered multi-CPU with 2 processes, then the plain
    `accelerate launch scripts/train_mnist.py --cpu`, which trained on one process and exited 0."""
    hf_home = tmp_path / "hf_home"  # where `accelerate config` writes default_config.yaml
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump(MULTI_CPU_DEFAULT_CONFIG))
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "accelerate.commands.launch", TRAIN_MNIST, "--cpu", "--data_dir",
                synthetic_mnist, "--epochs", "1", "--output_dir", out], check=False, env={"HF_HOME": str(hf_home)})
    assert_clean_user_error(proc, "asked for 2 processes (num_processes: 2 in ", "default_config.yaml",
                            "but started 1", "--multi_gpu --num_processes 2", "--cpu after the script name")
    assert not out.exists(), "nothing trained, nothing written"


@pytest.mark.parametrize("cmdline, launch_args", [
    (["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "t.py"],
     ["--num_processes", "2", "t.py"]),
    (["/venv/bin/accelerate-launch", "--cpu", "t.py", "--lr", "1"], ["--cpu", "t.py", "--lr", "1"]),
    (["python", "-m", "accelerate.commands.launch", "t.py"], ["t.py"]),
    (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "t.py"], ["--multi_gpu", "t.py"]),
    (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"], None),
    (["python", "t.py", "accelerate", "launch"], None),  # a script's own arguments are not a launcher
    (["bash", "scripts/restart_on_failure.sh", "3", "accelerate", "launch", "t.py"], None),  # its child is
])
def test_the_launcher_is_recognised_by_its_command_line(cmdline, launch_args):
    assert _accelerate_launch_args(cmdline) == launch_args
