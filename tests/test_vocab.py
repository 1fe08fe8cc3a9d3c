"""The draft's LM head over the tokens its teacher emits most (``--forms vocab``): the kept vocabularies priced against
the whole decode step, their error the probability the teacher puts outside them, the chosen head declared and built
(its logits the teacher's on the kept tokens, VOCAB_MARGIN below the lowest kept one elsewhere), exported by its own
emitter, refused when damaged, and used as a speculative-decoding draft whose output stays the teacher's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_channels import shot
from test_head_bits import HEAD_X, head_tables
from test_whole_decode import LAYERS3
from typer.testing import CliRunner

import bdlora.compress.calibrate as cal
from bdlora.base.io import read_json, write_json
from bdlora.cli import app
from bdlora.compress.allocate import head_options
from bdlora.forms import HEAD, VOCAB_MARGIN
from bdlora.forms.context import Choice
from conftest import allocate_with


def test_calibration_sums_the_models_probabilities_and_counts_its_argmax(tiny_env, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"]).eval()
    blocks = np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 16))
    calib = cal.calibrate(model, blocks, predicted=True)
    with torch.no_grad():
        p = torch.softmax(model(torch.from_numpy(blocks)).logits.double(), -1).reshape(-1, model.config.vocab_size)
    np.testing.assert_allclose(calib.mass, p.sum(0).numpy(), rtol=1e-5)
    assert (calib.argmax == np.bincount(p.argmax(-1).numpy(), minlength=len(calib.argmax))).all()
    monkeypatch.setattr(cal, "HEAD_CHUNK", 5)  # chunks that split the blocks sum the same
    np.testing.assert_allclose(cal.calibrate(model, blocks, predicted=True).mass, calib.mass, rtol=1e-6)


def test_the_head_options_are_the_product_of_its_widths_and_kept_vocabularies():
    """(keep 0 = all, bits): the source's own first; a 4-bit option scales the time as the full head's and adds its
    error; the allocation buys the narrow head where it saves the most for the least error."""
    bits = [Choice("bits", 100.0, 0.0, bits=8), Choice("bits", 50.0, 2.0, bits=4)]  # as the forms offer them
    vocab = [Choice("vocab", 100.0, 0.0), Choice("vocab", 10.0, 5.0, keep=32)]
    opts = head_options(bits + vocab)  # one factor per form, the product priced by the others' ratios
    assert [((o[0][0].keep, o[0][1].bits), o[1], o[2]) for o in opts] == [
        ((0, 8), 100.0, 0.0), ((0, 4), 50.0, 2.0), ((32, 8), 10.0, 5.0), ((32, 4), 5.0, 7.0)]
    energy = {s.name: np.ones(32) for s in LAYERS3}
    rest = {f"model.layers.{i}": (1000.0, 0.0) for i in range(3)}
    vocab = [(0, 1500.0, 0.0), (64, 400.0, 3.0), (32, 200.0, 50.0)]
    a = allocate_with(LAYERS3, energy, 1.05, rest=rest, fixed=2000.0, vocab=vocab)
    assert a.head == (64, 0) and a.errors[HEAD] == 3.0  # saves 1,100 of 677 needed
    b = allocate_with(LAYERS3, energy, 1.12, rest=rest, fixed=2000.0, vocab=vocab)  # 1,523 to save
    assert b.head.keep == 64 and any(b.ranks.values())  # 64 tokens and a pair (error 3 + 31) beat 32 tokens (50)


@pytest.fixture(scope="module")
def draft(tiny_env, tmp_path_factory):
    """A one-shot draft of a genai-shaped teacher (vocabulary 320) with --forms layers,vocab --speedup 1.6 at int4,
    against hand-made tables where the 8-bit head dominates the step (``head_tables``) and a head keeping K tokens
    costs K / 320 of it."""
    import bdlora.compress.forms.vocab as vocab
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("vocab")
    genai_teacher(tiny_env["tokenizer"], root / "teacher")
    config = head_tables(root / "cache", root / "teacher")
    hidden = config["hidden_size"]
    from bdlora.export.genai import latency as lat

    for precision, x in (("int4", 1.0), ("int8", HEAD_X)):
        path = lat.table_path(root / "cache", precision, 1)
        doc = read_json(path)
        doc["us"].update({f"{hidden}x{k}@0": x * hidden * k / 100 for k in (32, 64, 128, 256)})
        write_json(path, doc)
    with pytest.MonkeyPatch.context() as mp:  # the random teacher's choices spread over the whole vocabulary
        mp.setattr(vocab, "MIN_COVERAGE", 0.0)
        r = shot({**tiny_env, "cache": root / "cache"}, root / "teacher", root / "d", "--precision", "int4",
                 "--threads", "1", "--speedup", "1.6", "--forms", "layers,vocab")
    assert r.exit_code == 0, r.output
    return root, json.loads(r.stdout)


def test_a_draft_keeps_the_tokens_the_teacher_emits_most(draft, tiny_env):
    from bdlora.models.load import load_model_folder

    root, report = draft
    prov = report["provenance"]
    keep = prov["vocab"]["keep"]
    assert keep in (32, 64, 128, 256) and prov["allocation_cost"]["head_keep"] == keep
    cov = prov["vocab"]["argmax_coverage"]
    assert all(0 <= cov[k] <= cov[k2] <= 1 for k, k2 in zip(list(cov), list(cov)[1:]))  # grows with K
    cfg = read_json(root / "d" / "config.json")
    assert cfg["bdlora_modules"][HEAD] == {"form": "vocab", "keep": keep} and cfg["tie_word_embeddings"] is False
    model, _, _ = load_model_folder(root / "d")
    teacher, _, _ = load_model_folder(root / "teacher")
    ids = model.lm_head.token_ids
    assert ids.shape == (keep,) and bool((ids[1:] > ids[:-1]).all())
    x = torch.tensor([tiny_env["tokenizer"]("alpha beta gamma")["input_ids"]])
    with torch.no_grad():
        z = model(x).logits
        hidden = model.model(x).last_hidden_state
    out = torch.ones(z.shape[-1], dtype=torch.bool)
    out[ids] = False
    floor = z[..., ids].amin(-1, keepdim=True) - VOCAB_MARGIN
    assert bool((z[..., out] == floor).all())
    torch.testing.assert_close(z[..., ids], hidden @ teacher.lm_head.weight[ids].T)  # the teacher's rows


def test_the_draft_exports_by_its_head_form_and_drafts_for_the_teacher(draft, tiny_env):
    """export genai validates the scattered head against PyTorch (and its last-position twin); as a draft it
    proposes kept tokens only, and the speculative output is the teacher's greedy output."""
    from bdlora.export.genai import export_genai_folder
    from bdlora.export.settings import GenaiExportConfig
    from bdlora.speculative.decoders import DecoderFactory
    from bdlora.speculative.loop import Speculator, generate
    from bdlora.speculative.policy import KPolicy
    from bdlora.speculative.proposers import DraftProposer

    root, _ = draft
    info = export_genai_folder(root / "d", root / "d.genai", GenaiExportConfig(precision="fp32"))
    assert info["validation"]["parity"]["max_abs_diff"] <= 1e-4
    export_genai_folder(root / "teacher", root / "t.genai", GenaiExportConfig(precision="fp32", validate=False))
    target, d = DecoderFactory.verifying(root / "t.genai"), DecoderFactory(root / "d.genai")
    ids = tiny_env["tokenizer"]("alpha beta gamma")["input_ids"]
    plain = Speculator(target.new(64), None, KPolicy(1))
    want = [t for t, _ in generate(plain, ids, 24, max_length=64)]
    sp = Speculator(target.new(64), DraftProposer(d.new(64)), KPolicy(3, fixed=3))
    assert [t for t, _ in generate(sp, ids, 24, max_length=64)] == want and sp.stats.proposed > 0


