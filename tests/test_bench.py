import json

import pytest
import torch
from typer.testing import CliRunner

from bdlora.base.threads import ThreadPool
from bdlora.bench.config import BenchConfig
from bdlora.bench.run import projection_macs, run_bench, variant_macs
from bdlora.bench.variants import dense_variant, floor_variant, lora_variant, synthetic_model
from bdlora.cli import app
from bdlora.deployed.folder import save_model_folder
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.train.plan import plan
from conftest import compressed_student

TINY = {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 320, "max_position_embeddings": 128,
        "sliding_window": None}


def test_variants_compute_the_same_function(tiny_model):
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 10))
    trained, model, _ = compressed_student(tiny_model, [1.0])  # F = 1, gates open: everything kept and merged
    with torch.no_grad():
        ref = trained(x).logits
        torch.testing.assert_close(model(x).logits, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense_variant(model)(x).logits, ref, rtol=1e-5, atol=1e-5)
    _, mixed, _ = compressed_student(tiny_model, [0.0, 1.0, 0.3])
    with torch.no_grad():
        dense = dense_variant(mixed)(x).logits
        torch.testing.assert_close(mixed(x).logits, dense, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lora_variant(mixed, 4)(x).logits, dense, rtol=1e-4, atol=1e-4)
    assert sum(1 for m in floor_variant(mixed).modules() if getattr(m, "rank", None) == 1) == 28
    # the variants' MACs as bench counts them without building the variants (at 1B each is a teacher-sized copy)
    assert variant_macs(mixed, 4) == {"dense": projection_macs(dense_variant(mixed)),
                                      "lora": projection_macs(lora_variant(mixed, 4)),
                                      "compressed": projection_macs(mixed)}


def test_bench_report_schema_and_signatures(tiny_model, tmp_path):
    _, model, report = compressed_student(tiny_model, [0.0, 1.0, 0.3])
    cfg = BenchConfig(scope="both", batch_sizes=[1, 2], seq_lens=[8], decode_tokens=2, repeats=2, warmup=0,
                      pool=ThreadPool(1), int8=True)
    doc = run_bench(model, 4, cfg, tmp_path / "b", report)
    rows = doc["results"]
    keys = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]) for r in rows}
    for scope in ("modules", "model"):
        for v in ("dense", "lora", "compressed"):
            for phase, b in (("decode", 1), ("decode", 2), ("prefill", 1), ("prefill", 2)):
                seq = 1 if (scope, phase) == ("modules", "decode") else 8
                assert (scope, v, phase, b, seq) in keys
    for r in rows:
        assert {"scope", "variant", "phase", "batch", "seq", "median_ms", "p10_ms", "p90_ms"} <= r.keys()
        assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        if r["variant"] == "compressed":
            assert {"speedup_vs_dense", "speedup_vs_lora", "mac_ratio_vs_dense", "fraction_of_limit"} <= r.keys()
            assert r["fraction_of_limit"] == pytest.approx(r["speedup_vs_dense"] / r["mac_ratio_vs_dense"])
    q8 = [r for r in rows if r["variant"] == "compressed-int8"]
    assert len(q8) == 4 and all(r["scope"] == "model" and "speedup_vs_dense_int8" in r for r in q8)
    assert "int8 (onnxruntime dynamic weight quantisation)" in (tmp_path / "b" / "bench.md").read_text()
    mods = [r for r in rows if r["scope"] == "modules" and r["variant"] == "compressed"]
    assert all(r["mac_ratio_vs_dense"] == pytest.approx(report["speedup_vs_dense"]) for r in mods)
    assert doc["mac_ratio_modules_vs_lora"] == pytest.approx(report["speedup_vs_lora"])
    for f in ("bench.json", "bench.md", "bench.png"):
        assert (tmp_path / "b" / f).stat().st_size > 0
    import onnxruntime as ort

    sigs = set()
    for v in ("dense", "lora", "compressed"):
        s = ort.InferenceSession(str(tmp_path / "b" / "graphs" / f"model-{v}.onnx"))
        sigs.add((tuple((i.name, len(i.shape)) for i in s.get_inputs()),
                  tuple((o.name, len(o.shape)) for o in s.get_outputs())))
    assert len(sigs) == 1


