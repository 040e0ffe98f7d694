#!/usr/bin/env python
"""The GPU check: every test marked gpu and the ResNet-50 throughput numbers, in one command that fits one device lease.

    bash tests/gpu/check.sh             # on the GPU machine, through the device tool (docs/gpus.md): results in $OUT
    bash tests/gpu/check.sh --dry-run   # here, on the CPU: would it find there all it needs?

Steps, one after the other, each with its own timeout (a step that runs out is stopped, recorded as `timeout`, and the
check goes on; a step with no time left in the budget is recorded as `skipped`):

- environment: the card, driver, torch and the versions of the carried packages as installed there;
- pytest_gpu: `python -m pytest -m gpu tests` (6 workers on the one GPU), junit XML with each test's outcome and the
  numbers the tests record (train_mnist fp16/bf16 accuracy and skipped loss-scale steps, the bit-exact fp16 resume
  with --deterministic, ResNet-50 fp16 channels-last with --compile off and on, FSDP on one GPU, peak memory);
- resnet50_synthetic, resnet50_jpeg, resnet50_synthetic_compile: ResNet-50 bf16 channels-last training alone on the
  GPU, on synthetic images on the device (scripts/benchmark_train.py, --compile off and on) and on real JPEGs decoded
  by 16 DataLoader workers (scripts/train_image_classifier.py), each run through tests/gpu/step_timer.py: images/s,
  the GPU's utilisation (nvidia-smi, sampled every 100 ms over the steady steps), the data-wait share of each step,
  peak memory.

Written to OUTPUT: check.json (everything), check.md (the tables), pytest_gpu.xml, check.log (every step's output).
A rerun after a fix takes what failed alone: `bash tests/gpu/check.sh --only pytest_gpu --pytest_k fsdp`.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import dry_run

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "tests" / "gpu"
CARRIED = REPO / ".gpu_check"  # ignored; prepared by tests/gpu/prepare.sh, carried by the device tool
DATA_SETS = ("mnist-10k", "photos-jpeg")
BUDGET_S = 480  # issue 34: at most 8 minutes on one H100, all included
INSTALL_S = 20  # check.sh's pip install of the wheels, before this driver starts
GRACE_S = 10  # a step past its timeout gets SIGINT, then this long to write what it has (pytest: its XML), then SIGKILL
CARRY_LIMIT_BYTES = 64 * 2**20  # what one device call may send
WARMUP_STEPS = 10  # as utils/report/meters.py ThroughputMeter: the steady state starts after these
PHOTO_COPIES = 40  # 192 training photos -> 7680 images: 30 steps of 256, 20 past the warm-up
PYTEST_WORKERS = 6  # the gpu tests are small: six at a time share the GPU and 16 cores
LAUNCH = ["-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]  # as tests/helpers.py launcher_args(1)
RESNET = ["--model", "resnet50", "--mixed_precision", "bf16", "--channels_last", "--batch_size", "256", "--epochs", "1"]
# What the issue asks for that a gpu test shows, by test id: the table's first rows.
HEADLINES = {
    "train_mnist fp16 (mnist-10k)": "tests/test_gpu_paths.py::test_train_mnist_mixed_precision_on_gpu[fp16]",
    "train_mnist bf16 (mnist-10k)": "tests/test_gpu_paths.py::test_train_mnist_mixed_precision_on_gpu[bf16]",
    "fp16 resume bit-exact, --deterministic":
        "tests/test_gpu_paths.py::test_fp16_resume_is_bit_exact_with_deterministic",
    "ResNet-50 fp16 channels-last, eager": "tests/test_gpu_paths.py::test_resnet50_fp16_channels_last_on_gpu[eager]",
    "ResNet-50 fp16 channels-last, --compile":
        "tests/test_gpu_paths.py::test_resnet50_fp16_channels_last_on_gpu[compile]",
    "FSDP on one GPU (fsdp.yaml)":
        "tests/test_gpu_paths.py::test_fsdp_on_one_gpu_saves_full_weights_and_resumes_from_sharded_checkpoints",
    "fp16 overflow steps counted": "tests/test_reliability.py::test_fp16_overflow_steps_are_counted",
}


@dataclass
class Step:
    name: str
    timeout_s: int
    about: str
    script: str = None  # launched through tests/gpu/step_timer.py with `argv`
    argv: list = field(default_factory=list)


def plan(work: Path) -> list:
    synthetic = ["--method", "accelerate", "--data_on_device", "--synthetic_samples", str(PHOTO_COPIES * 192), *RESNET]
    return [
        Step("environment", 40, "card, driver, torch, carried packages"),
        Step("pytest_gpu", 165, "python -m pytest -m gpu tests"),
        Step("resnet50_synthetic", 45, "ResNet-50 bf16 channels-last, synthetic images on the GPU, eager",
             "scripts/benchmark_train.py", [*synthetic, "--output_dir", work / "resnet50_synthetic"]),
        Step("resnet50_jpeg", 90, "ResNet-50 bf16 channels-last, 224 px JPEGs decoded by 16 workers, eager",
             "scripts/train_image_classifier.py",
             ["--data_dir", work / "photos", "--output_dir", work / "resnet50_jpeg", "--image_size", "224",
              "--num_workers", "16", *RESNET]),
        Step("resnet50_synthetic_compile", 120, "ResNet-50 bf16 channels-last, synthetic images on the GPU, --compile",
             "scripts/benchmark_train.py",
             [*synthetic, "--compile", "--output_dir", work / "resnet50_synthetic_compile"]),
    ]


# ---------------------------------------------------------------- running a step


def run_command(cmd, timeout_s: float, log, env) -> tuple:
    """(exit status, or None when it ran out of time; the last 40 lines). Its own process group: a timeout stops the
    launcher, the training process and its DataLoader workers alike."""
    log.write(f"\n$ {' '.join(map(str, cmd))}\n")
    log.flush()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: [(lines.append(line), log.write(line)) for line in proc.stdout])
    reader.start()
    try:
        status = proc.wait(timeout=max(1.0, timeout_s - GRACE_S))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status = None
    reader.join(timeout=5)
    log.flush()
    return status, "".join(lines[-40:])


class GpuSampler:
    """nvidia-smi's GPU utilisation and memory in use every 100 ms, each sample stamped with the wall time it came."""

    def __enter__(self):
        self.samples, self.proc = [], None
        if shutil.which("nvidia-smi") is None:
            return self  # no samples: the utilisation reads as unknown
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                utilisation, memory = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), utilisation, memory))

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=5)


