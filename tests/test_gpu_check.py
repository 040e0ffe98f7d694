"""The GPU check (tests/gpu/check.sh) on the CPU: its dry run passes when everything it needs is carried and names
what is missing when something is not; the step timer and the numbers made of it, on a CPU run."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch
from helpers import REPO, launcher_args, make_synthetic_mnist, results, run

sys.path.insert(0, str(REPO / "tests" / "gpu"))
import check  # noqa: E402
import dry_run  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
requires_shared_data = pytest.mark.skipif(
    not all((SHARED_DATA / name / "SHA256SUMS").is_file() for name in check.DATA_SETS),
    reason=f"the check carries {SHARED_DATA}'s data sets, absent here (a plain clone has no ../shared)")


def write_wheel(folder, name, version, requires=()):
    """A wheel as pip download saves it, as far as the dry run reads one: its file name and METADATA."""
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata + "\n")


@pytest.fixture
def carried(tmp_path):
    """.gpu_check as tests/gpu/prepare.sh fills it: the listed wheels (datasets' with its requirements), the data."""
    folder = tmp_path / "carried"
    (folder / "wheels").mkdir(parents=True)
    for name, version in dry_run.read_pins(check.GPU_DIR / "wheels.txt").items():
        requires = ["pyarrow>=24.0.0", "dill<0.4.2,>=0.3.0", "multiprocess<0.70.20",
                    "huggingface-hub<3.0,>=1.31.0"] if name == "datasets" else []
        write_wheel(folder / "wheels", name, version, requires)
    for name in check.DATA_SETS:
        shutil.copytree(SHARED_DATA / name, folder / "data" / name)
    return folder


@requires_shared_data
def test_dry_run_passes_when_everything_is_carried(carried):
    proc = subprocess.run([sys.executable, check.GPU_DIR / "check.py", "--dry-run", "--carried", carried], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "dry run: 0 problem(s)" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = int(proc.stdout.split("gpu_tests: ")[1].split()[0])
    assert collected >= len(check.HEADLINES)  # and each headline test is among them, or the dry run says which not


def remove_simplejpeg_from_the_list(carried, tmp_path):
    listed = tmp_path / "wheels.txt"
    listed.write_text("".join(line for line in (check.GPU_DIR / "wheels.txt").read_text().splitlines(keepends=True)
                              if not line.startswith("simplejpeg")))
    return carried, listed, ["imports simplejpeg: the device image lacks it", "holds simplejpeg"]


def lose_a_carried_wheel(carried, tmp_path):
    next((carried / "wheels").glob("pexpect-*.whl")).unlink()
    return carried, check.GPU_DIR / "wheels.txt", ["lists pexpect==4.9.0", "holds none"]


def carry_a_wheel_that_needs_more(carried, tmp_path):
    write_wheel(carried / "wheels", "evaluate", "0.4.6", ["datasets>=2.0.0", "lmdb>=1.0"])  # replaces the listed one
    return carried, check.GPU_DIR / "wheels.txt", ["evaluate-0.4.6-py3-none-any.whl needs lmdb>=1.0"]


def lose_a_photo(carried, tmp_path):
    next((carried / "data" / "photos-jpeg" / "val").rglob("*.jpg")).unlink()
    return carried, check.GPU_DIR / "wheels.txt", ["is missing (listed in SHA256SUMS)"]


@requires_shared_data
@pytest.mark.parametrize("break_it", [remove_simplejpeg_from_the_list, lose_a_carried_wheel,
                                      carry_a_wheel_that_needs_more, lose_a_photo])
def test_dry_run_names_what_would_be_missing_on_the_device(break_it, carried, tmp_path):
    folder, wheels_list, expected = break_it(carried, tmp_path)
    problems, _ = check.dry_run_problems(folder, wheels_list, sys.executable, collect=False)
    for words in expected:
        assert any(words in problem for problem in problems), problems


@requires_shared_data
def test_dry_run_names_a_new_import_and_a_plan_over_the_budget(carried, tmp_path, monkeypatch):
    new_module = tmp_path / "uses_lmdb.py"
    new_module.write_text("def open_shards(path):\n    import lmdb  # a script's new dependency\n")
    source_files = dry_run.source_files
    monkeypatch.setattr(dry_run, "source_files", lambda repo: [*source_files(repo), new_module])
    plan = check.plan
    monkeypatch.setattr(check, "plan", lambda work: [*plan(work), check.Step("one_more", 60, "a new step")])
    problems, _ = check.dry_run_problems(carried, check.GPU_DIR / "wheels.txt", sys.executable, collect=False)
    assert any("uses_lmdb.py imports lmdb" in p and "lmdb==VERSION" in p for p in problems), problems
    assert any(f"> {check.BUDGET_S} s" in p for p in problems), problems


def test_step_numbers_are_the_steady_steps_wait_over_their_wall_time():
    ends = [float(i) for i in range(check.WARMUP_STEPS + 5)]  # one step a second
    waits = [0.9] * (check.WARMUP_STEPS + 1) + [0.0, 0.5, 0.25, 0.25]  # the warm-up's waits do not count
    samples = [(t + 0.5, 50.0 + t, 1000.0) for t in ends]  # nvidia-smi's: (time, utilisation %, memory MB)
    numbers = check.step_numbers({"train_samples_per_second": 250.0, "peak_memory_mb": 9.0},
                                 {"step_ends": ends, "wait_s": waits}, samples, batch_size=256)
    assert numbers["images_per_s_between_steps"] == 256
    assert numbers["data_wait_share_median"] == 0.25 and numbers["data_wait_share_max"] == 0.5
    assert numbers["data_wait_share_overall"] == 0.25
    steady = [50.0 + t for t in ends[check.WARMUP_STEPS:-1]]  # samples from the warm-up's end to the last step
    assert numbers["gpu_utilisation_pct_mean"] == sum(steady) / len(steady)


def test_cpu_cores_busy_are_the_steady_windows_busy_time_over_its_wall_time():
    """A step that kept 3 cores busy in its steady steps and none before: 3 cores, 3 per 256 images/s there."""
    ends = [float(i) for i in range(check.WARMUP_STEPS + 5)]
    cpu = [(t, 100.0 + (3.0 * (t - ends[check.WARMUP_STEPS]) if t >= ends[check.WARMUP_STEPS] else 0.0))
           for t in np.arange(0.0, ends[-1] + 0.05, 0.1)]  # (time, busy CPU seconds since boot)
    numbers = check.step_numbers({}, {"step_ends": ends, "wait_s": [0.0] * len(ends)}, [], 256, cpu)
    assert numbers["cpu_cores_busy_mean"] == pytest.approx(3.0)
    assert numbers["cpu_cores_per_1000_images_per_s"] == pytest.approx(3000 / 256)
    assert numbers["images_per_s"] is None and numbers["steady_s"] == 4.0  # no results.json: a step stopped in time


def test_the_summary_names_the_fewest_workers_within_5_percent_and_compares_decoding_on_the_gpu():
    def step(name, rate, cores=None):
        return {"name": name, "numbers": {"images_per_s_between_steps": rate, "cpu_cores_busy_mean": cores}}

    steps = [step("resnet50_synthetic_compile", 5000.0), step("resnet50_jpeg_compile_w16", 4990.0),
             step("resnet50_jpeg_compile_w8", 4750.0), step("resnet50_jpeg_compile_w4", 3000.0, 4.2),
             step("resnet50_decode_on_device_compile_w4", 4500.0, 1.5)]
    first, second = check.feeding_summary(steps)
    assert "4 workers 0.600, 8 workers 0.950, 16 workers 0.998" in first and "the fewest within 5%: 8 workers" in first
    assert "images/s 1.500 (4,500 against 3,000), CPU cores busy 1.5 against 4.2" in second
    steps[2]["numbers"]["images_per_s_between_steps"] = 4700.0  # 0.94: 16 workers are the fewest within 5%
    assert "the fewest within 5%: 16 workers" in check.feeding_summary(steps)[0]
    (lone,) = check.feeding_summary([steps[0], step("resnet50_jpeg_compile_w4", 2000.0)])
    assert lone.endswith("none within 5%; the best: 4 workers")
    assert check.feeding_summary(steps[1:]) == []  # no synthetic run to compare with


def test_cpu_sampler_reads_the_machines_busy_time():
    assert check.busy_seconds("cpu  100 5 50 1000 20 3 2 0 0 0\n", 100) == 1.6  # not idle (1000), not iowait (20)
    with check.CpuSampler() as cpu:
        began = time.process_time()
        while time.process_time() - began < 0.4:  # this process alone keeps a core busy
            pass
    (t0, busy0), (t1, busy1) = cpu.samples[0], cpu.samples[-1]
    assert len(cpu.samples) >= 3 and busy1 - busy0 >= 0.25 and busy1 - busy0 <= (t1 - t0) * (os.cpu_count() + 0.5)


def test_a_plain_run_takes_the_steps_that_always_run_then_those_that_fit_and_on_request_steps_when_asked():
    steps = check.plan(REPO)
    default = [s.name for s in check.steps_to_run(steps)]
    assert default[0] == "environment" and "pytest_gpu" not in default and "resnet50_jpeg" not in default
    assert [s.name for s in steps if s.when == check.ALWAYS] == default[:6]
    assert {"resnet50_jpeg_compile_w4", "resnet50_jpeg_compile_w8", "resnet50_jpeg_compile_w16",
            "resnet50_decode_on_device_compile_w4", "resnet50_synthetic_compile"} <= set(default[:6])
    assert [s.name for s in check.steps_to_run(steps, ["pytest_gpu"])] == ["environment", "pytest_gpu"]
    tf32 = next(s for s in steps if s.name == "resnet50_synthetic_compile_tf32")
    assert tf32.when == check.IF_TIME and not check.time_for(tf32, tf32.timeout_s - 1)
    assert check.time_for(tf32, tf32.timeout_s) and check.time_for(tf32, 20, only=[tf32.name])
    always = steps[1]
    assert check.time_for(always, 15) and not check.time_for(always, 14)


@requires_shared_data
def test_the_repeated_digits_are_mnist_10ks_in_order(tmp_path):
    from utils.data.mnist import load_mnist_idx

    check.repeated_digits(SHARED_DATA / "mnist-10k", tmp_path / "mnist-60k", 60000)
    source, repeated = load_mnist_idx(SHARED_DATA / "mnist-10k"), load_mnist_idx(tmp_path / "mnist-60k")
    images, labels = repeated["train"]
    assert images.shape == (60000, 28, 28) and labels.shape == (60000,)
    for start in (0, 8000, 56000):  # 7 whole copies, then the first half again
        count = min(8000, 60000 - start)
        assert torch.equal(images[start:start + count], source["train"][0][:count])
        assert torch.equal(labels[start:start + count], source["train"][1][:count])
    assert all(torch.equal(a, b) for a, b in zip(repeated["test"], source["test"], strict=True))


def test_a_check_step_stamps_every_optimizer_step_of_a_script_run_unchanged(tmp_path, monkeypatch):
    """run_check's own launch of a step, on the CPU: step_timer stamps every step of train_mnist.py, the numbers and
    the report come from them; a step that runs if time is left and does not fit is skipped, one on request not run."""
    data = make_synthetic_mnist(tmp_path / "data", num_train=640, num_test=101)
    out, work = tmp_path / "report", tmp_path / "work"
    out.mkdir()
    mnist = check.Step("mnist_cpu", 400, "train_mnist on the CPU", "scripts/train_mnist.py",
                       ["--cpu", "--data_dir", data, "--output_dir", work / "out", "--batch_size", "64",
                        "--epochs", "2"])
    monkeypatch.setattr(check, "plan", lambda work: [
        mnist, check.Step("too_long", check.BUDGET_S, "runs if time is left", when=check.IF_TIME),
        check.Step("pytest_gpu", 165, "on request", when=check.ON_REQUEST)])
    report = check.run_check(out, work, time.time())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("mnist_cpu", "ok"), ("too_long", "skipped")]
    steps = json.loads((work / "mnist_cpu.steps.json").read_text())
    assert len(steps["step_ends"]) == len(steps["wait_s"]) == results(work / "out")["global_step"] == 20
    assert steps["step_ends"] == sorted(steps["step_ends"]) and all(w >= 0 for w in steps["wait_s"])
    assert sum(steps["wait_s"]) > 0  # the DataLoader was waited on (the first batch of each epoch at least)
    numbers = report["steps"][0]["numbers"]
    assert numbers["steps"] == 20 and numbers["images_per_s"] > 0 and numbers["cpu_cores_busy_mean"] > 0
    (row,) = [line for line in check.markdown(report).splitlines() if line.startswith("| mnist_cpu: ")]
    assert f"eval accuracy {results(work / 'out')['eval_accuracy']} | ok" in row
