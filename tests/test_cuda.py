"""The GPU path, run for real where a CUDA device exists (skipped elsewhere; ``scripts/gpu-check.sh`` runs these on a
machine that already has torch with CUDA): the builtin teacher's student trained a few steps with ``--device cuda``
in bf16, resumed, compressed and evaluated, each against the same steps on the CPU.

Tolerances: CUDA's and the CPU's bf16 kernels round differently (and cuBLAS may sum in another order), so the two
devices agree to a stated tolerance, not bit for bit: every step's loss within 2% and held-out perplexity within 3%
after STEPS steps; on one device a resumed run repeats the uninterrupted one to 1e-3 relative. These bounds are
chosen, not yet measured: no session has had a GPU when they were written (the CPU-only dry run of this file, every
"cuda" read as "cpu", passes with them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (scripts/gpu-check.sh)")]

STEPS = 6
LOSS_RTOL = 0.02
PPL_RTOL = 0.03
RESUME_RTOL = 1e-3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the short builtin teacher (the e2e tests' 60-step pretraining) is built once."""
    root = tmp_path_factory.mktemp("cuda-cache")
    old = os.environ.get("BDLORA_TEACHER_STEPS")
    os.environ["BDLORA_TEACHER_STEPS"] = "60"
    yield root
    if old is None:
        os.environ.pop("BDLORA_TEACHER_STEPS", None)
    else:
        os.environ["BDLORA_TEACHER_STEPS"] = old


def _cfg(cache: Path, out: Path, device: str, **kw):
    from bdlora.train.config import TrainConfig

    base = dict(teacher="builtin", method="budgeted", budget=0.4, max_steps=STEPS, eval_every=STEPS, save_every=3,
                device=device, autocast="bf16", out=str(out), cache_dir=str(cache), measure_step_time=False,
                eval_tokens=4096, seed=0)
    return TrainConfig(**{**base, **kw})


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory):
    """The same budgeted run on each device."""
    from bdlora.train.loop import train

    root = tmp_path_factory.mktemp("cuda-runs")
    return {device: (train(_cfg(cache, root / device, device)), root / device) for device in ("cuda", "cpu")}


def test_cuda_bf16_training_matches_the_cpu_within_tolerance(runs):
    (gpu, gpu_dir), (cpu, cpu_dir) = runs["cuda"], runs["cpu"]
    assert gpu["steps"] == cpu["steps"] == STEPS
    assert json.loads((gpu_dir / "config.json").read_text())["config"]["device"] == "cuda"
    for a, b in zip(_losses(gpu_dir), _losses(cpu_dir), strict=True):
        assert a == pytest.approx(b, rel=LOSS_RTOL)
    assert gpu["student_val_ppl"] == pytest.approx(cpu["student_val_ppl"], rel=PPL_RTOL)


def test_a_cuda_run_resumes_where_it_stopped(cache, runs, tmp_path):
    from bdlora.train.config import TrainConfig
    from bdlora.train.loop import train
    from conftest import stop_at

    with pytest.raises(KeyboardInterrupt):
        train(_cfg(cache, tmp_path / "r", "cuda"), reporter=stop_at(STEPS - 1))
    resumed = train(TrainConfig(), resume=tmp_path / "r")
    assert resumed["resumed_from"] == 3 and resumed["steps"] == STEPS
    whole = runs["cuda"][0]
    assert resumed["student_val_ppl"] == pytest.approx(whole["student_val_ppl"], rel=RESUME_RTOL)


def test_a_cuda_run_compresses_and_evaluates_like_the_cpu_run(runs, tmp_path):
    from bdlora.eval.evaluate import EvalConfig, evaluate_target
    from bdlora.models.budgeted.config import BudgetedConfig
    from bdlora.train.compress_run import compress_run

    scored = {}
    for device, (_, run) in runs.items():
        report, folder = compress_run(run, BudgetedConfig(), tmp_path / device)
        doc = evaluate_target(folder, EvalConfig(ppl=True, icl=False))
        assert doc["ppl"]["val_ppl"] == pytest.approx(report["eval"]["compressed_val_ppl"], rel=1e-4)
        scored[device] = (report, doc["ppl"]["val_ppl"])
    (gpu, gpu_ppl), (cpu, cpu_ppl) = scored["cuda"], scored["cpu"]
    assert [m["case"] for m in gpu["modules"]] == [m["case"] for m in cpu["modules"]]
    assert gpu_ppl == pytest.approx(cpu_ppl, rel=PPL_RTOL)


if __name__ == "__main__":  # a device machine without pytest: the same checks, in order, by hand
    import sys
    import tempfile

    if not CUDA:
        sys.exit("no CUDA device: nothing to check")
    os.environ.setdefault("BDLORA_TEACHER_STEPS", "60")
    from bdlora.train.loop import train

    tmp = Path(tempfile.mkdtemp(prefix="bdlora-cuda-"))
    made = {d: (train(_cfg(tmp / "cache", tmp / d, d)), tmp / d) for d in ("cuda", "cpu")}
    for name, check in (("train", lambda: test_cuda_bf16_training_matches_the_cpu_within_tolerance(made)),
                        ("resume", lambda: test_a_cuda_run_resumes_where_it_stopped(tmp / "cache", made, tmp / "r")),
                        ("compress+eval", lambda: test_a_cuda_run_compresses_and_evaluates_like_the_cpu_run(
                            made, tmp / "c"))):
        (tmp / "r").mkdir(exist_ok=True)
        (tmp / "c").mkdir(exist_ok=True)
        check()
        print(f"passed: {name}", flush=True)
    print(f"3 passed, 0 failed (runs kept in {tmp})")


def test_layer_by_layer_calibration_on_a_gpu_is_the_whole_models():
    """A student held on the GPU (a structured start at 1B+ calibrates layer by layer past 2 GiB): the calibration
    runs there, its stored Grams come back to the GPU, and every quantity is ``calibrate``'s on the same device to
    1e-4 (cuBLAS may sum in another order)."""
    import numpy as np
    from transformers import MistralConfig, MistralForCausalLM

    from bdlora.compress.calibrate import calibrate
    from bdlora.compress.layerwise import calibrate_layers

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)).cuda().eval()
    blocks = np.random.default_rng(0).integers(0, 128, (11, 24))
    want = calibrate(model, blocks, residual=True, predicted=True)
    got = calibrate_layers(model, blocks, residual=True, predicted=True)
    for key in want.grams:
        g = got.grams[key]
        assert g.device.type == "cuda"
        assert torch.allclose(g, want.grams[key], rtol=1e-4, atol=1e-4 * float(want.grams[key].abs().max())), key
    for key in want.fisher:
        w = want.fisher[key]
        assert torch.allclose(got.fisher[key], w, rtol=1e-4, atol=1e-4 * float(w.abs().max())), key
    for i, (energy, grad) in want.residual.items():
        assert torch.allclose(got.residual[i][0], energy, rtol=1e-4) and torch.allclose(got.residual[i][1], grad,
                                                                                         rtol=1e-4), i
    assert np.allclose(got.mass, want.mass, rtol=1e-4) and got.tokens == want.tokens
