"""The whole sweep family on one quality/speed front (``sweep --front``): after the members, one onnxruntime-genai
bench of the first member with every other member beside it (``bench --also``), the teacher's own exports at every
precision (ours and the builder's) in the same interleaved run, every graph scored on the same held-out slice. Its
points, named by member, are drawn as ``DIR/front.png`` and tabled in ``sweep.md``; the bench itself is
``DIR/front.bench/``, a step of the sweep's ledger that reads every member's folder: kept on ``--resume`` when it
and they are as they were."""

from __future__ import annotations

from bdlora.base.argv import Invocation
from bdlora.base.io import read_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import BENCH, BENCH_JSON, COMPRESSED, BenchDir, SweepDir
from bdlora.base.threads import flat
from bdlora.bench.config import BenchConfig
from bdlora.bench.front import plot
from bdlora.bench.genai import deployment_for
from bdlora.bench.run import run_bench
from bdlora.bench.target import trained_lora_rank
from bdlora.models.load import load_model_folder
from bdlora.pipeline.ledger import Ledger, Step, do_step

FRONT_PNG = "front.png"


def member_name(row: str, first: str) -> str:
    """A bench row's name on the family's front: the first member's rows (``compressed``, ``compressed-int4``) get
    its name; the others already carry theirs (``--also``), the teacher's rows are the teacher's."""
    return first + row.removeprefix("compressed") if row == "compressed" or row.startswith("compressed-") else row


def bench_front(opts, sweep: SweepDir, names: list[str], ledger: Ledger, reporter: Reporter = SILENT,
                peers: list[str] = ()) -> dict:
    """Bench the family ``names`` (members with a compressed folder) on one front, the kd-lora baseline members
    (``peers``: the dense model healed with the same data and steps) as its healed dense peers (``bench --peer``),
    every row also scored on the builtin corpus the sweep never trained on (``--eval-data``'s default);
    {"bench", "points"}."""
    if not names:  # only baselines: the first is the bench's subject
        names, peers = list(peers[:1]), list(peers[1:])
    folders = [sweep.path / f"{n}{COMPRESSED}" for n in names]
    out = sweep.path / f"front{BENCH}"
    cfg = BenchConfig(runtime="genai", batch_sizes=[1], seq_lens=[min(opts.bench_seq_lens)],
                      decode_tokens=opts.bench_decode_tokens, repeats=opts.bench_repeats, warmup=1)
    also, peer = [str(f) for f in folders[1:]], [str(sweep.path / f"{n}{COMPRESSED}") for n in peers]
    step = Step(out.name, Invocation(("bench",), {"model_dir": str(folders[0]), "also": also or None,
                                                  "peer": peer or None, **flat(cfg)}), BENCH_JSON, "front",
                tuple(f"{n}{COMPRESSED}" for n in (*names, *peers)))

    def benched() -> None:
        reporter.stage(f"the family on one quality/speed front: {', '.join(names)} and the teacher's exports")
        model, tok, report = load_model_folder(folders[0])
        deploy = deployment_for(folders[0], report, tok, model, cfg, reporter, also=also, peers=peer)
        run_bench(model, trained_lora_rank(report), cfg, out, report, reporter=reporter, tokenizer=tok, deploy=deploy)

    do_step(ledger, step, reporter, benched)
    doc = read_json(out / BenchDir.MARKER)
    points = [{**p, "name": member_name(p["name"], names[0]),
               **{k: p[k] and member_name(p[k], names[0]) for k in ("dominated_by", "dominated_by_unseen") if k in p}}
              for p in doc.get("front", [])]
    plot(points, sweep.path / FRONT_PNG, unseen=doc.get("unseen_data"),
         title="the sweep family and the teacher's exports (onnxruntime-genai, decode ms/token at batch 1)")
    return {"bench": str(out), "points": points, "unseen_data": doc.get("unseen_data")}
