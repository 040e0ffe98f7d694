"""The README and the pages of docs/ stay true: their commands name files and flags that exist, their launch
commands run, each command that downloads says so on its line, their links lead somewhere, and the README stays
a front page."""

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from doc_commands import ACCELERATE, bash_commands, check_command, document_commands, documents, runnable
from helpers import REPO, make_synthetic_mnist, results, run

README = (REPO / "README.md").read_text()
DOCUMENTS = documents()
MIGRATION_PAIRS = ("minimal_mnist.py", "minimal_mnist_plain.py", "converted_ddp_imagenet_style.py", "ddp_imagenet_style.py",
                   "converted_horovod_style.py", "horovod_mnist.py", "converted_apex_amp_style.py",
                   "apex_amp_imagenet_style.py", "converted_fabric_style.py", "fabric_mnist.py",
                   "converted_deepspeed_style.py", "deepspeed_mnist.py")


def text_of(document: str) -> str:
    return (REPO / document).read_text()


def launch_commands() -> list:
    """(document, command) for the commands that run `accelerate launch`, directly or through a wrapper script."""
    return [(document, c) for document, c in document_commands() if "accelerate launch " in c]


QUICKSTART_RUN = "accelerate launch scripts/train_mnist.py"
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadfile tests"


def test_the_documents_are_the_readme_and_every_docs_page():
    pages = {page.relative_to(REPO).as_posix() for page in (REPO / "docs").rglob("*.md")}
    assert DOCUMENTS[0] == "README.md" and set(DOCUMENTS[1:]) == pages
    assert {"docs/topologies.md", "docs/slurm.md", "docs/reliability.md", "docs/benchmarks.md", "docs/gpus.md",
            "docs/troubleshooting.md", "docs/migration_guide.md"} <= pages


def test_quickstart_has_the_install_run_and_test_commands():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = bash_commands(quickstart)
    assert commands[0] == "pip install -r requirements.txt" and commands[-2:] == [QUICKSTART_RUN, TEST_COMMAND]
    assert any("scripts/minimal_mnist.py" in c for c in commands), "the quickstart starts with the minimal pair"


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text()
    assert ("requirements=(-r requirements.txt -r requirements-trackers.txt -r requirements-export.txt "
            "-r requirements-deepspeed.txt)") in ci
    assert 'install=("${requirements[@]}" -c constraints.txt)' in ci  # CI installs the versions that were tested
    pinned = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    for package in ("torch", "torchvision", "accelerate", "datasets"):
        assert f"{package} {pinned[package]}" in README, f"the README names the tested {package} {pinned[package]}"
    assert ci.rstrip().splitlines()[-1] == TEST_COMMAND


# ---------------------------------------------------------------- the README is a front page

def test_the_readme_is_a_front_page_that_links_every_page():
    lines = README.count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move the details to a page of docs/"
    for heading in ("## Quickstart", "## The minimal pair", "## The complete scripts", "## Choosing a topology",
                    "## Capabilities"):
        assert f"\n{heading}\n" in README, heading
    assert "](docs/README.md)" in README, "the README links the documentation's front door"


def test_the_documentations_front_door_links_every_page_in_its_reading_order():
    front = text_of("docs/README.md")
    sections = re.findall(r"^## (.*)$", front, flags=re.M)
    assert [title.split(" ", 1)[0] for title in sections] == ["1.", "2.", "3.", "4."], sections  # the reading order
    assert sections[0].endswith("Start here") and sections[1].startswith("2. By where you come from")
    linked = {(REPO / "docs" / target).resolve() for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", front)}
    unlinked = [page for page in DOCUMENTS[1:] if page.count("/") == 1 and page != "docs/README.md"
                and (REPO / page).resolve() not in linked]
    assert not unlinked, f"link these pages from docs/README.md: {unlinked}"


def table_cells(text: str) -> list:
    """The cells of the text's Markdown tables (code blocks left out; a | inside `code` does not end a cell)."""
    cells = []
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        if line.startswith("|"):
            cells += [cell.strip() for cell in re.findall(r"(?:`[^`]*`|[^|`])+", line.strip().strip("|"))]
    return cells


@pytest.mark.parametrize("document", DOCUMENTS)
def test_no_page_over_700_lines_and_no_table_cell_over_400_characters(document):
    """A reader finds a page's subject: a longer page is split by source or topic (docs/README.md), and a paragraph
    goes under a heading, with a link from its table row."""
    text = text_of(document)
    assert text.count("\n") <= 700, f"{document} has {text.count(chr(10))} lines: split it"
    long_cells = [cell[:60] for cell in table_cells(text) if len(cell) > 400]
    assert not long_cells, f"{document}: move these cells' paragraphs under a heading: {long_cells}"


def test_table_cells_are_split_at_bars_outside_code():
    assert table_cells("| `a | b` | c |\n|---|---|\n```\n| x |\n```\n") == ["`a | b`", "c", "---", "---"]

def test_the_readme_says_the_complete_scripts_are_copied_with_utils():
    assert "The complete scripts are copied together with `utils/`" in README
    for script in MIGRATION_PAIRS:
        assert script in README.split("## The complete scripts", 1)[1].split("\n## ", 1)[0], script


def imports_utils(script: Path) -> bool:
    tree = ast.parse(script.read_text())
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "utils"
               or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "utils" for a in node.names)
               for node in ast.walk(tree))


