"""A fair front (issue 54): the healed dense peer on the front (``bench --peer``), every row scored on a second
domain no row was fitted to (``bench --eval-data``, by default the builtin corpus the run never saw), dominance marked
on both; and the third builtin corpus, ``fortunes`` (Debian's fortune files), fetched once, pinned, unpacked in
Python, refused in one line when it cannot be had."""

import hashlib
import io
import json
import lzma
import tarfile

import pytest
from typer.testing import CliRunner

from bdlora.base.errors import DataError
from bdlora.bench.front import PEER, dominance, front_mark, markdown, same_precision
from bdlora.bench.genai import unseen_data
from bdlora.cli import app
from bdlora.data.corpora import other_domains, unseen_corpus
from bdlora.data.fortunes import FORTUNES_SOURCE, DebSource, deb_member, entries, fortunes_dir


def _pt(name, ms, ppl, unseen):
    return {"name": name, "ms": ms, "ppl": ppl, "ppl_unseen": unseen, "p10_ms": ms, "p90_ms": ms, "batch": 1,
            "seq": 16}


def test_a_row_dominated_on_one_domain_and_not_the_other_is_marked_so():
    """The student is faster than the peer; on the healing domain the peer is better (both on the front), and on the
    unseen domain the student is better too, so there it dominates the peer; the teacher's int4 is slower and worse
    on the healing domain than the peer but better than anything on the unseen one."""
    pts = [_pt("compressed-int4", 1.0, 12.0, 20.0), _pt(f"{PEER}dense-int4", 1.5, 10.0, 22.0),
           _pt("teacher-int4", 1.6, 11.0, 19.0)]
    marked = dominance(dominance(pts), "ppl_unseen", "_unseen")
    by = {p["name"]: p for p in marked}
    assert by["compressed-int4"]["front"] and by["compressed-int4"]["front_unseen"]
    assert by[f"{PEER}dense-int4"]["front"] and by[f"{PEER}dense-int4"]["dominated_by_unseen"] == "compressed-int4"
    assert by["teacher-int4"]["dominated_by"] == f"{PEER}dense-int4" and by["teacher-int4"]["front_unseen"]
    assert front_mark(by[f"{PEER}dense-int4"], True) == "**on the front**; unseen: dominated by compressed-int4"
    vs = same_precision(by["compressed-int4"], marked, PEER)
    assert vs["vs_peer"] == f"{PEER}dense-int4" and vs["speed_vs_peer"] == 1.5
    assert vs["ppl_vs_peer"] == pytest.approx(12 / 10 - 1) and vs["ppl_unseen_vs_peer"] == pytest.approx(20 / 22 - 1)
    assert same_precision(by[f"{PEER}dense-int4"], marked, PEER) == {}  # the peer is not compared with itself
    table = "\n".join(markdown([{**p, **same_precision(p, marked, PEER)} for p in marked], None, "fortunes"))
    assert "| unseen ppl |" in table and "vs the healed dense peer" in table and "on fortunes" in table


def test_the_unseen_default_is_the_builtin_corpus_the_run_never_saw():
    assert unseen_corpus("builtin") == "fortunes" and unseen_corpus("builtin:1,prose:1") == "fortunes"
    assert unseen_corpus("fortunes", "builtin") == "prose"
    assert unseen_corpus("builtin:1,prose:1", "fortunes") is None
    big = 49_152
    assert unseen_data(None, {"data": "builtin:1,prose:1", "calib_data": "builtin"}, big) == "fortunes"
    assert unseen_data(None, {"data": "prose", "calib_data": "fortunes"}, big) == "builtin"
    assert unseen_data(None, {}, big) == "fortunes"  # a folder with no recorded data: the builtin corpus only
    assert unseen_data(None, {"data": "builtin"}, 320) is None  # a tiny model of its own vocabulary: only if asked
    assert unseen_data("prose", {"data": "builtin"}, 320) == "prose" and unseen_data("none", {}, big) is None
    # eval's default second domains for a general-purpose model: prose and the corpus its data never named
    assert other_domains(None, "builtin", big) == ["prose", "fortunes"] and other_domains(None, "builtin", 320) == []
    assert other_domains(None, "fortunes", big) == ["prose"] and other_domains("prose", "builtin", 320) == ["prose"]


