"""The migration pages of docs/ stay true: their snippets run (or at least compile), their commands and
launch.json name files and flags that exist, and their links lead somewhere. The snippets are read from every page
of docs/ (the guide is split into a page per source and pages of common topics, docs/migration_guide.md indexes
them), so a snippet keeps running wherever it moves.

Marker convention, on the line before a ```python fence (every Python block needs one):
    <!-- runnable -->                      python snippet.py
    <!-- runnable: accelerate launch 2 --> accelerate launch --multi_gpu --num_processes 2 --main_process_port 0
    <!-- runnable: torchrun 2 -->          python -m torch.distributed.run --standalone --nproc_per_node 2
    <!-- runnable: horovod stand-in, torchrun 2 -->  the same, with tests/standins on PYTHONPATH: `import
                                           horovod.torch` loads a stand-in of Horovod over torch.distributed
    <!-- compile-only: REASON -->          compile() only; REASON says what it needs (GPUs, apex, Horovod, Slurm)
Runnable snippets run on the CPU in a temporary folder and must assert what the text claims. "Before" lines that
break a launched job (the environment variables to delete) are compile-only; their test launches them in front of a
script, as it launches the snippets changed to show what the text says goes wrong without a line (a Case below).

A before/after pair written as two snippets adds ` | pair: NAME before` (or `after`) and ` | compare: VAR, VAR`
to both markers, e.g. `<!-- runnable: torchrun 2 | pair: sharding before | compare: train_epochs, eval_samples -->`.
Both sides run; each process's values of the named variables are saved at the end; test_pair_sides_agree checks
that the before's and the after's are equal (per process where both sides run as many processes, otherwise the
values every process of a side agrees on), so the two sides cannot drift apart unnoticed.
"""

import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from doc_commands import bash_commands, check_command
from helpers import EXIT_CHECK, REPO, free_port, launcher_args, run, threads_left_message
from jobs import launch_jobs, read_job

# Every page of docs/ (the Python and JSON blocks are the migration pages'); its subfolders hold measurements only
GUIDE_PAGES = sorted((REPO / "docs").glob("*.md"))
README = (REPO / "README.md").read_text()

