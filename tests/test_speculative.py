"""Speculative decoding: the acceptance rules (greedy agreement, the rejection rule's distribution), prompt lookup,
the k policy, and the loop over both runtimes: greedy output token-identical to the target alone across rejections
and cache rollbacks, sampled output distributed as the target's, a draft of another tokenizer refused."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.models.runtime import DecoderShape, greedy_generate, run_decoder, session
from bdlora.speculative.decoders import DecoderFactory
from bdlora.speculative.loop import Speculator, generate
from bdlora.speculative.policy import Costs, KPolicy, best_k
from bdlora.speculative.proposers import DraftProposer, PromptLookup, common_prefix
from bdlora.speculative.rules import distribution, expected_tokens, verify_greedy, verify_sampled
from conftest import genai_teacher, put_foreign_tokenizer

# --- the rules ------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 2**31 - 1))
def test_greedy_rule_commits_the_targets_own_argmax_tokens(k, vocab, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(k + 1, vocab))
    best = z.argmax(-1)
    proposal = [int(best[i]) if rng.random() < 0.6 else int(rng.integers(vocab)) for i in range(k)]
    m, nxt = verify_greedy(proposal, z)
    committed = proposal[:m] + [nxt]
    assert committed == [int(b) for b in best[: m + 1]]  # each committed token is the argmax of its row
    assert m == k or proposal[m] != best[m]


def _first_tokens(p, q, rounds, seed, deterministic=False):
    rng = np.random.default_rng(seed)
    counts = np.zeros(p.shape[1])
    second = np.zeros(p.shape[1])
    for _ in range(rounds):
        if deterministic:
            proposal, qs = [0, 1], None
        else:
            proposal = [int(rng.choice(len(q[i]), p=q[i])) for i in range(2)]
            qs = q
        m, nxt = verify_sampled(proposal, qs, p, rng)
        committed = proposal[:m] + [nxt]
        counts[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
    return counts, second


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_rule_commits_tokens_distributed_as_the_target(deterministic):
    """k = 2 over 6 tokens, p and q far apart: the first committed token is distributed as p_1 (chi-square); the
    same test rejects a rule that accepts every proposal (the test can fail)."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6) * 0.7, size=3)
    q = rng.dirichlet(np.ones(6) * 0.7, size=2)
    counts, _ = _first_tokens(p, q, 20000, seed=1, deterministic=deterministic)
    assert chisquare(counts, p[0] * counts.sum()).pvalue > 1e-3
    wrong = np.bincount([int(rng.choice(6, p=q[0])) for _ in range(20000)], minlength=6)  # "accept everything"
    assert chisquare(wrong, p[0] * wrong.sum()).pvalue < 1e-6


def test_distribution_is_greedy_at_zero_temperature_and_a_nucleus_below_one():
    z = np.array([1.0, 3.0, 2.0, -1.0])
    assert distribution(z, 0.0).tolist() == [0.0, 1.0, 0.0, 0.0]
    full = distribution(z, 1.0)
    np.testing.assert_allclose(full, np.exp(z) / np.exp(z).sum(), rtol=1e-12)
    nucleus = distribution(z, 1.0, top_p=0.8)
    assert nucleus[3] == 0.0 and nucleus[0] == 0.0 and abs(nucleus.sum() - 1) < 1e-12  # 0.66 + 0.24 reach 0.8
    with pytest.raises(FloatingPointError):
        distribution(np.array([0.0, np.nan]), 1.0)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 3) - (1 + 0.5 + 0.25 + 0.125)) < 1e-12


# --- the policy -------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 0.5), st.floats(0.0, 1.0),
       st.integers(1, 8))
def test_best_k_grows_with_acceptance_and_is_off_when_nothing_is_accepted(a1, a2, draft, slope, base, max_k):
    cost = lambda w: 1.0 + base * 0 + slope * (w - 1)  # noqa: E731
    lo, hi = sorted((a1, a2))
    k_lo, r_lo = best_k(lo, draft, cost, max_k)
    k_hi, r_hi = best_k(hi, draft, cost, max_k)
    assert 0 <= k_lo <= k_hi <= max_k and r_hi >= r_lo - 1e-12
    assert best_k(0.0, draft, cost, max_k)[0] == 0  # nothing is ever accepted: plain steps
    assert r_lo >= 1.0 / cost(1) - 1e-12  # never slower than plain decoding, by its own measure