def step_numbers(results: dict, timing: dict, samples: list, batch_size: int) -> dict:
    """images/s (the script's own meter), and over the steady steps (after the warm-up): the data-wait share of each
    step (time blocked on the DataLoader over the step's wall time), GPU utilisation, memory."""
    ends, waits = timing["step_ends"], timing["wait_s"]
    numbers = {"images_per_s": results.get("train_samples_per_second"), "peak_memory_mb": results.get("peak_memory_mb"),
               "steps": len(ends)}
    if len(ends) <= WARMUP_STEPS + 1:
        return {**numbers, "note": f"only {len(ends)} steps: no steady state past {WARMUP_STEPS} warm-up steps"}
    durations = [ends[i] - ends[i - 1] for i in range(WARMUP_STEPS + 1, len(ends))]
    shares = [waits[i] / d for i, d in zip(range(WARMUP_STEPS + 1, len(ends)), durations)]
    window = [s for s in samples if ends[WARMUP_STEPS] <= s[0] <= ends[-1]]
    return {
        **numbers,
        "images_per_s_between_steps": batch_size * len(durations) / sum(durations),
        "data_wait_share_median": statistics.median(shares),
        "data_wait_share_max": max(shares),
        "data_wait_share_overall": sum(waits[WARMUP_STEPS + 1:]) / sum(durations),
        "data_wait_share_per_step": [round(share, 3) for share in shares],
        "gpu_utilisation_pct_mean": statistics.fmean(s[1] for s in window) if window else None,
        "gpu_utilisation_samples": len(window),
        "nvidia_smi_memory_used_mb_max": max((s[2] for s in samples), default=None),
    }


