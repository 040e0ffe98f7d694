"""Commands in the documents (README.md, docs/*.md): extracted from ```bash blocks and checked
against the files and --help texts they name, so the docs cannot rot."""

import contextlib
import fnmatch
import importlib.util
import io
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO

ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def documents() -> list:
    """The documents, as paths relative to the repository: README.md, every docs/*.md page, then the pages of
    docs' subfolders (the published benchmarks' notes)."""
    pages = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs").glob("*/**/*.md"))
    return ["README.md", *(page.relative_to(REPO).as_posix() for page in pages)]


def document_commands() -> list:
    """(document, command) for every command of every document, in document order."""
    return [(document, command) for document in documents()
            for command in bash_commands((REPO / document).read_text())]


def bash_commands(text: str) -> list:
    """Every command line in ```bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def runnable(command: str) -> list:
    """The command's words, with `accelerate` and `python` run from this interpreter's environment (VAR=value
    prefixes through `env`)."""
    words = shlex.split(command)
    assignments = []
    while words and re.match(r"^[A-Z_]+=", words[0]):
        assignments.append(words.pop(0))
    if assignments:
        return ["env", *assignments, *runnable(shlex.join(words))]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    at = words.index("accelerate")
    prefix = ["bash", REPO / words[0]] if at > 0 else []  # e.g. scripts/restart_on_failure.sh 3 ...
    return [*prefix, *words[1 if prefix else 0:at], *ACCELERATE, *words[at + 1:]]


def program_help(cmd) -> str:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, check=True).stdout


REPO_PATH = re.compile(r"^(scripts|accelerate_configs|utils|tests|docs)/")


def script_help(path) -> str:
    """A script's --help from its parse_args(argv), in this process: one torch import for all
    scripts instead of one per script (5 s each on a busy 2-core machine)."""
    spec = importlib.util.spec_from_file_location(f"guide_checked_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # written like another project's example: its module-level `parser` (Horovod, Fabric), or else run it (apex)
    parse_args = getattr(module, "parse_args", None) or getattr(getattr(module, "parser", None), "parse_args", None)
    if parse_args is None:
        return program_help([sys.executable, path, "--help"])
    output = io.StringIO()
    with contextlib.redirect_stdout(output), pytest.raises(SystemExit):
        parse_args(["--help"])
    return output.getvalue()


def module_help(module: str, args) -> str:
    """`python -m MODULE ARGS --help` run in this process by runpy, as `python -m` runs it: the same parser, without
    a new process importing torch again (5 s each on a busy 2-core machine)."""
    output = io.StringIO()
    saved_argv = sys.argv
    sys.argv = [module, *args, "--help"]
    try:
        # argparse exits after the help; torchrun's @record turns that exit into a return
        with contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
    return output.getvalue()


def help_cache():
    """help_of(*program) -> its --help text, fetched once per program."""
    cache = {}

    def get(*program):
        if program not in cache:
            script = Path(program[-1])
            if program[0] == sys.executable and len(program) == 2 and script.suffix == ".py":
                cache[program] = script_help(script)
            elif program[0] == sys.executable and program[1] == "-m":
                cache[program] = module_help(program[2], program[3:])
            else:
                cache[program] = program_help(list(program) + ["--help"])
        return cache[program]
    return get


def assert_flags_exist(flags, help_text, context):
    for flag in (w.split("=")[0] for w in flags if w.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"no {flag}: {context}"


def assert_script_and_flags(words, help_of, command):
    """words: SCRIPT FLAGS... of one of our scripts (a user's own train.py is not checked)."""
    script, script_flags = words[0], words[1:]
    if REPO_PATH.match(script):
        assert_flags_exist(script_flags, help_of(sys.executable, str(REPO / script)), command)


def check_command(command: str, help_of):
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words.pop(0)
    for word in words:
        if REPO_PATH.match(word):
            assert (REPO / word).exists(), f"{word} does not exist: {command}"
    program = words[0]
    if words[:2] == ["accelerate", "launch"]:
        words = words[2:]
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        assert_flags_exist(words[:at], help_of(*ACCELERATE, "launch"), command)
        assert_script_and_flags(words[at:], help_of, command)
    elif words[:2] == ["accelerate", "config"]:
        assert_flags_exist(words[2:], help_of(*ACCELERATE, "config"), command)
    elif words[:2] == ["accelerate", "merge-weights"]:  # a sharded checkpoint into one file (docs/fsdp.md)
        assert_flags_exist(words[2:], help_of(*ACCELERATE, "merge-weights"), command)
    elif program == "torchrun":
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        assert_flags_exist(words[1:at], help_of(sys.executable, "-m", "torch.distributed.run"), command)
        assert_script_and_flags(words[at:], help_of, command)
    elif program == "sbatch":  # sbatch [its options] BATCH_SCRIPT [training script and flags]
        at = next(i for i, w in enumerate(words) if w.endswith(".sbatch"))
        if len(words) > at + 1:
            assert_script_and_flags(words[at + 1:], help_of, command)
    elif program == "pip":  # the requirements, or our helpers under their own name (docs/layout.md)
        assert words[1:] == ["install", "-r", "requirements.txt"] and (REPO / "requirements.txt").is_file() or \
            words[1:] == ["install", "-e", "path/to/this/clone"] and (REPO / "pyproject.toml").is_file(), command
    elif program == "sed":
        pass  # a copied script's import lines rewritten: tests/test_helpers_shadowing.py runs it
    elif words[:2] == ["fabric", "run"]:  # Lightning Fabric's launcher (the Fabric "before"), a test dependency
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        assert_flags_exist(words[2:at], help_of(sys.executable, "-m", "lightning_fabric.cli"), command)
        assert_script_and_flags(words[at:], help_of, command)
    elif words[:3] == ["python", "-m", "pytest"]:
        assert (REPO / words[-1]).is_dir(), command
    elif program == "python":  # python SCRIPT FLAGS [-- SCRIPT FLAGS], e.g. a sweep that launches a script
        before, _, after = " ".join(map(shlex.quote, words[1:])).partition(" -- ")
        assert_script_and_flags(shlex.split(before), help_of, command)
        if after:
            assert_script_and_flags(shlex.split(after), help_of, command)
    elif REPO_PATH.match(program) and program.endswith(".sh"):  # a wrapper: WRAPPER [ARGS] COMMAND...
        at = next(i for i, w in enumerate(words) if w in ("accelerate", "torchrun", "python"))
        check_command(shlex.join(words[at:]), help_of)
    elif program == "bash" and REPO_PATH.match(words[1]) and words[1].endswith(".sh"):  # bash SCRIPT.sh [--option]
        for option in (w for w in words[2:] if w.startswith("--")):
            assert option in (REPO / words[1]).read_text(), f"{words[1]} takes no {option}: {command}"
    elif program == "mutmut":  # the mutation run (docs/testing.md): its subcommand, and mutants of configured modules
        assert words[1] in ("run", "results", "show"), command
        mutated = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]
        modules = [path.removesuffix(".py").replace("/", ".") for path in mutated]
        for pattern in (w for w in words[2:] if not w.startswith("-")):
            assert any(fnmatch.fnmatch(f"{module}.x_function__mutmut_1", pattern) for module in modules), command
    elif program in ("horovodrun", "ss"):
        pass  # Horovod is not installed (the "before" side); ss is iproute2's
    else:
        raise AssertionError(f"no rule checks {program!r}; add one: {command}")
