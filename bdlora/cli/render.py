"""Every table the CLI prints (rich), one function per report. Commands compute; these only format."""

from rich.markup import escape
from rich.table import Table

from bdlora.base.schemes import rounded
from bdlora.bench.front import front_mark, prediction_line, runtimes_named, same_precision_cell, vs_reference
from bdlora.bench.report import noise_lines
from bdlora.cli.app import out


def _kv(title: str) -> Table:
    t = Table(title=title)
    t.add_column("")
    t.add_column("value", justify="right")
    return t


def teacher(info: dict) -> None:
    t = _kv("teacher")
    t.add_row("path", escape(str(info["path"])))
    t.add_row("parameters", f"{info['parameters']:,}")
    if info.get("note"):
        t.add_row("source", f"{info['note']} ({info.get('requirement')}, licence {info.get('licence')})")
    if "corpus_tokens" in info:
        ct = info["corpus_tokens"]
        t.add_row("corpus tokens (train / val)", f"{ct['train']:,} / {ct['val']:,}")
    if "train_tokens_seen" in info:
        t.add_row("pretraining tokens seen", f"{info['train_tokens_seen']:,}")
    if info.get("val_ppl") is not None:
        where = f" ({info['ppl_tokens']:,} tokens of {info['data']})" if info.get("ppl_tokens") else ""
        t.add_row(f"validation perplexity{where}", f"{info['val_ppl']:.2f}")
    if info.get("unigram_ppl") is not None:
        t.add_row("unigram baseline perplexity", f"{info['unigram_ppl']:.2f}")
    if info.get("build_seconds") is not None:
        t.add_row("build time", f"{info['build_seconds']:.0f} s")
    out.print(t)


def train_summary(s: dict) -> None:
    t = _kv(f"{s['method']} run: {s['run_dir']}")
    t.add_row("teacher val ppl", f"{s['teacher_val_ppl']:.3f}")
    if s.get("initial_student_val_ppl") is not None:
        t.add_row("student val ppl before training", f"{s['initial_student_val_ppl']:.3f}")
    t.add_row("student val ppl", f"{s['student_val_ppl']:.3f}")
    t.add_row("steps / tokens", f"{s['steps']:,} / {s['tokens']:,}")
    if s.get("eval_data"):
        first = "" if s.get("eval_data_ppl_initial") is None else f"{s['eval_data_ppl_initial']:.3f} -> "
        best = "none eligible" if s.get("best_step") is None else (
            f"best {s['eval_data_ppl_best']:.3f} at step {s['best_step']:,}, kept")
        t.add_row(f"unseen {s['eval_data']} ppl", f"{first}{s['eval_data_ppl_last']:.3f} at the end; {best}")
    if s.get("time_budget"):
        b = s["time_budget"]
        plan = (f"{b['planned_steps']:,} steps planned" if b["planned_steps"] is not None else "stopped before the "
                "plan's first steps were timed")
        t.add_row("time budget", f"{b['used_seconds']:.0f} of {b['seconds']:.0f} s; {plan} at {b['step_seconds']:.2f} "
                  "s a step" + ("; stopped early" if b["stopped_by_budget"] else ""))
    if s.get("world_size", 1) > 1:
        t.add_row("processes / global batch", f"{s['world_size']} / {s['global_batch']} sequences")
    t.add_row("train time", f"{s['train_seconds']:.1f} s ({s['tokens_per_s']:.0f} tok/s)")
    p = s["compute_proxy"]
    t.add_row("dense MACs/token D, LoRA L", f"{p['D']:,} / {p['L']:,}")
    t.add_row("mean retained dense d_bar", f"{p['d_bar']:.3f}")
    t.add_row("train compute proxy vs kd-full", f"lora {p['lora_vs_full']:.3f}x, budgeted {p['bud_vs_full']:.3f}x")
    if "step_time_ms" in s:
        st = s["step_time_ms"]
        t.add_row("measured step time (ms)", f"full {st['kd-full']:.1f}, lora {st['kd-lora']:.1f}, "
                  f"budgeted d=0 {st['budgeted']:.1f}")
        t.add_row("measured step ratio vs kd-full", f"lora {st['lora_vs_full']:.3f}x, budgeted "
                  f"{st['budgeted_vs_full']:.3f}x")
    if "final_retained" in s:
        zero = sum(1 for m in s["modules"] if m["d"] == 0)
        t.add_row("final retained dense / modules at zero", f"{s['final_retained']:.3f} / {zero}/{len(s['modules'])}")
    out.print(t)


