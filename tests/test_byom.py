"""Bring your own model: a user's Keras classifier in, fine-tuned on the device, a Keras file out.

The model files are real Keras files: tests/fixtures/keras/k2 and k3 hold small ones written by
tf.keras 2.15 and Keras 3.15 (each stack imports the other's), and ``models`` writes this
stack's, MobileNetV2 included, with tests/make_keras_models.py in a subprocess.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import (
    REPO,
    built_once,
    native_suffix,
    odtctl,
    odtctl_json,
    plain_python,
    worker_config,
    worker_keras_major,
)
from PIL import Image

from odtd.errors import ModelError
from odtd.home.spec import imported_name
from odtd.trainer.modelfile import model_config, model_file

FIXTURES = REPO / "tests" / "fixtures" / "keras"
CLASSES = {"cnn_softmax": "cat,dog,owl,fox", "gray_logits": "red,green,blue",
           "mobilenet": "ant,bee,cow,doe,eel", "frozen_augmented": "sun,rain,snow",
           "arithmetic": "oak,elm,ash,yew", "dialect_details": "a,b,c"}


def keras_major() -> int:
    return worker_keras_major()


@pytest.fixture(scope="session")
def other_stack():
    """The fixture files the other Keras wrote (Keras 2's for Keras 3 and the reverse)."""
    return FIXTURES / ("k2" if keras_major() == 3 else "k3")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """This stack's model files, written by tests/make_keras_models.py (MobileNetV2 too)."""
    def build(out: Path) -> None:
        proc = plain_python(str(REPO / "tests" / "make_keras_models.py"), str(out), *CLASSES)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "keras-models", build)


def photos(root: Path, classes: str, per_class: int, seed: int) -> Path:
    """Camera-like images of several sizes and modes under root/<class>/."""
    rng = np.random.default_rng(seed)
    kinds = [((640, 480), "RGB", "jpg"), ((90, 200), "RGBA", "png"), ((50, 50), "L", "bmp"),
             ((120, 80), "P", "png"), ((64, 48), "RGB", "webp")]
    for label in classes.split(","):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (width, height), mode, fmt = kinds[i % len(kinds)]
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            image = image.convert(mode) if mode != "P" else image.quantize(16)
            image.save(root / label / f"{i}.{fmt}")
    return root


# -- screening, without Keras ---------------------------------------------------------------

@pytest.mark.parametrize("stack", ["k2", "k3"])
@pytest.mark.parametrize("name, layer, reason", [
    ("lambda", "doubler", "Lambda layer (runs Python code from the file)"),
    ("custom_layer", "tripler", "custom class userpkg>Tripler"),
])
def test_code_in_a_model_file_is_refused_naming_the_layer(stack, name, layer, reason):
    for suffix in (".keras", ".h5"):
        with pytest.raises(model_file.ModelFileError) as error:
            model_file.read_screened(str(FIXTURES / stack / (name + suffix)))
        message = str(error.value)
        assert f"layer {layer!r}: {reason}" in message, message
        assert "code in a model file is not loaded" in message and "\n" not in message


@pytest.mark.parametrize("name, expected", [
    ("vector_input", "input shape [20] is not an image"),
    ("four_channels", "input shape [16, 16, 4] is not an image"),
])
def test_inputs_that_are_not_images_are_refused(name, expected):
    for stack in ("k2", "k3"):
        with pytest.raises(model_file.ModelFileError, match=expected.replace("[", r"\[")):
            model_file.read_screened(str(FIXTURES / stack / (name + ".h5")))


