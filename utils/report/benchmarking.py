"""Helpers for the baselines and the benchmark: AMP as Accelerate picks it, synthetic images, machine facts, each
benchmark run's environment (its CPU threads, its visible GPUs), and scripts/benchmark.py's report (a row per
combination from its repeated runs, written as CSV, Markdown, JSON and plots). No distribution logic in here."""

import csv
import os
import platform
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ..errors import UserError
from ..files import write_json_atomically

def autocast_dtype(mixed_precision, device: torch.device):
    """torch's native AMP dtype for --mixed_precision (None: full fp32), as Accelerate chooses it.

    fp16 needs a GPU: on the CPU Accelerate ignores it and trains in fp32, so the baselines
    refuse it rather than compare different things.
    """
    if mixed_precision in (None, "no"):
        return None
    if mixed_precision == "fp16" and device.type != "cuda":
        raise UserError("--mixed_precision fp16 needs a CUDA GPU; on the CPU use --mixed_precision bf16 or no")
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]


class OptimizerStepWatch:
    """Whether `optimizer.step()` ran since the last look. GradScaler skips the call when fp16
    gradients overflowed; a post-hook on the optimizer knows that without reading anything off the
    GPU (the usual recipe, comparing `scaler.get_scale()` before and after, costs two host syncs a
    step). Accelerate's `optimizer_step_was_skipped` works the same way, by wrapping `step`."""

    def __init__(self, optimizer):
        self.stepped = False
        optimizer.register_step_post_hook(self._mark)

    def _mark(self, optimizer, step_args, step_kwargs):
        self.stepped = True

    def take(self) -> bool:
        stepped, self.stepped = self.stepped, False
        return stepped


class AutocastInForward(torch.nn.Module):
    """autocast is thread-local, and DataParallel runs each replica in a thread of its own,
    passing on only whether autocast is on, not its dtype (a bf16 run would compute in fp16).
    PyTorch's AMP notes for DataParallel: enter autocast inside forward."""

    def __init__(self, module: torch.nn.Module, amp_dtype):
        super().__init__()
        self.module, self.amp_dtype = module, amp_dtype

    def forward(self, x):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            return self.module(x)


def synthetic_images(num_samples: int, image_size: int, num_classes: int = 1000, seed: int = 0) -> TensorDataset:
    """Random normalised images and labels, as the classic ImageNet benchmarks use to time the
    GPU without the JPEG decoder (e.g. pytorch/examples imagenet --dummy)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return TensorDataset(images, labels)


def portable_path(path, repo) -> str:
    """An absolute path as seen from the repository root (published records must not name the
    folders of the machine they were made on); a relative one as it is."""
    return os.path.relpath(path, repo) if os.path.isabs(path) else str(path)


def portable_command(words, repo, run_dir=None) -> str:
    """A command as a reader runs it from the repository root: `python` for this interpreter,
    absolute paths relative to the repository, the run's temporary folder as RUN_DIR."""
    portable = []
    for word in map(str, words):
        if word == sys.executable:
            word = "python"
        elif run_dir is not None and (word == str(run_dir) or word.startswith(f"{run_dir}{os.sep}")):
            word = "RUN_DIR" + word[len(str(run_dir)):]
        else:
            word = portable_path(word, repo)
        portable.append(word)
    return shlex.join(portable)


def machine_facts() -> dict:
    """What a published number needs next to it: hardware and library versions."""
    import accelerate
    import torchvision

    cpu_model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu_model,
        "cpu_cores": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda if gpus else None,
        "load_average_1min_after": os.getloadavg()[0],
        "git_commit": _git_commit(),
    }


