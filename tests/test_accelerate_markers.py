"""The two training scripts (and benchmark_train.py) mark what is Accelerate and what is ours, truthfully.

- `# [accelerate]`: the statement uses Accelerate (`accelerator.…`, `Accelerator(`, a name imported from
  accelerate, an accelerate import). Every such statement carries it on one of its lines (a compound statement:
  on its header) or in the comment lines right above it; no other statement carries it, except a call on an object
  `accelerator.prepare` returned and the torch.distributed import. `self.accelerator` counts as `accelerator`.
- `# [collective]`: the statement calls one of our helpers that every process must call at the same point
  (utils.COLLECTIVE_HELPERS). Every such call carries it; no other statement does.

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
# the two training scripts, and the benchmark's four methods side by side (its Accelerate class's calls marked)
SCRIPTS = [TRAIN_MNIST, CLASSIFIER, REPO / "scripts" / "benchmark_train.py"]
# Accelerator methods and accelerate functions that every process must reach together
ACCELERATE_COLLECTIVES = {"gather", "gather_for_metrics", "reduce", "pad_across_processes", "wait_for_everyone",
                          "check_trigger", "save_state", "load_state", "save_model", "get_state_dict",
                          "main_process_first", "gather_object", "broadcast_object_list", "broadcast"}
MARK = re.compile(r"#.*\[(accelerate|collective)\]")


def comments_by_line(source: str) -> dict:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {token.start[0]: token.string for token in tokens if token.type == tokenize.COMMENT}


def own_lines(statement) -> range:
    """A simple statement's lines; a compound statement's header only (its body is checked statement by statement)."""
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef, ast.Try)):
        return range(statement.lineno, statement.lineno + 1)
    header = header_nodes(statement)
    if header is not None:
        return range(statement.lineno, max(node.end_lineno for node in header) + 1)
    return range(statement.lineno, statement.end_lineno + 1)


def header_nodes(statement):
    """The expressions a compound statement's header evaluates; None for a simple statement."""
    if isinstance(statement, (ast.If, ast.While)):
        return [statement.test]
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        return [statement.target, statement.iter]
    if isinstance(statement, (ast.With, ast.AsyncWith)):
        return [part for item in statement.items for part in (item.context_expr, item.optional_vars) if part]
    if isinstance(statement, (ast.FunctionDef, ast.ClassDef, ast.Try)):
        return []
    return None


def marks(statement, comments: dict, lines: list) -> set:
    """The markers on a statement's own lines and in the comment-only lines right above it."""
    found = {m.group(1) for n in own_lines(statement) if n in comments for m in [MARK.search(comments[n])] if m}
    above = statement.lineno - 1
    while above >= 1 and lines[above - 1].strip().startswith("#"):
        match = MARK.search(lines[above - 1])
        if match:
            found.add(match.group(1))
        above -= 1
    return found


def is_accelerator(node) -> bool:
    """`accelerator`, or an attribute of that name (`self.accelerator`)."""
    return isinstance(node, ast.Name) and node.id == "accelerator" or \
        isinstance(node, ast.Attribute) and node.attr == "accelerator"


def problems(source: str) -> list:
    """Every statement whose markers do not match what it calls, as 'line N: ...'."""
    tree, comments, lines = ast.parse(source), comments_by_line(source), source.splitlines()
    from_accelerate, prepared = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelerate":
            from_accelerate |= {alias.asname or alias.name for alias in node.names}
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "prepare":
            targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
            prepared |= {target.id for target in targets if isinstance(target, ast.Name)}
    # the script's own functions that reach a collective (its evaluate: gather_for_metrics) count as helpers
    collective = set(COLLECTIVE_HELPERS) | {
        node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name != "main" and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ACCELERATE_COLLECTIVES
            for n in ast.walk(node))}
    found = []
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.stmt):
            continue
        header = header_nodes(statement)
        nodes = [n for top in (header if header is not None else [statement]) for n in ast.walk(top)]
        uses_accelerate = isinstance(statement, ast.ImportFrom) and statement.module.split(".")[0] == "accelerate" or \
            any(isinstance(n, ast.Attribute) and is_accelerator(n.value)
                or isinstance(n, ast.Name) and n.id in from_accelerate for n in nodes)
        calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr: n.func for n in nodes
                 if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
        # a call on what accelerator.prepare returned (a DataLoaderShard's set_epoch reaches Accelerate's sampler)
        on_prepared = any(isinstance(f, ast.Attribute) and (isinstance(f.value, ast.Name) and f.value.id in prepared
                                                            or f.attr == "set_epoch") for f in calls.values())
        distributed_import = isinstance(statement, ast.Import) and \
            any(alias.name.startswith("torch.distributed") for alias in statement.names)
        calls_collective_helper = any(isinstance(f, ast.Name) and name in collective for name, f in calls.items())
        marked = marks(statement, comments, lines)
        where = f"line {statement.lineno}: {lines[statement.lineno - 1].strip()[:60]}"
        if uses_accelerate and "accelerate" not in marked:
            found.append(f"{where}: uses Accelerate, no # [accelerate]")
        if "accelerate" in marked and not (uses_accelerate or on_prepared or distributed_import):
            found.append(f"{where}: # [accelerate] on a line that does not use Accelerate")
        if calls_collective_helper and "collective" not in marked:
            found.append(f"{where}: calls a collective helper, no # [collective]")
        if "collective" in marked and not calls_collective_helper:
            found.append(f"{where}: # [collective] on a line that calls no collective helper")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_accelerate_line_and_collective_call_is_marked(script):
    assert problems(script.read_text()) == []


def test_the_check_fails_on_a_missing_or_a_wrong_marker():
    source = TRAIN_MNIST.read_text()
    unmarked = source.replace("accelerator.backward(loss)  # [accelerate]", "accelerator.backward(loss)  #")
    assert any("accelerator.backward" in p and "no # [accelerate]" in p for p in problems(unmarked))
    helper_as_accelerate = source.replace("# [collective] --early_stopping_patience", "# [accelerate]")
    assert any("epochs_to_train" in p and "does not use Accelerate" in p for p in problems(helper_as_accelerate))
    assert any("epochs_to_train" in p and "no # [collective]" in p for p in problems(helper_as_accelerate))
    assert any("model.train()" in p for p in problems(source.replace("model.train()", "model.train()  # [collective]")))
    assert any("self.accelerator.backward" in p for p in problems("def f(self):\n    self.accelerator.backward(x)\n"))


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
