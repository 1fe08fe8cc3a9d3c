import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from bdlora.base.errors import ConfigError
from bdlora.cli import app
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.budgeted.layer import GatedLoRALinear, fused_svd_pair
from bdlora.models.budgeted.model import compress_budgeted
from conftest import budgeted_student

TH = BudgetedConfig(eps_zero=1e-3, eps_lr=0.7, gate_threshold=0.3, svd_max_rank=8)


def _module(d, in_f=24, out_f=40, rank=6, bias=True, seed=0):
    torch.manual_seed(seed)
    m = GatedLoRALinear(torch.nn.Linear(in_f, out_f, bias=bias), rank=rank, alpha=12.0)
    torch.nn.init.normal_(m.lora_B)
    with torch.no_grad():  # some gates below the 0.3 threshold, some above
        m.gate_logits.copy_(torch.linspace(-3, 3, rank))
    m.set_retention(d)
    return m


def _hardened(m, th=TH):
    """The training module with pruned ranks switched off (gate logit -inf), otherwise identical."""
    h = copy.deepcopy(m)
    with torch.no_grad():
        g = torch.sigmoid(h.gate_logits)
        keep = g >= th.gate_threshold
        if not keep.any():
            keep[g.argmax()] = True
        h.gate_logits[~keep] = float("-inf")
    return h


def test_harden_keeps_at_least_one_rank():
    m = _module(0.0)
    with torch.no_grad():
        m.gate_logits.fill_(-5.0)
        m.gate_logits[2] = -4.0
    a, b = m.hardened(0.3)
    assert a.shape == (1, 24) and b.shape == (40, 1)
    torch.testing.assert_close(a[0], m.lora_A[2].double())


@pytest.mark.parametrize("d,case", [(0.0, "dropped"), (0.85, "kept"), (1.0, "kept")])
def test_case_1_and_3_equal_hardened_module(d, case):
    m = _module(d)
    c = m.to_deployed("m", TH)
    assert c.decision.case == case
    x = torch.randn(7, 24)
    with torch.no_grad():
        torch.testing.assert_close(c.module()(x), _hardened(m)(x), rtol=1e-5, atol=1e-5)
    assert c.decision.lora_rank == 4  # gates sigmoid(linspace(-3, 3, 6)) >= 0.3: four ranks (0.354 and up)


def test_case_2_error_bounded_by_next_singular_value():
    m = _module(0.35, in_f=32, out_f=48)
    c = m.to_deployed("m", TH)
    k = c.decision.svd_rank
    assert c.decision.case == "svd" and k == 4 and c.decision.rank == 4 + 4
    s = torch.linalg.svdvals(0.35 * m.base_layer.weight.double())
    x = torch.randn(50, 32)
    with torch.no_grad():
        err = (c.module()(x) - _hardened(m)(x)).double().norm(dim=-1)
    bound = s[k] * x.double().norm(dim=-1)  # ||(dW - U_k V_k) x|| <= sigma_{k+1} ||x||
    assert (err <= bound * (1 + 1e-5) + 1e-5).all()
    assert err.max() > 1e-3  # it is an approximation


def test_case_2_exact_at_full_rank():
    # at k = min(d_in, d_out) the factorisation is exact (the "never slower" rule would merge such a module in the
    # pipeline, so the fused pair is checked directly)
    m = _module(0.65, in_f=6, out_f=40, rank=2)
    a, b = m.hardened(0.3)
    first, second = fused_svd_pair(0.65 * m.base_layer.weight.double(), a, b, k=6)
    assert first.shape == (6 + a.shape[0], 6) and second.shape == (40, 6 + a.shape[0])
    x = torch.randn(5, 6)
    with torch.no_grad():
        y = (x.double() @ first.T) @ second.T + m.base_layer.bias.double()
        torch.testing.assert_close(y.float(), _hardened(m)(x), rtol=1e-5, atol=1e-5)


def test_boundaries_route_cases():
    assert _module(1e-3).to_deployed("m", TH).decision.case == "svd"
    assert _module(0.7).to_deployed("m", TH).decision.case == "kept"


