"""`tests/gpu/check.py --dry-run`: on the CPU, whether the GPU check would find on the device machine all it needs.

The device machine reaches nothing: what the check imports must be in its image (tests/gpu/device_packages.txt) or
among the carried wheels (tests/gpu/wheels.txt, downloaded into .gpu_check/wheels by tests/gpu/prepare.sh), and
what it reads must be in the checkout or in .gpu_check/. Each function returns a list of problems, one line each.
"""

import ast
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# Import names that differ from their distribution's name, among the packages the project imports.
DISTRIBUTION_OF = {"PIL": "pillow", "yaml": "pyyaml", "cv2": "opencv-python-headless", "sklearn": "scikit-learn"}
# Distributions that only tests no GPU check runs (not marked gpu) import, inside the test or the script they launch
# (requirements-trackers.txt's; the Fabric "before", scripts/baselines/fabric_mnist.py), or only a run by hand (mutmut).
NOT_NEEDED_THERE = {"mlflow", "wandb", "lightning-fabric", "mutmut"}
# The device machine's Python, for the wheels' tags and their requirements' markers.
DEVICE_PYTHON = "3.12"
DEVICE_MARKERS = {**default_environment(), "python_version": DEVICE_PYTHON, "python_full_version": "3.12.3",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def read_pins(path: Path) -> dict:
    """{canonical name: version or None} of a file of `name==version` or `name` lines (# comments allowed)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip() or None
    return pins


def third_party_imports(files, local_names, repo: Path) -> dict:
    """{top-level module: [files importing it, relative to `repo`]}, anywhere in the files (inside functions too),
    minus the standard library and the project's own modules (`local_names`)."""
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local_names:
                    shown = Path(path).relative_to(repo) if Path(path).is_relative_to(repo) else path
                    found.setdefault(top, []).append(str(shown))
    return found


def uncovered_imports(imports: dict, device: dict, wheels: dict) -> list:
    problems = []
    for module, files in sorted(imports.items()):
        name = canonicalize_name(DISTRIBUTION_OF.get(module, module))
        if name not in device and name not in wheels and name not in NOT_NEEDED_THERE:
            problems.append(f"{sorted(set(files))[0]} imports {module}: the device image lacks it and "
                            f"tests/gpu/wheels.txt does not carry it (add {name}==VERSION there)")
    return problems


def requirement_problems(requirements_file: Path, device: dict, wheels: dict) -> list:
    """The repo's requirements must admit the versions the device machine has and the carried wheels: a range that
    excluded torch 2.11 would make a user's `pip install -r` there replace the image's CUDA build."""
    problems = []
    for line in requirements_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        version = wheels.get(name) or device.get(name)
        if version is None and name not in device and name not in wheels and name not in NOT_NEEDED_THERE:
            problems.append(f"{requirements_file.name}: {req} is neither on the device nor in tests/gpu/wheels.txt")
        elif version is not None and not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{requirements_file.name}: {req} excludes {name} {version}, the version on the device")
    return problems


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        return archive.read(name).decode()


def wheel_problems(wheel_dir: Path, device: dict, wheels: dict) -> list:
    """Exactly the listed wheels, one file each, installable on the device's Python 3.12 x86-64, and every
    requirement of each (for that Python, without extras) on the device or among the wheels."""
    if not wheel_dir.is_dir():
        return [f"{wheel_dir} is missing: run tests/gpu/prepare.sh"]
    problems, present = [], {}
    for path in sorted(wheel_dir.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(path.name)
        present.setdefault(name, []).append(str(version))
        if not any(t.interpreter in ("py3", "py312", "cp312") and (t.platform == "any" or (
                t.platform.startswith("manylinux") and t.platform.endswith("x86_64"))) for t in tags):
            problems.append(f"{path.name}: not a wheel for CPython {DEVICE_PYTHON} on x86-64 Linux")
        for line in wheel_metadata(path).splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate({**DEVICE_MARKERS, "extra": ""}):
                continue  # another Python's or an extra's
            needed = canonicalize_name(req.name)
            version = wheels.get(needed) or device.get(needed)
            if needed not in wheels and needed not in device:
                problems.append(f"{path.name} needs {req}: neither on the device nor in tests/gpu/wheels.txt")
            elif version is not None and not req.specifier.contains(Version(version), prereleases=True):
                problems.append(f"{path.name} needs {req}, but {needed} is {version} there")
    for name, version in wheels.items():
        if present.get(name) != [version]:
            problems.append(f"tests/gpu/wheels.txt lists {name}=={version}; {wheel_dir} holds "
                            f"{present.get(name) or 'none'} (run tests/gpu/prepare.sh)")
    problems += [f"{wheel_dir} holds {name} {versions}, which tests/gpu/wheels.txt does not list"
                 for name, versions in present.items() if name not in wheels]
    return problems


def data_problems(data_dir: Path, data_sets) -> list:
    """Each data set the check reads is carried whole: every file of its SHA256SUMS, with those bytes."""
    problems = []
    for name in data_sets:
        sums = data_dir / name / "SHA256SUMS"
        if not sums.is_file():
            problems.append(f"{sums} is missing: run tests/gpu/prepare.sh")
            continue
        for line in sums.read_text().splitlines():
            digest, relative = line.split(maxsplit=1)
            relative = relative.lstrip("*")  # relative to the data set's folder, or to the folder above it
            path = data_dir / relative if relative.startswith(f"{name}/") else data_dir / name / relative
            if not path.is_file():
                problems.append(f"{path} is missing (listed in {sums.name})")
            elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                problems.append(f"{path} differs from its SHA256SUMS line")
    return problems


def travelling_bytes(repo: Path, carried: Path) -> int:
    """What the device tool sends: tracked and untracked-not-ignored files, plus the carried folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [repo / name.decode() for name in listed if name]
    files += [p for p in carried.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if p.is_file())


def collection_problems(repo: Path, python: str) -> tuple:
    """`pytest -m gpu tests --collect-only`: the selection collects (every test module imports) and is not empty."""
    proc = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests"], cwd=repo, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode != 0 or not ids:
        return [f"pytest -m gpu tests does not collect (exit {proc.returncode}): {proc.stdout[-1500:]}"], ids
    return [], ids


def flag_problems(repo: Path, launches) -> list:
    """Each launched script accepts the check's flags (its own parse_args, without running it)."""
    import importlib.util

    problems = []
    for script, argv in launches:
        spec = importlib.util.spec_from_file_location(f"dry_run_{Path(script).stem}", repo / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        try:
            module.parse_args([str(a) for a in argv])
        except SystemExit:
            problems.append(f"{script} refuses the check's flags {' '.join(map(str, argv))} (its error is above)")
    return problems


def source_files(repo: Path) -> list:
    return sorted(p for folder in ("scripts", "utils", "tests") for p in (repo / folder).rglob("*.py"))


def local_module_names(repo: Path) -> set:
    """Modules the project itself provides: its packages, the files the tests import by name, the top-level
    packages among them (tests/standins' apex and horovod, which the tests put on PYTHONPATH) and the names
    pyproject.toml installs utils/ under (accelerate_reference_utils, which a test pip-installs)."""
    import tomllib

    files = source_files(repo)
    top_level_packages = {p.parent.name for p in files
                          if p.name == "__init__.py" and not (p.parent.parent / "__init__.py").is_file()}
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    installed = {name.split(".")[0] for name in setuptools.get("package-dir", {})}
    return {"utils", "scripts", "tests"} | {p.stem for p in files} | top_level_packages | installed