FENCE = re.compile(r"(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.DOTALL)
RUNNERS = {
    "runnable": lambda path: [sys.executable, path],
    "runnable: accelerate launch 2": lambda path: [*launcher_args(2), path],
    "runnable: torchrun 2": lambda path: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc_per_node", "2", path],
    "runnable: horovod stand-in, torchrun 2": lambda path: [sys.executable, "-m", "torch.distributed.run",
                                                            "--standalone", "--nproc_per_node", "2", path],
}
RUNNER_ENV = {"runnable: horovod stand-in, torchrun 2": {"PYTHONPATH": str(REPO / "tests" / "standins")}}


def fenced_blocks(pages: list = GUIDE_PAGES) -> list:
    """(name, marker, language, code) of every fenced block of the pages; name = page, section slug, line number."""
    blocks = []
    for page in pages:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            section = ([""] + re.findall(r"^## (.*)$", text[: match.start()], flags=re.MULTILINE))[-1]
            name = f"{page.stem}:{slug(section)[:40]}-L{line}"
            blocks.append((name, match["marker"], match["lang"], match["code"]))
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def parse_marker(marker):
    """'runnable: torchrun 2 | pair: sharding before | compare: a, b' -> ('runnable: torchrun 2', {'pair': ...})."""
    launcher, *fields = [part.strip() for part in (marker or "").split(" | ")]
    return launcher, dict(field.split(": ", 1) for field in fields)


PYTHON = [b for b in fenced_blocks() if b[2] == "python"]
RUNNABLE = [pytest.param(parse_marker(marker)[0], code, id=name) for name, marker, _, code in PYTHON
            if parse_marker(marker)[0] in RUNNERS]
PAIR_SIDES = {}  # pair name -> {"before": (block name, launcher, code, [variables]), "after": ...}
for name, marker, _, code in PYTHON:
    launcher, fields = parse_marker(marker)
    if "pair" in fields:
        pair, side = fields["pair"].rsplit(" ", 1)
        assert side in ("before", "after") and side not in PAIR_SIDES.get(pair, {}), f"{name}: {marker}"
        PAIR_SIDES.setdefault(pair, {})[side] = (name, launcher, code, fields["compare"].split(", "))
COMPARED_IN = {code: variables for sides in PAIR_SIDES.values() for _, _, code, variables in sides.values()}
COMPILE_ONLY = [pytest.param(code, id=name) for name, marker, _, code in PYTHON
                if marker and marker.startswith("compile-only: ")]


def test_every_python_block_is_marked_and_runnable_ones_assert():
    for name, marker, _, code in PYTHON:
        launcher = parse_marker(marker)[0]
        assert launcher in RUNNERS or launcher.startswith("compile-only: "), f"{name}: unknown marker {marker!r}"
    for name, marker, _, code in PYTHON:
        if parse_marker(marker)[0] in RUNNERS:
            checks = re.search(r"^\s*(assert |torch\.testing\.assert_close)", code, flags=re.MULTILINE)
            assert checks, f"{name} checks nothing"
    # before and after side by side: some of each kind, several distributed ones actually run
    assert len(RUNNABLE) >= 10 and len(COMPILE_ONLY) >= 6
    assert sum("torchrun" in p.values[0] for p in RUNNABLE) >= 3
    assert sum("accelerate launch" in p.values[0] for p in RUNNABLE) >= 5


# Appended to each side of a pair: every process saves its values of the compared variables.
SAVE_COMPARED = """

import json as _json
import os as _os


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


with open(f"compared_{_os.environ.get('RANK', '0')}.json", "w") as _file:
    _json.dump({_name: _plain(globals()[_name]) for _name in COMPARED}, _file)
"""
# The snippets of one launcher run in one launch of tests/jobs.py, each in a process of its own forked from the
# launched one (a launch per snippet cost 8-20 s of imports each); torchrun's batch runs the Horovod one too.
# What the snippets import that costs seconds; imported once per launched process, before any fork, never used (no
# threads yet). Not torch._dynamo: it imports torch.distributed.nn, whose default arguments hold the process group when
# it is imported after one exists; a snippet must show that early import itself ("Ending a run cleanly"): it is left
# out (not_preloaded). The last three are what torch._dynamo (imported by DDP and Accelerate's prepare) spends most of
# its 2-3 s on without importing torch.distributed.nn, so the child's own import of torch._dynamo takes about 1 s.
JOBS = REPO / "tests" / "jobs.py"
SNIPPET_IMPORTS = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.nn.parallel",
                   "torch.utils.data", "accelerate", "accelerate.utils", "safetensors.torch",
                   "sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor"]