def latency_forms(doc: dict) -> None:
    """The measured decode time of each projection shape's forms at the deployed precision, and the prediction."""
    scheme = f" ({doc['scheme']}: {doc['layout']})" if doc.get("scheme") and rounded(doc["precision"]) else ""
    t = Table(title=f"decode time per projection form at {doc['precision']}{scheme}, {doc['threads']} thread(s), "
                    "measured in onnxruntime")
    for col in ("shape K x N", "dense us", "rank 8 us", "MAC break-even rank", "measured break-even rank"):
        t.add_column(col, justify="right")
    for f in doc["forms"]:
        r8 = "-" if f["rank_8_us"] is None else f"{f['rank_8_us']:.1f}"
        t.add_row(f["shape"], f"{f['dense_us']:.1f}", r8, str(f["mac_break_even"]), str(f["measured_break_even"]))
    out.print(t)
    out.print(f"projections: {doc['projection_us_dense']:.0f} us dense -> {doc['projection_us']:.0f} us "
              f"({doc['predicted_projection_speedup']:.2f}x predicted at {doc['precision']})")
    if doc.get("predicted_decode_speedup"):
        o = doc["overhead"]
        out.print(f"whole decode step: {doc['decode_us_teacher']:.0f} us for the dense model -> "
                  f"{doc['decode_us']:.0f} "
                  f"us ([bold]{doc['predicted_decode_speedup']:.2f}x[/] predicted; {doc['decode_layers']} of "
                  f"{doc['teacher_layers']} layers, each {o['per_layer_us']:.0f} us outside its projections, "
                  f"{o['fixed_us']:.0f} us per step for embedding, head and generator, head at {o['head_bits']} bits)")
    if doc.get("lowrank_slower_than_dense"):
        out.print(f"[yellow]low rank slower than dense at {doc['precision']} for: "
                  f"{', '.join(doc['lowrank_slower_than_dense'])}[/]")


def llamacpp_step(doc: dict) -> None:
    """``plan --runtime llamacpp``'s prediction: the teacher's and the structure's decode step timed in llama.cpp."""
    files = doc["files"]
    out.print(f"decode step in llama.cpp at {doc['precision']}, {doc['threads']} thread(s), batch 1 after "
              f"{doc['context']} tokens: {doc['decode_us_teacher'] / 1000:.2f} ms for the dense model "
              f"({files['teacher']['arch']}, {files['teacher']['bytes'] / 2**20:,.0f} MiB) -> "
              f"{doc['decode_us'] / 1000:.2f} ms ({files['student']['arch']}, {doc['decode_layers']} of "
              f"{doc['teacher_layers']} layers, {files['student']['bytes'] / 2**20:,.0f} MiB): "
              f"[bold]{doc['predicted_decode_speedup']:.2f}x[/] predicted")
    if doc.get("measurement"):
        out.print(f"[yellow]measured unclean: {doc['measurement']}[/]")


