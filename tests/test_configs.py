"""Every YAML in accelerate_configs/ is loaded by accelerate's own loader and checked
against what its topology needs; the CPU ones are also launched."""

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from helpers import REPO, launch, make_synthetic_mnist, results

CONFIG_DIR = REPO / "accelerate_configs"
ALL_CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))

# What each topology must say. Every YAML in the folder needs an entry here.
EXPECTED = {
    "cpu.yaml": dict(distributed_type="NO", num_processes=1, num_machines=1, mixed_precision="no", use_cpu=True),
    "cpu_2proc.yaml": dict(distributed_type="MULTI_GPU", num_processes=2, num_machines=1, mixed_precision="no",
                           use_cpu=True),
    "single_gpu.yaml": dict(distributed_type="NO", num_processes=1, num_machines=1, mixed_precision="fp16",
                            use_cpu=False),
    "multi_gpu.yaml": dict(distributed_type="MULTI_GPU", num_machines=1, mixed_precision="fp16", use_cpu=False,
                           gpu_ids="all"),
    # Topologies (tests/test_topologies.py and tests/test_slurm.py launch them)
    "multi_gpu_subset.yaml": dict(distributed_type="MULTI_GPU", num_processes=2, num_machines=1,
                                  mixed_precision="fp16", use_cpu=False, gpu_ids="2,3", main_process_port=0),
    "multi_node.yaml": dict(distributed_type="MULTI_GPU", num_processes=16, num_machines=2, machine_rank=0,
                            mixed_precision="fp16", use_cpu=False, main_process_port=29500),
    "slurm_gpu.yaml": dict(distributed_type="MULTI_GPU", num_machines=1, mixed_precision="fp16", use_cpu=False,
                           gpu_ids="all"),
    "slurm_cpu.yaml": dict(distributed_type="MULTI_GPU", num_machines=1, mixed_precision="no", use_cpu=True),
}

def test_every_config_has_expectations():
    assert set(ALL_CONFIGS) == set(EXPECTED), "add the new YAML's expected fields to EXPECTED"

@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_loads_and_is_consistent(name):
    config = load_config_from_file(str(CONFIG_DIR / name))
    for field, value in EXPECTED[name].items():
        actual = getattr(config, field)
        actual = getattr(actual, "value", actual)  # enums such as DistributedType
        assert actual == value, f"{name}: {field} is {actual!r}, expected {value!r}"
    assert config.num_processes >= config.num_machines >= 1
    assert config.num_processes % config.num_machines == 0, "same number of processes on every machine"
    assert 0 <= config.machine_rank < config.num_machines
    port = config.main_process_port
    assert port is None or port == 0 or 1024 <= port <= 65535
    if config.distributed_type.value == "MULTI_GPU" and not config.use_cpu:
        assert config.num_processes >= 2
    if config.gpu_ids not in (None, "all"):
        ids = str(config.gpu_ids).split(",")
        assert all(i.strip().isdigit() for i in ids) and len(set(ids)) == len(ids), f"gpu_ids {config.gpu_ids!r}"
        assert len(ids) == config.num_processes, "one process per listed GPU"
    if config.num_machines > 1:
        # every machine must name the same port: 0 would let each pick its own
        assert port is not None and port >= 1024, "multi-node needs a fixed main_process_port"

# cpu_2proc.yaml is launched by tests/test_readme.py, which runs the README command that uses it.
@pytest.mark.parametrize("name, processes", [("cpu.yaml", 1)])
def test_cpu_config_runs_with_its_process_count(name, processes, tmp_path):
    data = make_synthetic_mnist(tmp_path / "data", num_train=256, num_test=101)
    out = tmp_path / "out"
    launch(["--data_dir", data, "--output_dir", out, "--epochs", "1", "--batch_size", "32"],
           config_file=CONFIG_DIR / name)
    r = results(out)
    assert r["num_processes"] == processes
    assert r["eval_samples"] == 101
    assert len(set(r["parameter_fingerprints"])) == 1