def free_size(source: Path, out: Path, width: int | None = None) -> Path:
    """A copy of a model file whose input has no height and no ``width`` (its layers do not need
    them: cnn_softmax ends in global pooling)."""
    def freed(config: dict) -> dict:
        for layer in config["config"]["layers"]:
            if layer["class_name"] == "InputLayer":
                key = "batch_shape" if "batch_shape" in layer["config"] else "batch_input_shape"
                layer["config"][key] = [None, None, width, layer["config"][key][-1]]
        return config

    if source.suffix == ".h5":
        out.write_bytes(source.read_bytes())
        with h5py.File(out, "r+") as handle:
            handle.attrs["model_config"] = json.dumps(
                freed(json.loads(handle.attrs["model_config"])))
        return out
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(out, "w") as copy:
        for member in original.namelist():
            data = original.read(member)
            if member == "config.json":
                data = json.dumps(freed(json.loads(data))).encode()
            copy.writestr(member, data)
    return out


@pytest.mark.parametrize("stack", ["k2", "k3"])
def test_a_model_of_free_size_is_built_at_the_size_given_and_a_fixed_one_keeps_its_own(
        stack, tmp_path):
    for suffix in (".keras", ".h5"):
        fixed = FIXTURES / stack / ("cnn_softmax" + suffix)
        free = free_size(fixed, tmp_path / ("free" + suffix))
        with pytest.raises(model_file.ModelFileError, match="no fixed height and width; give the "
                                                            "size the model was trained at"):
            model_file.read_screened(str(free))
        info, summary = model_file.read_screened(str(free), (40, 56))
        assert summary["input_shape"] == (40, 56, 3)
        assert model_config.input_shape(info["config"]) == (40, 56, 3)  # what later jobs build
        with pytest.raises(model_file.ModelFileError,
                           match="--input-size 32x32: the model's input is fixed at 48x64"):
            model_file.read_screened(str(fixed), (32, 32))
        assert model_file.read_screened(str(fixed), (48, 64))[1]["input_shape"] == (48, 64, 3)
        # Free in height only: the width given must be the model's.
        tall = free_size(fixed, tmp_path / ("tall" + suffix), width=64)
        assert model_file.read_screened(str(tall), (40, 64))[1]["input_shape"] == (40, 64, 3)
        with pytest.raises(model_file.ModelFileError, match="input is fixed at \\?x64"):
            model_file.read_screened(str(tall), (40, 56))


def test_damaged_and_foreign_files_are_refused(tmp_path):
    good = FIXTURES / "k3" / "cnn_softmax.keras"
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(good.read_bytes()[:5000])
    notes = tmp_path / "notes.keras"
    with zipfile.ZipFile(notes, "w") as archive:
        archive.writestr("notes.txt", "not a model")
    half_h5 = tmp_path / "half.h5"
    half_h5.write_bytes((FIXTURES / "k3" / "cnn_softmax.h5").read_bytes()[:3000])
    text = tmp_path / "model.h5"
    text.write_text("hello")
    cases = {truncated: "corrupt or truncated zip", notes: "a zip without config.json",
             half_h5: "unreadable HDF5", text: "neither a .keras zip nor an HDF5 file",
             tmp_path / "missing.keras": "no such file"}
    for path, expected in cases.items():
        with pytest.raises(model_file.ModelFileError, match=expected):
            model_file.read_screened(str(path))


def test_a_model_name_from_the_file_is_made_safe_and_a_given_one_is_checked():
    # keras.applications' Xception saved as xception.keras: the built-in network's name.
    assert imported_name(None, "xception") == "xception-imported"
    assert imported_name(None, "my flowers (v2)") == "my-flowers-v2"
    assert imported_name(None, "_" + "a" * 80) == "a" * 55
    assert imported_name(None, "...") == "model"
    assert imported_name("flowers", "xception") == "flowers"
    with pytest.raises(ModelError, match="--name 'xception' is a built-in network's name"):
        imported_name("xception", "model")
    with pytest.raises(ModelError, match="use up to 64 letters"):
        imported_name("a" * 65, "model")