def test_never_slower_than_dense_is_merged_exactly():
    m = _module(0.0, in_f=9, out_f=9, rank=6)  # 4 kept ranks cost 4 * 18 = 72 < 81: stays factorised
    assert m.to_deployed("m", TH).decision.case == "dropped"
    m = _module(0.0, in_f=8, out_f=8, rank=6)  # 4 * 16 = 64 >= 64: merged
    c = m.to_deployed("m", TH)
    assert c.decision.case == "merged-cheaper" and c.weight is not None
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(c.module()(x), _hardened(m)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,needle", [
    ({"eps_zero": 0.8}, "--eps-zero 0.8 >= --eps-lr 0.7"),
    ({"eps_lr": 1.0}, "--eps-lr 1.0: must be in (0, 1)"),
    ({"gate_threshold": 0.0}, "--gate-threshold 0.0"),
    ({"svd_max_rank": 0}, "--svd-max-rank 0"),
])
def test_threshold_validation(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        BudgetedConfig(**kw).validate_thresholds()


def test_f1_gates_open_logits_equal(tiny_model):
    s = budgeted_student(tiny_model)
    compressed, report = compress_budgeted(s, BudgetedConfig(svd_max_rank=8), {"budget": 1.0})
    assert report["dense_kept"] == report["modules_total"] == 28
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(compressed(x).logits, s(x).logits, rtol=1e-5, atol=1e-5)


def test_mixed_student_save_load_both_ways(tiny_model, tiny_env, tmp_path):
    from transformers import AutoModelForCausalLM

    from bdlora.deployed.folder import save_model_folder

    s = budgeted_student(tiny_model, d_values=[0.0, 1.0, 0.0, 0.2, 0.0, 0.9, 0.0])
    compressed, report = compress_budgeted(s, BudgetedConfig(svd_max_rank=8), {"budget": 0.4})
    assert report["dense_dropped"] and report["dense_kept"] and report["dense_svd"]
    assert report["compressed_macs"] == sum(m["macs_after"] for m in report["modules"])
    assert report["params_after"] == sum(m["params_after"] for m in report["modules"])
    assert compressed.config.model_type == "bdlora_mistral"
    forms = compressed.config.bdlora_modules
    assert forms["model.layers.0.self_attn.q_proj"]["form"] == "lowrank"
    assert forms["model.layers.0.self_attn.k_proj"] == {"form": "dense"}
    out = save_model_folder(compressed, tiny_env["tokenizer"], tmp_path / "m", report)
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = compressed(x).logits
        loaded = AutoModelForCausalLM.from_pretrained(out)  # registered: no remote code
        torch.testing.assert_close(loaded(x).logits, ref, rtol=0, atol=0)
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        torch.testing.assert_close(remote(x).logits, ref, rtol=0, atol=0)
    g1 = compressed.generate(x[:1, :5], max_new_tokens=8, do_sample=False)
    g2 = loaded.generate(x[:1, :5], max_new_tokens=8, do_sample=False)
    assert torch.equal(g1, g2) and g1.shape[1] == 13
    # a fresh interpreter where bdlora cannot be imported loads it through trust_remote_code
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'bdlora' or name.startswith('bdlora.'): raise ImportError('bdlora hidden')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        f"x = torch.tensor({x.tolist()!r})\n"
        "print(type(m).__module__, m(x).logits.sum().item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    module, total = res.stdout.split()
    assert module.startswith("transformers_modules")
    assert abs(float(total) - ref.sum().item()) <= 1e-3 * max(1.0, abs(ref.sum().item()))


def _train(env, out, method, **extra):
    from conftest import train_args

    args = [*train_args(env, out), "--method", method, "--max-steps", "6"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("method", ["budgeted", "kd-lora", "kd-full"])
def test_cli_compress_every_method(tiny_env, tmp_path, method):
    run = _train(tiny_env, tmp_path / "run", method, budget=0.0, retention_ema=0.0, allocation="cost")  # F = 0: all
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    res = CliRunner().invoke(app, ["compress", str(run), "--svd-max-rank", "8", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # the input run is untouched
    folder = tmp_path / "run.compressed"
    assert json.loads((folder / "compression.json").read_text())["modules_total"] == 28 // 2
    trained = json.loads((run / "config.json").read_text())["config"]["lora_rank"]
    assert report["lora_rank"] == (None if method == "kd-full" else trained)  # what bench's LoRA variant uses
    ev = report["eval"]
    if method == "budgeted":
        assert report["dense_dropped"] == 14 and report["speedup_vs_dense"] > 1
        assert ev["compressed_val_ppl"] == pytest.approx(ev["student_val_ppl"], rel=1e-4)  # case 1 is exact
        assert report["param_reduction"] > 0 and report["speedup_vs_lora"] > report["speedup_vs_dense"]
        assert "dense + LoRA" in report["baselines"]["param_reduction"]
    else:  # the KD baselines deploy as a dense student: the paper's Table 5 gives them 1.00x and 0%
        assert report["dense_kept"] == 14 and report["speedup_vs_dense"] == 1.0
        assert report["speedup_vs_lora"] == 1.0 and report["param_reduction"] == 0.0
        assert (report["lora_macs"] > 0) == (method == "kd-lora")  # the trained adapter is still recorded
        assert "dense student" in report["baselines"]["param_reduction"]
        assert ev["compressed_val_ppl"] == pytest.approx(ev["student_val_ppl"], rel=1e-4)
    hf = CliRunner().invoke(app, ["export", "hf", str(folder), "--out", str(tmp_path / "share")])
    assert hf.exit_code == 0, hf.output
    card = (tmp_path / "share" / "README.md").read_text()
    assert "MAC speed-up vs dense" in card and "validation perplexity" in card
    from huggingface_hub import ModelCard

    meta = ModelCard.load(tmp_path / "share" / "README.md").data  # what a hub indexes
    assert meta.library_name == "transformers" and meta.pipeline_tag == "text-generation"
    assert "bdlora" in meta.tags and meta.base_model is None  # a local teacher path is not a hub id
    summary = meta.to_dict()["bdlora"]
    assert summary["method"] == method and summary["speedup_vs_dense"] == report["speedup_vs_dense"]
    assert summary["dense_dropped"] == report["dense_dropped"]
    (result,) = meta.eval_results
    assert result.metric_type == "perplexity"
    assert result.metric_value == pytest.approx(ev["compressed_val_ppl"], abs=1e-4)
    assert (tmp_path / "share" / "modeling_bdlora.py").exists()


def test_a_compressed_folder_keeps_its_heldout_slice_when_the_run_is_gone(tiny_env, tmp_path):
    """compress records the run's corpus settings in the provenance: moved away and with its run deleted, the folder
    is still scored on the run's held-out slice (eval gives compress's own figure), not on a fallback corpus."""
    import shutil

    from bdlora.base.runs import ModelDir, RunDir
    from bdlora.export.genai.folder import data_settings

    run = _train(tiny_env, tmp_path / "run", "budgeted", budget=0.0, retention_ema=0.0, allocation="cost")
    recorded = RunDir(run).data_settings()
    res = CliRunner().invoke(app, ["compress", str(run), "--svd-max-rank", "8", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    moved = tmp_path / "elsewhere" / "student"
    moved.parent.mkdir()
    shutil.move(tmp_path / "run.compressed", moved)
    shutil.rmtree(run)
    assert data_settings(moved, ModelDir(moved).report()) == recorded
    assert recorded["data"] == str(tiny_env["corpus"])
    r = CliRunner().invoke(app, ["eval", str(moved), "--ppl", "--report", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    scored = json.loads((tmp_path / "e.json").read_text())["ppl"]["val_ppl"]
    assert scored == pytest.approx(report["eval"]["compressed_val_ppl"], rel=1e-4)


def test_cli_compress_bad_input(tiny_env, tmp_path):
    r = CliRunner().invoke(app, ["compress", str(tmp_path), "--eps-zero", "0.9"])
    assert r.exit_code == 2 and "--eps-zero 0.9 >= --eps-lr 0.7" in r.stderr
    r = CliRunner().invoke(app, ["compress", str(tmp_path)])
    assert r.exit_code == 2 and "not a finished bdlora run" in r.stderr
    run = _train(tiny_env, tmp_path / "run", "budgeted")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    r = CliRunner().invoke(app, ["compress", str(run), "--out", str(tmp_path / "taken"), "--no-eval"])
    assert r.exit_code == 2 and "exists and is not empty" in r.stderr
    assert (tmp_path / "taken" / "x").read_text() == "mine"
    r = CliRunner().invoke(app, ["compress", str(run), "--out", str(run / "inside"), "--no-eval"])
    assert r.exit_code == 2 and "overlaps the input" in r.stderr
    (run / "student" / "budgeted.safetensors").unlink()
    r = CliRunner().invoke(app, ["compress", str(run), "--no-eval"])
    assert r.exit_code == 2 and "gated modules missing" in r.stderr
    r = CliRunner().invoke(app, ["export", "hf", str(tmp_path / "taken"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "not a bdlora model folder" in r.stderr


SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("teacher,expected", [(SMOL, SMOL), ("smollm2-135m", SMOL), ("builtin", None),
                                              ("/ckpt/teacher-0.5b", None),
                                              ("a/b/c", None)])
def test_model_card_base_model_only_for_hub_ids(teacher, expected):
    from bdlora.export.card import hub_id

    assert hub_id(teacher) == expected


# --------------------------------------------------------------------------------------------------------------------
# A damaged or edited compressed folder is refused by every reader, before anything is written
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def saved_student(tiny_env, tiny_model, tmp_path):
    from bdlora.deployed.folder import save_model_folder
    from conftest import compressed_student

    _, model, report = compressed_student(tiny_model, [0.0, 1.0, 0.3, 0.9], seed=1)
    return save_model_folder(model, tiny_env["tokenizer"], tmp_path / "m.compressed", report)


def _edit_form(folder):  # the case: a dense projection declared low-rank
    cfg = json.loads((folder / "config.json").read_text())
    dense = next(k for k, v in cfg["bdlora_modules"].items() if v["form"] == "dense")
    cfg["bdlora_modules"][dense] = {"form": "lowrank", "rank": 16}
    (folder / "config.json").write_text(json.dumps(cfg))


def _truncate(folder):
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _flip_a_weight_byte(folder):  # same size, valid header: only the recorded digest can tell
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))


def _declare(**sizes):  # issue 32: a config edited to sizes its weights do not have
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(sizes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


DAMAGE = [
    (_edit_form, "the weights do not match config.json"),
    (_declare(num_hidden_layers=1_000_000, hidden_size=1_000_000_000),
     "declares hidden_size 1,000,000,000 but the weights hold 32; num_hidden_layers 1,000,000 but the weights hold"),
    (_declare(intermediate_size=10**12), "declares intermediate_size 1,000,000,000,000 but the weights hold 64"),
    (_declare(vocab_size=10**9), "declares vocab_size 1,000,000,000 but the weights hold"),
    (_declare(num_attention_heads=4096), "num_attention_heads x head_dim 32,768 but the weights hold 32"),
    (_declare(num_key_value_heads=10**6), "num_key_value_heads x head_dim 8,000,000 but the weights hold 16"),
    (_declare(head_dim=0), "head_dim 0 (must be a positive integer)"),
    (_declare(num_hidden_layers="2"), "num_hidden_layers '2' (must be a positive integer)"),
    (_truncate, "(truncated or padded)"),
    (_flip_a_weight_byte, "its SHA-256 differs from the one recorded"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda f: (f / "config.json").write_text("[]"), "not a model config"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 64), "not a valid safetensors file"),
]


@pytest.mark.parametrize("damage,needle", DAMAGE)
def test_a_damaged_or_edited_folder_is_refused_by_every_reader(saved_student, tmp_path, damage, needle):
    from bdlora.models.integrity import DIGEST_KEY

    report = json.loads((saved_student / "compression.json").read_text())
    assert set(report[DIGEST_KEY]) == {"model.safetensors"}
    damage(saved_student)
    for args, out in [(["export", "hf", str(saved_student), "--out", str(tmp_path / "share")], tmp_path / "share"),
                      (["export", "onnx", str(saved_student), "--out", str(tmp_path / "o")], tmp_path / "o"),
                      (["export", "genai", str(saved_student), "--out", str(tmp_path / "g")], tmp_path / "g"),
                      (["eval", str(saved_student), "--ppl", "--report", str(tmp_path / "e.json")],
                       tmp_path / "e.json"),
                      (["bench", str(saved_student), "--out", str(tmp_path / "b")], tmp_path / "b")]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args[:2], res.output)
        assert needle in res.stderr and res.stderr.strip().count("\n") == 0, (args[:2], res.stderr)
        assert not out.exists()  # nothing published or written
