"""The answers to `accelerate config` in docs/launching.md write our YAMLs.

The real questionnaire runs in a pseudo-terminal and gets the guide's answers, question by
question; the file it writes is compared with ours in accelerate_configs/. A question the
guide does not list (or one it lists that is not asked) fails the test with what was on
the screen, so the table in the guide changes when accelerate's questionnaire does.
"""

import re
import sys

import pexpect
import pytest
import yaml
from helpers import REPO, launcher_args, run

GUIDE = (REPO / "docs" / "launching.md").read_text()  # the questionnaire's answers
MENU_MARK = "➔ "  # in the guide: pick this option in a menu; otherwise type the answer
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MENU_READS_KEYS = "\x1b[?25l"  # the menu hides the cursor, then reads keys
MENU_DONE = "\x1b[?25h"  # ... and shows it again once an option is chosen

# What ours say that the questionnaire does not ask about: on one machine, a free port each time.
ONLY_OURS = {"main_process_port"}
# Where ours deliberately differ (docs/launching.md and the YAML's comment say why): the multi-GPU answer
# never asks about the CPU; ours say use_cpu, which the multi-GPU launcher does not forward (the script's --cpu counts).
DIFFERENT = {("cpu_2proc.yaml", "use_cpu"): (False, True)}
# What a user who answers "multi-CPU" for two CPU processes gives: the answer the guide warns against.
MULTI_CPU_ANSWERS = [
    ("In which compute environment are you running?", "➔ This machine"),
    ("Which type of machine are you using?", "➔ multi-CPU"),
    ("How many different machines will you use", "1"),
    ("Should distributed operations be checked while running for errors?", "no"),
    ("Do you want accelerate to launch mpirun?", "no"),
    ("Do you wish to optimize your script with torch dynamo?", "no"),
    ("should be used for distributed training?", "2"),
    ("Do you wish to use mixed precision?", "➔ no"),
]


def questionnaire_table() -> dict:
    """{our yaml: [(question, answer), ...]} from the guide's table, in the order asked."""
    section = GUIDE.split("## The accelerate config questionnaire", 1)[1]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    header, rows = rows[0], rows[2:]
    configs = [re.search(r"`(\w+\.yaml)`", cell).group(1) for cell in header[1:]]
    return {config: [(row[0], row[1 + i]) for row in rows if row[1 + i] != "—"] for i, config in enumerate(configs)}


TABLE = questionnaire_table()


def press(child, key: str, until: str):
    """Send one key to a menu and wait for its effect. The menu switches the terminal to raw
    mode for every key with TCSAFLUSH, which discards a key that arrived too early: wait for
    raw mode (no echo), and send again if the key was lost."""
    for _ in range(10):
        child.waitnoecho(timeout=60)
        child.send(key)
        try:
            child.expect_exact(until, timeout=5)
            return
        except pexpect.TIMEOUT:
            continue
    raise AssertionError(f"the menu did not take {key!r}: {ANSI.sub('', child.before)[-500:]}")


def choose(child, option: str):
    child.expect_exact(MENU_READS_KEYS)
    lines = [ANSI.sub("", line).strip() for line in child.before.splitlines()]
    options = [line for line in lines[next(i for i, l in enumerate(lines) if l.startswith("Please select")) + 1:] if line]
    names = [o.removeprefix(MENU_MARK.strip()).strip() for o in options]
    assert option in names, f"no option {option!r} in {names}"
    index, current = names.index(option), next(i for i, o in enumerate(options) if o.startswith(MENU_MARK.strip()))
    assert index < 10, "number keys reach the first 10 options"
    if index != current:
        press(child, str(index), f"\x1b[32m{option}")  # the menu redraws the chosen option in green
    press(child, "\r", MENU_DONE)


