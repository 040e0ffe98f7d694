"""Our helpers never shadow a user's own `utils`, nor theirs ours (docs/layout.md, "When your project has its own
`utils`"): utils/ installs under a name of its own (pyproject.toml maps accelerate_reference_utils to utils/), and its
modules import one another relatively, so that they work under that name. Run here as a user runs the route: the
package installed (pip install --target, into a folder of this test) beside a foreign project with its own `utils`:

- a foreign FSDP2 script (tests/foreign_fsdp2: its own utils.py, as pytorch/examples' distributed/FSDP2 has) imports
  our shard_on_cpu (docs/fsdp.md) under the installed name and trains sharded on 2 CPU processes, where its
  `accelerator.get_state_dict(model)` is the whole weights and `accelerator.unwrap_model(model).state_dict()` this
  process's DTensor shards (one launch);
- a complete script copied into a project with a `utils` package of its own runs (its --help) after the documented
  rewrite of its import lines, in a process that imported the project's `utils` first."""

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest
from helpers import REPO, launcher_args, run

FSDP_CPU = REPO / "accelerate_configs" / "fsdp_cpu.yaml"
FOREIGN = REPO / "tests" / "foreign_fsdp2"
LAYOUT = REPO / "docs" / "layout.md"
INSTALLED_NAME = "accelerate_reference_utils"


def documented_commands() -> list:
    """The commands of docs/layout.md's section on a project with its own utils, in order."""
    section = LAYOUT.read_text().split("## When your project has its own `utils`", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for line in block.splitlines()
            if line.strip() and not line.startswith("#")]


def test_every_package_of_utils_is_installed_under_the_distinct_name():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {INSTALLED_NAME: "utils"}
    folders = {init.parent.relative_to(REPO / "utils").as_posix() for init in (REPO / "utils").rglob("__init__.py")}
    assert set(setuptools["packages"]) == {INSTALLED_NAME + ("" if folder == "." else "." + folder.replace("/", "."))
                                           for folder in folders}


def test_no_module_of_utils_imports_utils_by_its_name():
    """An absolute `from utils.x import y` inside utils/ would find the user's utils once ours is imported under the
    installed name ('utils' is not a package); relative imports find ours under any name."""
    absolute = [f"{path.relative_to(REPO)}:{node.lineno}" for path in (REPO / "utils").rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "utils"
                or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "utils" for a in node.names)]
    assert absolute == [], "import the other helpers relatively (from ..errors import UserError): " + str(absolute)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A folder holding our helpers as `pip install` installs them from pyproject.toml (the package files copied first:
    setuptools writes its build folder beside them)."""
    root = tmp_path_factory.mktemp("installed")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(REPO / "utils", root / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", root / "site", root])
    return root / "site"


def test_shadowing_a_foreign_fsdp2_script_keeps_its_utils_and_shards_with_ours(installed, tmp_path):
    """The foreign script's own utils.py and our installed helpers in one process, under an FSDP launch on 2 CPU
    processes: shard_on_cpu made it FSDP2 (each process holds half the parameter elements: 437 of 874; without
    the call, DDP: all 874), get_state_dict gave the main process the whole weights, unwrap_model(...).state_dict()
    gave each process DTensors of half the rows, which a plain torch.load refuses."""
    project = tmp_path / "project"
    shutil.copytree(FOREIGN, project, ignore=shutil.ignore_patterns("__pycache__"))
    run([*launcher_args(config_file=FSDP_CPU), "--num_processes", "2", "train.py", "out"], cwd=project,
        env={"PYTHONPATH": str(installed)})
    ranks = [json.loads((project / f"out.rank{rank}.json").read_text()) for rank in (0, 1)]
    # a first dimension of 32 or 10: half of each parameter on each process
    assert [(record["elements_held"], record["whole_elements"]) for record in ranks] == [(437, 874)] * 2
    assert [record["distributed_type"] for record in ranks] == ["FSDP"] * 2
    # the whole weights, equal to the model's before prepare, on the main process; the others get none
    assert {name: entry["shape"] for name, entry in ranks[0]["get_state_dict"].items()} == {
        "0.weight": [32, 16], "0.bias": [32], "2.weight": [10, 32], "2.bias": [10]}
    assert all(entry["equal"] for entry in ranks[0]["get_state_dict"].values()) and ranks[1]["get_state_dict"] == {}
    for record in ranks:
        unwrapped = record["unwrapped"]
        assert {entry["type"] for entry in unwrapped.values()} == {"DTensor"}
        assert unwrapped["0.weight"]["shape"] == [32, 16] and unwrapped["0.weight"]["local_shape"] == [16, 16]
        assert unwrapped["2.bias"]["local_shape"] == [5]
    # rank 0's file of the unwrapped state dict, loaded plainly, by a process that has not imported DTensor (as this
    # pytest worker may have: an earlier test's import registers it, and the load would then pass)
    plain_load = subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=True)",
                                 project / "out.rank0.pt"], capture_output=True, text=True, check=False, timeout=120)
    assert plain_load.returncode != 0 and "DTensor" in plain_load.stderr, plain_load.stderr


def test_shadowing_a_complete_script_copied_into_a_project_with_its_own_utils(installed, tmp_path):
    """docs/layout.md's route: our helpers installed, the copied script's `from utils` lines rewritten by the page's
    command; the project's `utils` package, imported first in the same process, stays the project's."""
    project = tmp_path / "project"
    (project / "utils").mkdir(parents=True)
    (project / "utils" / "__init__.py").write_text("THEIRS = True\n")
    shutil.copy(REPO / "scripts" / "train_mnist.py", project / "train_mnist.py")
    commands = documented_commands()
    assert commands[0] == "pip install -e path/to/this/clone", commands  # `installed`, here
    for command in commands[1:]:
        assert command.startswith("sed "), command
        subprocess.run(shlex.split(command), cwd=project, check=True)
    script = (project / "train_mnist.py").read_text()
    assert not re.search(r"^\s*(from|import) utils\b", script, flags=re.M)
    assert f"from {INSTALLED_NAME}.launch.flags import" in script
    main = ("import runpy, sys, utils; assert utils.THEIRS; sys.argv = ['train_mnist.py', '--help']; "
            "runpy.run_path('train_mnist.py', run_name='__main__')")
    proc = run([sys.executable, "-c", main], cwd=project, env={"PYTHONPATH": str(installed)})
    assert "--data_dir" in proc.stdout and "--resume_from_checkpoint" in proc.stdout
