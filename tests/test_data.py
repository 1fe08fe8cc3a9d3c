import json

import numpy as np
import pytest

from bdlora.base.errors import DataError
from bdlora.data.blocks import BlockSampler, PackedBlocks
from bdlora.data.documents import BUILTIN_HELDOUT_FRACTION, Corpus, builtin_files, is_heldout
from bdlora.data.tokens import tokenize_corpus


def test_md5_split_is_stable_and_matches_spec():
    import hashlib

    ids = [f"doc-{i}" for i in range(5000)]
    first = [is_heldout(i, 0.1) for i in ids]
    assert first == [is_heldout(i, 0.1) for i in ids]  # stable
    for i in ids[:50]:  # SPEC 7: MD5 as an integer, below fraction of the hash space
        assert is_heldout(i, 0.1) == (int(hashlib.md5(i.encode()).hexdigest(), 16) / 2**128 < 0.1)
    frac = sum(first) / len(ids)
    assert 0.08 < frac < 0.12
    # a larger fraction only adds documents (the slice grows, it never reshuffles)
    assert all(is_heldout(i, 0.2) for i, h in zip(ids, first) if h)


def test_builtin_corpus_finds_stdlib_without_tests():
    files = builtin_files()
    rel = {str(f.relative_to(Corpus("builtin").root)) for f in files}
    assert "json/decoder.py" in rel and "asyncio/base_events.py" in rel
    assert not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" or "site-packages" in r for r in rel)
    assert len(files) > 300
    assert Corpus("builtin").default_heldout_fraction == BUILTIN_HELDOUT_FRACTION


def test_tokenized_split_is_disjoint_and_cached(tiny_env, tmp_path):
    tok = tiny_env["tokenizer"]
    corpus = Corpus(tiny_env["corpus"])
    data = tokenize_corpus(corpus, tok, 0.2, tmp_path)
    train, val = data.tokens("train"), data.tokens("val")
    # recompute which documents went where, and check the token counts per split add up exactly
    n_val = sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 for d in corpus.documents()
                if is_heldout(d.id, 0.2))
    n_all = sum(len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 for d in corpus.documents())
    assert len(val) == n_val and len(train) == n_all - n_val and 0 < n_val < n_all
    assert data.meta["documents"]["val"] + data.meta["documents"]["train"] == 120
    # second call reuses the cache: same directory, files untouched
    mtime = (data.path / "train.bin").stat().st_mtime_ns
    again = tokenize_corpus(Corpus(tiny_env["corpus"]), tok, 0.2, tmp_path)
    assert again.path == data.path and (again.path / "train.bin").stat().st_mtime_ns == mtime
    # a different split fraction is a different cache entry
    assert tokenize_corpus(corpus, tok, 0.3, tmp_path).path != data.path