def answer_questionnaire(answers, config_file, hf_home):
    child = pexpect.spawn(
        sys.executable, ["-m", "accelerate.commands.accelerate_cli", "config", "--config_file", str(config_file)],
        env={"HF_HOME": str(hf_home), "PATH": "/usr/bin:/bin", "TERM": "xterm", "HF_HUB_OFFLINE": "1"},
        encoding="utf-8", timeout=60, dimensions=(50, 300),
    )
    asked = []
    try:
        for question, answer in answers:
            child.expect_exact(question)
            asked.append(question)
            if answer.startswith(MENU_MARK):
                choose(child, answer.removeprefix(MENU_MARK))
            else:  # input(): a typed line, which the terminal keeps until it is read
                child.sendline(answer)
        child.expect(pexpect.EOF)
    except (pexpect.TIMEOUT, pexpect.EOF):
        screen = ANSI.sub("", child.before if isinstance(child.before, str) else "")[-1500:]
        raise AssertionError(f"after {asked[-1:]} the questionnaire did not go on as the guide says; "
                             f"it showed:\n{screen}") from None
    child.close()
    assert child.exitstatus == 0, ANSI.sub("", child.before or "")
    return yaml.safe_load(config_file.read_text())


@pytest.fixture(scope="module")
def questionnaire(tmp_path_factory):
    """answer(name, answers): the YAML the questionnaire wrote for `answers`, each name answered once per module (every
    `accelerate config` is a process importing accelerate and torch): cpu_2proc.yaml's answers serve both the
    comparison with ours and the launch that counts its processes."""
    root, written = tmp_path_factory.mktemp("questionnaire"), {}

    def answer(name, answers):
        if name not in written:
            path = root / f"{name.removesuffix('.yaml')}.yaml"
            answer_questionnaire(answers, path, root / f"{name}-hf_home")
            written[name] = path
        return written[name]

    return answer


def test_table_covers_the_main_topologies():
    assert {"cpu.yaml", "cpu_2proc.yaml", "single_gpu.yaml", "multi_gpu.yaml", "multi_node.yaml"} <= set(TABLE)


@pytest.mark.parametrize("config", sorted(TABLE))
def test_questionnaire_answers_write_our_yaml(config, questionnaire):
    written = yaml.safe_load(questionnaire(config, TABLE[config]).read_text())
    ours = yaml.safe_load((REPO / "accelerate_configs" / config).read_text())
    assert set(ours) - set(written) <= ONLY_OURS, f"{config}: the questionnaire never writes {set(ours) - set(written)}"
    for key, value in ours.items():
        if key in ONLY_OURS and key not in written:
            continue
        if (config, key) in DIFFERENT:
            assert (written[key], value) == DIFFERENT[config, key], f"{config}: {key}"
            continue
        assert written[key] == value, f"{config}: {key} is {written[key]!r} from the questionnaire, {value!r} in ours"


def test_two_cpu_processes_come_from_the_guides_answers_not_from_multi_cpu(questionnaire, tmp_path):
    """The guide's answers for cpu_2proc.yaml (multi-GPU) start two processes in one group when the script asks for the
    CPU (--cpu: Accelerator(cpu=True)), on a machine without GPUs too; the multi-CPU answer starts one."""
    probe = tmp_path / "probe.py"
    probe.write_text("from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n"
                     # one write per process: the launcher's unbuffered output lets two prints' pieces interleave
                     "import sys\nsys.stdout.write(f'processes: {accelerator.num_processes}\\n')\n"
                     "accelerator.end_training()\n")
    counts = {}
    for name, answers in (("cpu_2proc.yaml", TABLE["cpu_2proc.yaml"]), ("multi_cpu", MULTI_CPU_ANSWERS)):
        proc = run([*launcher_args(config_file=questionnaire(name, answers)), probe], cwd=tmp_path, timeout=240)
        counts[name] = sorted(line for line in proc.stdout.splitlines() if line.startswith("processes:"))
    assert counts == {"cpu_2proc.yaml": ["processes: 2", "processes: 2"], "multi_cpu": ["processes: 1"]}
