#!/usr/bin/python3
"""Plots training metrics (JSON lines) from one or more runs into one PNG.

    /usr/bin/python3 tools/plot_metrics.py a.jsonl b.jsonl -o plot.png [--title T] [--smooth N]
        [--labels "run A" "run B"] [--logy]

Each line of a metrics file is a JSON object with some of: step, epoch, loss, lr, accuracy
(test accuracy, often only on some lines), val_loss, samples_per_s / tokens_per_s. Panels:
loss (train loss vs step, val_loss dashed), accuracy if any file has it, throughput if any file
has it, expert load if any file has Mixture-of-Experts routing ("moe": per block its
per-expert "counts", from gpt --experts; drawn as max/mean per block, 1 = balanced); one
colour per file, labelled by file name or --labels. Lines without "step" are
numbered in order. --smooth N draws a trailing N-point mean over the raw loss (kept faint).
Run with Debian's /usr/bin/python3 (python3-matplotlib); rendering uses the Agg backend, so
no display is needed.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


class MetricsError(Exception):
    pass


def read_metrics(path):
    """Returns the file's records (dicts) in order; MetricsError names the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise MetricsError(f"cannot read '{path}': {e.strerror}") from e
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from e
        if not isinstance(record, dict):
            raise MetricsError(
                f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        for key in ("step", "epoch", "loss", "lr", "accuracy", "val_loss", "samples_per_s",
                    "tokens_per_s"):
            value = record.get(key)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not is_number:
                raise MetricsError(f"{path}:{number}: \"{key}\" must be a number, got {value!r}")
        try:
            expert_load([record])
        except MetricsError as e:
            raise MetricsError(f"{path}:{number}: {e}") from e
        records.append(record)
    return records


def series(records, key):
    """(steps, values) of the records that have `key`; records without "step" count in order."""
    xs, ys = [], []
    for index, record in enumerate(records):
        if record.get(key) is None:
            continue
        xs.append(record.get("step", index))
        ys.append(record[key])
    return xs, ys


def expert_load(records):
    """{block: (steps, max/mean)} from the records' "moe" lists; MetricsError when malformed."""
    out = {}
    for index, record in enumerate(records):
        blocks = record.get("moe")
        if blocks is None:
            continue
        if not isinstance(blocks, list):
            raise MetricsError(f"\"moe\" must be a list of blocks, got {blocks!r}")
        for block in blocks:
            counts = block.get("counts") if isinstance(block, dict) else None
            if (not isinstance(counts, list) or not counts or
                    not all(isinstance(c, int) and c >= 0 for c in counts)):
                raise MetricsError(f"a \"moe\" block needs \"counts\", a list of counts: {block!r}")
            total = sum(counts)
            if total == 0:
                continue
            xs, ys = out.setdefault(str(block.get("layer", "?")), ([], []))
            xs.append(record.get("step", index))
            ys.append(max(counts) * len(counts) / total)
    return out


def trailing_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs, output, title=None, smooth=1, logy=False):
    """runs: [(label, records)]. Returns the names of the panels drawn."""
    have = lambda key: any(series(r, key)[1] for _, r in runs)  # noqa: E731
    if not have("loss") and not have("val_loss"):
        raise MetricsError("no \"loss\" or \"val_loss\" values in any file: nothing to plot")
    panels = ["loss"]
    if have("accuracy"):
        panels.append("accuracy")
    throughput_key = next((k for k in ("samples_per_s", "tokens_per_s") if have(k)), None)
    if throughput_key:
        panels.append("throughput")
    loads = [expert_load(r) for _, r in runs]
    if any(loads):
        panels.append("expert load")

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs):
        color = colors[i % len(colors)]
        xs, ys = series(records, "loss")
        if ys:
            if smooth > 1:
                axes["loss"].plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                axes["loss"].plot(xs, trailing_mean(ys, smooth), color=color, label=label)
            else:
                axes["loss"].plot(xs, ys, color=color, label=label)
        xs, ys = series(records, "val_loss")
        if ys:
            axes["loss"].plot(xs, ys, color=color, linestyle="--", marker=".",
                              label=f"{label} (val)")
        if "accuracy" in axes:
            xs, ys = series(records, "accuracy")
            if ys:
                axes["accuracy"].plot(xs, ys, color=color, marker="o", markersize=3, label=label)
        if throughput_key:
            xs, ys = series(records, throughput_key)
            if ys:
                axes["throughput"].plot(xs, ys, color=color, label=label)
        if "expert load" in axes:
            styles = ["-", "--", ":", "-."]
            for j, (block, (xs, ys)) in enumerate(sorted(loads[i].items())):
                axes["expert load"].plot(xs, ys, color=color, linestyle=styles[j % len(styles)],
                                         label=f"{label} {block}")

    axes["loss"].set_ylabel("loss" + (f" (mean of {smooth})" if smooth > 1 else ""))
    if logy:
        axes["loss"].set_yscale("log")
    if "accuracy" in axes:
        axes["accuracy"].set_ylabel("test accuracy")
    if throughput_key:
        axes["throughput"].set_ylabel(throughput_key.replace("_per_s", "/s"))
    if "expert load" in axes:
        axes["expert load"].set_ylabel("max / mean tokens per expert")
    for name, ax in axes.items():
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return panels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="metrics files, one JSON object per line")
    parser.add_argument("-o", "--output", required=True, help="PNG to write")
    parser.add_argument("--title")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over N loss points")
    parser.add_argument("--labels", nargs="+", help="one label per file (default: file names)")
    parser.add_argument("--logy", action="store_true", help="log scale for the loss")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    if args.labels and len(args.labels) != len(args.files):
        parser.error(f"--labels gives {len(args.labels)} labels for {len(args.files)} files")
    labels = args.labels or [os.path.basename(f) for f in args.files]
    try:
        runs = [(label, read_metrics(path)) for label, path in zip(labels, args.files)]
        panels = plot(runs, args.output, title=args.title, smooth=args.smooth, logy=args.logy)
    except MetricsError as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 1
    points = sum(len(series(r, "loss")[1]) for _, r in runs)
    print(f"wrote {args.output}: panels {', '.join(panels)}; "
          f"{len(runs)} runs, {points} loss points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