def compression_report(report: dict, title: str) -> None:
    """The SPEC 6.4 table: one row per module, then the totals (shared by plan and compress)."""
    t = Table(title=title)
    t.add_column("module", justify="left", min_width=22, overflow="fold")
    for col, j in (("d", "right"), ("case", "left"), ("LoRA r", "right"), ("SVD k", "right"),
                   ("MACs before", "right"), ("MACs after", "right"), ("params after", "right")):
        t.add_column(col, justify=j)
    for m in report["modules"]:
        t.add_row(m["name"].replace("model.layers.", "L"), f"{m['d']:.3f}", m["case"], str(m["lora_rank"]),
                  str(m["svd_rank"] or "-"), f"{m['macs_before']:,}", f"{m['macs_after']:,}",
                  f"{m['params_after']:,}")
    out.print(t)
    n = report["modules_total"]
    s = _kv("totals over the replaced modules")
    s.add_row("dense kept / SVD / dropped", f"{report['dense_kept']}/{n} / {report['dense_svd']}/{n} / "
              f"{report['dense_dropped']}/{n}" + (f" ({report['merged_cheaper']} merged-cheaper)"
                                                  if report["merged_cheaper"] else ""))
    if report.get("mlp_pruned"):
        downs = [m for m in report["modules"] if m.get("channels") and m["name"].endswith("down_proj")]
        kept = [m["channels"] for m in downs]
        s.add_row("MLPs keeping fewer channels", f"{report['mlp_pruned']} (kept {min(kept):,} to {max(kept):,} of "
                  f"{downs[0]['in_features']:,})")
    if report.get("attention_pruned"):
        ks = [m for m in report["modules"] if m.get("groups") and m["name"].endswith("k_proj")]
        kept = [m["groups"] for m in ks]
        k = ks[0]  # its source width over its kept width (macs_after / in_features), times the groups kept
        heads = k["groups"] * k["out_features"] * k["in_features"] // k["macs_after"]
        s.add_row("attention blocks keeping fewer KV heads", f"{report['attention_pruned']} (kept {min(kept)} to "
                  f"{max(kept)} of {heads})")
    if report.get("layers_removed"):
        gone = (report.get("provenance") or {}).get("removed_layers") or []
        s.add_row("decoder layers removed", f"{report['layers_removed']}" + (
            f" (source layers {', '.join(map(str, gone))})" if gone else ""))
    s.add_row("average LoRA rank kept", f"{report['avg_lora_rank']:.1f}")
    s.add_row("MAC speed-up vs dense", f"{report['speedup_vs_dense']:.2f}x")
    s.add_row("MAC speed-up vs LoRA", f"{report['speedup_vs_lora']:.2f}x")
    s.add_row("parameter reduction", f"{100 * report['param_reduction']:.1f}%")
    out.print(s)
    if report.get("baselines"):
        b = report["baselines"]
        out.print(f"[dim]vs LoRA: vs {b['speedup_vs_lora']}; parameter reduction: vs {b['param_reduction']}[/]")
    if "eval" in report:
        e = report["eval"]
        before = "source" if e.get("baseline") else "student"
        out.print(f"held-out perplexity: {before} {e['student_val_ppl']:.3f} -> compressed "
                  f"{e['compressed_val_ppl']:.3f} ({e['tokens']:,} tokens)")
    if "compute_proxy" in report:
        p = report["compute_proxy"]
        out.print(f"training-compute proxy vs kd-full: budgeted {p['bud_vs_full']:.3f}x, kd-lora "
                  f"{p['lora_vs_full']:.3f}x (D = {p['D']:,}, L = {p['L']:,}, d_bar = {p['d_bar']:.3f})")


