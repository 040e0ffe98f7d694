"""utils/lean_imports.py: evaluate and DeepSpeed imported without the large optional packages they would pull in for
features the scripts never use (transformers' pipelines, mlflow), about 3.7 s of CPU per process start where those are
installed; the packages themselves still import afterwards."""

import importlib.util
import subprocess
import sys

import pytest
from helpers import REPO

from utils.lean_imports import hidden

PROCESS_START = """
import sys
from utils.metrics import load_metric
from utils.run.group_holders import import_deepspeed_if_installed
import_deepspeed_if_installed()
metric = load_metric("accuracy")
print(sorted({"transformers", "mlflow"} & set(sys.modules)))
metric.add_batch(predictions=[1, 0, 1], references=[1, 1, 1])
print(metric.compute()["accuracy"])
import mlflow, transformers  # as --report_to mlflow or a DeepSpeed run import them later
print(mlflow.__name__, transformers.__name__)
"""


def test_a_scripts_start_imports_neither_transformers_nor_mlflow_which_still_import_after():
    for package in ("transformers", "mlflow", "deepspeed"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed here (requirements-deepspeed.txt, requirements-trackers.txt)")
    proc = subprocess.run([sys.executable, "-c", PROCESS_START], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    # (DeepSpeed's own lines before: "Setting accelerator to CPU" on a machine without a GPU)
    assert proc.stdout.splitlines()[-3:] == ["[]", str(2 / 3), "mlflow transformers"], proc.stdout + proc.stderr


def test_hidden_raises_inside_restores_after_and_leaves_an_imported_package_alone(tmp_path, monkeypatch):
    name = "a_package_of_this_test"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with hidden(name), pytest.raises(ImportError):
        __import__(name)
    assert name not in sys.modules
    with pytest.raises(RuntimeError), hidden(name):  # an error inside still restores it
        raise RuntimeError
    assert name not in sys.modules
    assert __import__(name).VALUE == 1  # importable afterwards
    with hidden(name):  # imported already: unchanged
        assert __import__(name).VALUE == 1
    del sys.modules[name]
