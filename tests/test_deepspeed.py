"""DeepSpeed ZeRO through Accelerate's DeepSpeed plugin on CPU processes (utils/run/deepspeed.py,
accelerate_configs/deepspeed_zero2_cpu.yaml and deepspeed_zero3_cpu.yaml), in this process: the scripts' --cpu under a
DeepSpeed launch (a gloo group, not cpu=True), the launch checks, the DeepSpeed config made to train what the scripts'
flags say, and what DeepSpeed does not take refused in one line."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
from accelerate.utils import DeepSpeedPlugin, DistributedType
from helpers import REPO, load_script

from utils.errors import UserError
from utils.launch import launch_checks
from utils.launch.flags import DEEPSPEED_UNSUPPORTED
from utils.run.deepspeed import accelerator_cpu, process_group_kwargs, set_gradient_accumulation

DEEPSPEED_LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true"}  # what `accelerate launch --use_deepspeed` exports
TRAIN_MNIST = REPO / "scripts" / "train_mnist.py"
CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"


@pytest.fixture
def deepspeed_launch(monkeypatch):
    """This process as one of a DeepSpeed launch's, on a machine without GPUs."""
    for name, value in DEEPSPEED_LAUNCH.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)


def test_cpu_under_a_deepspeed_launch_is_a_gloo_group_not_a_cpu_accelerator(deepspeed_launch):
    """cpu=True would make Accelerate drop the DeepSpeed plugin; without a backend each CPU process is a world of
    one."""
    assert accelerator_cpu(True) is False
    assert process_group_kwargs(True, 77).to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=77)}
    assert accelerator_cpu(False) is False  # on the GPUs: the backend Accelerate chooses
    assert process_group_kwargs(False, 77).to_kwargs() == {"timeout": timedelta(seconds=77)}


def test_cpu_without_deepspeed_is_accelerates_cpu_as_before(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert accelerator_cpu(True) is True
    assert process_group_kwargs(True, 5).to_kwargs() == {"timeout": timedelta(seconds=5)}


def test_a_deepspeed_launch_without_gpus_needs_cpu(deepspeed_launch):
    with pytest.raises(UserError, match="asks for DeepSpeed, but this machine has no GPUs; add --cpu"):
        launch_checks.check_enough_devices(cpu=False)
    launch_checks.check_enough_devices(cpu=True)  # DeepSpeed over the CPU processes


def test_a_deepspeed_launch_with_cpu_beside_gpus_is_refused(deepspeed_launch, monkeypatch):
    """DeepSpeed picks its accelerator by what it finds: --cpu would not keep it off the GPUs."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    with pytest.raises(UserError, match="--cpu with DeepSpeed on a machine with GPUs.*CUDA_VISIBLE_DEVICES="):
        launch_checks.check_enough_devices(cpu=True)


def deepspeed_accelerator(num_processes=2, **plugin):
    """What set_gradient_accumulation reads of an Accelerator under DeepSpeed: its type, process count and plugin."""
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=num_processes,
                           gradient_accumulation_steps=1,
                           state=SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(**plugin)))


def test_the_deepspeed_config_gets_the_scripts_batch_accumulation_and_clipping(monkeypatch):
    """Left "auto" (our configs, `accelerate launch --use_deepspeed`), each becomes the flag's; no --max_grad_norm is
    gradient_clipping 0 (none), not the 1.0 Accelerate would fill in."""
    for name in ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    accelerator = deepspeed_accelerator(zero_stage=2)
    set_gradient_accumulation(accelerator, 3, 24, None)
    assert accelerator.gradient_accumulation_steps == 3
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["gradient_clipping"]) == (24, 3, 0.0)
    accelerator = deepspeed_accelerator(zero_stage=3)
    set_gradient_accumulation(accelerator, 1, 8, 0.5)
    assert accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5


# flags: --gradient_accumulation_steps, --batch_size, --max_grad_norm
@pytest.mark.parametrize("plugin, flags, words", [
    ({"gradient_accumulation_steps": 1}, (2, 24, None), "sets gradient_accumulation_steps 1, but the script's "
                                                        "--gradient_accumulation_steps is 2"),
    ({"gradient_clipping": 1.0}, (1, 24, None),
     "sets gradient_clipping 1.0, but the script's --max_grad_norm is unset"),
    ({"hf_ds_config": {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}}, (1, 24, None),
     "sets train_micro_batch_size_per_gpu 16, but the script's --batch_size is 24"),
    ({"hf_ds_config": {"train_batch_size": 96, "zero_optimization": {"stage": 2}}}, (1, 24, None),
     "sets train_batch_size 96, but --batch_size 24 x --gradient_accumulation_steps 1 x 2 processes is 48"),
    ({"hf_ds_config": {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}}}, (1, 24, None),
     "has its own optimizer .* but the scripts build theirs"),
    ({"hf_ds_config": {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 2}}}, (1, 24, None),
     "has its own scheduler"),
])
def test_a_deepspeed_config_that_differs_from_the_flags_is_refused(plugin, flags, words, monkeypatch):
    """Accelerate would train DeepSpeed's value with a warning (accumulation), clip silently, or stop in a traceback."""
    for name in ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match=words):
        set_gradient_accumulation(deepspeed_accelerator(**plugin), *flags)


def test_without_deepspeed_only_the_accumulation_is_set():
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, gradient_accumulation_steps=1)
    set_gradient_accumulation(accelerator, 2, 24, None)
    assert vars(accelerator) == {"distributed_type": DistributedType.MULTI_CPU, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("script, flags", [
    (TRAIN_MNIST, ["--model_ema"]), (TRAIN_MNIST, ["--auto_find_batch_size"]),
    (CLASSIFIER, ["--compile", "--data_dir", "images"]),
    (CLASSIFIER, ["--streaming", "--max_steps", "4", "--data_dir", "images"]),
])
def test_what_deepspeed_does_not_take_is_refused_in_one_line(deepspeed_launch, script, flags, capsys):
    """Each would run into DeepSpeed's engine untested or wrong (utils/launch/flags.py DEEPSPEED_UNSUPPORTED: why)."""
    with pytest.raises(SystemExit) as exit:
        load_script(script).parse_args(["--cpu", *flags])
    flag = flags[0].lstrip("-")
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit.value.code != 0 and line.startswith("error: ") and (
        f"--{flag} does not work under DeepSpeed here: {DEEPSPEED_UNSUPPORTED[flag]}; drop it, or launch without "
        f"DeepSpeed (see --help)") in line


def test_a_deepspeed_launch_takes_each_scripts_other_flags(deepspeed_launch):
    """A script without one of DEEPSPEED_UNSUPPORTED's flags (train_mnist.py has no --compile or --streaming) has it
    off: neither script is refused for a flag it lacks."""
    assert not load_script(TRAIN_MNIST).parse_args(["--cpu"]).model_ema
    assert not load_script(CLASSIFIER).parse_args(["--cpu", "--data_dir", "images"]).compile


def test_the_same_flags_without_deepspeed_are_accepted(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert load_script(TRAIN_MNIST).parse_args(["--cpu", "--model_ema", "--auto_find_batch_size"]).model_ema


def test_deepspeed_and_fsdp_at_once_is_refused(deepspeed_launch, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="asks for both DeepSpeed and FSDP"):
        launch_checks.check_enough_devices(cpu=True)