def onnx_export(info: dict, dst) -> None:
    t = _kv(f"ONNX export: {dst}")
    t.add_row("opset / export time", f"{info['opset']} / {info['export_seconds']:.1f} s")
    fused = info.get("fused_ops") or info.get("ort_fusions")  # exports before the one emitter ran the optimizer
    if fused:
        t.add_row("onnxruntime fused ops", ", ".join(f"{v} {k}" for k, v in fused.items()))
    for name, size in info["files"].items():
        t.add_row(name, f"{size / 1e6:.2f} MB")
    if "validation" in info:
        v = info["validation"]
        noise = v.get("torch_fp32_vs_fp64")
        factor = v.get("noise_factor", 4)  # exports before the factor was recorded used 4
        why = (f" = {factor:g} x torch's own fp32 error {noise:.2e}" if noise is not None and v["tolerance"] > 1e-4
               else "")
        t.add_row("max |ONNX - torch| (logits, K/V)", f"{v['max_abs_diff']:.2e} (tolerance {v['tolerance']:.2g}{why}, "
                  f"{len(v['shapes'])} shapes incl. left padding)")
    q = info.get("int8") or {}
    if "val_ppl_fp32" in q:
        quantized = q.get("val_ppl_quantized", q.get("val_ppl_int8"))  # the key of exports before one harness
        t.add_row("held-out ppl fp32 -> int8", f"{q['val_ppl_fp32']:.3f} -> {quantized:.3f} "
                  f"({100 * q['ppl_change']:+.2f}%)")
    s = info["summary"]
    t.add_row("modules", ", ".join(f"{v} {k}" for k, v in s["forms"].items()))
    t.add_row("MAC speed-up of the projections vs dense", f"{s['mac_speedup_vs_dense']:.2f}x")
    out.print(t)


def genai_export(info: dict, dst) -> None:
    t = _kv(f"onnxruntime-genai export: {dst}")
    t.add_row("precision / nodes / export time", f"{info['precision']} / {info['nodes']} / "
              f"{info['export_seconds']:.1f} s")
    if info.get("seconds"):  # exports before the phases were timed have export_seconds only
        t.add_row("wall time by phase", ", ".join(f"{k} {x:.1f} s" for k, x in info["seconds"].items()))
    for name, size in info["files"].items():
        t.add_row(name, f"{size / 1e6:.2f} MB")
    v = info.get("validation") or {}
    if "parity" in v:
        p = v["parity"]
        t.add_row("max |ONNX - torch| (logits, K/V)", f"{p['max_abs_diff']:.2e} (tolerance {p['tolerance']:.2g}); "
                  f"over {p['decode_steps']} decode steps {p['decode_max_abs_diff']:.2e} (tolerance "
                  f"{p['decode_tolerance']:.2g})")
    if "generator" in v:
        g = v["generator"]
        same = "identical" if g["all_identical"] else f"identical up to {g['tie_breaks']} exact tie(s)"
        t.add_row("og.Generator vs torch greedy", f"{same} ({len(g['prompts'])} prompts x {g['new_tokens']} tokens)")
    if "quality" in v:
        q = v["quality"]
        t.add_row(f"held-out ppl fp32 -> {info['precision']}", f"{q['val_ppl_fp32']:.3f} -> "
                  f"{q['val_ppl_quantized']:.3f} ({100 * q['ppl_change']:+.2f}%; argmax agreement "
                  f"{100 * q['argmax_agreement']:.1f}%)")
    s = info["summary"]
    t.add_row("modules", ", ".join(f"{v} {k}" for k, v in s["forms"].items()))
    t.add_row("MAC speed-up of the projections vs dense", f"{s['mac_speedup_vs_dense']:.2f}x")
    out.print(t)


