"""Pruned attention groups (issue 51, item 2): a site form declared once in the registry, its drop error measured in
the low-rank error's own units (exact for every prefix of the group order), o refitted to the kept heads, the kept
heads' attention exactly the source's, one knapsack choosing per attention block between low rank and fewer groups,
and a pruned folder that every reader takes (HF with and without remote code, ONNX and genai graphs whose layers
cache different numbers of heads, validated against PyTorch; eval, serve, bench)."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_channels import _serves_its_greedy_generation, benched, healed_and_compressed, scored_and_exported, shot
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.compress.forms.groups import group_options, group_order, probe_shapes, prune
from bdlora.compress.forms.lowrank import FISHER_DAMPING, damped
from bdlora.compress.pricing import mac_cost
from bdlora.models.costs import ModuleShape
from conftest import allocate_with

KV, RATIO, HD, HIDDEN = 4, 2, 3, 10  # a problem of 4 groups of 2 query heads of width 3


def _problem(seed: int, tokens: int = 60):
    g = torch.Generator().manual_seed(seed)
    width = KV * RATIO * HD
    scale = torch.rand(width, generator=g, dtype=torch.float64) * 3
    a = torch.randn(tokens, width, generator=g, dtype=torch.float64) * scale
    return a, torch.randn(HIDDEN, width, generator=g, dtype=torch.float64), torch.rand(HIDDEN, generator=g,
                                                                                       dtype=torch.float64)


@given(st.integers(0, 100_000))
@settings(max_examples=40, deadline=None)
def test_the_error_of_every_prefix_is_the_loss_weighted_output_change_of_dropping_those_groups(seed):
    """error[n] = sum_i phi_i^2 ||W_o[i, cols(D)] A_D^T||^2 for D the first n groups of the order (all their query
    columns, cross terms included), with the damping every other form's error has."""
    a, w, f = _problem(seed)
    gram = a.T @ a
    order = group_order(w, gram, f, KV, HD)
    phi2 = f + FISHER_DAMPING * f.mean()
    c = damped(gram)
    assert sorted(order.order.tolist()) == list(range(KV)) and order.error[0] == 0 and order.ratio == RATIO
    for n in range(KV + 1):
        cols = torch.cat([torch.arange(g * RATIO * HD, (g + 1) * RATIO * HD) for g in order.order[:n].tolist()]
                         + [torch.zeros(0, dtype=torch.long)])
        wd = w[:, cols]
        direct = float(((wd @ c[cols][:, cols]) * wd).sum(1) @ phi2)
        assert order.error[n] == pytest.approx(direct, rel=1e-9, abs=1e-9)
    own = [order.error[1]]  # the first is the least important alone
    for g in range(KV):
        cols = torch.arange(g * RATIO * HD, (g + 1) * RATIO * HD)
        own.append(float(((w[:, cols] @ c[cols][:, cols]) * w[:, cols]).sum(1) @ phi2))
    assert order.error[1] == pytest.approx(min(own[1:]), rel=1e-9)


@given(st.integers(0, 100_000), st.integers(1, KV - 1))
@settings(max_examples=30, deadline=None)
def test_pruning_keeps_each_kept_groups_rows_and_the_refit_never_fits_worse(seed, keep):
    a, w, f = _problem(seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(KV * RATIO * HD, HIDDEN, generator=g, dtype=torch.float64)
    k, v = (torch.randn(KV * HD, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))
    order = group_order(w, a.T @ a, f, KV, HD)
    kept = order.kept(keep).tolist()
    pq, pk, pv, plain = prune(q, k, v, w, a.T @ a, order, keep, refit=False)
    *_, fit = prune(q, k, v, w, a.T @ a, order, keep)
    qrows = [r for gr in kept for r in range(gr * RATIO * HD, (gr + 1) * RATIO * HD)]
    kvrows = [r for gr in kept for r in range(gr * HD, (gr + 1) * HD)]
    assert torch.equal(pq, q[qrows]) and torch.equal(pk, k[kvrows]) and torch.equal(pv, v[kvrows])
    assert torch.equal(plain, w[:, qrows]) and fit.shape == (HIDDEN, keep * RATIO * HD)
    target = a @ w.T

    def err(o):
        return float(((a[:, qrows] @ o.T - target) ** 2).sum())

    assert err(fit) <= err(plain) * (1 + 1e-9)


def test_a_pruned_attention_block_computes_the_kept_heads_of_the_source_exactly():
    """The architecture's pruned block (narrower q, k, v, o; the family's own forward) equals the source block with
    the dropped groups' o columns zeroed, to 1e-5, at a different number of cached heads than the other layer."""
    from transformers import MistralConfig, MistralForCausalLM

    from bdlora.deployed.modeling_bdlora import BdloraMistralConfig, BdloraMistralForCausalLM

    base = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, sliding_window=None)
    torch.manual_seed(0)
    src = MistralForCausalLM(MistralConfig(**base)).eval()
    ours = BdloraMistralForCausalLM(BdloraMistralConfig(
        bdlora_modules={"model.layers.1.self_attn": {"form": "groups", "keep": 1}}, **base)).eval()
    state = src.state_dict()
    hd = 8  # 32 / 4; group 1 (query heads 2 and 3, KV head 1) is kept
    pre = "model.layers.1.self_attn"
    state[f"{pre}.q_proj.weight"] = state[f"{pre}.q_proj.weight"][2 * hd:]
    state[f"{pre}.k_proj.weight"] = state[f"{pre}.k_proj.weight"][hd:]
    state[f"{pre}.v_proj.weight"] = state[f"{pre}.v_proj.weight"][hd:]
    state[f"{pre}.o_proj.weight"] = state[f"{pre}.o_proj.weight"][:, 2 * hd:]
    ours.load_state_dict(state)
    with torch.no_grad():
        src.model.layers[1].self_attn.o_proj.weight[:, : 2 * hd] = 0  # the dropped heads contribute nothing
        x = torch.randint(0, 40, (2, 9))
        out = ours(x, use_cache=True)
        torch.testing.assert_close(out.logits, src(x).logits, rtol=1e-5, atol=1e-5)
    assert out.past_key_values.layers[0].keys.shape[1] == 2 and out.past_key_values.layers[1].keys.shape[1] == 1


