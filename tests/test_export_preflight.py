"""What ``export onnx`` and ``export genai`` check before loading a model (issue 76 item 3): a tokenizer without an
EOS token was refused after three minutes of work at 1B; an output whose file system cannot hold the export is
refused before anything is written."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.export import preflight


@pytest.fixture
def no_eos(tiny_env, tmp_path):
    folder = tmp_path / "no-eos"
    shutil.copytree(tiny_env["teacher"], folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / name
        if f.is_file():
            doc = json.loads(f.read_text())
            doc.pop("eos_token", None)
            f.write_text(json.dumps(doc))
    return folder


@pytest.mark.parametrize("argv", [["export", "onnx"], ["export", "genai", "--precision", "int4"]])
def test_a_tokenizer_without_eos_is_refused_before_loading(no_eos, tmp_path, argv, monkeypatch):
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(str(no_eos)).eos_token_id is not None:
        pytest.skip("this tokenizer keeps its EOS from tokenizer.json")
    loads = []
    monkeypatch.setattr("bdlora.models.load.load_model_folder", lambda *a, **k: loads.append(a))
    r = CliRunner().invoke(app, [*argv, str(no_eos), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "its tokenizer names no EOS token" in " ".join(r.output.split()), r.output
    assert not loads and not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,bits", [(["export", "onnx"], 32), (["export", "genai", "--precision", "int4"], 4)])
def test_an_output_without_room_is_refused_before_anything_is_written(tiny_env, tmp_path, monkeypatch, argv, bits):
    weights = preflight.weight_count(tiny_env["teacher"])
    need = preflight.bytes_needed(weights, bits, reference=bits < 32)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(need * 2, need * 2 - need + 1, need - 1))
    r = CliRunner().invoke(app, [*argv, str(tiny_env["teacher"]), "--out", str(tmp_path / "o")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"--out {tmp_path / 'o'}: the export writes about" in said, r.output
    assert not (tmp_path / "o").exists()


def test_the_estimate_counts_the_fp32_reference_of_a_rounded_export(tiny_env):
    n = preflight.weight_count(tiny_env["teacher"])
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    assert n == sum(p.numel() for p in m.state_dict().values())  # from the headers alone
    assert preflight.bytes_needed(n, 4, True) - preflight.bytes_needed(n, 4, False) == 4 * n


def test_onnxruntimes_warnings_stay_out_of_the_terminal(tmp_path):
    """Its optimiser's "CleanUnusedInitializersAndNodeArgs: Removing initializer ..." warnings reached the user's
    terminal during export; sessions bdlora opens log errors only (stderr read at the file descriptor, where
    onnxruntime writes)."""
    import subprocess
    import sys

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "y"))
    unused = numpy_helper.from_array(np.ones(3, np.float32), "unused_init")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y], [unused])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "g.onnx"))
    opened = (f"from bdlora.models.runtime import session; s = session({str(tmp_path / 'g.onnx')!r}, threads=1); "
              "print(s.run(None, {'x': __import__('numpy').ones(2, 'float32')})[0].sum())")
    r = subprocess.run([sys.executable, "-c", opened], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2.0" and "Removing initializer" not in r.stderr, r.stderr
    plain = ("import onnxruntime as ort; ort.InferenceSession(" + repr(str(tmp_path / "g.onnx")) + ", "
             "providers=['CPUExecutionProvider'])")
    assert "Removing initializer" in subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True,
                                                    timeout=120).stderr  # the case is real: onnxruntime warns