@pytest.mark.parametrize("stack", ["k2", "k3"])
def test_input_shape_and_output_convention_are_read_from_the_file(stack):
    for name, shape, output in (("cnn_softmax", (48, 64, 3), "softmax"),
                                ("gray_logits", (32, 32, 1), "logits")):
        for suffix in (".keras", ".h5"):
            info, summary = model_file.read_screened(str(FIXTURES / stack / (name + suffix)))
            assert (tuple(summary["input_shape"]), summary["output"]) == (shape, output)
            assert summary["rescales_input"] is True and info["format"] == suffix[1:]
            assert summary["dialect"] == ("keras3" if stack == "k3" else "keras2")


# Both Kerases' RandomFlip, tf.keras 2's RandomHeight, Keras 3's newer RandomGrayscale and
# RandAugment: each returns its input at inference.
@pytest.mark.parametrize("augmentation", ["RandomFlip", "RandomHeight", "RandomGrayscale",
                                          "RandAugment"])
def test_augmentation_becomes_identity_and_preprocessing_does_not_hide_a_rescaling(augmentation):
    def layer(cls, **config):
        return {"module": "keras.layers", "class_name": cls, "registered_name": None,
                "config": dict(name=cls.lower(), trainable=False, **config)}

    config = {"class_name": "Sequential", "config": {"name": "m", "layers": [
        layer("InputLayer", batch_shape=[None, 40, 40, 3]),
        layer(augmentation, seed=3),
        layer("Resizing", height=32, width=32), layer("Rescaling", scale=1 / 255),
        layer("Dense", units=3, activation="softmax")]}}
    summary = model_config.model_summary(config)
    assert summary["rescales_input"] is True and summary["classes"] == 3
    assert list(model_file.screen(config)) == []
    flip = model_config.without_augmentation(config)["config"]["layers"][1]
    assert flip["class_name"] == "Activation" and flip["registered_name"] is None
    assert flip["config"] == {"name": augmentation.lower(), "trainable": False,
                              "activation": "linear"}
    assert config["config"]["layers"][1]["class_name"] == augmentation  # a copy was changed
    # RandomCrop is not the identity at inference under tf.keras 2 (it crops the centre).
    config["config"]["layers"][1] = layer("RandomCrop", height=8, width=8)
    assert list(model_file.screen(config)) == [("randomcrop", "class RandomCrop not on the allowlist")]
    config["config"]["layers"][2:4] = [layer("Resizing", height=32, width=32)]
    assert model_config.model_summary(config)["rescales_input"] is False


# -- through the CLI, with a worker -----------------------------------------------------------

@pytest.mark.trains
@pytest.mark.parametrize("file, classes, expected", [
    ("k3/lambda.h5", "a,b,c", "layer 'doubler': Lambda layer (runs Python code from the file)"),
    ("k2/custom_layer.keras", "a,b,c", "layer 'tripler': custom class"),
    ("k3/four_channels.keras", "a,b,c", "input shape [16, 16, 4] is not an image"),
    ("k3/cnn_softmax.h5", None, "the model has 4 outputs but odtd has 10 class names"),
    ("k3/missing.keras", None, "--model-file"),
])
def test_a_refused_model_is_one_line_and_leaves_no_home(tmp_path, file, classes, expected):
    home = tmp_path / "home"
    args = ["init", "--model-file", str(FIXTURES / file)] + (["--classes", classes] if classes else [])
    proc = odtctl(*args, home=home, check=False)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (home / "odtd.db").exists() and not (home / "models").exists()


@pytest.mark.trains
def test_a_model_that_rescales_itself_given_an_input_scale_too_gets_a_note(other_stack, tmp_path):
    # cnn_softmax starts with Rescaling(1/255): --input-scale would scale the pixels twice.
    # The value "-1-1" is given as its own argument, as docs/own-model.md spells it.
    summary = json.loads(odtctl(
        "init", "--model-file", str(other_stack / "cnn_softmax.keras"), "--classes",
        CLASSES["cnn_softmax"], "--input-scale", "-1-1", "--json", home=tmp_path / "home").stdout)
    assert summary["input_scale"] == "-1-1"
    assert any("--input-scale -1-1 scales the pixels before it as well" in note
               for note in summary["notes"]), summary["notes"]


