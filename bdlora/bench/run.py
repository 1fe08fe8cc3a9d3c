"""``bdlora bench``: onnxruntime timing of the compressed student against its dense and LoRA forms (SPEC 9).

Variants of one architecture, exported by the same code (``export.onnx``) and run with identical session options:
    dense       every projection a dense Linear (the merged student: low-rank pairs multiplied out)
    lora        dense plus an unmerged low-rank adapter of the trained rank (how a LoRA student is served unmerged);
                its base is ``W - B A`` so its logits equal the dense variant's
    compressed  the model as compressed
    floor       (model scope only, a control) every projection at rank 1: what the rest of the model costs

Scopes: ``modules`` times only the replaced projections (one graph per variant over token shapes, the paper's
measure); ``model`` times the whole decoder: prefill latency per (batch, seq) and decode latency per token with a KV
cache of ``seq`` tokens (``decode_tokens`` steps that feed their own cache back).

Timing: variants interleaved round-robin (rotating the order every repeat) so machine noise hits them alike;
median and p10/p90 over repeats after warm-up. Fixed-shape runs (modules, prefill) bind inputs and preallocated
outputs once (IO binding), as a server would. The timing runs in a separate process (``bench_worker``) whose
sessions share one global onnxruntime thread pool, so no session's idle pool spins on the cores the timed one
needs (per-session pools distorted interleaved timings by up to 2x).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch.nn as nn

from bdlora import SCHEMA_VERSION, __version__
from bdlora.base.io import atomic_dir, write_json, write_text
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import BENCH_JSON, row_name
from bdlora.base.schemes import rounded
from bdlora.base.threads import flat
from bdlora.bench.config import BenchConfig, provider_name
from bdlora.bench.front import RUNTIME_NAMES, front_points, predicted_vs_measured
from bdlora.bench.front import plot as plot_front
from bdlora.bench.genai import Deployment, export_variants, score_folders, time_genai
from bdlora.bench.gguf import export_ggufs, score_ggufs
from bdlora.bench.icl import icl_of_rows
from bdlora.bench.launch import run_timing_process
from bdlora.bench.report import markdown, plot
from bdlora.bench.specs import OrtTiming
from bdlora.bench.speculative import front_rows, prompts_of, speculative_rows, summary
from bdlora.bench.variants import dense_variant, export_projection_stack, floor_variant, lora_variant
from bdlora.export.onnx.folder import export_decoder
from bdlora.export.onnx.metadata import module_table
from bdlora.export.onnx.quantize import quantize_int8
from bdlora.forms import DENSE, LOWRANK
from bdlora.models.runtime import DecoderShape

# --------------------------------------------------------------------------------------------------------------------
# MAC accounting (the limits)
# --------------------------------------------------------------------------------------------------------------------


def projection_macs(model: nn.Module) -> int:
    return sum(r["macs_per_token"] for r in module_table(model))


def variant_macs(model: nn.Module, lora_rank: int) -> dict[str, int]:
    """The projection MACs per token of the variants (``bench.variants``): ``model`` as deployed, every projection
    dense (``dense_variant``) and dense beside a rank-``lora_rank`` adapter (``lora_variant``), from ``model``'s
    projection shapes, without building the variants (at 1B each is a teacher-sized copy)."""
    rows = module_table(model)
    dense = sum(DENSE.macs(r["in_features"], r["out_features"]) for r in rows)
    adapters = sum(LOWRANK.macs(r["in_features"], r["out_features"], lora_rank) for r in rows)
    return {"dense": dense, "lora": dense + adapters, "compressed": sum(r["macs_per_token"] for r in rows)}


def decoder_macs_per_token(config, projections: int, context: float) -> float:
    """MACs per token of the whole decoder described by ``config`` (an HF config or config.json mapping):
    ``projections`` + attention scores and values over ``context`` keys (2 * heads * head_dim * context per layer) +
    the LM head. Norms and rotary are negligible and left out."""
    s = DecoderShape.of(config)
    return projections + 2 * s.heads * s.head_dim * context * s.layers + s.hidden * s.vocab_size


def model_macs_per_token(model: nn.Module, context: float, projections: int | None = None) -> float:
    """``decoder_macs_per_token`` of ``model`` (its own projections unless ``projections`` is given)."""
    return decoder_macs_per_token(model.config, projection_macs(model) if projections is None else projections,
                                  context)


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------


def run_worker(kind: str, graphs: dict[str, Path], shapes: list, cfg: BenchConfig, threads: int, dims: dict,
               workdir: Path, reporter: Reporter = SILENT) -> tuple[list[dict], str]:
    """Time ``graphs`` in a separate process (``bench.worker``) with one global onnxruntime thread pool."""
    spec = OrtTiming(kind=kind, graphs={k: str(v) for k, v in graphs.items()}, shapes=shapes, repeats=cfg.repeats,
                     warmup=cfg.warmup, threads=threads, provider=provider_name(cfg.provider),
                     decode_tokens=cfg.decode_tokens, dims=dims, opt_level=cfg.opt_level)
    res = run_timing_process(spec, kind, workdir,
                             lambda line: not line.startswith((" ", "Traceback")), reporter)
    return res["times"], res["pool"]


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "repeats": len(a)}


def _dims(model: nn.Module) -> dict:
    s = DecoderShape.of(model.config)
    return {"hidden": s.hidden, "q_dim": s.heads * s.head_dim, "intermediate": model.config.intermediate_size,
            "layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "vocab": s.vocab_size}


def _rows(scope: str, times: list[dict]) -> list[dict]:
    rows = []
    for t in times:
        row = {"scope": scope, "variant": t["variant"], "phase": t["phase"], "batch": t["batch"], "seq": t["seq"],
               "tokens": t["batch"] * (1 if t["phase"] == "decode" else t["seq"]), **stats(t["ms"])}
        if scope == "model":
            row["tokens_per_s"] = row["tokens"] / (row["median_ms"] / 1000)
        rows.append(row)
    return rows


def bench_modules(models: dict[str, nn.Module], workdir: Path, cfg: BenchConfig, threads: int,
                  reporter: Reporter = SILENT) -> tuple[list[dict], str]:
    graphs = {}
    for name, m in models.items():
        graphs[name] = workdir / f"modules-{name}.onnx"
        export_projection_stack(m, graphs[name])
    shapes = [["decode", b, 1] for b in cfg.batch_sizes] + [["prefill", b, s] for b in cfg.batch_sizes
                                                             for s in cfg.seq_lens]
    times, pool = run_worker("modules", graphs, shapes, cfg, threads, _dims(next(iter(models.values()))), workdir,
                             reporter)
    return _rows("modules", times), pool


def bench_model(models: dict[str, nn.Module], workdir: Path, cfg: BenchConfig, threads: int,
                reporter: Reporter = SILENT) -> tuple[list[dict], str]:
    graphs = {}
    for name, m in models.items():
        graphs[name] = workdir / f"model-{name}.onnx"
        reporter.stage(f"exporting the {name} decoder")
        export_decoder(m, graphs[name], fused=cfg.optimize)
    if cfg.int8:
        for name in ("dense", "compressed"):
            reporter.stage(f"quantising the {name} decoder to int8")
            graphs[f"{name}-int8"] = workdir / f"model-{name}-int8.onnx"
            quantize_int8(graphs[name], graphs[f"{name}-int8"])
    shapes = [[phase, b, s] for b in cfg.batch_sizes for s in cfg.seq_lens for phase in ("prefill", "decode")]
    times, pool = run_worker("model", graphs, shapes, cfg, threads, _dims(next(iter(models.values()))), workdir,
                             reporter)
    return _rows("model", times), pool


def _base(variant: str) -> tuple[str, str]:
    """``compressed-int4`` -> (compressed, int4); ``builder-fp32`` -> (builder, fp32); ``dense`` -> (dense, "")."""
    name, _, precision = variant.partition("-")
    return name, "" if precision and not rounded(precision) and name != "builder" else precision


def repeats_needed(rows: list[dict], excess: float) -> int:
    """Repeats after which the ratio of two medians is known to within ``excess`` (relative), from the rows' own
    p10-p90 spreads: sigma ~ (p90 - p10) / 2.56 of a normal, the median's standard error ~ 1.2533 sigma / sqrt(n),
    and a ratio's relative error sqrt(2) times that."""
    sigma = max((r["p90_ms"] - r["p10_ms"]) / 2.56 / r["median_ms"] for r in rows)
    need = (2 ** 0.5 * 1.2533 * sigma / max(excess, 1e-3)) ** 2
    return int(min(10_000, max(rows[0]["repeats"] + 1, np.ceil(need))))


