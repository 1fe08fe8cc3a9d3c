"""The bench's timing processes take typed specs (``bench.specs``): what the launcher writes is what the worker
reads, and a spec with a missing or unknown field is refused naming its fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bdlora.bench.specs import GenaiTiming, OrtTiming, SpeculativeTiming, VerifyTiming

SPECS = [
    OrtTiming(kind="model", graphs={"dense": "d/model.onnx"}, shapes=[["decode", 1, 8]], repeats=3, warmup=1,
              threads=2, provider="CPUExecutionProvider", decode_tokens=4, dims={"layers": 2}),
    GenaiTiming(folders={"teacher-int4": "t"}, shapes=[["decode", 1, 8]], repeats=3, warmup=1, decode_tokens=4,
                vocab=128, threads=2, gguf={"teacher-gguf-q8_0": "t.gguf"}),
    SpeculativeTiming(target="t", prompts={"builtin": [[1, 2, 3]]}, new_tokens=8, max_k=4, threads=1, repeats=1,
                      warmup=0, draft="d", ks=[1, 2]),
    VerifyTiming(folder="f", widths=4, threads=1, vocab=128),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_a_spec_reads_back_as_written(spec, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_json()))
    assert type(spec).read(path) == spec


@pytest.mark.parametrize("change", [{"threds": 2}, {"threads": None}])
def test_a_spec_with_a_missing_or_unknown_field_is_refused(tmp_path, change):
    data = {**SPECS[0].to_json(), **change}
    data = {k: v for k, v in data.items() if v is not None}
    (tmp_path / "spec.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"not a OrtTiming \(fields \[.*'threads'"):
        OrtTiming.read(tmp_path / "spec.json")


def test_a_worker_refuses_a_bad_spec_in_its_last_line(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"folders": {}, "vocab": 3}))
    r = subprocess.run([sys.executable, "-m", GenaiTiming.MODULE, str(tmp_path / "spec.json"),
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not a GenaiTiming" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out.json").exists()