ATTN = [ModuleShape(f"model.layers.0.self_attn.{p}", *s) for p, s in
        (("q_proj", (64, 64)), ("k_proj", (64, 32)), ("v_proj", (64, 32)), ("o_proj", (64, 64)))]


def test_the_allocation_chooses_per_attention_block_between_low_rank_and_fewer_groups_by_error():
    """Hand-made: 2 groups (KV 2 heads of 16, 2 query heads each); each spectrum loses 1 per dropped component. A
    cheap group goes (the block keeps 1 of 2: half of every width) and nothing is factored; a costly one stays."""

    class Order:
        groups = 2

        def __init__(self, e):
            self.error = np.array([0.0, e, 2 * e])

    energy = {s.name: np.ones(32) for s in ATTN}
    site = "model.layers.0.self_attn"
    cheap = allocate_with(ATTN, energy, 1.5, sites={site: group_options(ATTN, Order(0.01), mac_cost)}, kv_heads=2)
    assert cheap.keep == {site: 1} and not any(cheap.ranks.values())
    assert [cheap.shape(s) for s in ATTN] == [ModuleShape(ATTN[0].name, 64, 32), ModuleShape(ATTN[1].name, 64, 16),
                                              ModuleShape(ATTN[2].name, 64, 16), ModuleShape(ATTN[3].name, 32, 64)]
    assert cheap.macs(ATTN) == (64 * 64 + 64 * 32) and cheap.mac_ratio(ATTN) == 2.0
    costly = allocate_with(ATTN, energy, 1.5, sites={site: group_options(ATTN, Order(1e6), mac_cost)}, kv_heads=2)
    assert costly.keep == {} and any(costly.ranks.values())
    # 2, 4 and 6 of 8 groups: q and o at 16, 32, 48 wide, k and v at 8, 16, 24 (16 already timed for q)
    assert probe_shapes(ATTN, 8) == [(64, 16), (64, 32), (64, 48), (64, 8), (64, 24), (16, 64), (32, 64), (48, 64)]


@pytest.fixture(scope="module")
def grouped(tiny_env, tmp_path_factory):
    """A one-shot student of a head-dim-16 teacher (4 query heads on 2 KV heads) with --forms groups at 1.15x."""
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("groups")
    genai_teacher(tiny_env["tokenizer"], root / "teacher")
    r = shot(tiny_env, root / "teacher", root / "s", "--mac-ratio", "1.15", "--forms", "groups")
    assert r.exit_code == 0, r.output
    return root, json.loads(r.stdout)