def mark_noise(r: dict, base: dict, fraction: float) -> None:
    """A speed-up above its MAC limit (beyond 2%) is not a result: time does not fall faster than the work. Mark it
    with the spread behind it and the repeats a stable figure needs (issue: a prefill of 3.87x against a limit of
    1.86x was printed as "208% of limit" from 5 repeats)."""
    if fraction <= 1.02:
        return
    spread = max((x["p90_ms"] - x["p10_ms"]) / x["median_ms"] for x in (r, base))
    r["noise"] = {"above_limit": round(fraction, 3), "p10_p90_spread": round(spread, 3),
                  "repeats_needed": repeats_needed([r, base], fraction - 1)}


def add_ratios(results: list[dict], macs: dict) -> None:
    """Speed-ups of the compressed variant vs dense and vs LoRA, beside the MAC ratio (the limit) and the fraction
    of that limit achieved; model-scope rows also get the floor (rank-1 control) and the share of time outside the
    replaced modules; genai rows also compare with onnxruntime-genai's own builder at the same precision."""
    index = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in results}
    for r in results:
        if r["scope"] == "llamacpp":  # compared on the front with the teacher's GGUF of its type, not by MACs
            continue
        key = (r["scope"], r["phase"], r["batch"], r["seq"])
        name, precision = _base(r["variant"])
        if name not in macs["modules"] and name != "builder":  # the teacher's exports and other students (--also)
            continue  # are compared on the front (bench.front), not by MACs
        if r["scope"] in ("model", "genai"):
            ctx = (r["seq"] + 1) / 2 if r["phase"] == "prefill" else r["seq"] + 1
            r["mac_per_token"] = macs["model"]["dense" if name == "builder" else name](ctx)
            floor = index.get((r["scope"], "floor", *key[1:]))
            if floor is not None and r["variant"] != "floor":
                r["share_outside_modules"] = min(1.0, floor["median_ms"] / r["median_ms"])
        else:
            r["mac_per_token"] = macs["modules"][name]
        builder = index.get((key[0], f"builder-{precision or 'fp32'}", *key[1:]))
        if builder is not None and name in ("dense", "compressed"):
            r["speedup_vs_builder"] = builder["median_ms"] / r["median_ms"]
        if name != "compressed":
            continue
        dense = index.get((key[0], "dense", *key[1:]))  # absent when fp32 was not timed (--genai-precisions int4)
        dense_macs = macs["modules"]["dense"] if r["scope"] == "modules" else macs["model"]["dense"](ctx)
        r["mac_ratio_vs_dense"] = dense_macs / r["mac_per_token"]
        if dense is not None:
            r["speedup_vs_dense"] = dense["median_ms"] / r["median_ms"]
        if builder is not None:
            r["fraction_of_limit_vs_builder"] = r["speedup_vs_builder"] / r["mac_ratio_vs_dense"]
            mark_noise(r, builder, r["fraction_of_limit_vs_builder"])
        if precision:  # quantised on top of low rank: vs the fp32 dense and the dense graph at the same precision
            same = index.get((key[0], row_name("dense", precision), *key[1:]))
            if same is not None:
                r[f"speedup_vs_dense_{precision}"] = same["median_ms"] / r["median_ms"]
            continue
        lora = index.get((key[0], "lora", *key[1:]))
        if dense is None:
            continue
        r["fraction_of_limit"] = r["speedup_vs_dense"] / r["mac_ratio_vs_dense"]
        mark_noise(r, dense, r["fraction_of_limit"])
        if lora is not None:
            r["speedup_vs_lora"] = lora["median_ms"] / r["median_ms"]
            r["mac_ratio_vs_lora"] = lora["mac_per_token"] / r["mac_per_token"]