BATCHED_WITH = {"runnable: horovod stand-in, torchrun 2": "runnable: torchrun 2"}
# accelerate launch --num_processes 2 --cpu without --multi_gpu: its simple launcher starts one process
ONE_OF_TWO = "accelerate launch --num_processes 2 --cpu, no --multi_gpu"
BATCH_RUNNERS = {**RUNNERS, ONE_OF_TWO: lambda path: [
    sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no", path]}
PROCESSES = {"runnable": 1, "runnable: accelerate launch 2": 2, "runnable: torchrun 2": 2, ONE_OF_TWO: 1}
OUTCOMES = {}  # code -> {rank: {variable: value}}, or the AssertionError saying why the snippet failed
SNIPPET_TIMEOUT = 240


@dataclass
class Case:
    """A test's variant of the guide's snippets, run in its launcher's batch after the snippets, in a process per rank
    forked as a snippet's is, so that it fails as it would alone (tests/jobs.py). own_group: its own MASTER_PORT
    and store, as a snippet; False: the launcher's rendezvous store and port, as a script launched alone has them
    (at most one case of a batch may form its group there: the store keeps the keys of the first)."""
    launcher: str
    code: object  # the script, or a function returning it, called when its batch runs
    own_group: bool = True


@dataclass
class Ran:
    """What a case's processes did: by rank, the exit status (0, 1, -6 for a signal, None: killed at its timeout) and
    output (stdout and stderr); the gloo threads the exit check found alive at their exits; the script they ran, and
    its path."""
    status: list
    outputs: list
    threads_left: list
    code: str
    script: str

    @property
    def output(self) -> str:
        return "\n".join(self.outputs)

    @property
    def succeeded(self) -> bool:
        return all(status == 0 for status in self.status)


CASES = {}  # name -> Case, filled where each test is defined
RAN = {}  # name -> Ran


def batch_job(folder: Path, marker: str, code: str, own_group: bool = True) -> dict:
    """folder/snippet.py as a job of tests/jobs.py, run in that folder."""
    folder.mkdir()
    snippet = folder / "snippet.py"
    snippet.write_text(code)
    path = [RUNNER_ENV[marker]["PYTHONPATH"]] if marker in RUNNER_ENV else []
    # its processes' exit check (a gloo worker thread left alive at a snippet's exit fails it, "Ending a run cleanly")
    # in the processes it starts too; own_group: its own port, for its group, and for mp.spawn and notebook_launcher,
    # which otherwise take 29500
    env = {"PYTHONPATH": os.pathsep.join([*path, str(EXIT_CHECK)])}
    return {"argv": [snippet], "cwd": folder, "path": path, "env": env, "own_group": own_group,
            "timeout": SNIPPET_TIMEOUT}


def run_batch(launcher: str, folder) -> None:
    """Run every runnable snippet of this launcher, then its cases, in one launch; record each snippet's outcome in
    OUTCOMES, each case's in RAN."""
    snippets = [p.values for p in RUNNABLE if BATCHED_WITH.get(p.values[0], p.values[0]) == launcher]
    cases = [(name, case) for name, case in CASES.items() if case.launcher == launcher]
    jobs = {}
    for index, (marker, code) in enumerate(snippets):
        variables = COMPARED_IN.get(code, [])
        code += SAVE_COMPARED.replace("COMPARED", repr(variables)) if variables else ""
        jobs[f"snippet_{index}"] = batch_job(folder / f"snippet_{index}", marker, code)
    for name, case in cases:
        code = case.code() if callable(case.code) else case.code
        jobs[name] = batch_job(folder / name, launcher, code, case.own_group)
    launcher_command = BATCH_RUNNERS[launcher](JOBS)[:-1]  # the runner's command, less the script it ends with
    launch = launch_jobs(jobs, launcher_command, folder, env={"OMP_NUM_THREADS": "1"}, cwd=folder,
                         preload=SNIPPET_IMPORTS, not_preloaded=["torch.distributed.nn"])
    assert launch.returncode == 0, f"{launch.stdout[-3000:]}\n{launch.stderr[-6000:]}"
    for index, (_, code) in enumerate(snippets):
        OUTCOMES[code] = outcome_in(folder / f"snippet_{index}", PROCESSES[launcher])
    for name, _ in cases:
        RAN[name] = ran_in(folder / name, PROCESSES[launcher])


def ran_in(folder, processes: int) -> Ran:
    """What the job run in `folder` did (its files beside the folder: tests/jobs.py)."""
    job = read_job(folder, processes)
    return Ran(job.statuses, job.outputs, job.threads_left, (folder / "snippet.py").read_text(),
               str(folder / "snippet.py"))


def outcome_in(folder, processes: int):
    """A snippet's outcome from its folder: every process's compared values, or why it failed."""
    ran = ran_in(folder, processes)
    for rank, status in enumerate(ran.status):
        if status != 0:
            return AssertionError(f"process {rank} of {processes} exited {status}\n{ran.outputs[rank][-8000:]}")
    if ran.threads_left:
        return AssertionError(threads_left_message(ran.threads_left))
    return {int(path.stem.split("_")[1]): json.loads(path.read_text()) for path in folder.glob("compared_*.json")}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """batch(launcher): run the launcher's batch the first time one of its snippets or cases is asked for (a launch
    that failed fails each of them)."""
    def run_once(launcher):
        if launcher not in BATCH_FAILURES:
            try:
                BATCH_FAILURES[launcher] = None
                run_batch(launcher, tmp_path_factory.mktemp(re.sub(r"\W+", "_", launcher)))
            except Exception as failure:  # the launch exited non-zero, or ran past its time
                BATCH_FAILURES[launcher] = failure
        if BATCH_FAILURES[launcher] is not None:
            raise BATCH_FAILURES[launcher]
    return run_once


BATCH_FAILURES = {}  # launcher -> None, or why its launch failed


@pytest.fixture(scope="module")
def snippet_outcome(batch):
    """outcome(marker, code): the snippet's compared values; its failure raised."""
    def outcome(marker, code):
        batch(BATCHED_WITH.get(marker, marker))
        if isinstance(OUTCOMES[code], AssertionError):
            raise OUTCOMES[code]
        return OUTCOMES[code]
    return outcome


@pytest.fixture(scope="module")
def case_ran(batch):
    """ran(name) -> Ran: what the case's processes did."""
    def ran(name):
        batch(CASES[name].launcher)
        return RAN[name]
    return ran


@pytest.mark.parametrize("marker, code", RUNNABLE)
def test_runnable_snippet(marker, code, snippet_outcome):
    snippet_outcome(marker, code)


def same(a, b, where: str) -> None:
    """Equal, floats within float32 rounding (the two sides may sum in another order)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {a} != {b}"
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for index, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{index}]")
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def common_values(outcome: dict, variable: str, side: str):
    """The value every process of one side holds (a side on another number of processes is compared by these)."""
    values = [outcome[rank][variable] for rank in sorted(outcome)]
    for rank, value in enumerate(values[1:], 1):
        same(values[0], value, f"{side}: {variable} of process 0 and process {rank}")
    return values[0]


def test_every_pair_has_two_sides_that_compare_the_same_things():
    assert len(PAIR_SIDES) >= 10
    for pair, sides in PAIR_SIDES.items():
        assert sides.keys() == {"before", "after"}, f"pair {pair}: {sorted(sides)}"
        assert sides["before"][3] == sides["after"][3], f"pair {pair} compares different variables"
        for side, (name, launcher, code, variables) in sides.items():
            assert launcher in RUNNERS, f"{name}: a pair's sides run"
            for variable in variables:
                assigned = rf"^[^#\n=]*\b{variable}\b[^#\n=]*=[^=]"  # 'a, variable = ...' too
                assert re.search(assigned, code, flags=re.MULTILINE), f"{name} never sets {variable}"


@pytest.mark.parametrize("pair", sorted(PAIR_SIDES))
def test_pair_sides_agree(pair, snippet_outcome):
    """What the pair claims: the before and the after end with the same values of the compared variables."""
    before, after = (snippet_outcome(launcher, code) for _, launcher, code, _ in
                     (PAIR_SIDES[pair]["before"], PAIR_SIDES[pair]["after"]))
    assert before and after
    for variable in PAIR_SIDES[pair]["before"][3]:
        if before.keys() == after.keys():
            for rank in before:
                same(before[rank][variable], after[rank][variable], f"{pair}: {variable} of process {rank}")
        else:
            same(common_values(before, variable, "before"), common_values(after, variable, "after"), f"{pair}: {variable}")


def the_snippet_with(text: str, blocks: list) -> str:
    (code,) = [p.values[-1] for p in blocks if text in p.values[-1]]
    return code


TWO_HEADS = the_snippet_with("Kwargs(find_unused_parameters=True", RUNNABLE)
CASES["two_heads_without_find_unused"] = Case(
    "runnable: accelerate launch 2", TWO_HEADS.replace("find_unused_parameters=True", "find_unused_parameters=False"))


def test_find_unused_parameters_snippet_needs_the_option(case_ran):
    """The guide says the two-head model fails without find_unused_parameters=True: it does."""
    assert "find_unused_parameters=False" in CASES["two_heads_without_find_unused"].code
    ran = case_ran("two_heads_without_find_unused")
    assert not ran.succeeded
    assert "Expected to have finished reduction in the prior iteration" in ran.output


def torch_cuda_available() -> bool:
    import torch  # the test process imports it anyway: tests/test_image_recipes.py does at collection

    return torch.cuda.is_available()


PROCESS_COUNT_CHECKS = the_snippet_with('if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", "1"))',
                                        RUNNABLE)
if not torch_cuda_available():  # on GPUs, the test below skips
    CASES["process_count_check_without_cpu"] = Case(
        "runnable: accelerate launch 2", PROCESS_COUNT_CHECKS.replace('parser.parse_args(["--cpu"])', "parser.parse_args([])"))


def test_the_process_count_check_stops_a_launch_without_cpu(case_ran):
    """The guide's check: without --cpu on a machine without GPUs, two lone processes; the check stops them."""
    if torch_cuda_available():
        pytest.skip("this machine has GPUs: without --cpu the processes form one group")
    assert 'parser.parse_args(["--cpu"])' in PROCESS_COUNT_CHECKS
    assert "parser.parse_args([])" in CASES["process_count_check_without_cpu"].code
    ran = case_ran("process_count_check_without_cpu")
    error = "error: 2 processes were launched but each runs alone; on a machine without GPUs add --cpu"
    assert not ran.succeeded and ran.output.count(error) == 2, ran.output
    assert not any('File "' + ran.script in output for output in ran.outputs)  # sys.exit: no traceback through it


def without_the_multi_gpu_check(code: str) -> str:
    check_start = code.index('if "MASTER_ADDR" in os.environ')
    check_end = code.index("\n", code.index("sys.exit(", check_start)) + 1
    unchecked = code[:check_start] + code[check_end:]
    return unchecked.replace("assert world_size == 2 and total.item() == 3.0", "print(f'world_size {world_size}')")


# The simple launcher's one process, alone: the launcher's environment as it is
CASES["process_count_check_without_multi_gpu"] = Case(ONE_OF_TWO, PROCESS_COUNT_CHECKS, own_group=False)
CASES["no_process_count_check_without_multi_gpu"] = Case(
    ONE_OF_TWO, without_the_multi_gpu_check(PROCESS_COUNT_CHECKS), own_group=False)


def test_the_process_count_check_stops_a_launch_without_multi_gpu(case_ran):
    """accelerate launch --num_processes 2 --cpu without --multi_gpu starts one process: without the guide's second
    check it trains alone to the end, exit status 0; with it, it stops with one line."""
    assert 'if "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:' in PROCESS_COUNT_CHECKS
    unchecked = CASES["no_process_count_check_without_multi_gpu"].code
    assert "world_size {world_size}" in unchecked and 'if "MASTER_ADDR" in os.environ' not in unchecked
    ran = case_ran("no_process_count_check_without_multi_gpu")
    assert ran.succeeded and not ran.threads_left, ran.output
    assert "world_size 1" in ran.outputs[0]  # the silent difference: one process, exit 0
    ran = case_ran("process_count_check_without_multi_gpu")
    error = "error: accelerate launch was asked for several processes but started one; add --multi_gpu to it"
    assert not ran.succeeded and ran.outputs[0].count(error) == 1, ran.outputs


# What `accelerate launch --mixed_precision fp16` sets for the script (this batch is launched with --mixed_precision no)
FP16 = 'import os\nos.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"\n'
CASES["fp16_on_the_cpu"] = Case("runnable: accelerate launch 2", FP16 + PROCESS_COUNT_CHECKS)


def without_the_fp16_check(code: str) -> str:
    check_start = code.index('if accelerator.mixed_precision == "fp16"')
    check_end = code.index("\n", code.index("sys.exit(", check_start)) + 1
    return code[:check_start] + "print(f'mixed precision {accelerator.mixed_precision}, native_amp {accelerator.native_amp}')\n" + \
        code[check_end:]


CASES["fp16_on_the_cpu_unchecked"] = Case("runnable: accelerate launch 2", FP16 + without_the_fp16_check(PROCESS_COUNT_CHECKS))


def test_the_fp16_check_stops_a_cpu_run_that_would_train_in_fp32(case_ran):
    """The guide's third check: fp16 asked for on CPU processes. Without it the run ends with exit status 0, fp16 named
    but no autocast (native_amp False: fp32); with it, each process stops with one line."""
    unchecked = CASES["fp16_on_the_cpu_unchecked"].code
    assert 'if accelerator.mixed_precision == "fp16"' not in unchecked and "native_amp" in unchecked
    ran = case_ran("fp16_on_the_cpu_unchecked")
    assert ran.succeeded and not ran.threads_left, ran.output
    assert all("mixed precision fp16, native_amp False" in output for output in ran.outputs), ran.outputs
    ran = case_ran("fp16_on_the_cpu")
    error = "error: fp16 mixed precision needs a GPU (on the CPU it would run in fp32); use bf16 or no"
    assert not ran.succeeded and ran.output.count(error) == 2, ran.output
    assert not any('File "' + ran.script in output for output in ran.outputs)  # sys.exit: no traceback through it

LOCAL_RANK_SNIPPET = the_snippet_with('add_argument("--local_rank"', RUNNABLE)
_start, _parse = "parser = argparse.ArgumentParser()", "args = parser.parse_args()"
# the snippet's parser without its torch and accelerate imports
OLD_PARSER = (f"import argparse\n\n{LOCAL_RANK_SNIPPET[LOCAL_RANK_SNIPPET.index(_start):LOCAL_RANK_SNIPPET.index(_parse)]}"
              f"{_parse}\nprint('local_rank', args.local_rank)\n")
CASES["old_parser_under_torchrun"] = Case("runnable: torchrun 2", OLD_PARSER)


def test_old_local_rank_parser_under_torch_launchers(tmp_path, case_ran):
    """The guide's table: torch.distributed.launch passes --local-rank=N, which the old parser refuses;
    torchrun passes nothing (its batch gives its snippets what it was given), so the parser keeps its default
    (accelerate launch: the snippet itself)."""
    assert 'parser.add_argument("--local_rank", type=int, default=-1)' in OLD_PARSER
    script = tmp_path / "old_parser.py"
    script.write_text(OLD_PARSER)
    launch = run([sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc_per_node", "1", script],
                 cwd=tmp_path, check=False)
    assert launch.returncode != 0 and "error: unrecognized arguments: --local-rank=0" in launch.stderr, launch.stderr
    torchrun = case_ran("old_parser_under_torchrun")
    assert torchrun.succeeded and not torchrun.threads_left, torchrun.output
    assert all("local_rank -1" in output for output in torchrun.outputs)


# What a script does after the guide's lines to delete: join the group, say who it is. TIMEOUT: the process
# group's, in seconds; short only where nobody hosts the store (a short one would fail a slow-starting peer).
JOIN_AND_REPORT = """
from datetime import timedelta

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=TIMEOUT))])
# one write per line: print() writes text and newline apart, and two unbuffered ranks interleave them
print(f"process {accelerator.process_index} of {accelerator.num_processes}\\n", end="", flush=True)
accelerator.end_training()
"""
LINES_TO_DELETE = the_snippet_with('os.environ["WORLD_SIZE"] = "1"', COMPILE_ONLY)


def with_the_line_setting(variable) -> str:
    """The guide's line that sets `variable` (None: no line) in front of JOIN_AND_REPORT."""
    (line,) = [text for text in LINES_TO_DELETE.splitlines() if text.startswith(f'os.environ["{variable}"] = ')] or [""]
    # a port nobody listens on, not 29500, which another job on this machine may really hold
    line = line.replace('"29500"', f'"{free_port()}"')
    timeout = "1" if variable == "MASTER_PORT" else "100"
    return f"import os\n{line}\n" + JOIN_AND_REPORT.replace("TIMEOUT", timeout)


# WORLD_SIZE and MASTER_PORT: with the launcher's store and port, as the script launched alone has them
for _variable in (None, "WORLD_SIZE", "MASTER_PORT"):
    CASES[f"environment_set_by_the_script_{_variable}"] = Case(
        "runnable: accelerate launch 2", lambda variable=_variable: with_the_line_setting(variable),
        own_group=_variable is None)


@pytest.mark.parametrize("variable", [None, "WORLD_SIZE", "MASTER_PORT"])
def test_environment_set_by_the_script_overrides_the_launcher(variable, case_ran):
    """The guide's lines to delete, each run in front of JOIN_AND_REPORT with 2 processes; None: without them."""
    ran = case_ran(f"environment_set_by_the_script_{variable}")
    stdout = "".join(ran.outputs)
    if variable is None:
        assert ran.succeeded and not ran.threads_left, ran.output
        assert {"process 0 of 2", "process 1 of 2"} <= set(stdout.splitlines()), ran.output
    elif variable == "WORLD_SIZE":
        # process 0 forms a group of one (it may be stopped before it prints); process 1 cannot join
        assert not ran.succeeded and "rank < size. 1 vs 1" in ran.output, ran.output
        assert "process 1 of" not in stdout and "of 2" not in stdout
    else:
        port = re.search(r'os.environ\["MASTER_PORT"\] = "(\d+)"', ran.code)[1]
        assert not ran.succeeded and f"127.0.0.1:{port}" in ran.output, ran.output
        assert "process " not in stdout


@pytest.mark.parametrize("code", COMPILE_ONLY)
def test_compile_only_snippet_compiles(code):
    compile(code, "snippet.py", "exec")


# ---------------------------------------------------------------- commands, launch.json, links

# the pages whose snippets run here, and the README that sends readers to them
SNIPPET_PAGES = sorted({page.relative_to(REPO).as_posix() for page in GUIDE_PAGES
                        if any(block[2] == "python" for block in fenced_blocks([page]))})


@pytest.mark.parametrize("document", [*SNIPPET_PAGES, "README.md"])
def test_commands_name_existing_files_and_flags(document, helps):
    commands = bash_commands((REPO / document).read_text())
    assert commands or document != "README.md"
    for command in commands:
        check_command(command, helps)


def test_launch_json_runs_the_launcher_on_our_script(helps):
    (config,) = [json.loads(code) for _, _, lang, code in fenced_blocks() if lang == "json"]
    (entry,) = config["configurations"]
    assert entry["module"] == "accelerate.commands.launch" and entry["request"] == "launch"
    args = entry["args"]
    assert args[args.index("--num_processes") + 1] == "1"  # one process: the debugger follows it
    check_command(shlex.join(["accelerate", "launch", *args]), helps)
    assert entry["env"]["ACCELERATE_DEBUG_MODE"] == "1"


def test_links_lead_somewhere():
    assert len(SNIPPET_PAGES) >= 1
    for page in SNIPPET_PAGES:
        text = (REPO / page).read_text()
        anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}
        for target in re.findall(r"\]\(#([^)]+)\)", text):
            assert target in anchors, f"{page}: no heading for #{target}"
        for path in set(re.findall(r"`((?:scripts|accelerate_configs|utils|tests|docs)/[\w./-]+)`", text)):
            assert (REPO / path).exists(), f"{page}: {path}"
    assert "(docs/migration_guide.md)" in README, "the README links the guide"
