"""`--help` answers about as fast as Python can import torch and accelerate: the libraries that only a run needs
(torchvision, datasets, evaluate, PIL, the ONNX packages, plotting) are imported where the run needs them.

The module check is exact and cannot flake; the timing check compares CPU seconds (not wall time, which another
test on the same cores would stretch), the best of three runs each.

One Python process measures them all: each `--help` runs in a child forked from it, whose CPU seconds the kernel
gives (wait4) and whose modules its sys.modules lists. The three `import torch, accelerate` baselines, and sweep.py,
which must not import torch, run in children forked before the server imports torch and accelerate itself; every
other script's child is forked after and pays only what its --help adds to them, so its cost counts as the baseline
plus that. (22 fresh interpreters, each importing torch again, took 110 s of the suite.)"""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPTS = sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "scripts" / "baselines").glob("*.py")])
# Each costs from a tenth of a second (PIL) to seconds (torchvision imports torch._dynamo; datasets, evaluate)
RUN_ONLY = ("torchvision", "datasets", "evaluate", "PIL", "simplejpeg", "onnx", "onnxruntime", "onnxscript",
            "matplotlib", "pandas", "tensorboard", "mlflow", "wandb")
LIMIT = 1.6  # x the CPU time of `import torch, accelerate`
BASELINE = ("torch", "accelerate")
# The Horovod and apex "befores" import those libraries, which cannot be installed here: their stand-ins
STANDINS = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "standins")}

# Reads one JSON request a line, answers one JSON line: {"help": SCRIPT} runs `SCRIPT --help` in a forked child and
# answers the modules it ended with and its CPU seconds; {"import": [NAMES]} imports them in a forked child (its CPU
# seconds); {"preload": [NAMES]} imports them in the server itself, so that the children forked after inherit them.
HELP_SERVER = r"""
import importlib, json, os, runpy, signal, sys, tempfile, time, traceback

def in_child(work):
    with tempfile.NamedTemporaryFile("r", suffix=".json") as answer:
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the --help text: not our answer line
                payload = {"value": work()}
            except BaseException:
                payload = {"error": traceback.format_exc()}
            with open(answer.name, "w") as file:
                json.dump(payload, file)
            os._exit(0)
        deadline = time.monotonic() + 120
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return {"error": "no answer after 120 s"}
            time.sleep(0.005)
        payload = json.loads(answer.read() or '{"error": "the child wrote no answer"}')
    return {**payload, "seconds": usage.ru_utime + usage.ru_stime}

def help_modules(script):
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), exit.code
    return sorted(sys.modules)

def import_all(names):
    for name in names:
        importlib.import_module(name)
    return sorted(sys.modules)

for line in sys.stdin:
    request = json.loads(line)
    if "help" in request:
        answer = in_child(lambda: help_modules(request["help"]))
    elif "import" in request:
        answer = in_child(lambda: import_all(request["import"]))
    else:
        answer = {"value": import_all(request["preload"])}
    print(json.dumps(answer), flush=True)
"""


class HelpServer:
    """The server's process, asked one request at a time."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", HELP_SERVER], cwd=REPO, env=STANDINS, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the help server ended (exit {self.process.poll()}): see its stderr above"
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def measured():
    """(server, baseline CPU seconds, {script name: (modules, CPU seconds)} of the scripts run before the preload)."""
    server = HelpServer()
    try:
        sweep = REPO / "scripts" / "sweep.py"  # it only starts other scripts: measured before torch is there
        bare = {"sweep.py": help_run_in(server, sweep)}
        baseline = min(server.ask(**{"import": list(BASELINE)})["seconds"] for _ in range(3))
        preloaded = set(server.ask(preload=list(BASELINE))["value"])
        # what every later child starts with adds no library of RUN_ONLY: each one it shows, its script imported
        assert run_only_modules(preloaded) == []
        yield server, baseline, bare
    finally:
        server.close()


def help_run_in(server, script) -> tuple:
    """(modules imported, CPU seconds) of one `script --help` in a child of the server as it is now."""
    answer = server.ask(help=str(script))
    return set(answer["value"]), answer["seconds"]


def help_run(measured, script) -> tuple:
    """(modules imported, CPU seconds) of one `script --help`, after the preload: the baseline plus what it added."""
    server, baseline, _ = measured
    modules, added = help_run_in(server, script)
    return modules, baseline + added


def run_only_modules(modules: set) -> list:
    return sorted(m for m in modules if any(m == lib or m.startswith(lib + ".") for lib in RUN_ONLY))


def test_help_imports_nothing_that_only_a_run_needs_and_is_fast(measured):
    _, baseline, bare = measured
    heavy, slow = {}, {}
    for script in SCRIPTS:
        name = script.relative_to(REPO / "scripts").as_posix()
        modules, seconds = bare[name] if name in bare else help_run(measured, script)
        if seconds > LIMIT * baseline and name not in bare:  # a busy machine? the better of two runs decides
            seconds = min(seconds, help_run(measured, script)[1])
        heavy[name], slow[name] = run_only_modules(modules), round(seconds / baseline, 2)
        if name == "sweep.py":  # it only starts other scripts: not even torch
            assert "torch" not in modules
    # the Fabric "before" is Lightning Fabric's example: `import lightning_fabric` alone imports torchvision,
    # torchmetrics, PIL and matplotlib; its converted script is held to the rule
    heavy.pop("baselines/fabric_mnist.py"), slow.pop("baselines/fabric_mnist.py")
    # the DeepSpeed "before" is DeepSpeedExamples' style: its parser needs deepspeed.add_config_arguments, and
    # `import deepspeed` imports transformers' and MLflow's integrations where installed; its converted script is held
    heavy.pop("baselines/deepspeed_mnist.py"), slow.pop("baselines/deepspeed_mnist.py")
    assert {name: found for name, found in heavy.items() if found} == {}
    assert {name: ratio for name, ratio in slow.items() if ratio > LIMIT} == {}, \
        f"--help slower than {LIMIT} x import torch, accelerate ({baseline:.2f} s of CPU); all: {slow}"


def test_the_checks_see_an_import_at_the_top(measured, tmp_path):
    script = tmp_path / "slow_help.py"
    # torchvision, datasets and evaluate: about twice the import time of torch and accelerate
    script.write_text("import argparse\nimport datasets, evaluate, torchvision\n"
                      "argparse.ArgumentParser().parse_args()\n")
    modules, seconds = help_run(measured, script)
    assert "torchvision" in run_only_modules(modules)
    assert seconds > LIMIT * measured[1]