def bench_genai(models: dict[str, nn.Module], tokenizer, workdir: Path, cfg: BenchConfig, threads: int,
                reporter: Reporter = SILENT, deploy: Deployment | None = None) -> tuple[list[dict], dict, dict]:
    """Every variant timed in onnxruntime-genai (and, --runtime llamacpp, every front folder's GGUF in llama.cpp,
    interleaved with them); with ``deploy`` (the teacher and the held-out slice) the teacher's own exports beside
    them and every folder's held-out perplexity: (rows, notes, quality by variant)."""
    deploy = deploy or Deployment()
    models = {**models, **deploy.others, **({"teacher": deploy.teacher} if deploy.teacher is not None else {})}
    genai = "genai" in cfg.runtimes
    folders, notes = export_variants(models if genai else {}, tokenizer, cfg.genai_precisions, workdir,
                                     cfg.pool.resolved(),
                                     cfg.peers and genai, reporter, teacher=deploy.teacher_dir,
                                     settings=cfg.settings_for, calibration=deploy.calibration)
    ggufs: dict[str, Path] = {}
    if "llamacpp" in cfg.runtimes:
        ggufs, more = export_ggufs(deploy.folders, cfg.gguf_quants, workdir, threads, reporter)
        notes.update(more)
    shapes = [[phase, b, s] for b in cfg.batch_sizes for s in cfg.seq_lens for phase in ("prefill", "decode")]
    vocab = DecoderShape.of(next(iter(models.values())).config).vocab_size
    times = time_genai(folders, shapes, cfg.repeats, cfg.warmup, cfg.decode_tokens, vocab, workdir, reporter, ggufs,
                       threads) if folders or ggufs else []
    quality = {}
    if deploy.heldout is not None:
        owner = {row_name(n, p): n for n in models for p in cfg.genai_precisions}
        owner.update({k: "teacher" if k.startswith("teacher-builder") else "dense" for k in folders if k not in owner})
        dims = {k: DecoderShape.of(models[owner[k]].config) for k in folders}
        quality = score_folders(folders, dims, deploy.heldout, reporter)
        quality.update(score_ggufs(ggufs, deploy.heldout, threads, reporter))
        if deploy.unseen is not None:  # the same graphs on a corpus none of them was fitted to
            corpus, blocks = deploy.unseen
            unseen = score_folders(folders, dims, blocks, reporter)
            unseen.update(score_ggufs(ggufs, blocks, threads, reporter))
            for key, q in unseen.items():
                quality[key].update(ppl_unseen=q["ppl"], unseen_data=corpus, unseen_tokens=q["tokens"])
    spec = {}
    if cfg.speculative and deploy.teacher is not None and deploy.heldout is not None:
        spec = speculate(folders, cfg, deploy, tokenizer, threads, workdir, reporter)
        for p in spec:
            for name in ("draft", "lookup"):  # the teacher's output: its quality
                quality[f"spec-{name}-{p}"] = dict(quality.get(row_name("teacher", p)) or {})
    if deploy.words is not None:  # dense and lora compute the compressed model's function: its ICL is theirs
        rows = {k: m for k, m in models.items() if k not in ("dense", "lora")}
        icl = icl_of_rows(rows, tokenizer, cfg.genai_precisions, deploy.words, cfg.icl_examples, workdir,
                          cfg.settings_for, deploy.calibration, reporter)
        for key, figures in icl.items():
            quality.setdefault(key, {}).update(figures)
    rows = _rows("genai", [t for t in times if t["variant"] not in ggufs])
    rows += _rows("llamacpp", [t for t in times if t["variant"] in ggufs])
    for p, doc in spec.items():
        rows += front_rows(rows, doc["summary"], p)
    if spec:
        notes["speculative"] = spec
    return rows, notes, quality