def gguf_export(info: dict, dst) -> None:
    t = _kv(f"GGUF export (llama.cpp): {dst}")
    f = info["file"]
    t.add_row("architecture / layers", f"{info['architecture']} / {len(info['layers'])}"
              + (" (per-layer heads and MLP widths)" if info["architecture"] == "deci" else ""))
    t.add_row("file", f"model.gguf, {info['quant']}, {f['bytes'] / 1e6:,.1f} MB, {f['tensors']} tensors ("
              + ", ".join(f"{n} {k}" for k, n in sorted(f["types"].items())) + ")")
    t.add_row("tokenizer", f"{f['vocab']['model']} / pre {f['vocab']['pre']}, {f['vocab']['tokens']:,} tokens, from "
              f"{f['vocab']['source']}")
    if info.get("merged_lowrank"):
        t.add_row("low-rank modules multiplied out", str(len(info["merged_lowrank"])))
    v = info.get("validation") or {}
    if "skipped" in v:
        t.add_row("llama.cpp checks", f"not run: {escape(v['skipped'])}")
    if "tokenizer" in v:
        k = v["tokenizer"]
        t.add_row("llama.cpp tokenisation vs HF", f"{k['identical']:,} of {k['lines']:,} lines identical"
                  + (f" (first that differs: {k['differ'][0]['line'][:40]!r})" if k.get("differ") else ""))
    if "logits" in v:
        g = v["logits"]
        bound = f"tolerance {g['tolerance']:.3g}" if g.get("tolerance") is not None else "rounded: no bound"
        t.add_row("max |llama.cpp - torch| logits", f"{g['max_abs_diff']:.3g} ({bound}); argmax agreement "
                  f"{100 * g['argmax_agreement']:.1f}%")
    if "quality" in v:
        q = v["quality"]
        t.add_row(f"held-out ppl torch fp32 -> llama.cpp {info['quant']}", f"{q['ppl_torch']:.3f} -> "
                  f"{q['ppl_gguf']:.3f} ({100 * q['ppl_change']:+.2f}%, {q['tokens']:,} tokens)")
    t.add_row("wall time by phase", ", ".join(f"{k} {x:.1f} s" for k, x in info["seconds"].items()))
    t.add_row("run it", f"llama-cli -m {dst}/model.gguf; python -m llama_cpp.server --model {dst}/model.gguf; "
              f"ollama create NAME -f {dst}/Modelfile")
    out.print(t)


def bench(doc: dict) -> None:
    t = Table(title=f"bench: compressed vs dense / LoRA ({doc['thread_pool']})")
    t.add_column("scope phase shape", overflow="fold")
    for col in ("dense ms", "comp. ms", "vs dense", "MAC limit", "of limit", "vs LoRA", "vs builder", "outside"):
        t.add_column(col, justify="right")
    idx = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in doc["results"]}

    def x(r, k):
        return f"{r[k]:.2f}x" if k in r else "-"

    for r in doc["results"]:
        if r["variant"] != "compressed":
            continue
        d = idx.get((r["scope"], "dense", r["phase"], r["batch"], r["seq"]))  # none: --no-own-forms
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else (
            f"{r['batch']}x1 @{r['seq']}" if r["scope"] != "modules" else f"{r['batch']}x1")
        t.add_row(f"{r['scope']} {r['phase']} {shape}", f"{d['median_ms']:.3f}" if d else "-", f"{r['median_ms']:.3f}",
                  x(r, "speedup_vs_dense"), x(r, "mac_ratio_vs_dense"),
                  f"{100 * r['fraction_of_limit']:.0f}%{' (noise)' if 'noise' in r else ''}"
                  if "fraction_of_limit" in r else "-",
                  x(r, "speedup_vs_lora"), x(r, "speedup_vs_builder"),
                  f"{100 * r['share_outside_modules']:.0f}%" if "share_outside_modules" in r else "-")
    if t.row_count:
        out.print(t)
    for r in doc["results"]:
        name, _, precision = r["variant"].partition("-")
        if r["scope"] == "llamacpp":
            continue  # on the front (and in bench.md's llama.cpp table), against the teacher's GGUF of its type
        if name == "compressed" and precision:
            shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else f"{r['batch']}x1 @{r['seq']}"
            out.print(f"{r['scope']} {precision} compressed {r['phase']} {shape}: {r['median_ms']:.3f} ms, "
                      f"{x(r, 'speedup_vs_dense')} vs fp32 dense, {x(r, f'speedup_vs_dense_{precision}')} vs "
                      f"{precision} dense, {x(r, 'speedup_vs_builder')} vs the builder's {precision}")
    for key, why in (doc.get("genai_notes") or {}).items():
        out.print(f"[yellow]{key}: {why}[/]")
    for line in noise_lines(doc):
        if line:
            out.print(f"[yellow]{line}[/]")
    if doc.get("front"):
        front(doc["front"])
    if doc.get("prediction"):
        out.print(prediction_line(doc["prediction"]))
    for precision, spec in (doc.get("speculative") or {}).items():
        speculative(spec, precision)


