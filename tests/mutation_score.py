"""Mutation testing of the decision code (docs/testing.md, "Mutation testing"): mutmut changes one thing at a time in
a module (a comparison, a constant, a string) and runs the in-process tests that reach it; a mutant they all pass is a
bug they would not catch. Run by hand, not by CI:

    python tests/mutation_score.py utils/run/resume.py     # one module (or several)
    python tests/mutation_score.py --changed               # those a change touched (git diff main, uncommitted too)
    python tests/mutation_score.py --all                   # every module of [tool.mutmut] only_mutate

It prints one table row per module (| module | mutants | killed | survived | score |) and each survivor's name:
`python -m mutmut show NAME` shows its diff. Which modules and tests take part: [tool.mutmut] in pyproject.toml.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILLED = ("killed", "timeout", "caught by type check")  # a mutant that hangs is caught too, by mutmut's time limit


def covered_modules() -> list:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]


def changed_modules(base: str) -> list:
    """The covered modules this branch changed since it left `base` (their merge base), committed or not."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    changed = git("diff", "--name-only", git("merge-base", base, "HEAD").strip(), "--").split()
    return [module for module in covered_modules() if module in changed]


def mutant_prefix(module: str) -> str:
    """utils/run/resume.py -> utils.run.resume. (mutmut names each mutant MODULE.FUNCTION__mutmut_N)"""
    return module.removesuffix(".py").replace("/", ".") + "."


def run_mutmut(modules: list, max_children: int) -> dict:
    """{mutant name: status} of `modules`' mutants, after a fresh mutmut run (results of earlier runs were for other
    code or other tests)."""
    shutil.rmtree(REPO / "mutants", ignore_errors=True)
    globs = [mutant_prefix(module) + "*" for module in modules]
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *globs], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    results = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+?)\s*$", results, re.MULTILINE))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("modules", nargs="*", help="paths such as utils/run/resume.py")
    parser.add_argument("--changed", nargs="?", const="main", metavar="BASE",
                        help="the covered modules changed since BASE (default main)")
    parser.add_argument("--all", action="store_true", help="every covered module")
    parser.add_argument("--max_children", type=int, default=os.cpu_count(), help="mutants tested at once")
    args = parser.parse_args(argv)
    if (bool(args.modules) + bool(args.changed) + args.all) != 1:
        parser.error("name the modules, or pass --changed or --all")
    uncovered = sorted(set(args.modules) - set(covered_modules()))
    if uncovered:
        parser.error(f"not among [tool.mutmut] only_mutate in pyproject.toml: {', '.join(uncovered)}")
    return args


def main() -> int:
    args = parse_args()
    modules = covered_modules() if args.all else changed_modules(args.changed) if args.changed else args.modules
    if not modules:
        print("No covered module changed.")
        return 0
    statuses = run_mutmut(modules, args.max_children)
    print("| module | mutants | killed | survived | score |\n| --- | --- | --- | --- | --- |")
    survivors = []
    for module in modules:
        mine = {name: status for name, status in statuses.items() if name.startswith(mutant_prefix(module))}
        counts = Counter(mine.values())
        killed = sum(counts[status] for status in KILLED)
        survivors += [f"{name}: {status}" for name, status in sorted(mine.items()) if status not in KILLED]
        print(f"| {module} | {len(mine)} | {killed} | {len(mine) - killed} | {killed / max(1, len(mine)):.0%} |")
    print("\n".join(["", "Not killed (python -m mutmut show NAME):", *survivors] if survivors else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
