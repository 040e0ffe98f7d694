"""Every YAML in accelerate_configs/ is loaded by accelerate's own loader, passes our checker,
meets the invariants of its topology, and the CPU ones are launched and form the process group
they promise. The invariants are computed from each file, not restated, and shown able to fail."""

import copy

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from helpers import REPO, launch, make_synthetic_mnist, results

from utils.launch.launch_config import check_launch_config

CONFIG_DIR = REPO / "accelerate_configs"
ALL_CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def topology_problems(config: dict) -> list:
    """What a launch config of ours must satisfy, as a list of problems (empty: fine)."""
    problems = []
    processes, machines = config.get("num_processes", 1), config.get("num_machines", 1)
    kind, cpu, precision = config["distributed_type"], config.get("use_cpu", False), config.get("mixed_precision")
    if cpu and precision == "fp16":
        problems.append("fp16 on the CPU runs silently in fp32")
    if kind == "MULTI_GPU" and not cpu and processes < 2:
        problems.append("MULTI_GPU with one process")
    if kind == "FSDP" and (cpu or config.get("fsdp_config", {}).get("fsdp_version") != 2):
        problems.append("FSDP: FSDP2 only, use_cpu false (the scripts' --cpu shards over CPU processes)")
    gpu_ids = config.get("gpu_ids")
    if gpu_ids not in (None, "all"):
        ids = [i.strip() for i in str(gpu_ids).split(",")]
        if not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids) or len(ids) != processes:
            problems.append("gpu_ids must list one distinct GPU per process")
    if machines > 1 and not config.get("main_process_port"):
        problems.append("several machines need one fixed main_process_port (0 lets each pick its own)")
    deepspeed = config.get("deepspeed_config", {})
    if kind == "DEEPSPEED" and (cpu or deepspeed.get("zero_stage") not in (2, 3)):
        problems.append("DeepSpeed: ZeRO stage 2 or 3, use_cpu false (the scripts' --cpu runs it over CPU processes)")
    if kind == "DEEPSPEED" and deepspeed.get("zero_stage") == 3 and not deepspeed.get("zero3_save_16bit_model"):
        problems.append("ZeRO-3 without zero3_save_16bit_model: save_model cannot gather the whole weights")
    if kind == "DEEPSPEED" and {"gradient_accumulation_steps", "gradient_clipping"} & set(deepspeed):
        problems.append("DeepSpeed: leave gradient_accumulation_steps and gradient_clipping to the script's flags")
    if cpu and kind not in ("NO", "MULTI_GPU"):
        problems.append("CPU configs: 'NO' (one process) or MULTI_GPU with use_cpu (a gloo group)")
    return problems


def read(name) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_config_loads_passes_the_checker_and_fits_its_topology(name):
    load_config_from_file(str(CONFIG_DIR / name))  # accelerate's own loader: unknown keys and bad enums fail here
    assert check_launch_config(CONFIG_DIR / name).startswith(str(CONFIG_DIR / name))
    assert topology_problems(read(name)) == []


@pytest.mark.parametrize("change, problem", [
    ({"use_cpu": True, "mixed_precision": "fp16"}, "fp16 on the CPU"),
    ({"gpu_ids": "0,1,2", "num_processes": 2}, "gpu_ids"),
    ({"num_machines": 2, "num_processes": 16, "main_process_port": 0}, "fixed main_process_port"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}}, "ZeRO stage 2 or 3"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}, "zero3_save_16bit_model"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1}},
     "leave gradient_accumulation_steps"),
])
def test_the_invariants_can_fail(change, problem):
    config = copy.deepcopy(read("multi_gpu.yaml")) | change
    assert any(problem in p for p in topology_problems(config))


def test_the_folder_has_a_config_per_topology():
    kinds = {(read(n)["distributed_type"], read(n).get("use_cpu", False), read(n).get("num_machines", 1) > 1)
             for n in ALL_CONFIGS}
    assert {("NO", True, False), ("MULTI_GPU", True, False), ("NO", False, False), ("MULTI_GPU", False, False),
            ("MULTI_GPU", False, True), ("FSDP", False, False), ("DEEPSPEED", False, False)} <= kinds
    stages = {(read(n)["deepspeed_config"]["zero_stage"], read(n)["mixed_precision"]) for n in ALL_CONFIGS
              if read(n)["distributed_type"] == "DEEPSPEED"}
    assert stages == {(2, "fp16"), (3, "fp16"), (2, "no"), (3, "no")}  # GPUs, and the CPU processes the tests use


# CPU configs launched by another test, in a run it makes anyway, which asserts the same of it: not launched again here.
LAUNCHED_BY_ANOTHER_TEST = {
    "slurm_cpu.yaml": "tests/test_slurm.py, inside a real Slurm job",
    "cpu.yaml": "tests/test_topologies.py::test_an_interrupted_sweep_resumes_its_unfinished_run_from_its_checkpoints",
}


def test_the_cpu_configs_launched_by_another_test_are_cpu_configs():
    assert {n for n in ALL_CONFIGS if read(n).get("use_cpu")} >= set(LAUNCHED_BY_ANOTHER_TEST)


@pytest.mark.parametrize("name", [n for n in ALL_CONFIGS if read(n).get("use_cpu")
                                  and n not in LAUNCHED_BY_ANOTHER_TEST])
def test_cpu_configs_form_the_process_group_they_promise(name, tmp_path):
    data = make_synthetic_mnist(tmp_path / "data", num_train=256, num_test=101)
    out = tmp_path / "out"
    launch(["--data_dir", data, "--output_dir", out, "--epochs", "1", "--batch_size", "32"],
           config_file=CONFIG_DIR / name)
    r = results(out)
    assert r["num_processes"] == read(name).get("num_processes", 1)
    assert r["eval_samples"] == 101
    assert len(r["parameter_fingerprints"]) == r["num_processes"] and len(set(r["parameter_fingerprints"])) == 1
