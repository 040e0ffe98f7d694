"""`--help` answers about as fast as Python can import torch and accelerate: the libraries that only a run needs
(torchvision, datasets, evaluate, PIL, the ONNX packages, plotting) are imported where the run needs them.

The module check is exact and cannot flake; the timing check compares CPU seconds (not wall time, which another
test on the same cores would stretch), the best of three runs each."""

import json
import os
import resource
import subprocess
import sys

from helpers import REPO

SCRIPTS = sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "scripts" / "baselines").glob("*.py")])
# Each costs from a tenth of a second (PIL) to seconds (torchvision imports torch._dynamo; datasets, evaluate)
RUN_ONLY = ("torchvision", "datasets", "evaluate", "PIL", "simplejpeg", "onnx", "onnxruntime", "onnxscript",
            "matplotlib", "pandas", "tensorboard", "mlflow", "wandb")
LIMIT = 1.6  # x the CPU time of `import torch, accelerate`
# The Horovod and apex "befores" import those libraries, which cannot be installed here: their stand-ins
STANDINS = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "standins")}

MODULES_AFTER_HELP = """
import runpy, sys, json
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(json.dumps(sorted(sys.modules)))
"""


def help_run(script) -> tuple:
    """(modules imported, CPU seconds) of one `script --help`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", MODULES_AFTER_HELP, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=STANDINS)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr
    seconds = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return set(json.loads(proc.stdout.splitlines()[-1])), seconds


def run_only_modules(modules: set) -> list:
    return sorted(m for m in modules if any(m == lib or m.startswith(lib + ".") for lib in RUN_ONLY))


def test_help_imports_nothing_that_only_a_run_needs_and_is_fast():
    baseline = min(cpu_seconds(sys.executable, "-c", "import torch, accelerate") for _ in range(3))
    heavy, slow = {}, {}
    for script in SCRIPTS:
        name = script.relative_to(REPO / "scripts").as_posix()
        modules, seconds = help_run(script)
        if seconds > LIMIT * baseline:  # a busy machine? the better of two runs decides
            seconds = min(seconds, help_run(script)[1])
        heavy[name], slow[name] = run_only_modules(modules), round(seconds / baseline, 2)
        if name == "sweep.py":  # it only starts other scripts: not even torch
            assert "torch" not in modules
    assert {name: found for name, found in heavy.items() if found} == {}
    assert {name: ratio for name, ratio in slow.items() if ratio > LIMIT} == {}, \
        f"--help slower than {LIMIT} x import torch, accelerate ({baseline:.2f} s of CPU); all: {slow}"


def test_the_checks_see_an_import_at_the_top(tmp_path):
    script = tmp_path / "slow_help.py"
    # torchvision, datasets and evaluate: about twice the import time of torch and accelerate
    script.write_text("import argparse\nimport datasets, evaluate, torchvision\n"
                      "argparse.ArgumentParser().parse_args()\n")
    modules, seconds = help_run(script)
    assert "torchvision" in run_only_modules(modules)
    assert seconds > LIMIT * cpu_seconds(sys.executable, "-c", "import torch, accelerate")


def cpu_seconds(*command) -> float:
    """CPU time (user + system) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