def defines_something(module: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.parse(module.read_text()).body)


def test_layout_says_which_scripts_need_utils_and_names_every_utils_module():
    layout = text_of("docs/layout.md")
    rows = dict(re.findall(r"^\| `(scripts/[\w/]+\.py)` \|.*\| (itself alone|`utils/`) \|$", layout, flags=re.M))
    scripts = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "scripts").rglob("*.py"))
    assert sorted(rows) == scripts, "docs/layout.md has one row per script"
    for script, copy_with in rows.items():
        assert (copy_with == "`utils/`") == imports_utils(REPO / script), f"{script}: {copy_with} is not true"
    single = sorted(Path(s).name for s, copy_with in rows.items() if copy_with == "itself alone")
    assert single == sorted(MIGRATION_PAIRS), "only the migration pairs are single files"
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "utils").rglob("*.py") if p.name != "__init__.py"}
    # a package that defines something itself (utils/metrics/: load_metric) has a row of its own too
    modules |= {p.parent.relative_to(REPO).as_posix() + "/" for p in (REPO / "utils").rglob("__init__.py")
                if p.parent != REPO / "utils" and defines_something(p)}
    assert modules == set(re.findall(r"^\| `(utils/[\w/.]+)` \|", layout, flags=re.M)), "one row per utils module"
    # the rule can fail: the converted script's plain twin imports nothing of ours, the classifier does
    assert not imports_utils(REPO / "scripts/baselines/ddp_imagenet_style.py")
    assert imports_utils(REPO / "scripts/train_image_classifier.py")


def capability_rows() -> list:
    table = README.split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| capability")]


def test_every_capability_row_links_its_page_and_names_tests_that_exist():
    rows = capability_rows()
    assert len(rows) >= 50
    for row in rows:
        _, page, tests = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert re.search(r"\]\((docs/[\w.]+\.md|#[\w-]+)(#[\w-]+)?\)", page), f"no page: {row}"
        for test in re.findall(r"`(tests/[\w/.]+)`", tests):
            assert (REPO / test).is_file(), f"{test} does not exist: {row}"


# ---------------------------------------------------------------- commands

@pytest.mark.parametrize("document", DOCUMENTS)
def test_commands_name_existing_files_and_flags(document, helps):
    for command in bash_commands(text_of(document)):
        check_command(command, helps)


def test_the_documents_show_how_to_launch_and_every_readme_command_is_checked():
    assert len(launch_commands()) >= 30, "the documents show how to launch"
    assert sum(document == "README.md" for document, _ in document_commands()) >= 5


def test_quickstart_command_as_written_offline_asks_for_data_dir(tmp_path):
    # Offline (conftest), ylecun/mnist cannot be downloaded: the exact README command must say what to do.
    proc = run([*ACCELERATE, *shlex.split(QUICKSTART_RUN)[1:], "--output_dir", tmp_path / "out"], check=False)
    assert proc.returncode != 0
    assert any(line.startswith("error: ") and "--data_dir" in line for line in proc.stderr.splitlines())


# Our scripts that read MNIST, from the Hub unless --data_dir names local files (benchmark.py only for --models mnist).
MNIST_SCRIPTS = re.compile(r"^scripts/(train_mnist|minimal_mnist|baselines/\w+_mnist|benchmark|benchmark_train)\.py$")


def downloads(words: list):
    """What the command, run as written, fetches from the network (None: nothing)."""
    if "--dataset" in words:
        return "a Hub dataset"
    if "--pretrained" in words:
        return "pretrained weights"
    if "--data_dir" in words or "--data-dir" in words:  # --data-dir: the Horovod-style scripts' spelling
        return None
    models = words[words.index("--models") + 1] if "--models" in words else "mnist"
    for script in (word for word in words if MNIST_SCRIPTS.match(word)):
        if "mnist" in models or "benchmark" not in script:
            return "MNIST from the Hub"
    return None