def cpu_threads(num_processes: int, users_threads, cores) -> int:
    """OMP_NUM_THREADS for each of `num_processes` CPU processes: the user's OMP_NUM_THREADS (`users_threads`, None
    where unset; on a busy machine fewer threads than cores can train many times faster), else the cores shared out."""
    if users_threads is not None and not (users_threads.isdigit() and int(users_threads) > 0):
        raise UserError(f"OMP_NUM_THREADS={users_threads}: not a positive whole number; set it to the threads each "
                        f"process should use, or unset it (then the cores / processes)")
    return int(users_threads) if users_threads is not None else max(1, (cores or 1) // num_processes)


def print_cpu_threads(process_counts, users_threads, cores) -> None:
    """Before the first CPU run: the threads each process will use, per process count."""
    whose = ", yours" if users_threads is not None else ""
    print(f"CPU threads per process (OMP_NUM_THREADS{whose}): " + ", ".join(
        f"{cpu_threads(n, users_threads, cores)} on {n} processes" for n in sorted(process_counts)), flush=True)


def cpu_threads_source(users_threads) -> str:
    """benchmark.json's threads_per_process on the CPU: whose OMP_NUM_THREADS the runs took."""
    if users_threads is not None:
        return f"OMP_NUM_THREADS={users_threads} (set by the user)"
    return "cores / processes (OMP_NUM_THREADS)"


def run_environment(combo, on_cpu: bool, environ, cores, machine_gpus: int) -> dict:
    """The environment of one benchmark run: the user's (`environ`), with the same CPU threads or GPUs for every
    method; `cores` and `machine_gpus` are this machine's."""
    env = dict(environ)
    if on_cpu:
        # Every method gets the same threads (torchrun and accelerate launch would otherwise choose different counts).
        env["OMP_NUM_THREADS"] = str(cpu_threads(combo.num_processes, env.get("OMP_NUM_THREADS"), cores))
    if combo.method == "dataparallel":
        # DataParallel drives every GPU it sees: show it the first N of the GPUs the user chose
        # (CUDA_VISIBLE_DEVICES, as every other method respects it), not of the machine's.
        visible = env.get("CUDA_VISIBLE_DEVICES")
        chosen = visible.split(",") if visible is not None else [str(i) for i in range(machine_gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(chosen[:combo.num_processes])
    return env


def _git_commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def summarize(values) -> dict:
    """Median (robust to one disturbed repeat), min and max of the repeats; None when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ---------------------------------------------------------------- scripts/benchmark.py's report

METHODS = ("plain", "ddp", "dataparallel", "accelerate")
PRECISIONS = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}  # our names -> --mixed_precision
CSV_COLUMNS = (
    "model", "data_path", "method", "precision", "num_processes", "status", "reason", "runs",
    "samples_per_second", "samples_per_second_min", "samples_per_second_max", "time_per_epoch_s",
    "peak_memory_mb", "eval_accuracy", "eval_samples", "ratio_to_ddp", "ratio_to_ddp_min", "ratio_to_ddp_max",
    "ratio_to_ddp_best", "command",
)


@dataclass(frozen=True)
class Combination:
    model: str
    data_path: str
    method: str
    precision: str
    num_processes: int

    def label(self):
        return f"{self.model}/{self.data_path}/{self.method}/{self.precision}/{self.num_processes}p"

    def baseline(self):
        """Raw DDP in the same setting: the reference every ratio is taken against."""
        return Combination(self.model, self.data_path, "ddp", self.precision, self.num_processes)


def combination_of(record: dict) -> Combination:
    """The combination a row or run record (CSV, JSON) is about."""
    return Combination(*(record[name] for name in ("model", "data_path", "method", "precision", "num_processes")))


def summarize_combination(combo, runs_by_round, skipped_reason):
    """One table row from all rounds of one combination. Over the rounds that succeeded: samples/s as the
    median, min and max; time per epoch and accuracy as the median; peak memory as the maximum. The ratio
    to raw DDP twice: the median, min and max of the per-round ratios, and best of N (this combination's
    fastest round over DDP's fastest)."""
    row = {column: None for column in CSV_COLUMNS}
    row.update(asdict(combo), status="skipped", reason=skipped_reason or "", runs=0, command="")
    if skipped_reason:
        return row
    mine = [runs[combo] for runs in runs_by_round if combo in runs]
    ok = [r for r in mine if r["status"] == "ok"]
    row["command"] = mine[0]["command"] if mine else ""
    row["runs"] = len(ok)
    if not ok:
        row.update(status="failed", reason=mine[-1]["reason"] if mine else "")
        return row
    row["status"] = "ok" if len(ok) == len(mine) else "partly failed"
    row["reason"] = "" if len(ok) == len(mine) else next(r["reason"] for r in mine if r["status"] != "ok")
    speed = summarize(r["samples_per_second"] for r in ok)
    row.update(samples_per_second=speed["median"], samples_per_second_min=speed["min"],
               samples_per_second_max=speed["max"])
    row["time_per_epoch_s"] = summarize(r["time_per_epoch_s"] for r in ok)["median"]
    row["peak_memory_mb"] = max(r["peak_memory_mb"] for r in ok)
    row["eval_accuracy"] = summarize(r["eval_accuracy"] for r in ok)["median"]
    row["eval_samples"] = ok[0]["eval_samples"]
    # The ratio to DDP is taken within each round, then the median over rounds: both runs of a
    # pair saw the machine in the same state.
    ratios = []
    for runs in runs_by_round:
        mine_now, ddp_now = runs.get(combo), runs.get(combo.baseline())
        if mine_now and ddp_now and mine_now["status"] == ddp_now["status"] == "ok" and ddp_now["samples_per_second"]:
            ratios.append(mine_now["samples_per_second"] / ddp_now["samples_per_second"])
    ratio = summarize(ratios)
    row.update(ratio_to_ddp=ratio["median"], ratio_to_ddp_min=ratio["min"], ratio_to_ddp_max=ratio["max"])
    # Best of N against best of N: other work on the machine only ever slows a run down, so
    # the fastest repeat is the least disturbed one (timeit reports its minimum for this reason).
    ddp_ok = [runs[combo.baseline()] for runs in runs_by_round
              if combo.baseline() in runs and runs[combo.baseline()]["status"] == "ok"]
    if ddp_ok:
        row["ratio_to_ddp_best"] = speed["max"] / max(r["samples_per_second"] for r in ddp_ok)
    return row


def write_report(output_dir: Path, record: dict, combinations, skipped: dict, runs_by_round) -> list:
    """A benchmark's report, fresh or rebuilt by --rewrite_from: a row per combination (skipped ones
    with `skipped[combination]`, their reason) in benchmark.csv and benchmark.md, `record` with the rows
    and every run in benchmark.json, throughput.png, scaling.png, and the table on the terminal."""
    rows = [summarize_combination(c, runs_by_round, skipped[c]) for c in combinations]
    write_csv(output_dir / "benchmark.csv", rows)
    write_markdown(output_dir / "benchmark.md", rows)
    runs = [run for runs in runs_by_round for run in runs.values()]
    write_json_atomically(output_dir / "benchmark.json", {**record, "rows": rows, "runs": runs})
    plot(rows, output_dir)
    print_table(rows)
    return rows


def fmt(value, spec) -> str:
    """A figure as text; "-" where there is none."""
    return format(value, spec) if value is not None else "-"


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_COLUMNS})


def write_markdown(path, rows):
    """The table: measured rows (each figure over the rounds, as its header says), then the others with their
    status and reason."""
    lines = ["| model | data | method | precision | processes | samples/s median (min-max) | s/epoch median "
             "| peak MB max | accuracy median | ÷ DDP median (min-max) | ÷ DDP best of N |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["samples_per_second"] is None:
            continue
        ratio = (f"{fmt(r['ratio_to_ddp'], '.3f')} "
                 f"({fmt(r['ratio_to_ddp_min'], '.2f')}-{fmt(r['ratio_to_ddp_max'], '.2f')})")
        lines.append(
            f"| {r['model']} | {r['data_path']} | {r['method']} | {r['precision']} | {r['num_processes']} "
            f"| {r['samples_per_second']:.0f} ({r['samples_per_second_min']:.0f}-{r['samples_per_second_max']:.0f}) "
            f"| {fmt(r['time_per_epoch_s'], '.2f')} | {fmt(r['peak_memory_mb'], '.0f')} "
            f"| {fmt(r['eval_accuracy'], '.4f')} | {ratio} "
            f"| {fmt(r['ratio_to_ddp_best'], '.3f')} |"
        )
    not_measured = [r for r in rows if r["samples_per_second"] is None]
    if not_measured:
        lines += ["", "Not measured:", ""]
        lines += [f"- {combination_of(r).label()}: {r['status']}, {r['reason']}" for r in not_measured]
    Path(path).write_text("\n".join(lines) + "\n")


def print_table(rows):
    print(f"{'combination':<40} {'status':<8} {'samples/s':>10} {'s/epoch':>8} {'MB':>7} {'acc':>7} {'÷ddp':>6}")
    for r in rows:
        label = combination_of(r).label()
        print(f"{label:<40} {r['status']:<8} {fmt(r.get('samples_per_second'), '10.0f')} "
              f"{fmt(r.get('time_per_epoch_s'), '8.2f')} {fmt(r.get('peak_memory_mb'), '7.0f')} "
              f"{fmt(r.get('eval_accuracy'), '7.4f')} {fmt(r.get('ratio_to_ddp'), '6.3f')}"
              + (f"  ({r['reason']})" if r["reason"] else ""))


def save_figure(fig, axes, panels, path: Path) -> None:
    """Write one plot; without measured rows it says so instead of showing empty axes."""
    import matplotlib.pyplot as plt

    if not panels:
        axes[0][0].text(0.5, 0.5, "nothing measured", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(rows, output_dir: Path):
    """throughput.png: samples/s by method and precision; scaling.png: by process count."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["samples_per_second"] is not None]
    colors = {method: f"C{i}" for i, method in enumerate(METHODS)}

    # Throughput: one panel per model, data path and process count; bars grouped by precision.
    panels = sorted({(r["model"], r["data_path"], r["num_processes"]) for r in measured})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 4), squeeze=False)
    for ax, (model, data_path, n) in zip(axes[0], panels):
        here = [r for r in measured if (r["model"], r["data_path"], r["num_processes"]) == (model, data_path, n)]
        precisions = [p for p in PRECISIONS if any(r["precision"] == p for r in here)]
        methods = [m for m in METHODS if any(r["method"] == m for r in here)]
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            for i, precision in enumerate(precisions):
                row = next((r for r in here if (r["method"], r["precision"]) == (method, precision)), None)
                if row is None:
                    continue
                x = i + (j - (len(methods) - 1) / 2) * width
                error = [[row["samples_per_second"] - row["samples_per_second_min"]],
                         [row["samples_per_second_max"] - row["samples_per_second"]]]
                ax.bar(x, row["samples_per_second"], width, yerr=error, color=colors[method],
                       label=method if i == 0 else None, capsize=2)
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set_title(f"{model}, {data_path}, {n} process{'es' if n > 1 else ''}", fontsize=10)
        ax.set_ylabel("training samples/s (median, min-max)")
        ax.legend(fontsize=8)
    save_figure(fig, axes, panels, output_dir / "throughput.png")

    # Scaling: one panel per model and data path; a line per method and precision.
    panels = sorted({(r["model"], r["data_path"]) for r in measured})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for ax, (model, data_path) in zip(axes[0], panels):
        here = [r for r in measured if (r["model"], r["data_path"]) == (model, data_path)]
        for method in METHODS:
            for k, precision in enumerate(PRECISIONS):
                line = sorted((r["num_processes"], r["samples_per_second"]) for r in here
                              if (r["method"], r["precision"]) == (method, precision))
                if line:
                    ax.plot(*zip(*line), marker="os^"[k], linestyle=["-", "--", ":"][k], color=colors[method],
                            label=f"{method} {precision}")
        ax.set_xticks(sorted({r["num_processes"] for r in here}))
        ax.set_xlabel("processes (GPUs for DataParallel)")
        ax.set_ylabel("training samples/s, all processes (median)")
        ax.set_title(f"{model}, {data_path}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    save_figure(fig, axes, panels, output_dir / "scaling.png")
