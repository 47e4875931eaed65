"""Precision ``auto`` (odtd.trainer.plans.precision) without TensorFlow: the flags, the kept verdict.

The measurement itself runs in a real worker: tests/test_worker.py.
"""

import json
from types import SimpleNamespace

import pytest

from odtd.trainer.plans import precision

BF16_CPU = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx512f avx512_bf16\n"
PLAIN_CPU = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2\n"


@pytest.fixture
def measured(monkeypatch):
    """Stand in for the timing: each call returns the next speedup and is counted."""
    calls = []

    def speedups(values):
        def measure(tf):
            calls.append(tf.__version__)
            return values[len(calls) - 1]
        monkeypatch.setattr(precision, "measure_bfloat16_speedup", measure)
        return calls
    return speedups


def resolve(cpuinfo, probe, version="2.21.0", requested="auto", gpu=False):
    return precision.resolve_precision(requested, gpu, SimpleNamespace(__version__=version),
                                       str(probe) if probe else None, str(cpuinfo))


def test_a_gpu_or_a_cpu_without_bfloat16_never_measures(tmp_path, measured):
    calls = measured([])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(PLAIN_CPU)
    assert resolve(cpuinfo, tmp_path / "p.json") == (
        "fp32", "no bfloat16 instructions on this CPU")
    cpuinfo.write_text(BF16_CPU)
    assert resolve(cpuinfo, tmp_path / "p.json", gpu=True) == ("mixed_float16", "a GPU")
    assert resolve(cpuinfo, tmp_path / "p.json", requested="mixed_bfloat16") == (
        "mixed_bfloat16", None)
    assert calls == [] and not (tmp_path / "p.json").exists()


def test_bfloat16_is_chosen_only_where_it_measures_faster_and_the_verdict_is_kept(
        tmp_path, measured):
    calls = measured([0.6, 1.5, 1.1])
    cpuinfo, probe = tmp_path / "cpuinfo", tmp_path / "precision.json"
    cpuinfo.write_text(BF16_CPU)
    chosen, why = resolve(cpuinfo, probe)
    assert chosen == "fp32" and "0.60x float32's speed" in why and str(probe) in why
    assert json.loads(probe.read_text())["key"] == {
        "cpu": "Some CPU", "flags": ["avx512_bf16"], "tensorflow": "2.21.0"}
    assert resolve(cpuinfo, probe)[0] == "fp32" and calls == ["2.21.0"]  # read, not measured
    # another TensorFlow build measures again
    assert resolve(cpuinfo, probe, version="2.22.0")[0] == "mixed_bfloat16"
    assert len(calls) == 2 and json.loads(probe.read_text())["bfloat16_speedup"] == 1.5
    probe.write_text("{not json")  # a damaged file is measured again, not trusted
    assert resolve(cpuinfo, probe, version="2.22.0")[0] == "fp32"  # 1.1 < MIN_SPEEDUP
    assert len(calls) == 3


def test_without_a_probe_file_every_auto_measures(tmp_path, measured):
    calls = measured([1.3, 1.3])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(BF16_CPU)
    assert resolve(cpuinfo, None)[0] == "mixed_bfloat16"
    assert resolve(cpuinfo, None)[0] == "mixed_bfloat16" and len(calls) == 2  # nothing kept


def test_an_unwritable_probe_file_still_resolves(tmp_path, measured, capsys):
    measured([0.5])
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(BF16_CPU)
    assert resolve(cpuinfo, tmp_path / "missing-dir" / "p.json")[0] == "fp32"
    assert "cannot keep the precision probe" in capsys.readouterr().err


class OpError(Exception):
    """Stands in for tf.errors.OpError, the base of TensorFlow's run-time errors."""


class InternalError(OpError):
    pass


def test_a_probe_that_cannot_run_resolves_to_fp32_says_why_and_is_not_tried_again(
        tmp_path, monkeypatch):
    """TensorFlow 2.6 and 2.7 have no bfloat16 convolution for this CPU without oneDNN: the
    probe fails at run time (tests/test_tx2.py runs it for real on those stacks)."""
    calls = []

    def measure(tf):
        calls.append(tf.__version__)
        raise InternalError(" Missing 0-th output from node Conv2D (defined at x.py:87)  "
                            "[Op:__inference_step_185]\n\nFunction call stack:\nstep\n")
    monkeypatch.setattr(precision, "measure_bfloat16_speedup", measure)
    tf = SimpleNamespace(__version__="2.6.2", errors=SimpleNamespace(OpError=OpError))
    cpuinfo, probe = tmp_path / "cpuinfo", tmp_path / "precision.json"
    cpuinfo.write_text(BF16_CPU)
    chosen, why = precision.resolve_precision("auto", False, tf, str(probe), str(cpuinfo))
    assert chosen == "fp32"
    assert why == ("bfloat16 convolutions cannot run on this CPU with TensorFlow 2.6.2 "
                   "(InternalError: Missing 0-th output from node Conv2D); kept in " + str(probe))
    assert precision.resolve_precision("auto", False, tf, str(probe), str(cpuinfo)) == (chosen, why)
    assert calls == ["2.6.2"]  # the kept verdict is read, not tried again

    def broken(tf):
        raise RuntimeError("a bug in odtd's probe")  # not TensorFlow's verdict: not hidden
    monkeypatch.setattr(precision, "measure_bfloat16_speedup", broken)
    with pytest.raises(RuntimeError):
        precision.resolve_precision("auto", False, tf, None, str(cpuinfo))


def test_only_a_start_event_of_precision_auto_is_said():
    from odtd.trainer.protocol.launch import precision_said

    start = {"event": "start", "precision": "fp32",
             "precision_reason": "bfloat16 convolutions measured at 0.56x float32's speed"}
    assert precision_said(start) == ("precision auto -> fp32 (bfloat16 convolutions measured at "
                                     "0.56x float32's speed)")
    assert precision_said(dict(start, precision_reason=None)) is None  # not auto
    assert precision_said(dict(start, event="step")) is None