def command_lines(text: str) -> list:
    """(command, the comment on its line) for every line of the text's ```bash blocks."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, comment = re.fullmatch(r"(.*?)(?:(?:^|\s)(#.*))?", line).groups()
            if command.strip():
                lines.append((command.strip(), comment or ""))
    return lines


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_command_runs_offline_or_says_in_its_line_what_it_needs(document):
    """A user offline (or on a compute node without network) copies a command and it fails: each one names
    local data with --data_dir, or its own line's comment says what it downloads / what to add."""
    text = text_of(document)
    commands = command_lines(text)
    assert [command for command, _ in commands] == bash_commands(text)
    needing = []
    for command, comment in commands:
        fetched = downloads(shlex.split(command))
        said = "--data_dir" if fetched == "MNIST from the Hub" else "network"
        if fetched and said not in comment:
            needing.append(command)
    assert not needing, "add --data_dir path/to/MNIST/raw, or say what it downloads:\n" + "\n".join(needing)


def test_the_download_rule_can_fail():
    # the Quickstart's command downloads, and its comment says what to add
    quickstart = ("accelerate launch scripts/train_mnist.py",
                  "# downloads MNIST once; offline add --data_dir path/to/MNIST/raw")
    assert downloads(shlex.split(quickstart[0])) == "MNIST from the Hub" and quickstart in command_lines(README)
    assert downloads(shlex.split("accelerate launch scripts/train_image_classifier.py --dataset x")) == "a Hub dataset"


# Scripts whose commands need more than small generated data: the test that runs them.
RUN_ELSEWHERE = {
    "scripts/predict.py": "needs a trained run: tests/test_predict.py runs the documents' predict.py commands",
    "scripts/converted_ddp_imagenet_style.py": "takes its data as a positional argument: "
                                               "tests/test_whole_script_conversion.py runs it",
    "scripts/converted_horovod_style.py": "tests/test_whole_script_conversion.py runs it beside its Horovod original",
    "scripts/converted_apex_amp_style.py": "takes its data as a positional argument: "
                                           "tests/test_whole_script_conversion.py runs it",
    "scripts/converted_fabric_style.py": "tests/test_whole_script_conversion.py runs it beside its Fabric original",
    "scripts/converted_deepspeed_style.py": "tests/test_whole_script_conversion.py runs it beside its DeepSpeed "
                                            "original",
}
RUN_HERE = ("scripts/train_mnist.py", "scripts/minimal_mnist.py", "scripts/train_image_classifier.py")
# Launches (launcher flags and script, as first_command_per_topology tells them apart) that another test already makes
# with the same launcher flags and script, and checks more of: not launched a second time here.
LAUNCHED_BY_ANOTHER_TEST = {
    "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_mnist.py":
        "tests/test_configs.py::test_cpu_configs_form_the_process_group_they_promise",  # [cpu_2proc.yaml]
    # its run "fsdp": the yaml's 2 processes, given as --num_processes 2, a job of tests/jobs.py
    "accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml scripts/train_mnist.py":
        "tests/test_fsdp.py::test_mnist_fsdp_on_2_processes_shards_and_trains_as_ddp",
    # its run "resized": --num_processes 3 ... --resume_from_checkpoint latest, a job of tests/jobs.py
    "accelerate launch --config_file accelerate_configs/fsdp_cpu.yaml --num_processes 3 scripts/train_mnist.py":
        "tests/test_fsdp.py::test_mnist_fsdp_resumes_on_3_processes_training_every_sample_once",
    # tests/test_deepspeed_launched.py's two launches, each a job of tests/jobs.py per stage and script: the ZeRO-2
    # config's 2 processes given as --num_processes 2, the ZeRO-3 config's with --num_processes 3
    "accelerate launch --config_file accelerate_configs/deepspeed_zero2_cpu.yaml scripts/train_mnist.py":
        "tests/test_deepspeed_launched.py::test_mnist_under_zero_trains_as_ddp_with_its_state_partitioned",
    "accelerate launch --config_file accelerate_configs/deepspeed_zero3_cpu.yaml --num_processes 3 "
    "scripts/train_mnist.py":
        "tests/test_deepspeed_launched.py::test_mnist_under_zero_trains_as_ddp_with_its_state_partitioned",
    # helpers.launcher_args(2): these flags, and --num_machines 1 --mixed_precision no --dynamo_backend no, the
    # launcher's own defaults where `accelerate config` never ran, spelled out
    "accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 scripts/train_mnist.py":
        "tests/test_step_based_runs.py::test_max_steps_ends_inside_an_epoch_with_the_schedule_and_a_final_evaluation",
    # helpers.launcher_args(2) again, with --main_process_port 0: a free port for the group instead of 29500
    "accelerate launch --multi_gpu --num_processes 2 scripts/train_image_classifier.py":
        "tests/test_image_classifier.py::test_single_folder_layout_two_processes_learn_with_identical_replicas",
}
# Wrappers that run the launch after them as it is, and restart it when it fails, which their test checks: a wrapped
# launch is the launch alone here (made here, or by the test that LAUNCHED_BY_ANOTHER_TEST names).
WRAPPERS_CHECKED_BY = {
    "scripts/restart_on_failure.sh": "tests/test_reliability.py::test_killed_rank_restarts_resumes_and_matches_the_uninterrupted_run",
}
# Environment variables that change nothing of a run but its speed: a launch with them is the launch without them here.
NO_CHANGE_OF_RESULTS = ("CUDA_LAUNCH_BLOCKING",)  # synchronous GPU kernels, for a debugger's stack trace