def test_policy_switches_speculation_off_when_it_does_not_pay_and_probes_again_backing_off():
    costs = Costs()
    costs.record_target(1, 1.0)
    costs.record_target(5, 1.0)  # verifying 4 proposals costs one step
    costs.record_draft(4, 0.4)
    good = KPolicy(4, costs)
    for _ in range(20):
        good.record(4, 4)
    assert good.choose(100) == 4
    bad = KPolicy(4, Costs(target=dict(costs.target), draft=costs.draft))  # another server: another acceptance
    for _ in range(20):
        bad.record(4, 0)
    ks = []
    for _ in range(250):
        ks.append(bad.choose(100))
        bad.record(ks[-1], 0)  # every probe rejected: the next one waits twice as long
    assert [i for i, k in enumerate(ks) if k] == [15, 47, 111, 239]  # after 16, 32, 64, 128 rounds at k = 0
    assert bad.choose(100) == 0 and bad.probe_every == 256
    while not bad.choose(100):
        pass
    bad.record(1, 1)  # a probe accepted: back to probing every 16
    assert bad.probe_every == 16
    assert KPolicy(4, costs, fixed=3).choose(2) == 2  # never more than the tokens still wanted


def test_a_new_request_starts_from_the_acceptance_its_server_has_seen():
    """Measured with serve --draft at 1 client: every 48-token request re-learned the draft's ~25% acceptance from
    the prior 0.5, proposing (and paying for) drafts it then rejected: 0.68x of serving without the draft."""
    costs = Costs()
    for w, c in {1: 1.0, 2: 1.2, 3: 1.5}.items():
        costs.record_target(w, c)
    costs.record_draft(1, 0.15)
    assert KPolicy(4, costs).choose(100) == 1  # nothing seen yet: the prior 0.5 says a proposal pays
    earlier = KPolicy(4, costs)
    for _ in range(100):
        earlier.record(2, 0)  # the requests before: every proposal rejected
    assert costs.prior_alpha() < 0.05
    assert KPolicy(4, costs).choose(100) == 0  # a new request does not re-learn it
    for _ in range(5000):
        costs.record_acceptance(1, 1)  # the memory is bounded: a proposer that improves is seen as improved
    assert costs.evaluated <= 1024 and costs.prior_alpha() > 0.99


def test_prompt_lookup_proposals_are_priced_at_nothing_whatever_a_draft_costs():
    """Measured in bench --speculative (SmolLM2 int4): lookup at k = 4 accepted 67% and decoded 1.17x faster, but
    the adaptive policy, pricing each proposal at the draft model's step, stayed at k = 0 (0.96x)."""
    costs = Costs()
    for w, c in {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.8, 5: 2.2}.items():
        costs.record_target(w, c)
    costs.record_draft(1, 0.6)  # a draft model's step, measured by another proposer on the same server
    priced, free = KPolicy(4, costs), KPolicy(4, costs)
    for p in (priced, free):
        for _ in range(40):
            p.record(3, 2)  # acceptance 2/3
    assert priced.choose(100) == 0
    Speculator(type("T", (), {"all_rows": True})(), PromptLookup(), free)
    assert free.free and free.choose(100) == 2  # (1 + a + a^2) / c(3) = 1.40 tokens a step, the best k
    assert not Speculator(type("T", (), {"all_rows": True})(), None, KPolicy(4, costs)).policy.free


# --- prompt lookup ----------------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    pl = PromptLookup(max_ngram=3)
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert pl.propose(seq, 3).tokens == [7, 8, 2]  # "2 3 4" last seen before 7 8
    assert pl.propose(seq + [7], 2).tokens == [8, 2]  # incremental: the index grew by one position
    assert pl.propose([5, 6, 7], 3).tokens == []  # another context, no repetition: no proposal
    assert PromptLookup(2, 2).propose([1, 2, 3, 9, 3], 2).tokens == []  # "9 3" never seen; unigrams not tried
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2


