"""``odtctl profile`` and ``odtctl policy validate | explain | check | schema``.

Handlers register with ``odtd.cli.command``; ``add_parsers`` adds their argument parsers. Like
the rest of the CLI, only these handlers print (through ``emit`` and ``progress``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError, PolicyError
from odtd.policy import Policy, load_policy
from odtd.session.gates import FORCE_CLOSED_FILE, check_gates
from odtd.table import table
from odtd.trainer.protocol.job import PRECISIONS

DEFAULT_PROFILE_STEPS = 10
_NO_PENDING_SAMPLES = 64  # DESIGN.md's reference day: 64 new images


def _int_list(option: str, text: str) -> List[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"{option} {text!r}: expected sizes >= 1 separated by commas, "
                          "e.g. 4,8,16")
    return sizes


def _precisions(text: str) -> List[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in PRECISIONS]
    if not names or unknown:
        raise ConfigError(f"--precisions {text!r}: choose from {', '.join(PRECISIONS)}, "
                          "separated by commas")
    return list(dict.fromkeys(names))


def _recompute_shares(text: str) -> List[float]:
    """``off,0.5,on`` -> [0.0, 0.5, 1.0]; ``both`` is ``off,on``."""
    from odtd.profiling.profile import recompute_share

    parts = [part.strip() for part in text.replace("both", "off,on").split(",")]
    try:
        return sorted({recompute_share(part) for part in parts})
    except ValueError:
        raise ConfigError(f"--recompute {text!r}: give off, on, both or shares of the network "
                          "from 0 to 1, separated by commas (e.g. off,0.5,on)") from None


# -- profile ---------------------------------------------------------------------------------


@command("profile")
def cmd_profile(args: argparse.Namespace) -> int:
    """Profile batch sizes in worker processes; optionally write a policy from the result."""
    from odtd.home.spec import check_model_name
    from odtd.profiling.policy_writer import write_policy
    from odtd.profiling.profile import plan_name, profile_table
    from odtd.profiling.sweep import run_profile

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: measure at least 1 step")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: run each size at least once")
    if not args.write_policy and (args.objective or args.memory_budget_mb is not None):
        raise ConfigError("--objective and --memory-budget-mb choose the batch size of "
                          "--write-policy FILE; add --write-policy FILE")
    home = home_of(args)
    store = home.open_store()
    try:
        config = home.load_config()
        policy = load_policy(home.policy_path(config))
        model = args.model or store.meta("model")
        if model != store.meta("model"):
            check_model_name(model)
        sizes = _int_list("--batch-sizes", args.batch_sizes) if args.batch_sizes \
            else list(policy.batch.candidates)
        precisions = _precisions(args.precisions) if args.precisions \
            else [policy.training.precision]
        recompute = _recompute_shares(args.recompute)
        result = run_profile(home, store, config, model, sizes, args.steps, precisions,
                             progress=progress, training=policy.training, recompute=recompute,
                             repeats=args.repeats)
        data = result.to_dict()
        runs = f", {args.repeats} runs of each" if args.repeats > 1 else ""
        lines = [f"profile {result.profile_id}: {model} on {result.board}, telemetry "
                 f"{result.backend}, {result.steps} measured steps per size{runs}", "",
                 *profile_table(result), ""]
        lines += [f"memory fit ({plan_name(p, r)}): {result.memory_fit(p, r).describe()}"
                  for p, r in result.plans()]
        if args.write_policy:
            written = write_policy(Path(args.write_policy), policy, result,
                                   args.objective or policy.objective, args.memory_budget_mb)
            data["policy_written"] = written
            lines += [*written["notes"][1:], f"wrote {written['path']}: batch "
                      f"{written['batch_size']} (objective {written['objective']})"]
    finally:
        store.close()
    emit(args, data, "\n".join(lines))
    return 0


# -- policy ----------------------------------------------------------------------------------


@command("policy")
def cmd_policy(args: argparse.Namespace) -> int:
    """Dispatch ``policy validate | explain | schema``."""
    if args.policy_command == "schema":
        emit(args, Policy.model_json_schema())
        return 0
    if args.policy_command == "validate":
        return _validate(args)
    if args.policy_command == "check":
        return _check(args)
    return _explain(args)


def _check(args: argparse.Namespace) -> int:
    """``policy check [FILE]``: a few steps of the policy on the home's images (exit 1: diverged)."""
    from odtd.session.check import check_policy

    home = home_of(args)
    store = home.open_store()  # an error line where the home is not initialised
    config = home.load_config()
    path = Path(args.file) if args.file else home.policy_path(config)
    try:
        policy = load_policy(path, missing_ok=args.file is None)
    except PolicyError:
        store.close()
        raise
    try:
        found = check_policy(home, store, config, policy, progress,
                             remember=path.resolve() == home.policy_path(config).resolve())
    finally:
        store.close()
    emit(args, {"policy": str(path), **found.to_dict()}, found.message)
    return 1 if found.verdict == "diverged" else 0