def speculative_prediction(p: dict) -> None:
    """plan --speculative: the measured agreement, draft share and verification costs, the speed-up per k."""
    ks = ", ".join(f"k={k}: {v:.2f}x" for k, v in p["per_k"].items() if k != "0")
    out.print(f"speculative decoding with this draft: agreement {p['alpha']:.1%} on {p['agreement_tokens']:,} "
              f"held-out tokens, a draft step {p['draft_step_share']:.2f} of the teacher's, verifying "
              + ", ".join(f"{w} tokens {v:.2f}x" for w, v in p["verify_share"].items() if w != "1")
              + f" a step; predicted {ks}; best k={p['best_k']}: {p['speedup']:.2f}x")


def speculative(spec: dict, precision: str) -> None:
    """bench --speculative: the teacher's export at ``precision`` alone, with the draft at each k, with prompt
    lookup: tokens/s per domain, acceptance, tokens per teacher call, whether every token was the teacher's."""
    t = Table(title=f"speculative decoding, teacher {precision} (batch 1, greedy, {sum(spec['prompts'].values())} "
                    "prompts of 128 tokens)")
    for col in ("configuration", "domain", "tok/s", "vs teacher", "decode tok/s", "decode vs teacher", "acceptance",
                "tokens/call", "identical"):
        t.add_column(col, justify="left" if col in ("configuration", "domain") else "right")
    plain = {r["domain"]: r for r in spec["rows"] if r["config"] == "plain"}
    for r in spec["rows"]:
        acc = f"{r['acceptance']:.0%}" if r["evaluated"] else "-"
        p = plain[r["domain"]]
        t.add_row(r["config"], escape(r["domain"]), f"{r['tokens_per_s']:.1f}",
                  f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x", f"{r['decode_tokens_per_s']:.1f}",
                  f"{r['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x", acc,
                  f"{r['tokens_per_target_call']:.2f}", "yes" if r["identical"] else "[red]no[/]")
    for name, s in spec["summary"].items():
        t.add_row(f"[bold]{name}[/]", "all", f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x", "",
                  f"{s['decode_speedup']:.2f}x", f"{s['acceptance']:.0%}", f"{s['tokens_per_target_call']:.2f}",
                  "yes" if s["identical"] else "no")
    out.print(t)


def front(points: list[dict]) -> None:
    """The quality/speed front: every deployed form, fastest first, each on the front or dominated by whom (on the
    held-out domain and on the unseen one, when scored), against the teacher and the healed dense peer."""
    ref = next((p for p in points if p["name"] == "teacher"), None)
    two = any(p.get("ppl_unseen") is not None for p in points)
    peer = any("vs_peer" in p for p in points)
    t = Table(title=f"quality/speed front ({runtimes_named(points)}, decode at batch {points[0]['batch']} after "
                    f"{points[0]['seq']} tokens)")
    cols = ["variant", "ms/token", "ppl", *(["unseen ppl"] if two else []), "speed vs teacher", "ppl vs teacher",
            "vs teacher, same precision", *(["vs healed dense peer"] if peer else []), "front"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("variant", "front") else "right")
    for p in points:
        ppl, unseen = p["ppl"], p.get("ppl_unseen")
        t.add_row(escape(p["name"]), f"{p['ms']:.3f}", "-" if ppl is None else f"{ppl:.3f}",
                  *([("-" if unseen is None else f"{unseen:.3f}")] if two else []), *vs_reference(p, ref),
                  same_precision_cell(p), *([same_precision_cell(p, "peer")] if peer else []),
                  escape(front_mark(p, two)).replace("**on the front**", "[green]on the front[/]"))
    out.print(t)