# --- the loop over both runtimes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_env, tmp_path_factory):
    """A 2-layer hidden-64 teacher (head dim 16: the genai graph's attention) and a draft that agrees with it on
    about two thirds of its argmax tokens (its weights perturbed), each exported for onnxruntime-genai and
    onnxruntime."""
    from bdlora.export.genai import export_genai_folder
    from bdlora.export.onnx import export_onnx_folder
    from bdlora.export.settings import GenaiExportConfig

    root = tmp_path_factory.mktemp("spec")
    tok = tiny_env["tokenizer"]
    teacher = genai_teacher(tok, root / "teacher")
    draft = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.003)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    out = {"tok": tok, "root": root}
    for name in ("teacher", "draft"):
        export_genai_folder(root / name, root / f"{name}.genai", GenaiExportConfig(precision="fp32",
                                                                                       validate=False))
        export_onnx_folder(root / name, root / f"{name}.onnx", run_validation=False)
        out[name] = root / name
    return out


PROMPTS = ("alpha beta gamma delta", "red green blue. one two three four", "monday tuesday")


def _plain_greedy(runtime, folder, ids, n):
    if runtime == "ort":
        sess, shape = session(folder / "model.onnx"), DecoderShape.from_folder(folder)
        return greedy_generate(sess, shape, np.array([ids]), n)[0, len(ids):].tolist()
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False, min_length=len(ids) + n)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([ids], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(ids):]]


@pytest.mark.parametrize("runtime", ["ort", "genai"])
@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_greedy_speculative_output_is_the_targets_token_for_token(pair, runtime, proposer):
    """Across rejections (some proposals refused), full acceptances and the rollbacks they need, adaptive and
    fixed k: every generated token equals plain greedy decoding of the target in the same runtime."""
    root, tok = pair["root"], pair["tok"]
    ext = ".genai" if runtime == "genai" else ".onnx"
    target = DecoderFactory.verifying(root / f"teacher{ext}")
    draft = DecoderFactory(root / f"draft{ext}") if proposer == "draft" else None  # its last position only
    totals = {"accepted": 0, "evaluated": 0, "full": 0}
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = _plain_greedy(runtime, root / f"teacher{ext}", ids, 48)
        for k, fixed in ((3, True), (1, True), (4, False)):
            prop = DraftProposer(draft.new(128)) if draft else PromptLookup(3)
            sp = Speculator(target.new(128), prop, KPolicy(k, fixed=k if fixed else None))
            got = [t for t, _ in generate(sp, ids, 48, max_length=128)]
            assert got == ref, (prompt, k, fixed)
            totals["accepted"] += sp.stats.accepted
            totals["evaluated"] += sp.stats.evaluated
            totals["full"] += sp.stats.committed - sp.stats.target_calls
    assert 0 < totals["accepted"] < totals["evaluated"]  # both acceptances and rejections (rollbacks) happened
    assert totals["full"] > 0  # rounds committed more than one token per target call