def test_a_damaged_vocab_declaration_is_refused_in_one_line(draft, tmp_path):
    import shutil

    root, _ = draft
    bad = tmp_path / "bad"
    shutil.copytree(root / "d", bad)
    cfg = read_json(bad / "config.json")
    cfg["bdlora_modules"][HEAD]["keep"] += 1
    write_json(bad / "config.json", cfg)
    r = CliRunner().invoke(app, ["export", "genai", str(bad), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "lm_head is declared vocab keeping" in r.output and "Traceback" not in r.output


def test_vocab_needs_the_whole_step_as_its_budget(tiny_env, tmp_path):
    r = shot(tiny_env, tiny_env["teacher"], tmp_path / "x", "--mac-ratio", "1.2", "--forms", "layers,vocab")
    assert r.exit_code == 2 and "vocab prices the LM head against the whole decode step" in r.output



def test_only_vocabularies_holding_most_of_the_teachers_choices_are_offered():
    """A kept vocabulary is offered only if it holds MIN_COVERAGE of the teacher's argmax tokens; its error is twice
    the probability outside it, summed over the tokens; the source's full head comes first at no error."""
    from types import SimpleNamespace

    from bdlora.compress.forms.vocab import MIN_COVERAGE, STEP
    from bdlora.forms.context import OneShotContext

    vocab = 128
    mass = np.zeros(vocab)
    mass[:40] = np.linspace(40, 1, 40)  # 820 tokens' worth of probability over 40 tokens
    argmax = np.zeros(vocab, dtype=np.int64)
    argmax[:33] = 30  # the teacher picks 33 tokens: 32 hold 32/33 = 0.970 of its choices, 64 all of them
    ctx = OneShotContext(None, None, None, ("vocab",), [], {}, 1, {"hidden_size": 64, "vocab_size": vocab},
                         calib=SimpleNamespace(mass=mass, argmax=argmax))
    STEP.offer(ctx)
    offered = ctx.offers[HEAD]
    assert MIN_COVERAGE > 0.970 and [c.keep for c in offered] == [0, 64] and {c.form for c in offered} == {"vocab"}
    assert (offered[0].cost, offered[0].error) == (64 * vocab, 0.0) and offered[1].cost == 64 * 64  # MACs, no table
    assert offered[1].error == 0.0  # 64 tokens hold all the probability
    assert ctx.facts["vocab"]["argmax_coverage"]["32"] == pytest.approx(32 / 33)


def test_plan_predicts_the_speculative_speedup_of_a_draft(draft):
    """plan DRAFT --precision int4 --speculative: the draft's agreement with its teacher measured on held-out text,
    its step's share of the teacher's from the whole-step prediction, the teacher's verification costs (here a cached
    curve), and per k the speed-up ``expected_tokens(alpha, k) / (k share + verify(k + 1))``."""
    from transformers import AutoConfig

    from bdlora.base.schemes import DEFAULT_SCHEME, scheme
    from bdlora.bench.verify import verify_path
    from bdlora.speculative.rules import expected_tokens

    root, _ = draft
    config = AutoConfig.from_pretrained(root / "teacher").to_dict()
    shares = {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.8, 5: 2.2}
    layout = scheme(DEFAULT_SCHEME).timed_as("int4").layout("int4")
    write_json(verify_path(root / "cache", config, "int4", 1, layout, 5), {"shares": shares})
    r = CliRunner().invoke(app, ["plan", str(root / "d"), "--precision", "int4", "--threads", "1", "--speculative",
                                 "--json"], env={"BDLORA_CACHE": str(root / "cache")})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    p = doc["speculative"]
    assert 0.0 <= p["alpha"] <= 1.0 and p["agreement_tokens"] > 0
    share = doc["deployed"]["decode_us"] / doc["deployed"]["decode_us_teacher"]
    assert p["draft_step_share"] == pytest.approx(share) and share < 1
    for k in range(1, 5):
        want = expected_tokens(p["alpha"], k) / (k * share + shares[k + 1])
        assert p["per_k"][str(k)] == pytest.approx(want)
    assert p["speedup"] == max(p["per_k"].values())


def test_the_verification_curve_is_measured_on_the_targets_shapes_and_cached(tmp_path, monkeypatch):
    """Calls of 1 to 3 tokens after a 128-token prompt on a synthetic graph of the config's shapes, timed in their own
    process: shares of a one-token call, cached; read back without timing again."""
    import bdlora.bench.verify as verify

    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "rope_theta": 10000.0}
    monkeypatch.setattr(verify, "REPEATS", 3)
    shares = verify.verify_curve(config, "int4", 1, tmp_path, "rtn", widths=3)
    assert sorted(shares) == [1, 2, 3] and shares[1] == 1.0 and all(v > 0 for v in shares.values())
    monkeypatch.setattr(verify, "run_timing_process", lambda *a, **k: pytest.fail("timed again"))
    assert verify.verify_curve(config, "int4", 1, tmp_path, "rtn", widths=3) == shares