def speculate(folders: dict, cfg: BenchConfig, deploy: Deployment, tokenizer, threads: int, workdir: Path,
              reporter: Reporter) -> dict:
    """``--speculative``: per precision, the teacher's folder with the benched folder's as its draft and with prompt
    lookup, on prompts of the held-out slice and the unseen domain (``bench.speculative``)."""
    context = getattr(deploy.teacher.config, "max_position_embeddings", None) if deploy.teacher is not None else None
    prompts = {"held-out": prompts_of(deploy.heldout, context)}
    if deploy.unseen is not None:
        prompts[deploy.unseen[0]] = prompts_of(deploy.unseen[1], context)
    out = {}
    for p in cfg.genai_precisions:
        target, draft = folders.get(row_name("teacher", p)), folders.get(row_name("compressed", p))
        if target is None or draft is None:
            continue
        reporter.stage(f"speculative decoding: {target.name} with {draft.name} as its draft, and prompt lookup")
        res = speculative_rows(target, draft, True, prompts, threads, workdir, tokenizer.eos_token_id, reporter,
                               cfg.fixed_widths)
        out[p] = {**res, "summary": summary(res["rows"]), "prompts": {d: len(v) for d, v in prompts.items()}}
    return out


def deployed_pool(cfg: BenchConfig, threads: int) -> str:
    """How the genai and llama.cpp rows were timed, for the report's title."""
    return ", ".join(RUNTIME_NAMES[r] for r in cfg.runtimes if r in RUNTIME_NAMES) + (
        f", {threads} intra-op threads per model (separate timing process)")