@pytest.mark.parametrize("budget", [0.0, 0.4])
def test_synthetic_mode_builds_the_planned_structure(budget, tmp_path):
    model, report = synthetic_model(TINY, budget, layers=2, rank=4)
    expected = plan(TINY, BudgetedConfig(budget=budget, rank=4), layers=2)
    assert report["modules"] == expected["modules"]
    forms = model.config.bdlora_modules
    for m in expected["modules"]:
        assert forms[m["name"]] == ({"form": "lowrank", "rank": m["rank"]} if m["rank"] else {"form": "dense"})

    # the modules scope's graph: every projection alone, each computing its own module's output exactly
    import numpy as np
    import onnx

    from bdlora.export.decoder import build_projection_stack
    from bdlora.export.decoder.graph import STACK_INPUTS
    from bdlora.models.arch import projection_modules
    from bdlora.models.families import Anatomy
    from bdlora.models.runtime import session

    path = tmp_path / "stack.onnx"
    onnx.save(build_projection_stack(model), str(path))
    sess = session(path)
    feeds = {i.name: np.random.default_rng(0).standard_normal((3, i.shape[1]), dtype=np.float32)
             for i in sess.get_inputs()}
    assert len(feeds) == 4 * 2  # x_a, x_o, x_m, x_d per layer
    got = sess.run(None, feeds)
    named = projection_modules(model)
    assert [o.name for o in sess.get_outputs()] == [f"y{k}" for k in range(len(named))] and len(named) == 14
    with torch.no_grad():
        for k, (name, m) in enumerate(named):
            layer = name.split("layers.")[1].split(".")[0]
            group = Anatomy().input_group(name.rsplit(".", 1)[-1])
            x = torch.from_numpy(feeds[f"{STACK_INPUTS[group]}.{layer}"])
            np.testing.assert_allclose(got[k], m(x).numpy(), atol=1e-5)


