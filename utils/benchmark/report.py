"""scripts/benchmark.py's report: a row per combination from its repeated runs, written as CSV, Markdown, JSON and
plots."""

import csv
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..files import write_json_atomically

METHODS = ("plain", "ddp", "dataparallel", "accelerate")
PRECISIONS = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}  # our names -> --mixed_precision
CSV_COLUMNS = (
    "model", "data_path", "method", "precision", "num_processes", "status", "reason", "runs",
    "samples_per_second", "samples_per_second_min", "samples_per_second_max", "time_per_epoch_s",
    "peak_memory_mb", "eval_accuracy", "eval_samples", "ratio_to_ddp", "ratio_to_ddp_min", "ratio_to_ddp_max",
    "ratio_to_ddp_best", "command",
)


def summarize(values) -> dict:
    """Median (robust to one disturbed repeat), min and max of the repeats; None when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
