"""The scripts' marks mean what README.md's "Marks in the scripts" says, and nothing else.

- `# [accelerate]` belongs to the migration pairs (minimal_mnist.py and the converted_*.py scripts), where it marks
  the lines changed from the plain-PyTorch baseline (tests/test_minimal.py and tests/test_whole_script_conversion.py
  check that every changed hunk carries one). No other script, and nothing in utils/, carries it.
- `# [collective]`, in the complete scripts: the statement makes a call that every process must make at the same
  point: an Accelerate collective (ACCELERATE_COLLECTIVES), one of our helpers that reaches one
  (utils.COLLECTIVE_HELPERS) or the script's own function that does (its evaluate). Every such statement carries it
  on one of its lines (a compound statement: on its header) or in the comment lines right above it; no other
  statement does. `self.accelerator` counts as `accelerator`.

utils.COLLECTIVE_HELPERS itself is checked against the code: a helper is collective when it calls an Accelerate
collective (gather, barrier, trigger, save/load state...) or another collective helper.
"""

import ast
import io
import re
import tokenize

import pytest
from helpers import REPO, TRAIN_MNIST

from utils import COLLECTIVE_HELPERS

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
# the scripts users copy whole, whose processes must meet at the same calls
COMPLETE_SCRIPTS = [TRAIN_MNIST, CLASSIFIER, REPO / "scripts" / "predict.py"]
MIGRATION_PAIRS_AFTER = [REPO / "scripts" / "minimal_mnist.py", *sorted((REPO / "scripts").glob("converted_*.py"))]
# Accelerator methods and accelerate functions that every process must reach together
ACCELERATE_COLLECTIVES = {"gather", "gather_for_metrics", "reduce", "pad_across_processes", "wait_for_everyone",
                          "check_trigger", "save_state", "load_state", "save_model", "get_state_dict",
                          "main_process_first", "gather_object", "broadcast_object_list", "broadcast"}
COLLECTIVE_MARK = re.compile(r"#.*\[collective\]")
ACCELERATE_MARK = re.compile(r"#.*\[accelerate\]")


def comments_by_line(source: str) -> dict:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {token.start[0]: token.string for token in tokens if token.type == tokenize.COMMENT}


def header_nodes(statement):
    """The expressions a compound statement's header evaluates; None for a simple statement."""
    if isinstance(statement, (ast.If, ast.While)):
        return [statement.test]
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        return [statement.target, statement.iter]
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return [part for item in statement.items for part in (item.context_expr, item.optional_vars) if part]
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try)):
        return []
    return None


def own_lines(statement) -> range:
    """A simple statement's lines; a compound statement's header only (its body is checked statement by statement)."""
    header = header_nodes(statement)
    if header is None:
        return range(statement.lineno, statement.end_lineno + 1)
    return range(statement.lineno, max([statement.lineno] + [node.end_lineno for node in header]) + 1)


def is_marked(statement, comments: dict, lines: list) -> bool:
    """`# [collective]` on the statement's own lines or in the comment-only lines right above it."""
    if any(n in comments and COLLECTIVE_MARK.search(comments[n]) for n in own_lines(statement)):
        return True
    above = statement.lineno - 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
        if COLLECTIVE_MARK.search(lines[above - 1]):
            return True
        above -= 1
    return False


def is_accelerator(node) -> bool:
    """`accelerator`, or an attribute of that name (`self.accelerator`)."""
    return isinstance(node, ast.Name) and node.id == "accelerator" or \
        isinstance(node, ast.Attribute) and node.attr == "accelerator"


def is_collective_call(node, collective_functions: set) -> bool:
    """`accelerator.<an Accelerate collective>(...)`, or a call of a collective function by its name."""
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    return isinstance(function, ast.Attribute) and function.attr in ACCELERATE_COLLECTIVES and \
        is_accelerator(function.value) or isinstance(function, ast.Name) and function.id in collective_functions