def launch_key(launcher_part: str) -> str:
    """The launch a command's part before its script makes (see WRAPPERS_CHECKED_BY and NO_CHANGE_OF_RESULTS)."""
    words = shlex.split(launcher_part)
    if words[0] in WRAPPERS_CHECKED_BY:
        words = words[words.index("accelerate"):]
    return shlex.join(w for w in words if w.split("=", 1)[0] not in NO_CHANGE_OF_RESULTS)


def first_command_per_topology() -> list:
    """One command per (launch options, script), over all documents (the first one found): the others differ
    only in script flags, which test_commands_name_existing_files_and_flags checks."""
    chosen = {}
    for document, command in launch_commands():
        script = next(word for word in shlex.split(command) if word.endswith(".py"))
        if script in RUN_ELSEWHERE:
            continue
        assert script in RUN_HERE, f"no rule runs {script}: add it to RUN_HERE or RUN_ELSEWHERE ({document})"
        launch = launch_key(command.split(".py", 1)[0])
        if launch + ".py" not in LAUNCHED_BY_ANOTHER_TEST:
            chosen.setdefault(launch, (document, command))
    return [pytest.param(command, id=f"{document}: {command}") for document, command in chosen.values()]


def needs_more_than_cpus(command: str):
    """Why the command cannot run on this machine's CPU processes (None: it can)."""
    launcher, _, script_part = command.partition(".py")
    config = re.search(r"--config_file\s+(\S+)", launcher)
    if config and "cpu" not in config.group(1):
        return (f"{config.group(1)} needs GPUs or several machines (CI has neither); "
                "tests/test_configs.py and tests/test_topologies.py check it")
    if "--gpu_ids" in launcher:
        return "--gpu_ids names GPUs (CI has none); tests/test_topologies.py checks a GPU subset"
    processes = re.search(r"--num_processes\s+(\d+)", launcher)
    several = "--multi_gpu" in launcher or (processes and int(processes.group(1)) > 1)
    if several and "--cpu" not in script_part.split():
        return ("several processes without the script's --cpu take one GPU each (CI has none); "
                "tests/test_errors.py checks the line such a launch gives on CPUs")
    return None


@pytest.mark.parametrize("command", first_command_per_topology())
def test_launch_commands_run_on_cpu(command, tmp_path):
    reason = needs_more_than_cpus(command)
    if reason:
        pytest.skip(reason)
    out = tmp_path / "out"
    # The command as written, plus small generated data, on a machine where `accelerate config` never ran.
    if "train_image_classifier.py" in command:
        from image_data import make_flat_image_folder

        data = make_flat_image_folder(tmp_path / "images", per_class=10)
        extra, expected_eval = ["--image_size", "32", "--num_workers", "0", "--batch_size", "8"], 8
    else:
        data, extra, expected_eval = make_synthetic_mnist(tmp_path / "data", num_train=128, num_test=40), [], 40
    run([*runnable(command), "--data_dir", data, "--epochs", "1", "--output_dir", out, *extra])
    assert results(out)["eval_samples"] == expected_eval