@pytest.mark.trains
def test_the_other_stacks_files_import_export_the_same_and_as_given_for_that_keras(other_stack, tmp_path):
    # A model trained on a server running the other Keras: imported, exported by this one,
    # and the export predicts what the original did.
    exported = []
    # dialect_details: layers and activations each Keras writes in its own way, and
    # activations named alike that compute differently (tests/make_keras_models.py).
    for name, suffix in (("cnn_softmax", ".h5"), ("gray_logits", ".keras"),
                         ("dialect_details", ".h5"), ("dialect_details", ".keras")):
        home = tmp_path / (name + suffix)
        odtctl("init", "--model-file", str(other_stack / (name + suffix)), "--classes",
               CLASSES[name], home=home)
        out = tmp_path / f"{name}-{suffix[1:]}-v0{native_suffix(suffix)}"
        odtctl("models", "export", "0", "--out", str(out), home=home)
        exported.append((out, other_stack / (name + ".ref.npz")))
    assert max(predict_max_diff(exported)) < 1e-5

    # The device's Keras may not be the server's: --as-given writes the fine-tuned weights into
    # a copy of the user's own file, which the Keras that wrote it opens.
    home = tmp_path / "cnn_softmax.h5"
    out = tmp_path / "as-given.h5"
    odtctl("models", "export", "0", "--out", str(out), "--as-given", home=home)
    wrong = odtctl("models", "export", "0", "--out", str(tmp_path / "x.keras"), "--as-given",
                   home=home, check=False)
    assert wrong.returncode == 1 and "name --out like it (it was .h5)" in wrong.stderr
    python = other_python()
    if python is None:
        pytest.skip("the other Keras stack is not installed here (make test-compat builds it)")
    assert predict_max_diff([(out, other_stack / "cnn_softmax.ref.npz")], python)[0] < 1e-5


@pytest.mark.trains
@pytest.mark.parametrize("name", ["slash_names", "slash_nested"])
def test_tf_keras_2_layer_names_with_a_slash_train_on_either_keras_and_export_as_given(
        tmp_path, name):
    # tf.keras 2's MobileNetV3 names layers "Conv/BatchNorm"; its .h5 keeps weights under them,
    # as "Conv/BatchNorm/gamma:0" inside a nested base (slash_nested: a head on such a base).
    # Keras 3 allows no "/" in a name: it builds them as "Conv_BatchNorm", weights matched so.
    path, classes = FIXTURES / "k2" / f"{name}.h5", "a,b,c"
    home = tmp_path / "home"
    odtctl("init", "--model-file", str(path), "--classes", classes, "--no-check", "--validation",
           str(photos(tmp_path / "validation", classes, 2, seed=1)), home=home)
    (home / "policy.yaml").write_text((REPO / "policies" / "tinycnn-test.yaml").read_text())
    odtctl_json("ingest", str(photos(tmp_path / "day1", classes, 5, seed=2)), home=home)
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] in ("promoted", "rolled_back") and session["steps"] > 0, session
    native, given = tmp_path / "v0.h5", tmp_path / "v0-as-given.h5"
    odtctl("models", "export", "0", "--out", str(native), home=home)
    odtctl("models", "export", "0", "--as-given", "--out", str(given), home=home)
    ref = FIXTURES / "k2" / f"{name}.ref.npz"
    assert predict_max_diff([(native, ref)])[0] < 1e-5  # this stack's Keras opens its own
    python = other_python() if keras_major() == 3 else None
    if keras_major() == 3 and python is None:
        pytest.skip("the other Keras stack is not installed here (make test-compat builds it)")
    # The copy of the user's file, their names kept: tf.keras 2 opens it, the same model.
    assert predict_max_diff([(given, ref)], python)[0] < 1e-5


def other_python():
    """The interpreter of the other Keras stack, or None where it is not built: .venv's Keras 3
    beside a tf.keras 2 worker (.venv-compat's, make test-tx2's), .venv-compat's tf.keras 2
    beside Keras 3's."""
    other = REPO / (".venv" if keras_major() == 2 else ".venv-compat") / "bin" / "python"
    return other if other.exists() else None


