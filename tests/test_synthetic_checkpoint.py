"""``benchmarks/synthetic_checkpoint.py``: a released model's shapes as sharded bf16 safetensors, one shard per layer,
with a real tokenizer and the vocabulary sized to it; the folder loads in transformers with every weight present
and passes bdlora's loader checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_checkpoint.py"


def _write(shape: str, tokenizer, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), shape, "--tokenizer", str(tokenizer), "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=300)


# a second large shape in pytest -m full (CI runs it): large shapes stay out of the README's test command
@pytest.mark.parametrize("shape,tied", [("qwen2.5-1.5b", True), pytest.param("gemma-3-1b", True,
                                                                              marks=pytest.mark.full)])
def test_a_shape_is_written_shard_by_shard_and_loads_whole(tiny_env, tmp_path, shape, tied):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from bdlora.models.integrity import check_loadable

    out = tmp_path / shape
    r = _write(shape, tiny_env["teacher"], out, "--layers", "2")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[-1] == "model-00004-of-00004.safetensors"  # embedding, 2 layers, the rest
    with safe_open(str(out / shards[1]), "pt") as f:
        assert {k.split(".")[2] for k in f.keys()} == {"0"} and f.get_tensor(next(iter(f.keys()))).dtype == \
            torch.bfloat16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == len(tiny_env["tokenizer"]) and cfg["num_hidden_layers"] == 2
    assert cfg["architectures"] == [{"qwen2.5-1.5b": "Qwen2ForCausalLM", "gemma-3-1b": "Gemma3ForCausalLM"}[shape]]
    assert cfg["tie_word_embeddings"] is tied and ("lm_head.weight" in index["weight_map"]) is not tied
    check_loadable(out)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    std = float(model.model.layers[1].mlp.down_proj.weight.float().std())
    assert 0.019 < std < 0.021 and bool((model.model.norm.weight == 1).all())
    if shape.startswith("qwen"):
        assert bool((model.model.layers[0].self_attn.q_proj.bias == 0).all())


def test_it_refuses_an_existing_folder_and_a_bad_layer_count(tiny_env, tmp_path):
    (tmp_path / "taken").mkdir()
    r = _write("llama-3.2-1b", tiny_env["teacher"], tmp_path / "taken")
    assert r.returncode != 0 and "--out" in r.stderr and "exists" in r.stderr
    r = _write("llama-3.2-1b", tiny_env["teacher"], tmp_path / "n", "--layers", "0")
    assert r.returncode == 2 and "--layers 0: at least 1" in r.stderr and not (tmp_path / "n").exists()