def _deb(files: dict[str, str], licence: str = "BSD") -> bytes:
    """A minimal Debian archive (ar: debian-binary, control.tar.xz, data.tar.xz) holding ``files`` as fortune files
    and a copyright file."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in {**{f"./usr/share/games/fortunes/{k}": v for k, v in files.items()},
                           "./usr/share/doc/fortunes/copyright": licence}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = b"!<arch>\n"
    for name, data in ((b"debian-binary", b"2.0\n"), (b"control.tar.xz", lzma.compress(b"")),
                       (b"data.tar.xz", lzma.compress(buf.getvalue()))):
        out += name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + b"100644".ljust(8)
        out += str(len(data)).encode().ljust(10) + b"`\n" + data + (b"\n" if len(data) % 2 else b"")
    return out


def test_the_fortunes_corpus_is_fetched_once_pinned_and_grouped_into_documents(tmp_path):
    wisdom = "\n%\n".join(f"Saying number {i}.\n\t-- Someone" for i in range(85)) + "\n%\n"
    deb = _deb({"wisdom": wisdom, "wisdom.dat": "index", "computers": "Software talk.\n%\n", "tao": "One.\n%\nTwo.\n"})
    (tmp_path / "f.deb").write_bytes(deb)
    src = DebSource("fortunes", "1:0.1-1", (tmp_path / "f.deb").as_uri(), hashlib.sha256(deb).hexdigest(),
                    FORTUNES_SOURCE.folder, FORTUNES_SOURCE.licence_member, "BSD", ("computers",), "test")
    assert entries("a\n%\n\n%\nb\nc\n%") == ["a", "b\nc"] and deb_member(deb, "data.tar")[:6] == b"\xfd7zXZ\x00"
    out = fortunes_dir(tmp_path / "cache", src=src)
    meta = json.loads((out / "corpus.json").read_text())
    docs = sorted(p.name for p in (out / "docs").iterdir())
    assert docs == ["tao-000.txt", "wisdom-000.txt", "wisdom-001.txt", "wisdom-002.txt"]  # 85 entries: 40, 40, 5
    assert meta["entries"] == 87 and meta["files"] == 4 and meta["sha256"] == src.sha256 and meta["licence"] == "BSD"
    assert (out / "wisdom-002.txt").exists() is False and (out / "LICENSE").read_text() == "BSD"
    assert (out / "docs" / "wisdom-002.txt").read_text().count("Saying number") == 5
    (tmp_path / "f.deb").unlink()
    assert fortunes_dir(tmp_path / "cache", src=src) == out  # cached: not fetched again
    changed = DebSource(**{**src.__dict__, "version": "1:0.2-1", "url": _write(tmp_path / "g.deb", deb + b"x")})
    with pytest.raises(DataError, match="refusing a changed corpus"):
        fortunes_dir(tmp_path / "cache", src=changed)
    gone = DebSource(**{**src.__dict__, "version": "1:0.3-1", "url": "http://127.0.0.1:9/fortunes.deb"})
    with pytest.raises(DataError, match="could not fetch .* from Debian's package archive") as e:
        fortunes_dir(tmp_path / "cache", src=gone)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "corpora" / "fortunes-1_0.2-1").exists()  # nothing half-written is left


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return path.as_uri()


def test_bench_puts_the_healed_dense_peer_and_the_unseen_domain_on_the_front(tiny_env, tmp_path):
    """A one-shot student benched at fp32 and int4 with --peer (a dense folder: the teacher itself stands in for a
    healed one) and --eval-data (a corpus of other text): the peer's rows at both precisions, every row scored on
    both domains, each student compared with the peer at its precision, the table and plot carrying both."""
    from conftest import genai_teacher, make_corpus

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher")
    genai_teacher(tiny_env["tokenizer"], tmp_path / "dense", seed=1)
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "teacher"), "--one-shot", "--mac-ratio", "1.3",
                                 "--data", str(tiny_env["corpus"]), "--cache-dir", str(tiny_env["cache"]),
                                 "--seq-len", "32", "--calib-tokens", "512", "--eval-tokens", "512",
                                 "--heldout-fraction", "0.1", "--no-eval", "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    other = make_corpus(tmp_path / "other", n_docs=1500, seed=7)  # a user corpus holds out 0.2% of its documents
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "s"), "--runtime", "genai", "--genai-precisions",
                                 "fp32,int4", "--batch-sizes", "1", "--seq-lens", "16", "--decode-tokens", "2",
                                 "--repeats", "1", "--warmup", "0", "--no-peers", "--quality-tokens", "512",
                                 "--peer", str(tmp_path / "dense"), "--eval-data", str(other),
                                 "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    by = {p["name"]: p for p in doc["front"]}
    assert {"peer-dense", "peer-dense-int4", "compressed", "compressed-int4", "teacher", "teacher-int4"} <= set(by)
    assert doc["unseen_data"] == str(other)
    assert all(p["ppl_unseen"] > 1 and p["front_unseen"] in (True, False) for p in by.values())
    q = doc["quality"]
    assert 0 < q["teacher"]["unseen_tokens"] <= 512 and q["teacher"]["ppl_unseen"] != q["teacher"]["ppl"]
    for prec in ("", "-int4"):
        s = by[f"compressed{prec}"]
        assert s["vs_peer"] == f"peer-dense{prec}" and s["vs_teacher"] == f"teacher{prec}"
        assert s["speed_vs_peer"] == pytest.approx(by[f"peer-dense{prec}"]["ms"] / s["ms"])
        assert s["ppl_unseen_vs_peer"] == pytest.approx(s["ppl_unseen"] / by[f"peer-dense{prec}"]["ppl_unseen"] - 1)
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "| unseen ppl |" in md and "vs the healed dense peer" in md and "; unseen: " in md
    assert "peer-dense" in r.output  # the rich table, whose columns a narrow terminal cuts
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "s"), "--runtime", "genai", "--eval-data",
                                 str(tmp_path / "nowhere"), "--out", str(tmp_path / "b2")])
    assert r.exit_code == 2 and "--eval-data" in r.stderr and not (tmp_path / "b2").exists(), r.output


def test_train_like_copies_a_runs_data_steps_and_seed(tiny_env, tmp_path):
    """``train --like RUN --method kd-lora``: the dense peer healed with the budgeted run's own teacher, data, split,
    steps, batch, sequence length and seed, whatever the defaults; a flag still overrides; a folder that is not a run
    is refused in one line."""
    from conftest import train_args

    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "a", "--method", "budgeted", "--max-steps", "3",
                                           "--seed", "5", "--batch-size", "2"))
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["train", "--like", str(tmp_path / "a"), "--method", "kd-lora", "--lora-rank", "4",
                                 "--lora-alpha", "8", "--lr", "3e-3", "--no-measure-step-time", "--eval-tokens",
                                 "256", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    a, b = (json.loads((tmp_path / n / "config.json").read_text())["config"] for n in ("a", "b"))
    for k in ("teacher", "data", "heldout_fraction", "seq_len", "batch_size", "max_steps", "seed"):
        assert a[k] == b[k], k
    assert (a["max_steps"], a["seed"], a["batch_size"], b["method"], b["eval_tokens"]) == (3, 5, 2, "kd-lora", 256)
    r = CliRunner().invoke(app, ["train", "--like", str(tmp_path), "--method", "kd-lora", "--out",
                                 str(tmp_path / "c")])
    assert r.exit_code == 2 and "not a bdlora run directory" in r.stderr and not (tmp_path / "c").exists()


def test_a_default_domain_that_cannot_be_fetched_is_said_not_fatal(tiny_env, tmp_path, monkeypatch):
    """eval's default second domains for a general-purpose vocabulary (prose and the unseen builtin corpus) are
    fetched on first use; where the archive cannot be reached they are skipped and named in the report, while a
    domain asked for with --domains still fails in one line."""
    from transformers import MistralForCausalLM

    import bdlora.eval.evaluate as ev
    from conftest import tiny_config

    MistralForCausalLM(tiny_config(32_000, layers=1, hidden=16)).save_pretrained(tmp_path / "m")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "m")
    real = ev.load_tokens

    def offline(spec, *a, what="--data", **k):
        if what == "--domains":
            raise DataError(f"--data {spec}: could not fetch it (offline)")
        return real(spec, *a, what=what, **k)

    monkeypatch.setattr(ev, "load_tokens", offline)
    args = ["eval", str(tmp_path / "m"), "--ppl", "--data", str(tiny_env["corpus"]), "--heldout-fraction", "0.1",
            "--tokens", "256", "--seq-len", "32"]
    r = CliRunner().invoke(app, [*args, "--report", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "e.json").read_text())
    assert set(doc["domains_skipped"]) == {"prose", "fortunes"} and doc["ppl"]["val_ppl"] > 1
    r = CliRunner().invoke(app, [*args, "--domains", "fortunes", "--report", str(tmp_path / "f.json")])
    assert r.exit_code == 2 and "could not fetch" in r.stderr and not (tmp_path / "f.json").exists()


def test_trains_start_calibrates_a_general_purpose_teacher_on_the_builtin_mixture(tiny_env, tmp_path, monkeypatch):
    """Issue 54, item 3: a general-purpose teacher (a vocabulary of 32,000 or more) healed on the default --data
    builtin has its start calibrated on builtin:1,prose:1, as compress --one-shot does, so fortunes stays unseen; the
    run's config.json records it as defaulted. An explicit --calib-data, or a small vocabulary, is left alone.
    (The corpora themselves are redirected to the tiny fixture corpus: what is checked is which spec is asked for.)"""
    from transformers import MistralForCausalLM

    import bdlora.train.session as session
    from bdlora.data.corpora import GENERAL_CALIB_DATA, general_calib_data
    from conftest import tiny_config, train_args

    assert general_calib_data("builtin", None, 32_000) == GENERAL_CALIB_DATA == "builtin:1,prose:1"
    assert general_calib_data("builtin", None, 31_999) is None and general_calib_data("prose", None, 50_000) is None
    assert general_calib_data("builtin", "prose", 50_000) == "prose"
    MistralForCausalLM(tiny_config(32_000, layers=2, hidden=16)).save_pretrained(tmp_path / "m")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "m")
    asked = []

    def redirect(real):
        def redirected(spec, tok, *a, **k):
            asked.append(spec)
            return real(str(tiny_env["corpus"]), tok, *a, **k)
        return redirected

    # the mixture is read by load_parts (once, for the run and its reweighting), the calibration set by load_tokens
    monkeypatch.setattr(session, "load_tokens", redirect(session.load_tokens))
    monkeypatch.setattr(session, "load_parts", redirect(session.load_parts))
    env = {**tiny_env, "teacher": tmp_path / "m"}
    for out, extra, calib in (("a", [], GENERAL_CALIB_DATA), ("b", ["--calib-data", "fortunes"], "fortunes")):
        asked.clear()
        args = train_args(env, tmp_path / out, "--method", "budgeted", "--max-steps", "1", "--mac-ratio", "1.2",
                          "--calib-tokens", "256", *extra)
        args[args.index("--data") + 1] = "builtin"
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        cfg = json.loads((tmp_path / out / "config.json").read_text())["config"]
        assert asked == ["builtin", calib] and cfg["calib_data"] == calib
        assert ("calib_data" in cfg["defaulted"]) == (not extra)