def predict(pairs, python=None) -> list:
    """Load each model file with plain Keras (no odtd), in one subprocess: its predictions on
    the images of the reference file paired with it."""
    code = ("import sys, json, numpy as np, keras\n"
            "for path, ref in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    model = keras.models.load_model(path)\n"
            "    x = np.load(ref)['x'].astype('float32')\n"
            "    print(json.dumps(model.predict(x, verbose=0).tolist()))")
    args = [str(item) for pair in pairs for item in pair]
    proc = plain_python("-c", code, *args, python=str(python) if python else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    return [np.array(json.loads(line)) for line in out.strip().splitlines()[-len(pairs):]]


def predict_max_diff(pairs, python=None) -> list:
    """For each (model file, reference file): the largest difference from the reference's
    predictions."""
    diffs = []
    for (_, ref), out in zip(pairs, predict(pairs, python)):
        with np.load(ref) as arrays:
            diffs.append(float(np.abs(out - arrays["y"]).max()))
    return diffs


@pytest.mark.trains
@pytest.mark.parametrize("name, suffix", [("cnn_softmax", ".keras"), ("gray_logits", ".h5"),
                                          ("mobilenet", ".keras"), ("frozen_augmented", ".h5"),
                                          ("arithmetic", ".h5")])
def test_a_session_on_an_imported_model_and_its_export(models, tmp_path, name, suffix):
    home = tmp_path / "home"
    classes = CLASSES[name]
    # The session runs the test recipe, not the installed one: no `policy check` of that.
    summary = json.loads(odtctl(
        "init", "--model-file", str(models / (name + suffix)), "--classes", classes, "--no-check",
        "--validation", str(photos(tmp_path / "validation", classes, 2, seed=1)), "--json",
        home=home).stdout)
    assert summary["source"] == "imported" and summary["output"] in ("softmax", "logits")
    assert summary["input_scale"] == "0-255" and summary["validation_samples"] > 0
    (home / "policy.yaml").write_text((REPO / "policies" / "tinycnn-test.yaml").read_text()
                                      .replace("epochs: 2", "epochs: 1"))
    ingest = odtctl_json("ingest", str(photos(tmp_path / "day1", classes, 5, seed=2)), home=home)
    assert ingest["rejected"] == 0
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["outcome"] in ("promoted", "rolled_back"), session["reason"]
    assert session["steps"] > 0 and session["accuracy_before"] is not None
    assert session["peak_memory_mb"] > 100 and session["details"]["evaluation_set"] == "validation"
    status = odtctl_json("status", home=home)
    assert status["model"]["name"] == name and status["samples"]["pending"] == 0
    # Version 0 exported predicts exactly what the user's file does; the current one loads too.
    v0 = tmp_path / f"v0{native_suffix(suffix)}"
    odtctl("models", "export", "0", "--out", str(v0), home=home)
    current = tmp_path / f"current{native_suffix('.keras')}"
    odtctl("models", "export", str(status["model"]["version"]), "--out", str(current), home=home)
    ref = models / (name + ".ref.npz")
    from_v0, out = predict([(v0, ref), (current, ref)])
    original = np.load(ref)["y"]
    assert np.abs(from_v0 - original).max() < 1e-5
    assert out.shape == original.shape
    if summary["output"] == "softmax":
        assert np.allclose(out.sum(axis=1), 1.0, atol=1e-4)
    assert np.array_equal(out, original) == (session["outcome"] == "rolled_back")


@pytest.mark.trains
def test_a_free_size_model_file_trains_at_the_input_size_given(other_stack, tmp_path):
    # The other Keras's cnn_softmax with its input's height and width taken out.
    free = free_size(other_stack / "cnn_softmax.keras", tmp_path / "free.keras")
    classes = CLASSES["cnn_softmax"]
    home = tmp_path / "home"
    refused = odtctl("init", "--model-file", str(free), "--classes", classes, home=home,
                     check=False)
    assert refused.returncode == 1 and "--input-size HxW" in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and not (home / "odtd.db").exists()
    summary = json.loads(odtctl("init", "--model-file", str(free), "--classes", classes,
                                "--input-size", "48x64", "--json", home=home).stdout)
    assert summary["input_shape"] == [48, 64, 3]
    (home / "policy.yaml").write_text((REPO / "policies" / "tinycnn-test.yaml").read_text())
    odtctl_json("ingest", str(photos(tmp_path / "day1", classes, 3, seed=2)), home=home)
    session = odtctl_json("train-now", "--foreground", home=home)
    assert session["steps"] > 0 and session["outcome"] in ("promoted", "rolled_back")
    # Built at the size it was trained at, version 0 predicts what the file's model did.
    v0 = tmp_path / f"v0{native_suffix('.keras')}"
    odtctl("models", "export", "0", "--out", str(v0), home=home)
    assert predict_max_diff([(v0, other_stack / "cnn_softmax.ref.npz")])[0] < 1e-5


def _weights(path: Path, names) -> dict:
    with np.load(path) as arrays:
        return {name: arrays[f"w{i:04d}"] for i, name in enumerate(names)}


class _Imported:
    """A model file imported by the real worker into ``tmp_path``, trained by ``train`` jobs."""

    def __init__(self, tmp_path: Path, model_file: Path, classes, shape, output: str):
        from odtd.trainer.protocol.job import make_job
        from odtd.trainer.protocol.launch import run_job

        self.tmp, self.classes, self.shape, self.output = tmp_path, classes, shape, output
        self.run = lambda job, folder: run_job(worker_config().trainer.command(), job, tmp_path / folder)
        self.make_job = make_job
        result, _, _ = self.run(make_job(
            "import", "imported", classes, None, model_file=str(model_file),
            weights_out=str(tmp_path / "v0.npz"), architecture_out=str(tmp_path / "arch.json"),
            original_out=str(tmp_path / "original.keras")), "import")
        self.names = result["weight_names"]
        rng = np.random.default_rng(3)
        np.savez(tmp_path / "train.npz",
                 x=rng.integers(0, 256, (16, *shape), dtype=np.uint8), y=rng.integers(0, 3, 16))

    def weights(self, name: str) -> dict:
        return _weights(self.tmp / name, self.names)

    def train(self, out: str, **keys) -> dict:
        """One epoch of batches of 8 from v0; the weights written."""
        result, _, _ = self.run(self.make_job(
            "train", "imported", self.classes, list(self.shape),
            architecture=str(self.tmp / "arch.json"), input_scale="0-255", output=self.output,
            weights_in=str(self.tmp / "v0.npz"), weights_out=str(self.tmp / out),
            train_data=str(self.tmp / "train.npz"), batch_size=8, epochs=1, optimizer="sgd",
            learning_rate=0.1, **keys), out + ".job")
        assert result["status"] == "ok", result
        self.result = result
        return self.weights(out)


@pytest.mark.trains
def test_trainable_scope_and_frozen_batchnorm_reach_nested_layers(other_stack, tmp_path):
    model = _Imported(tmp_path, other_stack / "gray_logits.keras",
                      CLASSES["gray_logits"].split(","), (32, 32, 1), "logits")
    names, before = model.names, model.weights("v0.npz")

    def train(out: str, **keys) -> set:
        after = model.train(out, **keys)
        return {name for name in names if not np.array_equal(before[name], after[name])}

    # The head only: the last Dense's kernel and bias, nothing in the nested block.
    assert train("head.npz", trainable="head") == {n for n in names if "logits" in n}
    # Frozen BatchNorm inside the nested Sequential: its statistics (and gamma, beta) stay,
    # the convolutions train.
    changed = train("frozen.npz", freeze_bn=True)
    assert not any("block_bn" in n for n in changed)
    assert any("block_conv" in n for n in changed) and any("logits" in n for n in changed)
    # Trained BatchNorm moves them (so the test above can fail).
    assert any("block_bn" in n and "moving" in n for n in train("trained.npz"))
    # BatchNorm alone: its scale, offset and statistics move, in the nested block too; no
    # convolution or dense weight does.
    changed = train("bn-only.npz", trainable="batchnorm")
    assert {n.rsplit("/", 1)[-1].split(":")[0] for n in changed if "block_bn" in n} >= {
        "gamma", "beta", "moving_mean", "moving_variance"}
    assert all("_bn" in n for n in changed)


@pytest.mark.trains
def test_recomputation_cuts_inside_the_network_of_an_exported_model(tmp_path):
    # odtd exports a built-in network as a chain around it (pixels, rescaling, the network as a
    # nested model, softmax); imported again, as reproduce_tx2_daily.py --import-model does,
    # recomputation cuts inside the nested network and two steps leave the same weights and
    # BatchNorm statistics as without it (the nested model's output is not a tensor of the
    # outer graph: cutting there failed the session).
    from odtd.trainer.protocol.job import make_job
    from odtd.trainer.protocol.launch import run_job

    command, classes = worker_config().trainer.command(), ["red", "green", "blue"]
    run_job(command, make_job("init", "tinycnn", classes, [32, 32, 3], seed=3,
                              weights_out=str(tmp_path / "init.npz")), tmp_path / "init")
    run_job(command, make_job("export", "tinycnn", classes, [32, 32, 3],
                              weights_in=str(tmp_path / "init.npz"),
                              export_to=str(tmp_path / f"tiny{native_suffix('.keras')}")),
            tmp_path / "export")
    model = _Imported(tmp_path, tmp_path / f"tiny{native_suffix('.keras')}", classes, (32, 32, 3),
                      "softmax")
    plain, recomputed = model.train("plain.npz"), model.train("recomputed.npz", recompute=1.0)
    before = model.weights("v0.npz")
    assert any("moving_mean" in n and not np.allclose(plain[n], before[n]) for n in model.names)
    for name in model.names:
        np.testing.assert_allclose(recomputed[name], plain[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


TRANSITION_MODEL = r"""
import sys
import tensorflow as tf
L = tf.keras.layers
inputs = tf.keras.Input((16, 16, 3))
x = L.Rescaling(1 / 255.0, name="scale")(inputs)
x = L.Conv2D(6, 3, padding="same", name="stem")(x)
x = L.Concatenate(name="cat")([x, L.Conv2D(4, 3, padding="same", name="grow")(x)])
x = L.BatchNormalization(name="t_bn")(x)
x = L.Activation("relu", name="t_relu")(x)
x = L.AveragePooling2D(2, name="t_pool")(L.Conv2D(8, 1, use_bias=False, name="t_conv")(x))
x = L.GlobalAveragePooling2D(name="gap")(x)
tf.keras.Model(inputs, L.Dense(3, name="logits")(x)).save(sys.argv[1])
"""


@pytest.mark.trains
def test_a_users_transition_trains_pooling_first_and_takes_the_same_step(tmp_path):
    # A user's model with a DenseNet transition (1x1 convolution, then average pooling): the
    # worker runs the pooling first and says so; the weights after an epoch are those of the
    # checkpointed plan, which runs the model as written.
    path = tmp_path / "transition.keras"
    proc = plain_python("-c", TRANSITION_MODEL, str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = _Imported(tmp_path, path, ["red", "green", "blue"], (16, 16, 3), "logits")
    pooled = model.train("pooled.npz")
    assert model.result["pool_first"] == ["t_conv"]
    written = model.train("written.npz", recompute=1.0)
    assert model.result["pool_first"] == []
    before = model.weights("v0.npz")
    assert any("t_conv" in n and not np.allclose(pooled[n], before[n]) for n in model.names)
    for name in model.names:
        np.testing.assert_allclose(pooled[name], written[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)