def test_the_launches_another_test_makes_are_documented_and_that_test_exists():
    documented = {launch_key(command.split(".py", 1)[0]) + ".py" for _, command in launch_commands()}
    for launch, test in LAUNCHED_BY_ANOTHER_TEST.items():
        assert launch in documented, f"no document launches {launch}: drop it from LAUNCHED_BY_ANOTHER_TEST"
        path, name = test.split("::")
        assert f"\ndef {name}(" in (REPO / path).read_text(), f"{test} does not exist: name the test that runs {launch}"
    for wrapper, test in WRAPPERS_CHECKED_BY.items():
        assert any(command.startswith(wrapper) for _, command in launch_commands()), f"no document wraps with {wrapper}"
        path, name = test.split("::")
        assert f"\ndef {name}(" in (REPO / path).read_text(), f"{test} does not exist: name the test of {wrapper}"
        assert wrapper.split("/")[-1] in (REPO / path).read_text(), f"{test} does not run {wrapper}"


def test_a_checked_wrapper_or_a_variable_that_changes_no_result_makes_no_other_launch():
    assert launch_key("scripts/restart_on_failure.sh 3 accelerate launch --num_processes 2 scripts/t") == \
        "accelerate launch --num_processes 2 scripts/t"
    assert launch_key("CUDA_LAUNCH_BLOCKING=1 accelerate launch scripts/t") == "accelerate launch scripts/t"
    # a variable the launcher reads stays part of the launch
    assert launch_key("PET_RDZV_ENDPOINT=localhost:0 accelerate launch scripts/t") == \
        "PET_RDZV_ENDPOINT=localhost:0 accelerate launch scripts/t"


def test_commands_that_need_gpus_are_told_apart():
    assert needs_more_than_cpus("accelerate launch --multi_gpu --num_processes 2 scripts/train_mnist.py")
    assert needs_more_than_cpus("accelerate launch --config_file accelerate_configs/fsdp.yaml scripts/x.py --cpu")
    assert needs_more_than_cpus("accelerate launch --gpu_ids 2,3 --num_processes 2 scripts/train_mnist.py")
    assert not needs_more_than_cpus("accelerate launch --multi_gpu --num_processes 2 scripts/train_mnist.py --cpu")
    assert not needs_more_than_cpus("accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/t.py")


# ---------------------------------------------------------------- links and paths

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(heading) for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def relative_links(text: str) -> list:
    """The targets of the text's Markdown links and images that are not URLs (code blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_lead_to_files_and_headings_that_exist(document):
    page = REPO / document
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        assert destination.exists(), f"{document}: the link ({target}) leads nowhere"
        assert destination.is_relative_to(REPO), f"{document}: the link ({target}) leaves the repository"
        if anchor and destination.suffix == ".md":
            assert anchor in anchors(destination), f"{document}: no heading for #{anchor} in {destination.name}"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_repository_paths_named_in_the_text_exist(document):
    text = text_of(document)
    for path in set(re.findall(r"`((?:scripts|accelerate_configs|utils|tests|docs)/[\w./-]+)`", text)):
        assert (REPO / path).exists(), f"{document} names {path}, which does not exist"


def test_the_link_rules_can_fail():
    assert relative_links("[a](docs/x.md#y) [b](https://h.org) ![c](p.png) `[d](e)`") == ["docs/x.md#y", "p.png", "e"]
    assert slug("GPUs: what has run and what has not") == "gpus-what-has-run-and-what-has-not"
    assert slug("run.json") == "runjson" and slug('Several CPU processes: do not answer "multi-CPU"') == \
        "several-cpu-processes-do-not-answer-multi-cpu"


# ---------------------------------------------------------------- the flag tables

def table_flags(text: str) -> set:
    """The flags in the first column of the text's tables."""
    return {flag for cell in re.findall(r"^\| (.+?) \|", text, flags=re.M)
            for flag in re.findall(r"`(--[\w-]+)", cell)}


def test_every_flag_in_the_flag_tables_exists_in_the_scripts_that_take_it(helps):
    shared = table_flags(text_of("docs/flags.md"))
    classifier = table_flags(text_of("docs/image_classification.md").split("## Flags", 1)[1].split("\n## ", 1)[0])
    assert len(shared) >= 25 and len(classifier) >= 15
    for script, flags in (("train_mnist.py", shared), ("train_image_classifier.py", shared | classifier)):
        help_text = helps(sys.executable, str(REPO / "scripts" / script))
        missing = [flag for flag in sorted(flags) if not re.search(rf"{re.escape(flag)}\b", help_text)]
        assert not missing, f"{script} has no {missing}"