def replicate_photos(source: Path, target: Path, copies: int) -> None:
    """photos-jpeg's 192 training photos, each linked `copies` times (each link is decoded afresh), its 64 val photos
    once."""
    shutil.rmtree(target, ignore_errors=True)
    for split, times in (("train", copies), ("val", 1)):
        for photo in sorted((source / split).glob("*/*.jpg")):
            folder = target / split / photo.parent.name
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(times):
                (folder / f"copy{k:02d}_{photo.name}").symlink_to(photo.resolve())


def environment(path: Path) -> None:
    """What ran where, written to `path` fact by fact: a step stopped at its timeout still leaves the facts it had.
    nvidia-smi, not torch, reads the card: a CUDA context in this process would stay for the whole check and take GPU
    memory from the steps. Each carried package's import is timed: on the GPU image `import evaluate` imports the
    image's transformers, whose import scans every installed distribution (the first check: over 8 s)."""
    import importlib
    import importlib.metadata

    began = time.perf_counter()
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "cpu_count": os.cpu_count(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "import_s": {"torch": round(time.perf_counter() - began, 2)}}
    if shutil.which("nvidia-smi") is not None:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        facts["card"] = facts["nvidia_smi"].split(",")[0]
    for name in ("accelerate", "torchvision", "transformers", "datasets", "evaluate", "simplejpeg", "pyarrow", "fsspec",
                 "huggingface-hub", "pytest-xdist", "pytest-timeout"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = None
    facts["wheel_requirement_problems"] = installed_requirement_problems()
    facts["wheel_import_errors"] = {}
    path.write_text(json.dumps(facts))
    for name in dry_run.read_pins(GPU_DIR / "wheels.txt"):  # each carried package imports there (datasets: pyarrow)
        began = time.perf_counter()
        try:
            importlib.import_module(name.replace("-", "_"))
        except Exception as err:
            facts["wheel_import_errors"][name] = f"{type(err).__name__}: {err}"[:300]
        facts["import_s"][name] = round(time.perf_counter() - began, 2)
        path.write_text(json.dumps(facts))


def installed_requirement_problems() -> list:
    """The carried wheels' requirements against what is installed here (pip install --no-deps checks none)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    problems = []
    for name in dry_run.read_pins(GPU_DIR / "wheels.txt"):
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                version = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{name} needs {req}: {req.name} {version} is installed")
    return problems


def pytest_command(xml: Path, select: str = None) -> list:
    """pytest -m gpu tests, in parallel (pytest-xdist) and each test stopped after 150 s (pytest-timeout), where the
    image has those plugins (tests/gpu/device_packages.txt says it has); xunit1: the XML keeps recorded properties."""
    from importlib.util import find_spec

    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider", "--junitxml", xml,
           "-o", "junit_family=xunit1", *(["-k", select] if select else [])]
    if find_spec("xdist") is not None:
        cmd += ["-n", str(PYTEST_WORKERS)]
    if find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "150"]
    return cmd


def junit_tests(path: Path) -> list:
    """Each test of the junit XML (xunit1): id, outcome, seconds, first line of its message, recorded properties."""
    if not path.is_file():
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome, message = {"failure": "failed"}.get(kind, kind), (element.get("message") or "").split("\n")[0]
                break
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append({"id": f"{file}::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message[:300], "properties": properties})
    return tests


def run_check(out: Path, work: Path, started: float, only=None, pytest_select=None) -> dict:
    deadline = started + BUDGET_S - 5  # 5 s to write the report
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "MNIST_10K_DIR": str(CARRIED / "data" / "mnist-10k")}  # tests/helpers.py: the real digits, carried
    report = {"budget_s": BUDGET_S, "steps": [], "tests": []}
    with open(out / "check.log", "w") as log:
        for step in [s for s in plan(work) if not only or s.name in ("environment", *only)]:
            left = deadline - time.time()
            record = {"name": step.name, "about": step.about, "timeout_s": step.timeout_s}
            report["steps"].append(record)
            if left < 15:
                record.update(status="skipped", reason=f"{left:.0f} s left of the {BUDGET_S} s budget")
                continue
            timeout = min(step.timeout_s, left)
            began = time.time()
            try:
                if step.name == "environment":  # in its own process too: its timeout holds
                    facts = work / "environment.json"
                    facts.unlink(missing_ok=True)
                    status, tail = run_command([sys.executable, Path(__file__), "--environment", facts], timeout, log,
                                               env)
                    record.update(status="timeout" if status is None else ("ok" if status == 0 else "failed"),
                                  returncode=status)
                    if facts.is_file():  # written fact by fact: a timeout leaves those it had
                        report["environment"] = json.loads(facts.read_text())
                    if status != 0:
                        record["tail"] = tail[-2000:]
                elif step.name == "pytest_gpu":
                    xml = out / "pytest_gpu.xml"
                    status, tail = run_command(pytest_command(xml, pytest_select), timeout, log, env)
                    report["tests"] = junit_tests(xml)
                    record.update(status="timeout" if status is None else ("ok" if status == 0 else "failed"),
                                  returncode=status, tail=tail[-2000:])
                else:
                    if step.name == "resnet50_jpeg":
                        replicate_photos(CARRIED / "data" / "photos-jpeg", work / "photos", PHOTO_COPIES)
                    timing_file = work / f"{step.name}.steps.json"
                    with GpuSampler() as sampler:
                        status, tail = run_command(
                            [sys.executable, *LAUNCH, GPU_DIR / "step_timer.py", step.script, *step.argv],
                            timeout - (time.time() - began), log, {**env, "STEP_TIMER_OUT": str(timing_file)})
                    record.update(status="timeout" if status is None else ("ok" if status == 0 else "failed"),
                                  returncode=status)
                    if status == 0:
                        results = json.loads((Path(step.argv[step.argv.index("--output_dir") + 1]) / "results.json")
                                             .read_text())
                        batch_size = int(step.argv[step.argv.index("--batch_size") + 1])
                        record["numbers"] = step_numbers(results, json.loads(timing_file.read_text()),
                                                         sampler.samples, batch_size)
                    else:
                        record["tail"] = tail[-2000:]
            except Exception as err:  # a broken step is a finding; the others still run
                record.update(status="failed", reason=f"{type(err).__name__}: {err}")
            record["seconds"] = round(time.time() - began, 1)
    report["total_s"] = round(time.time() - started, 1)
    return report


# ---------------------------------------------------------------- the report


def fmt(value, digits=0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = [f"# GPU check: {env.get('card', 'no GPU seen')}, torch {env.get('torch')}, {env.get('date')}", "",
             f"{report['total_s']} s of the {report['budget_s']} s budget. nvidia-smi: {env.get('nvidia_smi')}", ""]
    if env.get("import_s"):
        lines += ["Import seconds there: " + ", ".join(f"{name} {s}" for name, s in env["import_s"].items()), ""]
    if env.get("wheel_requirement_problems"):
        lines += ["Carried wheels' requirements not met there: " + "; ".join(env["wheel_requirement_problems"]), ""]
    if env.get("wheel_import_errors"):
        lines += ["Carried packages that do not import there: " + "; ".join(
            f"{name}: {error}" for name, error in env["wheel_import_errors"].items()), ""]
    lines += ["| step | status | s | images/s | GPU util % | data-wait share (median / max) | peak MB |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["steps"]:
        n = s.get("numbers", {})
        wait = (f"{fmt(n.get('data_wait_share_median'), 2)} / {fmt(n.get('data_wait_share_max'), 2)}"
                if "data_wait_share_median" in n else "–")
        lines.append(f"| {s['name']}: {s['about']} | {s['status']} {s.get('reason', '')} | {fmt(s.get('seconds'))} | "
                     f"{fmt(n.get('images_per_s'))} | {fmt(n.get('gpu_utilisation_pct_mean'))} | {wait} | "
                     f"{fmt(n.get('peak_memory_mb'))} |")
    by_id = {t["id"]: t for t in report["tests"]}
    lines += ["", "| what the issue asks | test | outcome | recorded |", "| --- | --- | --- | --- |"]
    for what, test_id in HEADLINES.items():
        t = by_id.get(test_id, {"outcome": "not run", "properties": {}})
        lines.append(f"| {what} | `{test_id.split('::')[1]}` | {t['outcome']} | "
                     f"{', '.join(f'{k} {v}' for k, v in t['properties'].items())} |")
    lines += ["", "| test marked gpu | outcome | s | message |", "| --- | --- | --- | --- |"]
    lines += [f"| `{t['id']}` | {t['outcome']} | {t['seconds']:.1f} | {t['message']} |" for t in report["tests"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the dry run


def dry_run_problems(carried: Path, wheels_list: Path, python: str, collect: bool = True) -> tuple:
    """On the CPU: every problem that would make the check fail for want of something carried, and what was checked.
    collect=False leaves out `pytest --collect-only` (its own process, the slow part)."""
    device = dry_run.read_pins(GPU_DIR / "device_packages.txt")
    wheels = dry_run.read_pins(wheels_list)
    steps = plan(Path("/tmp/gpu_check"))
    fixed = INSTALL_S + sum(s.timeout_s for s in steps)
    problems = [] if fixed <= BUDGET_S else [f"the steps' timeouts and the install add up to {fixed} s > {BUDGET_S} s"]
    imports = dry_run.third_party_imports(dry_run.source_files(REPO), dry_run.local_module_names(REPO), REPO)
    problems += dry_run.uncovered_imports(imports, device, wheels)
    problems += [f"the check needs {name} there (pytest -n, --timeout)" for name in ("pytest-xdist", "pytest-timeout")
                 if name not in device]
    problems += dry_run.requirement_problems(REPO / "requirements.txt", device, wheels)
    problems += dry_run.wheel_problems(carried / "wheels", device, wheels)
    problems += dry_run.data_problems(carried / "data", DATA_SETS)
    launched = [(s.script, s.argv) for s in steps if s.script]
    problems += [f"missing file: {p}" for p in ["tests/gpu/step_timer.py", *(s for s, _ in launched)]
                 if not (REPO / p).is_file()]
    problems += dry_run.flag_problems(REPO, launched)
    size = dry_run.travelling_bytes(REPO, carried) if carried.is_dir() else None
    if size is not None and size > CARRY_LIMIT_BYTES:
        problems.append(f"the checkout and {carried.name} send {size / 2**20:.1f} MiB; the device takes 64 MiB")
    collection, ids = dry_run.collection_problems(REPO, python) if collect else ([], [])
    problems += collection
    problems += [f"HEADLINES names {test_id}, which pytest -m gpu does not collect"
                 for test_id in HEADLINES.values() if ids and test_id not in ids]
    summary = {"steps": [(s.name, s.timeout_s) for s in steps], "install_s": INSTALL_S, "budget_s": BUDGET_S,
               "gpu_tests": len(ids), "wheels": sorted(wheels),
               "travelling_mib": None if size is None else round(size / 2**20, 1)}
    return problems, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=os.environ.get("OUT"), help="default: $OUT (the device tool's)")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="on the CPU: is everything carried?")
    parser.add_argument("--carried", type=Path, default=CARRIED, help="the carried folder (tests/gpu/prepare.sh)")
    parser.add_argument("--wheels_list", type=Path, default=GPU_DIR / "wheels.txt")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in plan(Path("."))][1:],
                        help="a rerun after a fix: these steps alone (the environment step always runs)")
    parser.add_argument("--pytest_k", help="with the pytest_gpu step: only the gpu tests this -k expression selects")
    parser.add_argument("--environment", type=Path, help=argparse.SUPPRESS)  # the first step: its facts, to this file
    args = parser.parse_args(argv)
    if args.environment:
        environment(args.environment)
        return 0
    if args.dry_run:
        problems, summary = dry_run_problems(args.carried, args.wheels_list, sys.executable)
        for key, value in summary.items():
            print(f"{key}: {value}")
        for problem in problems:
            print(f"problem: {problem}")
        print(f"dry run: {len(problems)} problem(s)")
        return 1 if problems else 0
    if not args.output_dir:
        parser.error("--output_dir is needed where $OUT is not set")
    out, work = Path(args.output_dir), Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))  # check.sh's start: its install counts
    report = run_check(out, work, started, args.only, args.pytest_k)
    (out / "check.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "check.md").write_text(table)
    print(table)
    return 0 if all(s["status"] == "ok" for s in report["steps"]) else 1


if __name__ == "__main__":
    # A step past its time gets SIGINT; started from a script with `&`, this process and so every step would have it
    # ignored (an ignored signal stays ignored through exec). A handler of its own makes it the default in the steps.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