def test_a_grouped_folder_declares_its_sites_and_holds_the_kept_heads(grouped):
    from transformers import AutoModelForCausalLM

    root, report = grouped
    assert report["attention_pruned"] >= 1 and report["mlp_pruned"] == 0 and report["speedup_vs_dense"] >= 1.15
    cfg = json.loads((root / "s" / "config.json").read_text())
    sites = {k: v for k, v in cfg["bdlora_modules"].items() if k.endswith(".self_attn")}
    assert len(sites) == report["attention_pruned"] and all(v == {"form": "groups", "keep": 1}
                                                            for v in sites.values())
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32)
    src = {k: v.detach() for k, v in teacher.named_parameters()}
    got = load_file(str(root / "s" / "model.safetensors"))
    rows = {m["name"]: m for m in report["modules"]}
    for site in sites:
        q, k, v, o = (got[f"{site}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert q.shape == (32, 64) and k.shape == v.shape == (16, 64) and o.shape == (64, 32)
        kept = [g for g in range(2) if torch.equal(k, src[f"{site}.k_proj.weight"][16 * g: 16 * (g + 1)])]
        assert len(kept) == 1 and torch.equal(q, src[f"{site}.q_proj.weight"][32 * kept[0]: 32 * (kept[0] + 1)])
        assert torch.equal(v, src[f"{site}.v_proj.weight"][16 * kept[0]: 16 * (kept[0] + 1)])
        assert rows[f"{site}.o_proj"]["case"] == "pruned" and rows[f"{site}.o_proj"]["groups"] == 1
        assert rows[f"{site}.q_proj"]["macs_after"] == 64 * 32 and rows[f"{site}.k_proj"]["macs_after"] == 64 * 16
    x = torch.randint(0, teacher.config.vocab_size, (2, 12))
    ours = AutoModelForCausalLM.from_pretrained(root / "s", dtype=torch.float32).eval()
    remote = AutoModelForCausalLM.from_pretrained(root / "s", dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, remote(x).logits, rtol=0, atol=0)


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_every_reader_takes_a_grouped_folder(tiny_env, grouped, tmp_path):
    """eval scores the slice the report did; export onnx and export genai (fp32 and int4) validate their graphs,
    whose pruned layers cache fewer heads, against PyTorch; serve answers with the graph's own greedy tokens; bench
    times it beside the teacher in both runtimes (genai sizes each layer's cache from the graph)."""
    root, report = grouped
    folder = root / "s"
    scored_and_exported(folder, report, tmp_path)
    graph = onnx.load(str(tmp_path / "o" / "model.onnx")).graph
    heads = [i.type.tensor_type.shape.dim[1].dim_value for i in graph.input if i.name.endswith(".key")]
    pruned_layers = {int(s.split(".")[2]) for s in json.loads((folder / "config.json").read_text())["bdlora_modules"]
                     if s.endswith(".self_attn")}
    assert heads == [1 if i in pruned_layers else 2 for i in range(len(heads))]
    _serves_its_greedy_generation(tmp_path / "o", tiny_env["tokenizer"])
    doc = benched(folder, tmp_path)
    assert "blocks are pruned" in doc["genai_notes"]["builder-int4"]
    assert {"compressed-int4", "teacher-int4"} <= {p["name"] for p in doc["front"]}


def test_a_groups_site_declared_inconsistently_is_refused(grouped, tmp_path):
    root, _ = grouped
    for i, (edit, needle) in enumerate((
            (lambda m, s: m.__setitem__(s, {"form": "groups", "keep": 2}),
             "keep x head_dim 32 but the weights hold 16"),
            (lambda m, s: m.__setitem__(s, {"form": "channels", "keep": 32}), "cannot be declared on"),
            (lambda m, s: m.__setitem__(s, {"form": "groups", "keep": 0}), "keep 0 (a positive integer)"))):
        folder = tmp_path / f"m{i}"
        shutil.copytree(root / "s", folder)
        cfg = json.loads((folder / "config.json").read_text())
        site = next(k for k in cfg["bdlora_modules"] if k.endswith(".self_attn"))
        edit(cfg["bdlora_modules"], site)
        (folder / "config.json").write_text(json.dumps(cfg))
        r = CliRunner().invoke(app, ["eval", str(folder), "--ppl", "--report", str(tmp_path / f"e{i}.json")])
        assert r.exit_code == 2, r.output
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_grouped_folder_heals_as_a_student_and_compresses_to_the_same_sites(tiny_env, tmp_path):
    r = shot(tiny_env, tiny_env["teacher"], tmp_path / "p", "--mac-ratio", "1.15", "--forms", "groups")
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    sites = {k: v for k, v in json.loads((tmp_path / "p" / "config.json").read_text())["bdlora_modules"].items()
             if k.endswith(".self_attn")}
    assert sites
    r = healed_and_compressed(tiny_env, tmp_path / "p", tmp_path, steps=3)
    healed = json.loads((tmp_path / "healed" / "config.json").read_text())["bdlora_modules"]
    assert {k: v for k, v in healed.items() if k.endswith(".self_attn")} == sites
    report = json.loads(r.stdout)
    assert report["attention_pruned"] == first["attention_pruned"] and report["dense_macs"] == first["dense_macs"]
    assert report["compressed_macs"] == first["compressed_macs"]


def test_the_report_table_names_the_pruned_attention_blocks():
    from bdlora.cli import render
    from bdlora.models.costs import compression_report, prune_decision

    shapes = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576)}
    decisions = [prune_decision(ModuleShape(f"model.layers.{i}.self_attn.{p}", *s), keep, of=3)
                 for i, keep in ((0, 1), (1, 2)) for p, s in shapes.items()]
    report = compression_report(decisions, baseline="source")
    assert report["attention_pruned"] == 2 and report["mlp_pruned"] == 0
    with render.out.capture() as cap:
        render.compression_report(report, title="t")
    assert "attention blocks keeping fewer KV heads" in cap.get() and "2 (kept 1 to 2 of 3)" in cap.get()