def _profile_context(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The home's model, latest profile and learned OOM limit; None outside a home."""
    from odtd.profiling.profile import ProfileResult
    from odtd.session.oom import learned_oom_limit

    home = home_of(args)
    if not home.is_initialised():
        return None
    store = home.open_store()
    try:
        model = store.meta("model")
        return {"home": home, "model": model, "counts": store.sample_counts(),
                "profile": ProfileResult.from_store(store, model),
                "oom_limit": learned_oom_limit(store, model)}
    finally:
        store.close()


def _validate(args: argparse.Namespace) -> int:
    from odtd.profiling.memory_fit import allowed_mb
    from odtd.session.prediction import memory_problem, predict

    path = Path(args.file)
    policy = load_policy(path, missing_ok=False)
    batch = policy.batch
    context = _profile_context(args)
    profile = context["profile"] if context else None
    summary: Dict[str, Any] = {"file": str(path), "valid": True, "batch_size": batch.size,
                               "objective": policy.objective, "memory_check": None, "notes": []}
    if profile is None:
        summary["notes"].append("memory not checked: " + (
            "no odtd home here" if context is None else
            f"{context['model']} was never profiled (run `odtctl profile`)"))
    else:
        precision = policy.training.precision
        prediction = predict(profile, precision, batch.size, 1, 1)
        problem = memory_problem(prediction, batch)
        fit = profile.memory_fit(precision)
        if problem:
            if prediction.fails_at is not None:
                failed = profile.smallest_failure(precision)
                raise PolicyError(f"{path}: batch.size={batch.size}: batch {prediction.fails_at} "
                                  f"did not run when {context['model']} was profiled "
                                  f"({failed.reason if failed else ''}); lower batch.size below "
                                  f"{prediction.fails_at}")
            limit = allowed_mb(batch.memory_budget_mb, batch.headroom_pct)  # type: ignore[arg-type]
            largest = fit.largest_batch(batch.memory_budget_mb, batch.headroom_pct) \
                if (fit.per_sample_mb or 0) > 0 else None  # type: ignore[arg-type]
            raise PolicyError(
                f"{path}: batch.size={batch.size}: needs ~{prediction.peak_mb:.0f} MB by the "
                f"profile's {fit.formula()} (profile {profile.profile_id}); the memory "
                f"budget {batch.memory_budget_mb:.0f} MB less {batch.headroom_pct:g}% headroom "
                f"is {limit:.0f} MB. Lower batch.size"
                f"{f' to {largest} or less' if largest else ''} or raise batch.memory_budget_mb")
        summary["memory_check"] = {"profile_id": profile.profile_id,
                                   "predicted_peak_mb": _round(prediction.peak_mb),
                                   "memory_budget_mb": batch.memory_budget_mb,
                                   "headroom_pct": batch.headroom_pct}
        if prediction.peak_mb is None:
            summary["notes"].append(f"memory not checked: {fit.reason}")
        elif batch.memory_budget_mb is None:
            summary["notes"].append("no memory budget (batch.memory_budget_mb: null)")
    limit = context["oom_limit"] if context else None
    if limit is not None and batch.size >= limit:
        summary["notes"].append(f"batch {limit} ran out of memory in an earlier session: "
                                "sessions will run below it")
    check = summary["memory_check"]
    text = (f"{path}: valid; batch {batch.size}, objective {policy.objective}, "
            f"{policy.training.epochs} epochs, precision {policy.training.precision}")
    if check and check["predicted_peak_mb"] is not None:
        text += (f"; predicted peak {check['predicted_peak_mb']:.0f} MB (profile "
                 f"{check['profile_id']})")
        if batch.memory_budget_mb is not None:
            text += (f" within {allowed_mb(batch.memory_budget_mb, batch.headroom_pct):.0f} MB "
                     f"({batch.memory_budget_mb:.0f} MB less {batch.headroom_pct:g}% headroom)")
    emit(args, summary, "\n".join([text] + [f"  note: {n}" for n in summary["notes"]]))
    return 0


def _round(value: Optional[float], digits: int = 1) -> Optional[float]:
    return None if value is None else round(value, digits)


def _session_samples(policy: Policy, counts: Dict[str, int], override: Optional[int]
                     ) -> Dict[str, Any]:
    """Tonight's samples per epoch: pending (capped) plus replay, as the session will draw."""
    if override is not None:
        return {"new": override, "replay": 0, "total": override, "basis": "--samples"}
    new = min(counts.get("pending", 0), policy.training.max_samples_per_session)
    basis = "pending samples"
    if new == 0:
        new, basis = _NO_PENDING_SAMPLES, ("no pending samples, so tonight's session would be "
                                           f"skipped; shown for a {_NO_PENDING_SAMPLES}-image day")
    replay_policy = policy.replay
    replay = min(int(round(replay_policy.ratio * new)), replay_policy.max_samples,
                 counts.get("trained", 0), replay_policy.capacity_samples)
    return {"new": new, "replay": replay, "total": new + replay, "basis": basis}


def _explain(args: argparse.Namespace) -> int:
    from odtd.profiling.sweep import board_description
    from odtd.session.admission import admit
    from odtd.session.prediction import Plan, memory_problem, predict

    context = _profile_context(args)
    home = context["home"] if context else home_of(args)
    path = Path(args.file) if args.file else home.policy_path(home.load_config())
    policy = load_policy(path, missing_ok=args.file is None)
    profile = context["profile"] if context else None
    samples = _session_samples(policy, context["counts"] if context else {}, args.samples)
    epochs, precision = policy.training.epochs, policy.training.precision
    admission = admit(policy, profile, samples["total"], context["oom_limit"] if context else None,
                      board=board_description())
    gates = check_gates(policy.gates, force_file=home.run / FORCE_CLOSED_FILE)
    data: Dict[str, Any] = {"policy": str(path), "profile_id": None, "memory_model": None,
                            "samples": samples, "epochs": epochs, "predictions": [],
                            "admission": admission.to_dict(),
                            "gates": [vars(g) for g in gates]}
    rate = _learning_rate(context, policy)
    data["learning_rate"] = rate.to_dict()
    lines = [f"policy {path}: objective {policy.objective}, batch {policy.batch.size}, "
             f"{epochs} epochs, precision {precision}, learning rate {rate.describe()}"]
    if profile is None:
        lines.append("no profile: run `odtctl profile` to predict time, energy and memory")
    else:
        fit = profile.memory_fit(precision)
        data.update(profile_id=profile.profile_id, memory_model=fit.to_dict())
        ids = sorted({r.profile_id for r in profile.rows if r.profile_id is not None})
        merged = f", newest row per size from profiles {', '.join(map(str, ids))}" \
            if len(ids) > 1 else ""
        lines += [f"profile {profile.profile_id} of {profile.model} on {profile.board} "
                  f"(telemetry {profile.backend}{merged}); memory fit: {fit.describe()}",
                  f"tonight: {samples['new']} new + {samples['replay']} replay = "
                  f"{samples['total']} samples x {epochs} epochs ({samples['basis']})"]
        rows = []
        sizes = sorted(set(policy.batch.candidates) | {policy.batch.size}
                       | {r.batch_size for r in profile.rows if r.precision == precision})
        for size in sizes:
            p = predict(profile, precision, size, samples["total"], epochs)
            problem = memory_problem(p, policy.batch)
            row = {**vars(p), "fits_memory": problem is None, "memory_problem": problem}
            data["predictions"].append(row)
            beyond = p.memory_extrapolated_past
            past = f" (extrapolated past batch {beyond})" if beyond is not None else ""
            rows.append(("*" if size == policy.batch.size else "", size, p.basis,
                         _num(p.time_s, ".1f"), _num(p.energy_j, ".1f"), _num(p.peak_mb, ".0f"),
                         f"{problem or 'fits'}{past}"))
        lines += table(rows, ("", "batch", "basis", "time s", "energy J", "peak MB", "memory"),
                       align="<><>>>")
    a = admission
    plan = Plan(a.precision, a.recompute, a.micro_batch_size).name
    lines.append(f"admission: {a.decision} at batch {a.batch_size} ({plan}), {a.epochs} epochs; "
                 f"{a.reason}")
    if a.rejected:
        lines.append("plans not chosen:")
        lines += table(((f"batch {r['batch_size']}", r["plan"], r["reason"]) for r in a.rejected),
                       indent="  ")
    lines.append("gates now:" if gates else "gates: none configured")
    lines += table(((g.name, "open" if g.passed else "CLOSED", g.reason) for g in gates), indent="  ")
    emit(args, data, "\n".join(lines))
    return 0


def _learning_rate(context: Optional[Dict[str, Any]], policy: Policy) -> Any:
    """The rate tonight's session starts at (``session.learning_rate.starting_rate``)."""
    from odtd.session.learning_rate import LearningRate, starting_rate

    if context is None:
        return LearningRate(policy.training.learning_rate, policy.training.learning_rate)
    store = context["home"].open_store()
    try:
        return starting_rate(store, context["model"], policy.training)
    finally:
        store.close()


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


# -- parsers ---------------------------------------------------------------------------------


def add_parsers(sub: Any, common: argparse.ArgumentParser, reader: argparse.ArgumentParser
                ) -> None:
    """Add ``profile`` and ``policy`` (validate, explain, schema) to ``odtctl``'s sub-parsers."""
    p = sub.add_parser(
        "profile", parents=[reader], help="measure batch sizes: throughput, energy, peak memory",
        description="Run each batch size (and precision) in its own trainer worker, skip "
                    "3 warm-up steps, measure samples/s, joules per sample per rail and peak "
                    "memory, fit peak memory = fixed + per-sample x batch, store the profile, "
                    "and optionally write a policy with the best batch size for the objective.")
    p.add_argument("--model", help="registry name (default: the home's model)")
    p.add_argument("--batch-sizes", help="comma-separated sizes, e.g. 4,8,16 "
                                         "(default: the policy's batch.candidates)")
    p.add_argument("--steps", type=int, default=DEFAULT_PROFILE_STEPS,
                   help=f"measured steps per size after the warm-up (default "
                        f"{DEFAULT_PROFILE_STEPS})")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the sweep this many times over and fit memory through every run: a "
                        "size's peak moved between runs by up to 12%% on large batches here, "
                        "and the peak kept is the largest run's (default 1; 3 where a memory "
                        "budget is tight)")
    p.add_argument("--precisions", help="comma-separated, from " + ", ".join(PRECISIONS) +
                                        " (default: the policy's training.precision)")
    p.add_argument("--recompute", default="off", metavar="off,on,SHARE",
                   help="profile without (off, default) and/or with gradient checkpointing, so "
                        "admission can weigh it (training.recompute: auto): comma-separated, "
                        "off, on (every segment but the last), a share of the network from the "
                        "input (0.5), or both (off,on)")
    p.add_argument("--write-policy", metavar="FILE",
                   help="write the active policy with the best measured batch size to FILE")
    p.add_argument("--objective", choices=["energy", "time", "balanced"],
                   help="with --write-policy: what 'best' means (default: the policy's)")
    p.add_argument("--memory-budget-mb", type=float,
                   help="with --write-policy: the memory budget to choose under and write "
                        "(default: the policy's batch.memory_budget_mb)")

    p = sub.add_parser("policy", parents=[common], help="validate, explain or describe a policy",
                       description="validate FILE | explain [FILE] | check [FILE] | schema")
    actions = p.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    v = actions.add_parser(
        "validate", parents=[reader], help="check a policy file, and its batch size against "
                                           "the latest profile's memory prediction",
        description="Exit 0 with a summary, or print one 'Error: FILE: key=value: problem' "
                    "line per problem and exit 1.")
    v.add_argument("file", help="policy YAML")
    e = actions.add_parser(
        "explain", parents=[reader], help="predict tonight's session at each batch size, the "
                                          "plan admission picks and the plans it rejects, and "
                                          "which gates are open now",
        description="With the latest profile: predicted training time, energy and peak memory "
                    "at the policy's batch size (*) and each candidate, the admission "
                    "decision with its plan (precision, recomputation, micro-batches) and every "
                    "plan it did not choose and why, and each gate now. A gate can be "
                    f"forced closed by writing its name to ODTD_HOME/run/{FORCE_CLOSED_FILE}.")
    e.add_argument("file", nargs="?", help="policy YAML (default: the home's active policy)")
    e.add_argument("--samples", type=int,
                   help="samples per epoch to predict for (default: pending + replay)")
    c = actions.add_parser(
        "check", parents=[reader], help="train a few steps of a policy on the home's images "
                                        "and report a loss that diverges or rises",
        description="Train a copy of the served model for a few steps of the policy's recipe "
                    "(at least 16) on a session's worth of the home's images (the replay "
                    "seed, else the validation set), in a worker, writing no model version. "
                    "Prints the loss over the first and last third of the steps, or a "
                    "one-line warning with the fix: a loss that is not finite at every rate "
                    "the policy lets a session retry at (exit 1), or one that rises. A lower "
                    "rate that trained after a retry is remembered, and sessions start there.")
    c.add_argument("file", nargs="?", help="policy YAML (default: the home's active policy)")
    actions.add_parser("schema", parents=[reader], help="print the policy's JSON schema",
                       description="Print the JSON schema of policy.yaml (every key, type, "
                                   "default and description).")