def benched_models(model: nn.Module, lora_rank: int, own_forms: bool = True) -> dict[str, nn.Module]:
    """The variants a bench times: ``model`` ("compressed") and, with ``own_forms``, its dense and LoRA forms
    (--no-own-forms leaves them out: genai runtime only, ``BenchConfig.validate``)."""
    if not own_forms:
        return {"compressed": model.eval()}
    return {"dense": dense_variant(model), "lora": lora_variant(model, lora_rank), "compressed": model.eval()}


def run_bench(model: nn.Module, lora_rank: int, cfg: BenchConfig, out: Path, report: dict | None = None,
              reporter: Reporter = SILENT, tokenizer=None, deploy: Deployment | None = None) -> dict:
    """Bench a compressed model (its three variants) and write bench.json, bench.md and bench.png into ``out``;
    ``tokenizer`` goes into the genai folders (synthetic mode: a stand-in); ``deploy``: the teacher and the slices
    of the quality/speed front (genai runtime)."""
    cfg.validate(DecoderShape.of(model.config).max_positions)
    threads = cfg.pool.count
    pool = ""
    macs_modules = variant_macs(model, lora_rank)
    models = benched_models(model, lora_rank, cfg.own_forms)
    with atomic_dir(Path(out)) as tmp:
        work = tmp / "graphs"
        work.mkdir()
        results, notes = [], {}
        ort_runtime = "ort" in cfg.runtimes
        if ort_runtime and cfg.scope in ("modules", "both"):
            rows, pool = bench_modules(models, work, cfg, threads, reporter)
            results += rows
        quality: dict = {}
        if cfg.deployed:
            rows, notes, quality = bench_genai(models, tokenizer, work, cfg, threads, reporter, deploy)
            results += rows
            pool = pool or deployed_pool(cfg, threads)
        if ort_runtime and cfg.scope in ("model", "both"):
            with_floor = {**models, "floor": floor_variant(model)}
            rows, pool = bench_model(with_floor, work, cfg, threads, reporter)
            results += rows
            macs_modules["floor"] = projection_macs(with_floor["floor"])
        macs = {"modules": macs_modules,
                "model": {n: (lambda ctx, n=n: model_macs_per_token(model, ctx, macs_modules[n]))
                          for n in macs_modules}}
        add_ratios(results, macs)
        doc = {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__, "onnxruntime": ort.__version__,
               "config": flat(cfg), "threads": threads, "thread_pool": pool, "lora_rank": lora_rank,
               "mac_per_token_modules": macs_modules, "mac_ratio_modules_vs_dense":
               macs_modules["dense"] / macs_modules["compressed"], "mac_ratio_modules_vs_lora":
               macs_modules["lora"] / macs_modules["compressed"], "results": results}
        if "speculative" in notes:  # --speculative: the teacher with this folder as its draft
            doc["speculative"] = notes.pop("speculative")
        if notes:
            doc["genai_notes"] = notes
        if quality:
            doc["quality"] = quality
            doc["front"] = front_points(results, quality)
            if deploy is not None and deploy.unseen is not None:
                doc["unseen_data"] = deploy.unseen[0]
            plot_front(doc["front"], tmp / "bench_front.png", unseen=doc.get("unseen_data"))
            cost = ((report or {}).get("provenance") or {}).get("allocation_cost")
            pred = predicted_vs_measured(doc["front"], cost, (cfg.quant_of("compressed"), cfg.quant_of("teacher"))) \
                if cost else None
            if pred:
                doc["prediction"] = pred
        if report is not None:
            doc["compression"] = {k: report.get(k) for k in ("speedup_vs_dense", "speedup_vs_lora", "dense_kept",
                                                               "dense_svd", "dense_dropped", "budget")}
        write_text(tmp / "bench.md", markdown(doc))
        plot(doc, tmp / "bench.png")
        write_json(tmp / BENCH_JSON, doc)
    return doc
