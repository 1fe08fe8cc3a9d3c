"""Issue 41: data a user calibrates and heals with. Mixtures honour their proportions exactly; teacher samples are
cached and a pure function of (teacher, N, seed); the prose corpus is fetched with its licence; --calib-data reaches
the calibration; the warm-up never starts a run at the full learning rate; the learning rate follows the start; and
the sequential correction is the exact least-squares solution on a one-layer model."""

import json
import tarfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bdlora.base.errors import DataError
from bdlora.cli import app
from bdlora.data.corpora import MIX_CHUNK, load_tokens, mix_counts, parse
from bdlora.data.prose import extract_docs
from bdlora.train.config import TrainConfig, default_lr, resolve_defaults
from bdlora.train.distill import MIN_WARMUP_STEPS, warmup_cosine, warmup_steps


def _two_corpora(root, make_corpus):
    a = make_corpus(root / "a", n_docs=60, seed=1)
    b = make_corpus(root / "b", n_docs=150, seed=2)
    return a, b


def test_mixture_takes_exactly_its_proportions_from_each_component(tiny_env, tmp_path):
    from conftest import make_corpus

    a, b = _two_corpora(tmp_path, make_corpus)
    tok, cache = tiny_env["tokenizer"], tmp_path / "cache"
    ta = load_tokens(str(a), tok, 0.1, cache)
    tb = load_tokens(str(b), tok, 0.1, cache)
    mixed = load_tokens(f"{a}:0.25,{b}:0.75", tok, 0.1, cache)
    for split in ("train", "val"):
        want = mix_counts([ta.meta["tokens"][split], tb.meta["tokens"][split]], [0.25, 0.75])
        comps = mixed.meta["mixture"]
        assert [c["tokens"][split] for c in comps] == want
        assert mixed.meta["tokens"][split] == sum(want) == len(mixed.tokens(split))
        # exact to one token, and the smaller side is taken whole or the larger one bounds it
        assert abs(want[0] - 0.25 * sum(want)) <= 1 and abs(want[1] - 0.75 * sum(want)) <= 1
    # every chunk of the mixture is a contiguous span of one component's stream
    train, sa, sb = (np.asarray(t.tokens("train")) for t in (mixed, ta, tb))
    head = train[:MIX_CHUNK]
    as_bytes = head.tobytes()
    assert as_bytes in sa.tobytes() or as_bytes in sb.tobytes()
    # a second call reads the cache (same folder, same bytes)
    again = load_tokens(f"{a}:0.25,{b}:0.75", tok, 0.1, cache)
    assert again.path == mixed.path and np.array_equal(np.asarray(again.tokens("train")), train)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**7), min_size=2, max_size=4),
       st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4))
def test_mix_counts_never_exceed_a_component_and_keep_the_proportions(available, raw):
    w = np.array(raw[: len(available)])
    w = list(w / w.sum())
    take = mix_counts(available, w)
    assert all(0 <= t <= a for t, a in zip(take, available))
    total = min(a / x for a, x in zip(available, w))
    assert all(abs(t - x * total) <= 1 + 1e-6 * total for t, x in zip(take, w))
    assert any(t >= a - 1 for t, a in zip(take, available))  # the bounding component is used (almost) whole


@pytest.mark.parametrize("spec, words", [
    ("builtin:0.5,nowhere:0.5", "no such file"),
    ("builtin:x,prose:0.5", "CORPUS:WEIGHT"),
    ("builtin:-1,prose:1", "positive weight"),
    ("builtin:0.5,builtin:0.5", "named twice"),
    ("teacher:abc", "a whole number of tokens from 1 to"),
    ("teacher:0", "a whole number of tokens from 1 to"),
])
def test_bad_specs_are_refused_in_one_line(spec, words):
    with pytest.raises(DataError, match=words):
        parse(spec)


def test_weights_are_normalised():
    assert [round(p.weight, 6) for p in parse("builtin:1,prose:3")] == [0.25, 0.75]
    assert [p.spec for p in parse("teacher:64:1,builtin:1")] == ["teacher:64", "builtin"]


