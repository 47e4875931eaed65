"""The report of scripts/reproduce_tx2_daily.py: its day-by-day table and its plot.

``table(summary)`` and ``plot(summary, path)`` take the summary the script prints with --json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from odtd.sim.arms import ARMS, CONTROLS

PUBLISHED = {"day0": 60.65, "day17": 61.32}


def mean_over_runs(summary, arm: str, key: str) -> list:
    """An arm's figure per day, averaged over the runs (None where a run has none)."""
    values = [[row["arms"][arm].get(key) for row in run["rows"]] for run in summary["runs"]]
    return [None if None in day else float(np.mean(day)) for day in zip(*values)]


def plot(summary, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = summary["test_images"]["domains"]
    fig, axes = plt.subplots(len(domains) + 1, 1, figsize=(9, 3.6 * len(domains) + 2.4), sharex=True,
                             gridspec_kw={"height_ratios": [3] * len(domains) + [1.4]})
    days = list(range(summary["days"] + 1))
    runs = f" (mean of {len(summary['seeds'])} seeds)" if len(summary["seeds"]) > 1 else ""
    for ax, domain in zip(axes, domains):
        for n, arm in enumerate(summary["arms"]):
            ax.plot(days, [100 * v for v in mean_over_runs(summary, arm, domain)], "os^vDx"[n % 6] + "-",
                    color=f"C{n}", label=f"{arm}: {ARMS[arm]}", ms=4)
        if domain == "clean" and not summary["shift"]:
            ax.plot([0, 17], [PUBLISHED["day0"], PUBLISHED["day17"]], ":", color="grey",
                    label="published TX2 (60.65 -> 61.32)")
        what = f"the {summary['shift']} camera" if domain == "shifted" else "clean images"
        ax.set_ylabel(f"test accuracy (%)\n{what}")
        ax.grid(alpha=0.3)
    camera = f", camera shift {summary['shift']}" if summary["shift"] else ""
    axes[0].set_title(f"{summary['model']}, {summary['per_day']} new images a day{camera}, "
                      f"{summary['test_images']['daily']:,} test images{runs}")
    axes[0].legend(fontsize=7)
    for n, arm in enumerate(summary["arms"]):
        energy = mean_over_runs(summary, arm, "energy_j_total")
        if any(energy):
            axes[-1].plot(days, [e / 1000 if e is not None else np.nan for e in energy], "-", color=f"C{n}")
    sources = {v.get("energy_source") for run in summary["runs"] for row in run["rows"]
               for v in row["arms"].values()} - {None}
    axes[-1].set_ylabel("energy, cumulative (kJ)\n" + ", ".join(sorted(sources)))
    axes[-1].set_xlabel("day")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _diff(d: dict) -> str:
    text = f"{d['points']:+.2f} ± {d['se']:.2f}"
    return text + (f" (seeds ± {d['se_seeds']:.2f})" if "se_seeds" in d else "")


def _number(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _diffs(by_domain: dict) -> str:
    return "; ".join(f"{domain} {_diff(d)}" for domain, d in by_domain.items())


def table(summary) -> str:
    domains = summary["test_images"]["domains"]
    full, daily = summary["test_images"]["all"], summary["test_images"]["daily"]
    camera = f"camera shift {summary['shift']}" if summary["shift"] else "no camera shift"
    lines = [f"{summary['model']}, {camera}; test accuracy on the {daily:,}-image daily subset "
             f"({' / '.join(domains)}); validation on the device's {summary['validation_images']:,}"]
    for run in summary["runs"]:
        lines.append(f"seed {run['seed']}")
        lines.append("day  arm     " + "".join(f"{d:>9}" for d in domains)
                     + "   valid.  outcome       energy J   total J   J/point")
        for row in run["rows"]:
            for arm, v in row["arms"].items():
                if row["day"] == 0 and arm != summary["arms"][0]:
                    continue
                line = f"{row['day']:3d}  {arm if row['day'] else 'base':<7}" + "".join(
                    f"{100 * v[d]:8.2f}%" for d in domains)
                line += f"  {100 * v['validation']:6.2f}%" if v.get("validation") is not None else "        "
                if row["day"]:
                    energy, per_point = v.get("energy_j"), v.get("joules_per_point")
                    line += (f"  {v.get('outcome') or '':<12}  {_number(energy):>8}"
                             f"  {_number(v['energy_j_total']):>8}  {_number(per_point):>8}")
                lines.append(line.rstrip())
            for name, by_domain in row.get("differences", {}).items():
                if name.split("-")[1] in CONTROLS:
                    lines.append(f"     {name:<13}" + _diffs(by_domain))
    final = summary["final"]
    seeds = len(final["seeds"])
    lines.append(f"after day {summary['days']}, all {full:,} test images"
                 + (f", mean of {seeds} seeds" if seeds > 1 else "") + ": change from day 0 "
                 + ", ".join(f"{d} {100 * summary['pretrain']['test_accuracy'][d]:.2f}%" for d in domains))
    for arm, v in final["arms"].items():
        lines.append(f"  {arm:<7}" + "".join(
            f"  {d} {100 * v['accuracy'][d]:.2f}% ({v['gain_points'][d]:+.2f})" for d in domains))
    for name, by_domain in final["differences"].items():
        lines.append(f"  {name:<12}" + _diffs(by_domain))
    lines.append(f"wall {summary['wall_s']} s; {summary['machine']}")
    return "\n".join(lines)
