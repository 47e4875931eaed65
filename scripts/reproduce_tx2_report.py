"""The report of scripts/reproduce_tx2_daily.py: its day-by-day table and its plot.

``table(summary)`` takes the summary the script prints with --json; its plot is
``odtd.report.plot.plot_arms`` (also ``odtctl plot --arms``).
"""

from __future__ import annotations

from odtd.sim.arms import CONTROLS

PUBLISHED = {"day0": 60.65, "day17": 61.32}


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