def test_teacher_samples_are_cached_and_a_pure_function_of_the_seed(tiny_env, tmp_path):
    from bdlora.data.selfgen import samples_dir
    from bdlora.models.teacher import TeacherSource

    cache = tmp_path / "cache"
    src = TeacherSource(tiny_env["teacher"])
    first = samples_dir(src, 300, 0, cache)
    meta = json.loads((first / "corpus.json").read_text())
    assert meta["tokens_generated"] >= 300 and meta["seed"] == 0 and not meta["chat_template"]
    text = (first / "samples.jsonl").read_text()
    stamp = (first / "samples.jsonl").stat().st_mtime_ns
    # cached: the same folder, not regenerated
    assert samples_dir(TeacherSource(tiny_env["teacher"]), 300, 0, cache) == first
    assert (first / "samples.jsonl").stat().st_mtime_ns == stamp
    # deterministic: regenerated from nothing, the same text; another seed, other text
    again = samples_dir(TeacherSource(tiny_env["teacher"]), 300, 0, tmp_path / "other")
    assert (again / "samples.jsonl").read_text() == text
    other = samples_dir(TeacherSource(tiny_env["teacher"]), 300, 1, cache)
    assert other != first and (other / "samples.jsonl").read_text() != text
    # read as a corpus through the spec
    tokens = load_tokens("teacher:300", tiny_env["tokenizer"], None, cache, teacher=src, seed=0)
    assert sum(tokens.meta["tokens"].values()) > 300
    # a rewritten or truncated cache is seen by its content hash and sampled again (it was read as the teacher's:
    # perplexity 424.0 against 16.65), the message naming the cache
    from bdlora.base.reporter import Reporter

    class Stages(Reporter):
        def __init__(self):
            self.lines = []

        def stage(self, text):
            self.lines.append(text)

    for damage in ("rewritten", "truncated"):
        f = first / "samples.jsonl"
        f.write_text('{"text": "not what the teacher wrote"}\n' if damage == "rewritten" else text[: len(text) // 2])
        rep = Stages()
        assert samples_dir(TeacherSource(tiny_env["teacher"]), 300, 0, cache, rep) == first
        assert f.read_text() == text
        assert any(f"the cached teacher samples {first} were changed or damaged" in line for line in rep.lines)


def test_teacher_samples_in_a_mixture_continue_prefixes_of_its_other_corpora(tiny_env, tmp_path):
    """Issue 68 item 1: in a mixture, every other prompt is a prefix of another corpus's training split, which the
    teacher continues; never of its held-out split; keyed apart from the same samples without prefixes."""
    from bdlora.data.selfgen import PREFIX_POOL, PREFIX_TOKENS, draw_prefixes
    from bdlora.models.teacher import TeacherSource
    from conftest import make_corpus

    cache, tok = tmp_path / "cache", tiny_env["tokenizer"]
    corpus = make_corpus(tmp_path / "c", n_docs=60, seed=5)
    alone = load_tokens(str(corpus), tok, None, cache)
    train, val = np.asarray(alone.tokens("train")), np.asarray(alone.tokens("val"))
    want = draw_prefixes({str(corpus): train}, seed=0)
    assert len(want.pool) == PREFIX_POOL and {len(p) for p in want.pool} == {PREFIX_TOKENS}
    assert want == draw_prefixes({str(corpus): train}, seed=0) and want != draw_prefixes({str(corpus): train}, 1)
    assert draw_prefixes({"short": train[:PREFIX_TOKENS]}, 0) is None
    windows = {tuple(train[i: i + PREFIX_TOKENS]) for i in range(len(train) - PREFIX_TOKENS + 1)}
    assert all(p in windows for p in want.pool[:64])  # drawn from the training split only
    assert not any(tuple(val[:PREFIX_TOKENS]) == p for p in want.pool)

    src = TeacherSource(tiny_env["teacher"])
    load_tokens(f"{corpus}:1,teacher:300:1", tok, None, cache, teacher=src, seed=0)
    folders = sorted((cache / "corpora").glob("teacher-*"))
    assert len(folders) == 1
    meta = json.loads((folders[0] / "corpus.json").read_text())
    assert meta["prefix_sources"] == [str(corpus)] and meta["prefix_tokens"] == PREFIX_TOKENS
    docs = [json.loads(line) for line in (folders[0] / "samples.jsonl").read_text().splitlines()]
    led = [d for d in docs if d["prefix_tokens"]]
    assert led and all(d["id"].endswith(("1", "3", "5", "7", "9")) for d in led)  # odd rows of each batch
    eos = tok.eos_token_id
    first = [t for t in want.pool[0] if t != eos]  # batch 0, row 1: the pool's first prefix
    row1 = next(d for d in docs if d["id"] == "teacher-0-0-1")
    assert row1["prefix_tokens"] == len(first) and row1["text"].startswith(tok.decode(first, skip_special_tokens=True))
    load_tokens("teacher:300", tok, None, cache, teacher=src, seed=0)  # alone: no prefixes, another folder
    plain = [f for f in (cache / "corpora").glob("teacher-*") if f != folders[0]]
    assert len(plain) == 1 and json.loads((plain[0] / "corpus.json").read_text())["prefix_sources"] == []


def test_chat_prompts_are_varied_and_deterministic():
    from bdlora.data.selfgen import prompts

    a, b = prompts(0, 64), prompts(0, 64)
    assert a == b and len(set(a)) > 40 and prompts(1, 64) != a


def test_prose_docs_are_extracted_with_their_licence_and_nothing_else(tmp_path):
    sdist = tmp_path / "pkg-1.0.tar.gz"
    src = tmp_path / "src"
    for rel, text in {"pkg-1.0/docs/intro.txt": "Hello prose.\n", "pkg-1.0/docs/ref/api.txt": "More prose.\n",
                      "pkg-1.0/docs/_theme/x.txt": "theme\n", "pkg-1.0/docs/requirements.txt": "sphinx\n",
                      "pkg-1.0/pkg/code.py": "x = 1\n", "pkg-1.0/LICENSE": "BSD\n"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src / "pkg-1.0", arcname="pkg-1.0")
    dst = tmp_path / "out"
    dst.mkdir()
    assert extract_docs(sdist, "pkg-1.0/docs/", "pkg-1.0/LICENSE", dst) == 2
    assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()) == [
        "LICENSE", "docs/intro.txt", "docs/ref/api.txt"]


def test_warm_up_never_starts_at_the_full_learning_rate():
    for total in (1, 2, 5, 20, 30, 100, 600, 10**6):
        f = warmup_cosine(total)
        w = warmup_steps(total)
        assert w <= max(1, total // 2) or total < 2
        if total >= 2 * MIN_WARMUP_STEPS:
            assert w >= MIN_WARMUP_STEPS and f(0) <= 1 / MIN_WARMUP_STEPS
        assert w <= 2000 and abs(f(w - 1) - 1.0) < 1e-12
    assert warmup_steps(600) == 18 and warmup_steps(30) == 10 and warmup_steps(10**6) == 2000


def test_learning_rate_follows_the_start_unless_given():
    assert default_lr(True, "budgeted", "whitened") == 1e-3 and default_lr(True, "budgeted", "zero") == 2e-3
    assert default_lr(True, "kd-full", None) == 2e-3 and default_lr(False, "budgeted", "zero") == 3e-4
    assert default_lr(False, "budgeted", "whitened") == 1e-4 and default_lr(False, "kd-lora", "svd") == 1e-4
    cfg = resolve_defaults(TrainConfig(), builtin_teacher=True)
    assert cfg.lora_init == "whitened" and cfg.lr == 1e-3 and "lr" in cfg.defaulted
    assert resolve_defaults(TrainConfig(lora_init="zero"), builtin_teacher=True).lr == 2e-3
    assert resolve_defaults(TrainConfig(lr=5e-4), builtin_teacher=True).lr == 5e-4


def test_sequential_correction_is_the_least_squares_solution_on_a_one_layer_model(tiny_env):
    import copy

    from transformers import MistralForCausalLM

    from bdlora.compress.correct import correct_sequential
    from bdlora.deployed.modeling_bdlora import LowRankLinear
    from bdlora.models.arch import projection_modules, set_module
    from conftest import tiny_config

    torch.manual_seed(0)
    tok = tiny_env["tokenizer"]
    teacher = MistralForCausalLM(tiny_config(len(tok), layers=1)).eval()
    student = copy.deepcopy(teacher)
    low = {}
    for name, mod in projection_modules(teacher):
        w = mod.weight.detach().double()
        u, s, vt = torch.linalg.svd(w, full_matrices=False)
        r = 6
        lr = LowRankLinear(mod.in_features, mod.out_features, r)
        with torch.no_grad():
            lr.proj_in.weight.copy_((vt[:r]).float())
            lr.proj_out.weight.copy_((u[:, :r] * s[:r]).float())
        set_module(student, name, lr)
        low[name] = (lr, lambda b, lr=lr: lr.proj_out.weight.copy_(b))
    blocks = np.random.default_rng(0).integers(0, len(tok), size=(12, 16)).astype(np.int64)
    # the inputs each projection sees, recorded independently with hooks on a plain forward pass
    errors = correct_sequential(teacher, student, blocks, low)
    assert set(errors) == set(low)
    seen_t, seen_s = {}, {}
    def record(seen, n):
        def hook(module, args):
            seen[n] = args[0].reshape(-1, args[0].shape[-1])  # returns None: the input is left as it is
        return hook

    hooks = [m.register_forward_pre_hook(record(seen_t, n)) for n, m in projection_modules(teacher)]
    hooks += [m.register_forward_pre_hook(record(seen_s, n)) for n, m in projection_modules(student) if n in low]
    with torch.no_grad():
        teacher(input_ids=torch.from_numpy(blocks))
        student(input_ids=torch.from_numpy(blocks))
    for h in hooks:
        h.remove()
    for name, (mod, _) in low.items():
        x, xs = seen_t[name].double(), seen_s[name].double()
        w = dict(projection_modules(teacher))[name].weight.double()
        z = xs @ mod.proj_in.weight.double().T  # (n, r)
        want = torch.linalg.lstsq(z, x @ w.T).solution.T  # (d_out, r)
        assert torch.allclose(mod.proj_out.weight.double(), want, atol=1e-4, rtol=1e-3), name
        before, after = errors[name]
        assert after <= before + 1e-9
    # q/k/v see the embeddings themselves: identical inputs on both sides
    assert torch.equal(seen_t["model.layers.0.self_attn.q_proj"], seen_s["model.layers.0.self_attn.q_proj"])


def test_one_shot_takes_calib_data_and_correct(tiny_env, tmp_path):
    from conftest import make_corpus

    other = make_corpus(tmp_path / "other", n_docs=40, seed=5)
    base = ["compress", str(tiny_env["teacher"]), "--one-shot", "--data", str(tiny_env["corpus"]), "--cache-dir",
            str(tiny_env["cache"]), "--seq-len", "32", "--calib-tokens", "512", "--eval-tokens", "512",
            "--heldout-fraction", "0.1", "--mac-ratio", "1.5", "--json"]
    r1 = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a")])
    r2 = CliRunner().invoke(app, [*base, "--calib-data", f"{other}:1,{tiny_env['corpus']}:1", "--correct",
                                  "--out", str(tmp_path / "b")])
    assert r1.exit_code == 0 and r2.exit_code == 0, r1.output + r2.output
    a, b = json.loads(r1.stdout), json.loads(r2.stdout)
    assert b["provenance"]["data_settings"]["calib_data"].startswith(str(other))
    corr = b["provenance"]["correction"]
    assert corr["modules"] > 0 and corr["mean_relative_error_after"] <= corr["mean_relative_error_before"]
    assert "correction" not in a["provenance"]
    assert a["eval"]["compressed_val_ppl"] != b["eval"]["compressed_val_ppl"]
    bad = CliRunner().invoke(app, [*base, "--calib-data", "builtin:1,nowhere:1", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "nowhere" in bad.output and not (tmp_path / "c").exists()


def test_eval_scores_a_second_domain_for_the_model_and_its_teacher(tiny_env, tmp_path):
    from conftest import make_corpus, train_args

    other = make_corpus(tmp_path / "other", n_docs=1500, seed=9)  # 0.2% held out: a few documents
    run = tmp_path / "run"
    args = train_args(tiny_env, run, "--method", "kd-lora", "--max-steps", "2", "--cache-dir", str(tmp_path / "c"),
                      "--calib-data", f"{tiny_env['corpus']}:1,{other}:1")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads((run / "config.json").read_text())["config"]["calib_data"].endswith(f"{other}:1")
    res = CliRunner().invoke(app, ["eval", str(run), "--ppl", "--domains", str(other), "--report",
                                   str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "e").read_text())
    assert set(doc["domains"]) == {doc["data"]["data"], str(other)}
    assert doc["domains"][doc["data"]["data"]] == doc["ppl"]
    assert doc["domains"][str(other)]["tokens"] == doc["ppl"]["tokens"]
    assert str(other) in doc["teacher"]["domains"] and "on " + str(other)[:20] in res.output.replace("\n", "")
    small = make_corpus(tmp_path / "small", n_docs=20, seed=3)  # nothing held out at 0.2%
    res = CliRunner().invoke(app, ["eval", str(run), "--ppl", "--domains", str(small), "--report",
                                   str(tmp_path / "g")])
    assert res.exit_code == 2 and "fewer than one block" in res.output and not (tmp_path / "g").exists()
    # the default for a small-vocabulary model: no second domain
    res = CliRunner().invoke(app, ["eval", str(run), "--ppl", "--report", str(tmp_path / "f")])
    assert res.exit_code == 0 and "domains" not in json.loads((tmp_path / "f").read_text())


def test_a_bad_autocast_or_calib_data_is_refused_before_any_run_folder(tiny_env, tmp_path):
    from conftest import train_args

    for flag, value, words in (("--autocast", "fp16", "allowed: bf16, fp32"),
                               ("--calib-data", "builtin:1,nowhere:1", "nowhere")):
        run = tmp_path / flag.strip("-")
        res = CliRunner().invoke(app, train_args(tiny_env, run, "--max-steps", "1", flag, value))
        assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output
        assert not run.exists()


def test_mixture_weights_at_the_float_limit_are_normalised():
    """Issue 53, case 7: ``builtin:1e308,DIR:1e308`` summed to inf and divided to zero (ZeroDivisionError)."""
    from bdlora.base.errors import DataError
    from bdlora.data.corpora import parse

    parts = parse("builtin:1e308,prose:1e308")
    assert [p.weight for p in parts] == [0.5, 0.5]
    with pytest.raises(DataError, match="prose:1e-300.*a weight this small next to the others is zero"):
        parse("builtin:1e308,prose:1e-300")