def test_jsonl_parquet_and_saved_dataset_readers(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    docs = list(Corpus(tmp_path / "j").documents())
    assert [(d.id, d.text) for d in docs] == [("a.jsonl:0", "hello"), ("a.jsonl:2", "x")]
    pq.write_table(pa.table({"text": ["p1", "p2", " "]}), tmp_path / "t.parquet")
    assert [d.text for d in Corpus(tmp_path / "t.parquet").documents()] == ["p1", "p2"]
    datasets.Dataset.from_dict({"text": ["s1", "s2"]}).save_to_disk(str(tmp_path / "ds"))
    assert [(d.id, d.text) for d in Corpus(tmp_path / "ds").documents()] == [("0", "s1"), ("1", "s2")]


def test_bad_corpora(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        Corpus(tmp_path / "missing")
    (tmp_path / "e").mkdir()
    with pytest.raises(DataError, match="no .txt"):
        Corpus(tmp_path / "e")
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(DataError, match="'text' field"):
        list(Corpus(tmp_path / "bad.jsonl").documents())


def test_packed_blocks_and_sampler_are_deterministic():
    tokens = np.arange(103, dtype=np.uint16)
    blocks = PackedBlocks(tokens, 10)
    assert len(blocks) == 10
    np.testing.assert_array_equal(blocks.get([2]), [np.arange(20, 30)])
    s = BlockSampler(10, seed=3)
    first_epoch = s.indices(0, 10)
    assert sorted(first_epoch) == list(range(10))  # a permutation per epoch
    assert s.indices(7, 6) == BlockSampler(10, seed=3).indices(7, 6)  # pure function of (seed, position)
    assert s.indices(10, 10) != first_epoch


def test_atomic_outputs_get_ordinary_permissions(tmp_path):
    import stat

    from bdlora.base import io

    io.write_json(tmp_path / "a.json", {"x": 1})
    with io.atomic_dir(tmp_path / "d") as tmp:
        (tmp / "f.txt").write_text("x")
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o666 & ~io._UMASK  # not mkstemp's 0600
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~io._UMASK  # not mkdtemp's 0700


def test_document_blocks_truncate_pad_and_mask():
    from bdlora.data.blocks import DocumentBlocks, training_blocks

    eos = 0
    #                 doc A (5+EOS)      bare EOS  doc B (2+EOS)  doc C (1+EOS)
    stream = np.array([5, 6, 7, 8, 9, 0, 0, 3, 4, 0, 2, 0], dtype=np.uint16)
    b = DocumentBlocks(stream, seq_len=4, eos=eos)
    assert len(b) == 3  # the bare EOS is no document
    ids, mask = b.batch([0, 1, 2])
    assert ids.tolist() == [[5, 6, 7, 8], [3, 4, 0, 0], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]  # a document's own EOS is a real target
    DocumentBlocks.CHUNK = 3  # documents straddling scan chunks are found the same
    try:
        assert DocumentBlocks(stream, 4, eos).batch([0, 1, 2])[0].tolist() == ids.tolist()
    finally:
        DocumentBlocks.CHUNK = 1 << 24
    assert isinstance(training_blocks(stream, 4, "pack", eos), PackedBlocks)
    assert training_blocks(stream, 4, "pack", eos).batch([0])[1] is None


# --------------------------------------------------------------------------------------------------------------------
# Hostile corpora (issue 44): bounded memory, one-line errors
# --------------------------------------------------------------------------------------------------------------------


def test_long_documents_are_cut_into_pieces_that_concatenate_exactly():
    from bdlora.data.documents import pieces

    text = ("word " * 30 + "\n") * 40  # 6,040 characters, a newline every 151
    parts = list(pieces("d", iter([text[i : i + 700] for i in range(0, len(text), 700)]), size=1000))
    assert "".join(p.text for p in parts) == text
    assert [p.last for p in parts] == [False] * (len(parts) - 1) + [True]
    assert all(len(p.text) <= 1000 and p.text.endswith("\n") for p in parts[:-1])  # cut after a newline
    one_line = "x" * 2500  # no newline, no space: hard cuts
    assert [len(p.text) for p in pieces("d", iter([one_line]), size=1000)] == [1000, 1000, 500]
    assert list(pieces("d", iter(["   ", "\n"]), size=2)) == []  # blank: no document


def test_a_long_document_tokenises_as_one_document_with_one_eos(tiny_env, tmp_path, monkeypatch):
    import bdlora.data.documents as D

    tok = tiny_env["tokenizer"]
    (tmp_path / "c").mkdir()
    lines = [p.read_text() for p in sorted(tiny_env["corpus"].glob("*.txt"))][:30]
    (tmp_path / "c" / "long.txt").write_text("".join(lines))
    whole = tokenize_corpus(Corpus(tmp_path / "c"), tok, 0.0, tmp_path / "a")
    monkeypatch.setattr(D, "PIECE_CHARS", 500)  # every piece cut after a newline, so BPE sees the same words
    cut = tokenize_corpus(Corpus(tmp_path / "c"), tok, 0.0, tmp_path / "b")
    assert cut.meta["documents"] == whole.meta["documents"] == {"train": 1, "val": 0}
    assert len(cut.tokens("train")) == len(whole.tokens("train"))
    assert int((cut.tokens("train") == tok.eos_token_id).sum()) == 1


CHILD = """
import resource, sys
from transformers import AutoTokenizer
from bdlora.data.documents import Corpus
from bdlora.data.tokens import tokenize_corpus
tok = AutoTokenizer.from_pretrained(sys.argv[1])
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # 1 GiB more than after imports
t = tokenize_corpus(Corpus(sys.argv[2]), tok, 0.0, cache_dir=sys.argv[3])
print(t.meta["tokens"]["train"], t.meta["documents"]["train"])
"""


def test_a_single_line_corpus_tokenises_in_bounded_memory(tiny_env, tmp_path):
    """A 6 MB document on one line: before, one tokenizer call over the whole line needed about 270 bytes per byte
    (a 200 MB line was killed at 22 GB; this one needs ~1.6 GB and aborts under the limit). In pieces it fits in
    1 GiB more address space than the imports take, whatever the line's length."""
    import base64
    import os
    import random
    import subprocess
    import sys

    (tmp_path / "c").mkdir()
    line = base64.b64encode(random.Random(0).randbytes(4_500_000)).decode()
    (tmp_path / "c" / "huge.txt").write_text(line)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one thread: the address space does not follow the cores
    res = subprocess.run([sys.executable, "-c", CHILD, str(tiny_env["teacher"]), str(tmp_path / "c"),
                          str(tmp_path / "cache")], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    tokens, docs = map(int, res.stdout.split())
    assert docs == 1 and tokens > 1_000_000
    assert not list((tmp_path / "cache" / "data").glob(".*.tmp"))  # nothing half-written left behind


def test_corpus_problems_are_one_line_errors(tmp_path):
    import os

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.jsonl").write_text('{"text": "ok"}\n{"text": "a \\ud800 b"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: 'text' holds the lone surrogate \\ud800 at character 3"):
        list(Corpus(tmp_path / "s").documents())
    (tmp_path / "n").mkdir()
    name = os.fsdecode(b"\xff\xfe.txt")
    (tmp_path / "n" / name).write_text("some text\n")
    docs = list(Corpus(tmp_path / "n").documents())
    assert [d.id for d in docs] == ["\\xff\\xfe.txt"] and is_heldout(docs[0].id, 0.5) in (True, False)
    Corpus(tmp_path / "n").fingerprint()  # hashes the raw name
    (tmp_path / "g").mkdir()
    for i in range(3):
        (tmp_path / "g" / f"{i}.txt").write_text("text\n")
    c = Corpus(tmp_path / "g")
    (tmp_path / "g" / "1.txt").unlink()  # removed while the corpus is read
    with pytest.raises(DataError, match=r"1.txt: could not be read \(No such file or directory\); did it change"):
        list(c.documents())


def test_an_overlong_jsonl_line_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    import bdlora.data.documents as D

    monkeypatch.setattr(D, "MAX_JSONL_LINE", 1000)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "ok"}\n' + '{"text": "' + "x" * 2000 + '"}\n')
    with pytest.raises(DataError, match="a.jsonl:2: a JSONL line longer than 1,000 bytes"):
        list(Corpus(tmp_path / "j").documents())