def problems(source: str) -> list:
    """Every statement whose `# [collective]` mark does not match what it calls, as 'line N: ...'."""
    tree, comments, lines = ast.parse(source), comments_by_line(source), source.splitlines()
    # accelerate's own collective functions imported by name (`from accelerate.utils import broadcast`)
    collective = set(COLLECTIVE_HELPERS) | {
        alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] == "accelerate" for alias in node.names
        if alias.name in ACCELERATE_COLLECTIVES}
    # the script's own functions that reach a collective (its evaluate: gather_for_metrics) count as helpers
    collective |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name != "main"
                   and any(is_collective_call(n, collective) for n in ast.walk(node))}
    found = []
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.stmt):
            continue
        header = header_nodes(statement)
        nodes = [n for top in (header if header is not None else [statement]) for n in ast.walk(top)]
        calls_collective = any(is_collective_call(n, collective) for n in nodes)
        marked = is_marked(statement, comments, lines)
        where = f"line {statement.lineno}: {lines[statement.lineno - 1].strip()[:60]}"
        if calls_collective and not marked:
            found.append(f"{where}: calls a collective, no # [collective]")
        if marked and not calls_collective:
            found.append(f"{where}: # [collective] on a line that calls no collective")
    return found


def accelerate_tags(source: str) -> list:
    """The lines whose comment carries `# [accelerate]`."""
    return [n for n, comment in comments_by_line(source).items() if ACCELERATE_MARK.search(comment)]


@pytest.mark.parametrize("script", COMPLETE_SCRIPTS, ids=lambda path: path.name)
def test_every_collective_call_is_marked_and_nothing_else(script):
    assert problems(script.read_text()) == []


def test_the_accelerate_tag_is_only_in_the_migration_pairs():
    for after in MIGRATION_PAIRS_AFTER:
        assert len(accelerate_tags(after.read_text())) >= 10, f"{after.name}: the migration's lines are marked"
    others = sorted(set((REPO / "scripts").rglob("*.py")) | set((REPO / "utils").rglob("*.py")))
    others = [path for path in others if path not in MIGRATION_PAIRS_AFTER]
    assert len(others) > 50
    tagged = {path.relative_to(REPO).as_posix(): lines for path in others
              if (lines := accelerate_tags(path.read_text()))}
    assert tagged == {}, "# [accelerate] marks a migration pair's changed lines (README.md, 'Marks in the scripts')"


def test_the_checks_fail_on_a_missing_or_a_wrong_marker():
    source = TRAIN_MNIST.read_text()
    # a collective of Accelerate's, unmarked: a reader may put it under `if accelerator.is_main_process:` and hang
    gather = "        metric.add_batch("
    unmarked = source.replace(gather, "        labels = accelerator.gather(labels)\n" + gather, 1)
    assert any("accelerator.gather(labels)" in p and "no # [collective]" in p for p in problems(unmarked))
    save_model = next(line for line in source.splitlines() if "accelerator.save_model(" in line)
    above = source.splitlines()[source.splitlines().index(save_model) - 1]
    assert "[collective]" in above
    unmarked = source.replace(above, above.replace("[collective]", ""))
    assert any("accelerator.save_model" in p and "no # [collective]" in p for p in problems(unmarked))
    # one of our helpers, its mark dropped
    unmarked = source.replace("# [collective] --early_stopping_patience", "# --early_stopping_patience")
    assert any("epochs_to_train" in p and "no # [collective]" in p for p in problems(unmarked))
    assert any("model.train()" in p for p in problems(source.replace("model.train()", "model.train()  # [collective]")))
    assert any("self.accelerator.wait_for_everyone" in p
               for p in problems("def close(self):\n    self.accelerator.wait_for_everyone()\n"))
    assert any("main_process_first" in p for p in problems("with accelerator.main_process_first():\n    pass\n"))
    assert any("broadcast" in p for p in problems("from accelerate.utils import broadcast\nbroadcast(x)\n"))
    # the tag, back on a complete script's line
    tagged = source.replace("accelerator.backward(loss)", "accelerator.backward(loss)  # [accelerate]")
    assert accelerate_tags(source) == [] and len(accelerate_tags(tagged)) == 1


def own_nodes(function):
    """The nodes of `function`'s body, not those of the functions defined inside it: a hook it registers
    is called later by torch, and is a function of its own here."""
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def collective_functions() -> set:
    """utils' functions that reach an Accelerate collective, directly or through another of them."""
    functions = {}
    for path in sorted((REPO / "utils").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                called = {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
                          for n in own_nodes(node) if isinstance(n, ast.Call)
                          and isinstance(n.func, (ast.Attribute, ast.Name))}
                functions.setdefault(node.name, set()).update(called)
    collective = {name for name, called in functions.items() if called & ACCELERATE_COLLECTIVES}
    while True:
        more = {name for name, called in functions.items() if called & collective} - collective
        if not more:
            return collective
        collective |= more


def test_utils_lists_its_collective_helpers_truthfully():
    assert collective_functions() == set(COLLECTIVE_HELPERS)
