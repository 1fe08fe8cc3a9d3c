"""``train --samples-runtime FOLDER``: ``teacher:N`` generated through the teacher's own onnxruntime-genai export
(``bdlora.data.runtime_samples``): greedy tokens equal PyTorch's, the nucleus draw is exact, and the samples are cached
apart from PyTorch's with the runtime recorded."""

import copy
import json

import numpy as np
import pytest
from scipy.stats import chisquare
from typer.testing import CliRunner

from bdlora.base.errors import DataError
from bdlora.cli import app
from bdlora.data import runtime_samples, selfgen
from conftest import genai_teacher, train_args

CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def exported(tiny_env, tmp_path_factory):
    """A 2-layer genai-shaped teacher, its fp32 onnxruntime-genai export, and a chat tokenizer for it."""
    from bdlora.export.genai import export_genai_folder
    from bdlora.export.settings import GenaiExportConfig

    root = tmp_path_factory.mktemp("samples")
    tok = copy.deepcopy(tiny_env["tokenizer"])
    tok.chat_template = CHAT
    model = genai_teacher(tok, root / "teacher")
    export_genai_folder(root / "teacher", root / "teacher.genai", GenaiExportConfig(precision="fp32",
                                                                                     validate=False))
    return {"root": root, "model": model, "tok": tok, "folder": root / "teacher.genai"}


def test_greedy_samples_through_the_export_are_pytorchs(exported):
    """At temperature 0 the documents generated through onnxruntime-genai (right-padded batches, tokens forced
    step by step) are the ones transformers' generate writes (left-padded), token for token."""
    tok = exported["tok"]
    torch_docs, n_torch = selfgen.generate(exported["model"], tok, 600, seed=3, temperatures=(0.0,))
    genai_docs, n_genai = selfgen.generate_runtime(exported["folder"], tok, 600, seed=3, temperatures=(0.0,))
    assert n_torch == n_genai >= 600
    assert [d["text"] for d in genai_docs] == [d["text"] for d in torch_docs]
    assert len({d["text"] for d in genai_docs}) > 5  # the prompts differ, so do the replies
    # prompts continuing prefixes of another corpus (a mixture's), of other lengths than the chat prompts
    rng = np.random.default_rng(0)
    prefixes = selfgen.Prefixes(("c",), tuple(tuple(int(t) for t in rng.integers(5, 300, 9 + i % 7))
                                              for i in range(40)))
    torch_led, n_torch = selfgen.generate(exported["model"], tok, 600, 3, temperatures=(0.0,), prefixes=prefixes)
    genai_led, n_genai = selfgen.generate_runtime(exported["folder"], tok, 600, 3, temperatures=(0.0,),
                                                  prefixes=prefixes)
    assert n_torch == n_genai >= 600 and [d["text"] for d in genai_led] == [d["text"] for d in torch_led]
    assert {d["prefix_tokens"] > 0 for d in genai_led} == {True, False}


def test_the_nucleus_draw_is_exact():
    """sample_rows: the argmax at temperature 0; at temperature t never a token outside the top-p nucleus, and
    the frequencies of the ones inside are the renormalised nucleus (chi-square, seeded)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 3000)).astype(np.float32) * 3
    assert runtime_samples.sample_rows(logits, 0.0, 0.95, rng)[0] == logits.argmax()
    t, top_p = 0.8, 0.6
    p = np.exp(logits[0] / t - (logits[0] / t).max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[np.cumsum(p[order]) - p[order] < top_p]
    draws = np.concatenate([runtime_samples.sample_rows(np.repeat(logits, 500, 0), t, top_p, rng)
                            for _ in range(20)])
    assert set(draws.tolist()) <= set(keep.tolist())
    want = p[keep] / p[keep].sum()
    counts = np.array([(draws == k).sum() for k in keep])
    assert chisquare(counts, want * len(draws)).pvalue > 1e-3
    flat = np.zeros((2, 2000), dtype=np.float32)  # a flat row: its nucleus reaches past the candidates
    assert len(set(np.concatenate([runtime_samples.sample_rows(flat, 1.0, 0.95, rng) for _ in range(200)]))) > 300


def test_train_samples_through_the_runtime_and_caches_them_apart(exported, tiny_env, tmp_path):
    """--data teacher:N --samples-runtime FOLDER: the samples are generated through the folder, cached under
    their own key and recorded as such; a second run reads the same cache."""
    teacher = exported["root"] / "teacher"
    args = ["--teacher", str(teacher), "--data", "teacher:3000", "--samples-runtime", str(exported["folder"]),
            "--max-steps", "2", "--student-layers", "1"]
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "a", *args))
    assert r.exit_code == 0, r.output
    records = [json.loads(p.read_text()) for p in (tiny_env["cache"] / "corpora").glob("teacher-*/corpus.json")]
    mine = [c for c in records if c.get("runtime_folder") == str(exported["folder"].resolve())]
    assert len(mine) == 1 and mine[0]["runtime"] == "onnxruntime-genai" and mine[0]["runtime_precision"] == "fp32"
    assert mine[0]["tokens_generated"] >= 3000
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())["config"]
    assert cfg["samples_runtime"] == str(exported["folder"].resolve())
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "b", *args))
    assert r.exit_code == 0 and "sampling" not in r.output, r.output


def test_a_folder_that_is_not_the_teachers_export_is_refused(exported, tiny_env, tmp_path):
    with pytest.raises(DataError, match="not an onnxruntime-genai folder"):
        runtime_samples.check_folder(tmp_path, exported["root"] / "teacher", 320)
    with pytest.raises(DataError, match="not the teacher"):
        runtime_samples.check_folder(exported["folder"], tiny_env["teacher"], 320)
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--data", "teacher:3000", "--samples-runtime",
                                           str(exported["folder"]), "--max-steps", "2"))
    assert r.exit_code != 0 and "not the teacher" in r.output and len(r.output.strip().splitlines()) <= 2, r.output
    assert not (tmp_path / "r").exists()
