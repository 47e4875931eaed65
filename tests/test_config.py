import logging

import pytest

from odtd.config import Config, default_config_text, load_config
from odtd.errors import ConfigError, PolicyError
from odtd.policy import default_policy_text, load_policy


def test_default_config_text_is_the_default_config(tmp_path):
    path = tmp_path / "odtd.yaml"
    path.write_text(default_config_text())
    assert load_config(path) == Config()


def test_unknown_key_names_file_and_key(tmp_path):
    path = tmp_path / "odtd.yaml"
    path.write_text("schedule:\n  cronn: '0 2 * * *'\n")
    with pytest.raises(ConfigError, match=r"odtd.yaml: unknown key 'schedule.cronn'"):
        load_config(path)


def test_bad_cron_names_file_key_and_value(tmp_path):
    path = tmp_path / "odtd.yaml"
    path.write_text("schedule:\n  cron: '0 25 * * *'\n")
    with pytest.raises(ConfigError, match=r"odtd.yaml: schedule.cron='0 25 \* \* \*': invalid cron"):
        load_config(path)


def test_wrong_type_and_bad_yaml(tmp_path):
    path = tmp_path / "odtd.yaml"
    path.write_text("inbox:\n  scan_interval_s: soon\n")
    with pytest.raises(ConfigError, match=r"inbox.scan_interval_s='soon'"):
        load_config(path)
    path.write_text("schedule: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_default_policy_files_match_the_shipped_defaults(tmp_path):
    from pathlib import Path

    policies = Path(__file__).resolve().parents[1] / "policies"
    assert (policies / "default.yaml").read_text() == default_policy_text()
    assert default_policy_text("tinycnn") == default_policy_text()  # no recipe of its own
    own = default_policy_text("densenet40")
    assert (policies / "densenet40.yaml").read_text() == own != default_policy_text()


def test_policy_errors_name_key_and_value(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("batch:\n  size: -4\n")
    with pytest.raises(PolicyError, match=r"p.yaml: batch.size=-4: Input should be greater than or equal"):
        load_policy(path)


def test_training_batchnorm_alone_needs_batchnorm_that_trains(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("training:\n  trainable: batchnorm\n")  # freeze_bn is true by default
    with pytest.raises(PolicyError, match=r"p.yaml: training.trainable=batchnorm .* freeze_bn: false"):
        load_policy(path)
    path.write_text("training:\n  trainable: batchnorm\n  freeze_bn: false\n")
    assert load_policy(path).training.trainable == "batchnorm"


def test_bare_on_and_off_mean_the_words_for_the_plan_switches(tmp_path):
    # YAML 1.1 reads on/off as booleans; the policy takes them as the words they are.
    path = tmp_path / "p.yaml"
    path.write_text("training:\n  recompute: on\n  micro_batch_size: off\n")
    training = load_policy(path).training
    assert (training.recompute, training.micro_batch_size) == ("on", "off")
    path.write_text("training:\n  recompute: off\n  micro_batch_size: 8\n")
    training = load_policy(path).training
    assert (training.recompute, training.micro_batch_size) == ("off", 8)
    path.write_text("training:\n  freeze_bn: on\n")  # a real boolean stays one
    assert load_policy(path).training.freeze_bn is True


def test_recompute_takes_a_share_of_the_network(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("training:\n  recompute: 0.5\n")
    assert load_policy(path).training.recompute == 0.5
    for bad in ("0", "1.5", "-0.2", "sometimes"):
        path.write_text(f"training:\n  recompute: {bad}\n")
        with pytest.raises(PolicyError, match=r"p.yaml: training.recompute"):
            load_policy(path)


def test_distill_is_a_non_negative_weight(tmp_path):
    path = tmp_path / "p.yaml"
    assert load_policy(path).training.distill == 0.0  # off unless asked for
    path.write_text("training:\n  distill: 1.5\n")
    assert load_policy(path).training.distill == 1.5
    for text in ("-1", "soft"):
        path.write_text(f"training:\n  distill: {text}\n")
        with pytest.raises(PolicyError, match=r"training.distill"):
            load_policy(path)


def test_trained_share_is_a_share_above_zero_or_auto(tmp_path):
    path = tmp_path / "p.yaml"
    assert load_policy(path).training.trained_share == 1.0  # the trained weights as they are
    for text, value in (("auto", "auto"), ("0.5", 0.5), ("1", 1.0)):
        path.write_text(f"training:\n  trained_share: {text}\n")
        assert load_policy(path).training.trained_share == value
    for text in ("0", "1.5", "null", "true", "half"):
        path.write_text(f"training:\n  trained_share: {text}\n")
        with pytest.raises(PolicyError, match=r"training.trained_share"):
            load_policy(path)


def test_bn_device_share_is_a_share_auto_or_null(tmp_path):
    path = tmp_path / "p.yaml"
    for text, value in (("auto", "auto"), ("0.5", 0.5), ("1", 1.0), ("null", None)):
        path.write_text(f"training:\n  bn_device_share: {text}\n")
        assert load_policy(path).training.bn_device_share == value
    for text in ("1.5", "-0.25", "device"):
        path.write_text(f"training:\n  bn_device_share: {text}\n")
        with pytest.raises(PolicyError, match=r"training.bn_device_share"):
            load_policy(path)


def test_bn_device_weight_still_loads_as_bn_device_share_with_a_warning(tmp_path, caplog):
    # The key's first name (a share, like trained_share): an old policy file keeps working.
    path = tmp_path / "p.yaml"
    for text, value in (("0.75", 0.75), ("auto", "auto"), ("null", None)):
        path.write_text(f"training:\n  freeze_bn: true\n  bn_device_weight: {text}\n")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="odtd.policy"):
            training = load_policy(path).training
        assert training.bn_device_share == value and training.freeze_bn is True
        lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
        assert lines == [f"{path}: training.bn_device_weight is deprecated: rename it "
                         "training.bn_device_share (same value)"]
    path.write_text("training:\n  bn_device_weight: 0.5\n  bn_device_share: 0.5\n")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert "training.bn_device_weight and training.bn_device_share" in str(caught.value)
    assert str(path) in str(caught.value) and len(str(caught.value).splitlines()) == 1
    path.write_text("training:\n  bn_device_weight: 2\n")  # its value checked as the new key's
    with pytest.raises(PolicyError, match=r"training.bn_device_share=2"):
        load_policy(path)
