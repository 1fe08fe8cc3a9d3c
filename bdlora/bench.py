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

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from bdlora.costs import PROJECTIONS
from bdlora.errors import UsageError

SCOPES = ("modules", "model", "both")


class DenseLoRALinear(nn.Module):
    """y = base(x) + B (A x): a dense projection serving an unmerged LoRA adapter (scale folded into B)."""

    def __init__(self, base: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor):
        super().__init__()
        self.base = base
        self.lora_rank = lora_A.shape[0]
        self.lora_A = nn.Parameter(lora_A, requires_grad=False)  # (r, d_in)
        self.lora_B = nn.Parameter(lora_B, requires_grad=False)  # (d_out, r)

    def forward(self, x):
        return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)


def _projections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, child = name.rsplit(".", 1)
    setattr(model.get_submodule(parent), child, module)


def _dense_weight(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    from bdlora.export.modeling_bdlora import LowRankLinear

    if isinstance(m, LowRankLinear):
        return m.proj_out.weight @ m.proj_in.weight, m.proj_out.bias
    if isinstance(m, DenseLoRALinear):
        return m.base.weight + m.lora_B @ m.lora_A, m.base.bias
    return m.weight, m.bias


@torch.no_grad()
def dense_variant(model: nn.Module) -> nn.Module:
    """Every projection as one dense Linear holding its effective weight (low-rank pairs multiplied out)."""
    out = copy.deepcopy(model)
    for name, m in _projections(out):
        w, b = _dense_weight(m)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
        _set(out, name, lin)
    return out.eval()


@torch.no_grad()
def lora_variant(model: nn.Module, rank: int, seed: int = 0) -> nn.Module:
    """Dense base plus an unmerged rank-``rank`` adapter, with base = W_eff - B A so the function is unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = dense_variant(model)
    for name, m in _projections(out):
        a = torch.randn(rank, m.in_features, generator=g) / math.sqrt(m.in_features)
        b = torch.randn(m.out_features, rank, generator=g) * 0.01
        base = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        base.weight.copy_(m.weight - b @ a)
        if m.bias is not None:
            base.bias.copy_(m.bias)
        _set(out, name, DenseLoRALinear(base, a, b))
    return out.eval()


@torch.no_grad()
def floor_variant(model: nn.Module) -> nn.Module:
    """Control: every projection at rank 1, so the projections cost ~nothing and what remains is attention, norms,
    rotary, the LM head and graph overhead."""
    from bdlora.export.modeling_bdlora import LowRankLinear

    out = copy.deepcopy(model)
    for name, m in _projections(out):
        w, b = _dense_weight(m)
        lr = LowRankLinear(w.shape[1], w.shape[0], 1, bias=b is not None)
        _set(out, name, lr)
    return out.eval()


class ProjectionStack(nn.Module):
    """The replaced projections alone (the paper's measure). Each layer reads its own inputs, wired as in the
    decoder: q/k/v read x_a.l (N, hidden; the attention-normed state), o reads x_o.l (N, heads * head_dim),
    gate/up read x_m.l (N, hidden; the MLP-normed state), down reads x_d.l (N, intermediate). Every module's output
    is a graph output. (Sharing inputs beyond that would let the shared-input fusion merge projections that no real
    decoder can merge.)"""

    def __init__(self, model: nn.Module):
        super().__init__()
        named = _projections(model)
        self.mods = nn.ModuleList(m for _, m in named)
        self.kinds = [n.rsplit(".", 1)[-1] for n, _ in named]
        self.layer = [int(n.split("layers.")[1].split(".")[0]) for n, _ in named]
        self.num_layers = max(self.layer) + 1

    SOURCE = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}

    def input_names(self) -> list[str]:
        return [f"{x}.{i}" for i in range(self.num_layers) for x in ("x_a", "x_o", "x_m", "x_d")]

    def forward(self, *xs):
        # xs: per layer (x_a, x_o, x_m, x_d)
        return tuple(m(xs[4 * i + self.SOURCE[k]]) for m, k, i in zip(self.mods, self.kinds, self.layer))


# --------------------------------------------------------------------------------------------------------------------
# MAC accounting (the limits)
# --------------------------------------------------------------------------------------------------------------------


def projection_macs(model: nn.Module) -> int:
    from bdlora.export.onnx import module_table

    return sum(r["macs_per_token"] for r in module_table(model))


def model_macs_per_token(model: nn.Module, context: float, projections: int | None = None) -> float:
    """MACs per token of the whole decoder: projections + attention scores and values over ``context`` keys
    (2 * heads * head_dim * context per layer) + the LM head. Norms and rotary are negligible and left out."""
    from bdlora.export.onnx import kv_shape

    c = model.config
    _, hd = kv_shape(c)
    proj = projection_macs(model) if projections is None else projections
    attn = 2 * c.num_attention_heads * hd * context * c.num_hidden_layers
    return proj + attn + c.hidden_size * c.vocab_size


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    scope: str = "both"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    seq_lens: list[int] = field(default_factory=lambda: [128, 512])
    decode_tokens: int = 64
    threads: int | None = None
    provider: str = "cpu"
    repeats: int = 10
    warmup: int = 2
    lora_rank: int | None = None
    opt_level: str = "all"
    int8: bool = False  # model scope: also time dynamic-int8 graphs of dense and compressed
    optimize: bool = False  # model scope: onnxruntime transformer-optimizer fusions on every variant

    def validate(self) -> None:
        p = []
        if self.scope not in SCOPES:
            p.append(f"--scope {self.scope!r}: unknown (allowed: {', '.join(SCOPES)})")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            p.append(f"--batch-sizes {self.batch_sizes}: need one or more positive integers")
        if not self.seq_lens or any(s < 1 for s in self.seq_lens):
            p.append(f"--seq-lens {self.seq_lens}: need one or more positive integers")
        if self.repeats < 1:
            p.append(f"--repeats {self.repeats}: must be >= 1")
        if self.warmup < 0:
            p.append(f"--warmup {self.warmup}: must be >= 0")
        if self.decode_tokens < 1:
            p.append(f"--decode-tokens {self.decode_tokens}: must be >= 1")
        if self.threads is not None and self.threads < 1:
            p.append(f"--threads {self.threads}: must be >= 1")
        if p:
            from bdlora.errors import ConfigError

            raise ConfigError(p)
        provider_name(self.provider)


def provider_name(provider: str) -> str:
    import onnxruntime as ort

    names = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
    if provider not in names:
        raise UsageError(f"--provider {provider!r}: unknown (allowed: cpu, cuda)")
    available = ort.get_available_providers()
    if names[provider] not in available:
        raise UsageError(f"--provider {provider}: onnxruntime here has {', '.join(available)} (install "
                         "onnxruntime-gpu, the [gpu] extra, for cuda)")
    return names[provider]


def run_worker(kind: str, graphs: dict[str, Path], shapes: list, cfg: BenchConfig, threads: int, dims: dict,
               workdir: Path, on_stage=None) -> tuple[list[dict], str]:
    """Time ``graphs`` in a separate process (``bench_worker``) with one global onnxruntime thread pool."""
    import subprocess
    import sys

    spec = {"graphs": {k: str(v) for k, v in graphs.items()}, "kind": kind, "shapes": shapes,
            "repeats": cfg.repeats, "warmup": cfg.warmup, "threads": threads, "provider": provider_name(cfg.provider),
            "opt_level": cfg.opt_level, "decode_tokens": cfg.decode_tokens, "dims": dims}
    spec_path, out_path = workdir / f"{kind}-spec.json", workdir / f"{kind}-times.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, "-m", "bdlora.bench_worker", str(spec_path), str(out_path)],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if on_stage and not line.startswith((" ", "Traceback")):
            on_stage(f"timed {line.strip()}")
    if proc.wait() != 0:
        from bdlora.errors import BdloraError

        raise BdloraError(f"the bench timing process failed: {''.join(lines[-5:]).strip()}")
    res = json.loads(out_path.read_text())
    return res["times"], res["pool"]


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "repeats": len(a)}


def export_projection_stack(model: nn.Module, path: Path, opset: int = 17, fuse: bool = True) -> None:
    import warnings

    from bdlora.export.onnx import kv_shape, module_table, postprocess

    c = model.config
    heads = c.num_attention_heads
    _, hd = kv_shape(c)
    stack = ProjectionStack(model).eval()
    ex = [torch.randn(2, d) for _ in range(stack.num_layers)
          for d in (c.hidden_size, heads * hd, c.hidden_size, c.intermediate_size)]
    outs = [f"y{i}" for i in range(len(stack.mods))]
    ins = stack.input_names()
    axes = {n: {0: "tokens"} for n in [*ins, *outs]}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(stack, tuple(ex), str(path), input_names=ins, output_names=outs,
                          dynamic_axes=axes, opset_version=opset, dynamo=False)
    rows = [{**r, "name": f"mods.{i}"} for i, r in enumerate(module_table(model))]
    postprocess(path, rows, fuse)


def _dims(model: nn.Module) -> dict:
    from bdlora.export.onnx import kv_shape

    c = model.config
    kv, hd = kv_shape(c)
    return {"hidden": c.hidden_size, "q_dim": c.num_attention_heads * hd, "intermediate": c.intermediate_size,
            "layers": c.num_hidden_layers, "kv_heads": kv, "head_dim": hd, "vocab": c.vocab_size}


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
                  on_stage=None) -> tuple[list[dict], str]:
    graphs = {}
    for name, m in models.items():
        graphs[name] = workdir / f"modules-{name}.onnx"
        export_projection_stack(m, graphs[name])
    shapes = [["decode", b, 1] for b in cfg.batch_sizes] + [["prefill", b, s] for b in cfg.batch_sizes
                                                             for s in cfg.seq_lens]
    times, pool = run_worker("modules", graphs, shapes, cfg, threads, _dims(next(iter(models.values()))), workdir,
                             on_stage)
    return _rows("modules", times), pool


def bench_model(models: dict[str, nn.Module], workdir: Path, cfg: BenchConfig, threads: int,
                on_stage=None) -> tuple[list[dict], str]:
    from bdlora.export.onnx import export_decoder

    graphs = {}
    for name, m in models.items():
        graphs[name] = workdir / f"model-{name}.onnx"
        if on_stage:
            on_stage(f"exporting the {name} decoder")
        export_decoder(copy.deepcopy(m), graphs[name])
        if cfg.optimize:
            from bdlora.export.onnx import optimize_graph

            optimize_graph(graphs[name], m)
    if cfg.int8:
        from bdlora.export.onnx import quantize_int8

        for name in ("dense", "compressed"):
            if on_stage:
                on_stage(f"quantising the {name} decoder to int8")
            graphs[f"{name}-int8"] = workdir / f"model-{name}-int8.onnx"
            quantize_int8(graphs[name], graphs[f"{name}-int8"])
    shapes = [[phase, b, s] for b in cfg.batch_sizes for s in cfg.seq_lens for phase in ("prefill", "decode")]
    times, pool = run_worker("model", graphs, shapes, cfg, threads, _dims(next(iter(models.values()))), workdir,
                             on_stage)
    return _rows("model", times), pool


def add_ratios(results: list[dict], macs: dict) -> None:
    """Speed-ups of the compressed variant vs dense and vs LoRA, beside the MAC ratio (the limit) and the fraction
    of that limit achieved; model-scope rows also get the floor (rank-1 control) and the share of time outside the
    replaced modules."""
    index = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in results}
    for r in results:
        key = (r["scope"], r["phase"], r["batch"], r["seq"])
        if r["scope"] == "model":
            ctx = (r["seq"] + 1) / 2 if r["phase"] == "prefill" else r["seq"] + 1
            r["mac_per_token"] = macs["model"][r["variant"]](ctx)
            floor = index.get(("model", "floor", *key[1:]))
            if floor is not None and r["variant"] != "floor":
                r["share_outside_modules"] = min(1.0, floor["median_ms"] / r["median_ms"])
        else:
            r["mac_per_token"] = macs["modules"][r["variant"]]
        if r["variant"] == "compressed-int8":  # int8 on top of low rank: vs the fp32 and the int8 dense graphs
            dense, dense8 = index[(key[0], "dense", *key[1:])], index.get((key[0], "dense-int8", *key[1:]))
            r["speedup_vs_dense"] = dense["median_ms"] / r["median_ms"]
            if dense8 is not None:
                r["speedup_vs_dense_int8"] = dense8["median_ms"] / r["median_ms"]
            continue
        if r["variant"] != "compressed":
            continue
        dense = index[(key[0], "dense", *key[1:])]
        lora = index.get((key[0], "lora", *key[1:]))
        r["speedup_vs_dense"] = dense["median_ms"] / r["median_ms"]
        r["mac_ratio_vs_dense"] = dense["mac_per_token"] / r["mac_per_token"]
        r["fraction_of_limit"] = r["speedup_vs_dense"] / r["mac_ratio_vs_dense"]
        if lora is not None:
            r["speedup_vs_lora"] = lora["median_ms"] / r["median_ms"]
            r["mac_ratio_vs_lora"] = lora["mac_per_token"] / r["mac_per_token"]


def run_bench(model: nn.Module, lora_rank: int, cfg: BenchConfig, out: Path, report: dict | None = None,
              on_stage=None) -> dict:
    """Bench a compressed model (its three variants) and write bench.json, bench.md and bench.png into ``out``."""
    import os

    from bdlora.io import atomic_dir, write_json, write_text

    cfg.validate()
    threads = cfg.threads or os.cpu_count() or 1
    pool = ""
    models = {"dense": dense_variant(model), "lora": lora_variant(model, lora_rank), "compressed": model.eval()}
    macs_modules = {n: projection_macs(m) for n, m in models.items()}
    out = Path(out)
    with atomic_dir(out) as tmp:
        work = tmp / "graphs"
        work.mkdir()
        results = []
        if cfg.scope in ("modules", "both"):
            rows, pool = bench_modules(models, work, cfg, threads, on_stage)
            results += rows
        if cfg.scope in ("model", "both"):
            with_floor = {**models, "floor": floor_variant(model)}
            rows, pool = bench_model(with_floor, work, cfg, threads, on_stage)
            results += rows
            macs_modules["floor"] = projection_macs(with_floor["floor"])
        for n in ("dense", "compressed"):  # int8 graphs do the same MACs (in int8)
            macs_modules[f"{n}-int8"] = macs_modules[n]
        macs = {"modules": macs_modules,
                "model": {n: (lambda ctx, n=n: model_macs_per_token(model, ctx, macs_modules[n]))
                          for n in macs_modules}}
        add_ratios(results, macs)
        import onnxruntime as ort

        from bdlora import SCHEMA_VERSION, __version__

        doc = {"schema_version": SCHEMA_VERSION, "bdlora_version": __version__, "onnxruntime": ort.__version__,
               "config": asdict(cfg), "threads": threads, "thread_pool": pool, "lora_rank": lora_rank,
               "mac_per_token_modules": macs_modules, "mac_ratio_modules_vs_dense":
               macs_modules["dense"] / macs_modules["compressed"], "mac_ratio_modules_vs_lora":
               macs_modules["lora"] / macs_modules["compressed"], "results": results}
        if report is not None:
            doc["compression"] = {k: report.get(k) for k in ("speedup_vs_dense", "speedup_vs_lora", "dense_kept",
                                                               "dense_svd", "dense_dropped", "budget")}
        write_json(tmp / "bench.json", doc)
        write_text(tmp / "bench.md", markdown(doc))
        plot(doc, tmp / "bench.png")
    return doc


def markdown(doc: dict) -> str:
    lines = [f"# bdlora bench ({doc['thread_pool']}, onnxruntime {doc['onnxruntime']})", "",
             f"Replaced-module MAC ratio vs dense {doc['mac_ratio_modules_vs_dense']:.2f}x, vs LoRA "
             f"{doc['mac_ratio_modules_vs_lora']:.2f}x.", "",
             "| scope | phase | batch x seq | dense ms | lora ms | compressed ms (p10-p90) | vs dense | MAC limit | "
             "of limit | vs LoRA | outside modules |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    idx = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in doc["results"]}
    q8 = [r for r in doc["results"] if r["variant"] == "compressed-int8"]
    for r in doc["results"]:
        if r["variant"] != "compressed":
            continue
        k = (r["phase"], r["batch"], r["seq"])
        d, lo = idx[(r["scope"], "dense", *k)], idx.get((r["scope"], "lora", *k))
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else f"{r['batch']}x1 (cache {r['seq']})" \
            if r["scope"] == "model" else f"{r['batch']}x1"
        outside = f"{100 * r['share_outside_modules']:.0f}%" if "share_outside_modules" in r else "-"
        lines.append(f"| {r['scope']} | {r['phase']} | {shape} | {d['median_ms']:.3f} | "
                     f"{lo['median_ms'] if lo else float('nan'):.3f} | {r['median_ms']:.3f} ({r['p10_ms']:.3f}-"
                     f"{r['p90_ms']:.3f}) | {r['speedup_vs_dense']:.2f}x | {r['mac_ratio_vs_dense']:.2f}x | "
                     f"{100 * r['fraction_of_limit']:.0f}% | {r.get('speedup_vs_lora', float('nan')):.2f}x | "
                     f"{outside} |")
    if q8:
        lines += ["", "int8 (onnxruntime dynamic weight quantisation), model scope:", "",
                  "| phase | batch x seq | dense int8 ms | compressed int8 ms | vs fp32 dense | vs int8 dense |",
                  "|---|---|---|---|---|---|"]
        for r in q8:
            d8 = idx.get((r["scope"], "dense-int8", r["phase"], r["batch"], r["seq"]))
            lines.append(f"| {r['phase']} | {r['batch']}x{r['seq']} | {d8['median_ms'] if d8 else float('nan'):.3f} "
                         f"| {r['median_ms']:.3f} | {r['speedup_vs_dense']:.2f}x | "
                         f"{r.get('speedup_vs_dense_int8', float('nan')):.2f}x |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bdlora.io import atomic_path

    rows = [r for r in doc["results"] if r["variant"] == "compressed"]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.2))
    labels = [f"{r['scope'][:3]} {r['phase'][:3]}\n{r['batch']}x{r['seq']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["mac_ratio_vs_dense"] for r in rows], 0.4, label="MAC limit vs dense", color="#bbbbbb")
    ax.bar(x + 0.2, [r["speedup_vs_dense"] for r in rows], 0.4, label="measured speed-up vs dense",
           color="tab:blue")
    ax.set_xticks(x, labels, fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("x faster than dense")
    ax.set_title("compressed vs dense under onnxruntime: measured speed-up beside the MAC limit")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def synthetic_model(config: dict, budget: float, layers: int | None, rank: int, seed: int = 0, **plan_kw):
    """A compressed-architecture model with random weights in the structure ``plan`` predicts for F."""
    from bdlora.costs import deployed_form
    from bdlora.export.modeling_bdlora import FAMILIES
    from bdlora.plan import plan

    report = plan(config, budget, layers=layers, rank=rank, **plan_kw)
    family = config["model_type"]
    cfg_cls, model_cls = FAMILIES[family]
    modules = {m["name"]: deployed_form(m["rank"]) for m in report["modules"]}
    base = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    if layers is not None:
        base["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(bdlora_modules=modules, bdlora={"base_model_type": family, "budget": budget},
                              **base))
    return model.eval(), report