def test_cli_bench_synthetic_and_bad_input(tmp_path, tiny_model, tiny_env):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    args = ["bench", "--model-config", str(cfg), "--budget", "0.0", "--lora-rank", "4", "--repeats", "2",
            "--warmup", "0", "--batch-sizes", "1", "--seq-lens", "8", "--decode-tokens", "2", "--threads", "1"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "--report", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b.json").read_text())
    p = plan(TINY, BudgetedConfig(budget=0.0, rank=4))
    assert doc["mac_ratio_modules_vs_dense"] == pytest.approx(p["speedup_vs_dense"])
    assert doc["mac_ratio_modules_vs_lora"] == pytest.approx(p["speedup_vs_lora"])
    for bad, needle in [(["--provider", "tpu"], "--provider 'tpu': unknown (allowed: cpu, cuda)"),
                        (["--provider", "cuda"], "--provider cuda: onnxruntime here has"),
                        (["--provider", "cuda"], "the [gpu] extra"),  # brackets survive the console's markup
                        (["--repeats", "0"], "--repeats 0: must be a positive integer"),
                        (["--threads", "100000"], "--threads 100000: must be in [1, "),
                        (["--batch-sizes", ""], "--batch-sizes '': empty list"),
                        (["--seq-lens", "a,b"], "--seq-lens 'a,b': need comma-separated integers"),
                        (["--icl"], "--icl: the ICL of the front's rows needs --runtime genai or both (not ort)"),
                        (["--icl", "--runtime", "genai"], "--icl: synthetic mode (--model-config) has random weights"),
                        (["--icl-examples", "0"], "--icl-examples 0: must be"),
                        (["--head-bits", "6"], "--head-bits 6: unknown (allowed: 4, 8)"),
                        (["--runtime", "genai,vllm"], "--runtime 'vllm': unknown (allowed: ort, genai, llamacpp,"),
                        (["--gguf-quants", "q5_k"], "--gguf-quants 'q5_k': unknown (allowed: f16, q8_0, q4_0,"),
                        (["--gguf-quants", "q8_0,q8_0"], "--gguf-quants q8_0,q8_0: q8_0 given twice")]:
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "x"), *bad])
        assert r.exit_code == 2 and needle in r.stderr, (bad, r.output)
        assert not (tmp_path / "x").exists()  # refused before anything is written
    _, model, report = compressed_student(tiny_model, [0.0])
    folder = save_model_folder(model, tiny_env["tokenizer"], tmp_path / "m", report)
    (folder / "compression.json").unlink()
    r = CliRunner().invoke(app, ["bench", str(folder), "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "no compression.json" in r.stderr


def test_runtimes_are_named_alone_together_or_by_alias_and_llama_cpp_needs_a_folder(tmp_path):
    """--runtime: ort, genai, llamacpp, comma-separated, or both (ort,genai) / all; llama.cpp's rows are GGUF files
    of a folder, so synthetic mode refuses them in one line (or, without llama-cpp-python, names the extra)."""
    from bdlora.bench.config import BenchConfig, llama_cpp_here

    assert BenchConfig(runtime="both").runtimes == ("ort", "genai")
    assert BenchConfig(runtime="all").runtimes == ("ort", "genai", "llamacpp")
    assert BenchConfig(runtime="llamacpp, genai").runtimes == ("genai", "llamacpp")
    assert BenchConfig(runtime="llamacpp").deployed and not BenchConfig(runtime="ort").deployed
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = CliRunner().invoke(app, ["bench", "--model-config", str(cfg), "--budget", "0.5", "--runtime", "genai,llamacpp",
                                 "--out", str(tmp_path / "x")])
    needle = "synthetic mode (--model-config) has none" if llama_cpp_here() else 'pip install -e ".[llamacpp]"'
    assert r.exit_code == 2 and needle in r.stderr and not (tmp_path / "x").exists()


def test_a_speed_up_above_its_mac_limit_is_marked_as_noise_with_the_repeats_it_needs():
    """Issue 42: "3.87x against a MAC limit of 1.86x (208% of limit)" from 5 repeats was printed as a result."""
    from bdlora.bench.report import markdown
    from bdlora.bench.run import add_ratios, repeats_needed

    def row(variant, median, p10, p90, phase="prefill"):
        return {"scope": "modules", "variant": variant, "phase": phase, "batch": 1, "seq": 128, "tokens": 128,
                "median_ms": median, "p10_ms": p10, "p90_ms": p90, "repeats": 5}

    rows = [row("dense", 3.87, 2.0, 4.4), row("lora", 4.0, 3.9, 4.1), row("compressed", 1.0, 0.9, 1.6),
            row("dense", 2.0, 1.98, 2.02, "decode"), row("lora", 2.2, 2.1, 2.3, "decode"),
            row("compressed", 1.2, 1.19, 1.21, "decode")]
    add_ratios(rows, {"modules": {"dense": 186, "lora": 200, "compressed": 100}})
    noisy, clean = rows[2], rows[5]
    assert noisy["fraction_of_limit"] == pytest.approx(3.87 / 1.86)
    assert noisy["noise"]["above_limit"] == pytest.approx(2.081, abs=1e-3)
    assert noisy["noise"]["p10_p90_spread"] == pytest.approx(0.7)  # the compressed row's (1.6 - 0.9) / 1.0
    assert "noise" not in clean and clean["fraction_of_limit"] < 1
    # sigma = 0.7 / 2.56; sqrt(2) * 1.2533 * sigma / 1.081 = 0.448 -> 1 repeat would do, but never fewer than 6
    assert noisy["noise"]["repeats_needed"] == 6
    assert repeats_needed([row("c", 1.0, 0.9, 1.1)], 0.01) == 192  # a 1% excess needs hundreds
    doc = {"thread_pool": "x", "onnxruntime": "1", "mac_ratio_modules_vs_dense": 1.86,
           "mac_ratio_modules_vs_lora": 2.0, "results": rows}
    md = markdown(doc)
    assert "208% (noise)" in md and "about --repeats 6 would give a stable figure" in md


def test_the_front_marks_each_point_on_it_or_dominated_by_which():
    """SPEC 11 on a hand-made set: a point is dominated when another is at least as fast and as good, and better in
    one; the dominating point named is the best-quality one; equal points dominate neither; unscored points are
    left out."""
    from bdlora.bench.front import dominance, markdown, same_precision

    pts = [{"name": "teacher", "ms": 10.0, "ppl": 18.0}, {"name": "teacher-int8", "ms": 3.4, "ppl": 18.1},
           {"name": "teacher-int4", "ms": 2.7, "ppl": 21.7}, {"name": "compressed-int8", "ms": 3.2, "ppl": 21.0},
           {"name": "compressed-int4", "ms": 2.7, "ppl": 26.0}, {"name": "twin", "ms": 3.4, "ppl": 18.1},
           {"name": "unscored", "ms": 1.0, "ppl": None}]
    got = {p["name"]: (p["front"], p["dominated_by"]) for p in dominance(pts)}
    assert got == {"teacher": (True, None), "teacher-int8": (True, None), "teacher-int4": (True, None),
                   "compressed-int8": (True, None), "compressed-int4": (False, "teacher-int4"),
                   "twin": (True, None), "unscored": (None, None)}
    pts.append({"name": "slow-and-bad", "ms": 11.0, "ppl": 30.0})  # dominated by everything: named by quality
    assert {p["name"]: p["dominated_by"] for p in dominance(pts)}["slow-and-bad"] == "teacher"
    rows = [{**p, "p10_ms": p["ms"], "p90_ms": p["ms"], "batch": 1, "seq": 128, **same_precision(p, pts)}
            for p in dominance(pts)]
    md = "\n".join(markdown(rows, "teacher"))
    # beside the teacher's fp32, and beside the teacher's own export at the same precision (what a user would ship)
    assert ("| compressed-int4 | 2.700 (2.700-2.700) | 26.000 | 3.70x | +44.4% | 1.00x, +19.8% (teacher-int4) | "
            "dominated by teacher-int4 |") in md
    assert "| twin | 3.400 (3.400-3.400) | 18.100 | 2.94x | +0.6% | 2.94x, +0.6% (teacher) | **on the front** |" in md
    assert "| teacher-int8 | 3.400 (3.400-3.400) | 18.100 | 2.94x | +0.6% | - | **on the front** |" in md