def evaluation(doc: dict) -> None:
    """The model's figures, with its teacher's on the same slice and prompts beside them when known."""
    teacher = doc.get("teacher") or {}
    if "ppl" in doc:
        p, tp = doc["ppl"], (teacher.get("ppl") or {}).get("val_ppl")
        beside = f" vs the teacher's [bold]{tp:.3f}[/] ({p['val_ppl'] / tp:.3f}x)" if tp else ""
        out.print(f"held-out perplexity: [bold]{p['val_ppl']:.3f}[/]{beside} ({p['tokens']:,} tokens of "
                  f"{escape(str(doc['data']['data']))}, blocks of {p['seq_len']}; {doc['kind']})")
    for name, d in (doc.get("domains") or {}).items():
        if name == doc["data"]["data"]:
            continue
        td = ((teacher.get("domains") or {}).get(name) or {}).get("val_ppl")
        beside = f" vs the teacher's [bold]{td:.3f}[/] ({d['val_ppl'] / td:.3f}x)" if td else ""
        out.print(f"held-out perplexity on {escape(name)}: [bold]{d['val_ppl']:.3f}[/]{beside} "
                  f"({d['tokens']:,} tokens)")
    if doc.get("teacher_note"):
        out.print(f"(no teacher figures beside: {escape(doc['teacher_note'])})")
    if "icl" in doc:
        _icl_table(doc["icl"], teacher.get("icl"))


def _icl_table(r: dict, teacher: dict | None) -> None:
    m = r["macro"]
    if teacher is not None and max(v["mean"] for v in teacher["tasks"].values()) == 0:
        out.print(f"ICL probes: the teacher scores 0% on every one of the {len(teacher['tasks'])} tasks (a model this "
                  f"small does not learn in context), so they cannot tell this model from it (this model: "
                  f"{m['mean']:.1f}%; per task in the JSON)")
        return
    t = Table(title=f"ICL probes ({r['shots']}-shot, {r['seeds']} seeds x {r['examples_per_seed']} prompts, "
                    "exact match %)")
    for col in ("task", "accuracy %", *(["teacher %"] if teacher else []), "log p(target)"):
        t.add_column(col, justify="left" if col == "task" else "right")
    for name, v in r["tasks"].items():
        tv = teacher["tasks"].get(name) if teacher else None
        t.add_row(name, f"{v['mean']:.1f} ± {v['std']:.1f}",
                  *([f"{tv['mean']:.1f} ± {tv['std']:.1f}" if tv else "-"] if teacher else []),
                  f"{v['target_logprob']:.2f}")
    tm = teacher["macro"] if teacher else None
    t.add_row("[bold]ICL composite (macro)[/]", f"[bold]{m['mean']:.1f} ± {m['std']:.1f}[/]",
              *([f"[bold]{tm['mean']:.1f} ± {tm['std']:.1f}[/]"] if teacher else []), f"{m['target_logprob']:.2f}")
    out.print(t)


def loadtest(rows: list[dict], url: str, max_tokens: int) -> None:
    stream = bool(rows[0].get("stream"))
    t = Table(title=f"loadtest {escape(url)} ({escape(str(rows[0]['model']))}, max_tokens {max_tokens}"
                    f"{', streaming' if stream else ''})")
    cols = ["clients", "requests", "failed", "req/s", "tok/s", "p50 ms", "p90 ms", "p99 ms"]
    keys = ["p50_ms", "p90_ms", "p99_ms"]
    if stream:
        cols += ["TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99"]
        keys += [f"{m}_p{q}_ms" for m in ("ttft", "itl") for q in (50, 90, 99)]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        t.add_row(str(r["concurrency"]), str(r["requests"]), str(r["failures"]), f"{r['requests_per_s']:.2f}",
                  f"{r['tokens_per_s']:.1f}", *(f(r[k]) for k in keys))
    out.print(t)