def test_speculative_rows_are_the_targets_logits(pair):
    """The logits row returned with each token is the target's own at that position (what logprobs report)."""
    root, tok = pair["root"], pair["tok"]
    ids = tok(PROMPTS[0])["input_ids"]
    target = DecoderFactory(root / "teacher.onnx")
    sp = Speculator(target.new(128), DraftProposer(DecoderFactory(root / "draft.onnx").new(128)), KPolicy(3, fixed=3))
    out = list(generate(sp, ids, 20, max_length=128))
    seq = ids + [t for t, _ in out]
    x = np.array([seq])
    full = run_decoder(target.sess, x, np.ones_like(x), np.arange(len(seq))[None], [
        np.zeros((1, target.shape.kv(i // 2), 0, target.shape.head_dim), np.float32)
        for i in range(2 * target.shape.layers)])[0][0]
    for j, (_, row) in enumerate(out):
        np.testing.assert_allclose(row, full[len(ids) - 1 + j], atol=1e-4)


def test_sampled_speculative_output_is_distributed_as_the_target(tiny_env, tmp_path):
    """Temperature 1 and top-p 0.9, a draft that often disagrees, k = 2: over 2,500 generations of 4 tokens the
    second and third (decided by round one's acceptances, residual and bonus draws) are each distributed as the
    target's exact marginal (chi-square over the tokens with enough expected mass; the rest pooled)."""
    from transformers import AutoModelForCausalLM

    from bdlora.export.onnx import export_onnx_folder

    teacher = tiny_env["teacher"]
    draft_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    draft_model.save_pretrained(tmp_path / "draft")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "draft")
    export_onnx_folder(teacher, tmp_path / "t.onnx", run_validation=False)
    export_onnx_folder(tmp_path / "draft", tmp_path / "d.onnx", run_validation=False)
    target, draft = DecoderFactory(tmp_path / "t.onnx", threads=1), DecoderFactory(tmp_path / "d.onnx", threads=1)
    ids = tiny_env["tokenizer"]("alpha beta")["input_ids"]
    temperature, top_p = 1.0, 0.9

    def after(prefix):
        return distribution(target.new(64).append(ids + prefix)[-1], temperature, top_p)

    # the exact marginals of the second and third tokens, summed over the tokens before them
    p1 = after([])
    p2, p3 = np.zeros_like(p1), np.zeros_like(p1)
    for t1 in np.flatnonzero(p1):
        q2 = after([int(t1)])
        p2 += p1[t1] * q2
        for t2 in np.flatnonzero(q2):
            p3 += p1[t1] * q2[t2] * after([int(t1), int(t2)])
    counts = np.zeros((2, len(p1)))
    accepted = evaluated = 0
    for seed in range(2500):
        sp = Speculator(target.new(64), DraftProposer(draft.new(64)), KPolicy(2, fixed=2))
        toks = [t for t, _ in generate(sp, ids, 4, temperature, top_p, seed=seed, max_length=64)]
        counts[0, toks[1]] += 1
        counts[1, toks[2]] += 1
        accepted += sp.stats.accepted
        evaluated += sp.stats.evaluated
    assert 0.2 < accepted / evaluated < 0.9, accepted / evaluated  # the draft is neither the target nor useless
    for c, p in zip(counts, (p2, p3)):
        big = p * c.sum() >= 5
        obs = np.append(c[big], c[~big].sum())
        exp = np.append(p[big], p[~big].sum()) * c.sum()
        assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(pair, tmp_path, tiny_env):
    import shutil

    root = pair["root"]
    foreign = tmp_path / "foreign.genai"
    shutil.copytree(root / "draft.genai", foreign)
    put_foreign_tokenizer(foreign, tiny_env["corpus"])
    marker = json.loads((foreign / "export.json").read_text())
    from bdlora.models.integrity import TOKENIZER_KEY, tokenizer_digests

    marker[TOKENIZER_KEY] = tokenizer_digests(foreign)  # a consistent folder, only another tokenizer
    (foreign / "export.json").write_text(json.dumps(marker))
    r = CliRunner().invoke(app, ["generate", str(root / "teacher.genai"), "--prompt", "alpha", "--draft",
                                 str(foreign)])
    assert r.exit_code == 2 and "its tokenizer differs" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_generate_command_compares_with_plain_decoding(pair):
    root = pair["root"]
    r = CliRunner().invoke(app, ["generate", str(root / "teacher.genai"), "--prompt", "alpha beta gamma",
                                 "--max-tokens", "24", "--draft", str(root / "draft.genai"), "--compare", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["identical"] and len(doc["tokens"]) == 24 and doc["stats"]["target_calls"] <= 24
    assert doc["plain"]["stats"]["proposed"] == 0 and doc["proposer"] == "draft"


# --- the serving engines ------------------------------------------------------------------------------------------


def _engine(pair, runtime, proposer="draft", fixed_k=True, **kw):
    """An engine with a proposer; ``fixed_k``: three proposals every round (the tiny draft costs what the target
    does, so the adaptive k rightly turns speculation off: the policy is tested on its own)."""
    from bdlora.serve.engine import Engine
    from bdlora.serve.genai_engine import GenaiEngine
    from bdlora.speculative.config import SpeculationConfig

    root = pair["root"]
    ext = ".genai" if runtime == "genai" else ".onnx"
    spec = SpeculationConfig(draft=str(root / f"draft{ext}") if proposer == "draft" else None,
                             prompt_lookup=proposer == "lookup", max_k=3, fixed_k=fixed_k)
    cls = GenaiEngine if runtime == "genai" else Engine
    return cls(root / f"teacher{ext}", threads=1, speculation=spec, **kw)


def _ask(eng, tok, asks, logprobs=None):
    import queue as queue_mod

    from bdlora.serve.engine import Request
    from bdlora.serve.sampling import SamplingParams

    events = [queue_mod.Queue() for _ in asks]
    with eng.held():
        for (prompt, n), q in zip(asks, events):
            eng.submit(Request(tok(prompt)["input_ids"], SamplingParams(max_tokens=n, temperature=0.0,
                                                                         logprobs=logprobs),
                               lambda kind, p, q=q: q.put((kind, p)), stream=False))
    return [q.get(timeout=120) for q in events]


@pytest.mark.parametrize("runtime", ["ort", "genai"])
def test_serving_with_a_draft_gives_the_models_own_tokens_alone_and_under_concurrency(pair, runtime):
    """Alone, a request is continued speculatively (rounds, acceptances) and gets the served model's greedy tokens
    with its own log-probabilities; four together decode as one batch (no speculation while they share it), and the
    one left last speculates again where the runtime can drop finished rows (onnxruntime); every text is the
    model's greedy text."""
    tok = pair["tok"]
    ext = ".genai" if runtime == "genai" else ".onnx"
    ref = {p: _plain_greedy(runtime, pair["root"] / f"teacher{ext}", tok(p)["input_ids"], n)
           for p, n in (("alpha beta gamma", 30), ("red green", 6), ("one two", 9), ("monday", 40))}
    eng = _engine(pair, runtime)
    try:
        (kind, info), = _ask(eng, tok, [("alpha beta gamma", 30)], logprobs=2)
        assert kind == "done" and info["generated"] == ref["alpha beta gamma"]
        totals = eng.speculation.totals
        assert totals.rounds > 0 and 0 < totals.accepted < totals.evaluated and eng.steps < 30
        plain = _plain_engine(pair, runtime)
        try:
            (_, base), = _ask(plain, tok, [("alpha beta gamma", 30)], logprobs=2)
        finally:
            plain.shutdown()
        for (t1, lp1, _), (t2, lp2, _) in zip(info["scores"], base["scores"]):
            assert t1 == t2 and abs(lp1 - lp2) < 1e-4  # the served model's own log-probabilities
        rounds = totals.rounds
        done = _ask(eng, tok, [("red green", 6), ("one two", 9), ("monday", 40), ("alpha beta gamma", 30)])
        for (kind, info), prompt in zip(done, ("red green", "one two", "monday", "alpha beta gamma")):
            assert kind == "done" and info["generated"] == ref[prompt], prompt
        assert eng.decode_rows > eng.steps  # steps carried several sequences (speculation off)
        if runtime == "ort":
            assert totals.rounds > rounds  # the last one, alone in the batch, speculated again
        else:  # the last one stays a row of its batched generator (genai cannot drop rows): no speculation
            assert totals.rounds == rounds
            (kind, info), = _ask(eng, tok, [("monday", 40)])
            assert info["generated"] == ref["monday"] and totals.rounds > rounds
    finally:
        eng.shutdown()


def _plain_engine(pair, runtime):
    from bdlora.serve.engine import Engine
    from bdlora.serve.genai_engine import GenaiEngine

    ext = ".genai" if runtime == "genai" else ".onnx"
    return (GenaiEngine if runtime == "genai" else Engine)(pair["root"] / f"teacher{ext}", threads=1)


def test_serving_with_prompt_lookup_gives_the_models_own_tokens(pair):
    tok = pair["tok"]
    prompt = "alpha beta gamma delta alpha beta gamma delta alpha beta"
    ref = _plain_greedy("ort", pair["root"] / "teacher.onnx", tok(prompt)["input_ids"], 24)
    eng = _engine(pair, "ort", proposer="lookup")
    try:
        (kind, info), = _ask(eng, tok, [(prompt, 24)])
        assert kind == "done" and info["generated"] == ref and eng.speculation.totals.proposed > 0
    finally:
        eng.shutdown()


def test_serve_draft_option_end_to_end_and_a_bad_draft_refused_before_listening(pair, tmp_path):
    import httpx

    from conftest import start_server

    root, tok = pair["root"], pair["tok"]
    r = CliRunner().invoke(app, ["serve", str(root / "teacher.onnx"), "--draft", str(tmp_path)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--draft" in r.output
    proc, url = start_server(root / "teacher.onnx", "--draft", str(root / "draft.onnx"), "--fixed-k", "--threads",
                             "1")
    try:
        ids = tok("alpha beta gamma")["input_ids"]
        res = httpx.post(url + "/v1/completions", json={"model": "teacher.onnx", "prompt": ids, "max_tokens": 20,
                                                        "temperature": 0.0}, timeout=60)
        assert res.status_code == 200
        want = tok.decode(_plain_greedy("ort", root / "teacher.onnx", ids, 20))
        assert res.json()["choices"][0]["text"] == want
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_draft_with_a_shorter_context_is_refused_before_serving_or_generating(pair, tmp_path):
    """Issue 78 case 5: a draft exported with --context-length 64 beside a 128-position teacher started, and 29 of
    70 requests got HTTP 500 "max_length (166) cannot be greater than model context_length (64)"."""
    from bdlora.export.genai import export_genai_folder
    from bdlora.export.settings import GenaiExportConfig

    root = pair["root"]
    short = tmp_path / "short.genai"
    export_genai_folder(root / "draft", short, GenaiExportConfig(precision="fp32", validate=False,
                                                                 context_length=64))
    for argv in (["generate", str(root / "teacher.genai"), "--prompt", "alpha"],
                 ["serve", str(root / "teacher.genai"), "--runtime", "genai", "--port", "0"]):
        r = CliRunner().invoke(app, [*argv, "--draft", str(short)])
        assert r.exit_code == 2, r.output
        assert "holds 64 positions" in r.output and "--context-length 128 or more" in r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_a_draft_with_truncated_weights_is_refused_in_one_line_by_generate(pair, tmp_path):
    """Issue 78 case 13: a RuntimeError traceback from onnxruntime-genai (serve already refused it in one line)."""
    import shutil

    broken = tmp_path / "broken.genai"
    shutil.copytree(pair["root"] / "draft.genai", broken)
    data = broken / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    r = CliRunner().invoke(app, ["generate", str(pair["root"] / "teacher.genai"), "--prompt", "alpha", "--draft",
                                 str(broken)])
    assert r.exit_code == 2, r.output
    assert f"--draft {broken}: does not load in its runtime" in r.output.replace("\n", "")
    assert "Traceback" not in r.output


def test_the_bench_times_fixed_widths_beside_the_adaptive_policy_unless_told_not_to():
    """bench --speculative --no-fixed-widths (ship's bench): the plain target, the adaptive draft and adaptive lookup
    only; by default every fixed width of the draft and lookup's widest beside them."""
    from bdlora.base.errors import ConfigError
    from bdlora.bench.config import BenchConfig
    from bdlora.bench.spec_worker import configurations
    from bdlora.bench.specs import SpeculativeTiming

    spec = SpeculativeTiming(target="t", prompts={}, new_tokens=8, max_k=4, threads=1, repeats=1, warmup=0,
                             draft="d", lookup=True, ks=[1, 2, 3, 4])
    assert [n for n, _, _ in configurations(spec)] == ["plain", "draft-k1", "draft-k2", "draft-k3", "draft-k4",
                                                      "draft", "lookup-k4", "lookup"]
    assert [(n, k) for n, _, k in configurations(dataclasses.replace(spec, ks=[]))] == [
        ("plain", 1), ("draft", None), ("lookup", None)]
    with pytest.raises(ConfigError, match="--no-fixed-widths: is about --speculative's timings"):
        BenchConfig(fixed_widths=False).validate()
