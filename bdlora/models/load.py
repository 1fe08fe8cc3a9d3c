"""Loading the models bdlora writes or reads, each with one clear error when it cannot: a run's student in its
trained form (gated modules or PEFT adapter intact) and any model folder (a compressed bdlora model, a kd-full
student, a plain Llama/Mistral/Qwen2 checkpoint). Teachers load through ``bdlora.models.teacher``."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bdlora.base.errors import ModelError, RunDirError
from bdlora.base.method_table import method_of
from bdlora.base.runs import ADAPTER, CONFIG, STUDENT_META, ModelDir, RunDir
from bdlora.deployed.folder import check_architecture
from bdlora.models.budgeted.model import FACTORS_FILE, META_FILE, load_budgeted
from bdlora.models.integrity import check_loadable, check_model_folder, check_safetensors, weight_files
from bdlora.models.peft_compat import load_adapter
from bdlora.models.tokenizer import check_vocabulary


def load_run_student(run: RunDir | str | Path, device: str = "cpu"):
    """(model, tokenizer, summary) of a finished run, in its trained form."""

    run = run if isinstance(run, RunDir) else RunDir(run)
    if not run.finished():
        what = "has not finished (continue it with `bdlora train --resume`)" if run.started() else \
            "is not a finished bdlora run (needs config.json, summary.json and student/)"
        raise RunDirError(f"{run.path}: {what}")
    summary = run.summary()
    sdir = run.student_dir
    check_loadable(sdir)  # the dense student and the gated factors: whole files whose shapes match the config
    check_tensor_shapes(sdir)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(sdir), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(sdir))
    except Exception as e:  # noqa: BLE001  transformers raises many types for a damaged folder
        raise ModelError(f"{sdir}: could not load the student ({_first_line(e)})") from None
    check_vocabulary(sdir, len(tok), model.get_input_embeddings().num_embeddings)
    if (sdir / ADAPTER).exists():
        model = load_adapter(model, str(sdir / ADAPTER))
    elif (sdir / META_FILE).exists() or method_of(summary.get("method")).gated:
        if not (sdir / FACTORS_FILE).exists():
            raise RunDirError(f"{run.path}: a budgeted run without student/{FACTORS_FILE} (gated modules missing)")
        model = load_budgeted(sdir, model)
    return model.to(device).eval(), tok, summary


def load_model_folder(model_dir: str | Path):
    """(model, tokenizer, compression report or None) of any folder bdlora can load, in fp32 with eager attention
    (what is exported)."""

    folder, report = checked_folder(model_dir)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                           attn_implementation="eager", output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{folder}: could not load the model ({_first_line(e)})") from None
    check_weights_match(folder, model, info)
    check_finite(folder, model)
    return checked_model(folder, model, tok), tok, report


def checked_folder(model_dir: str | Path) -> tuple[Path, dict | None]:
    """(folder, compression report or None) of a model folder that passed every check made before a weight is read
    (a model folder, not a run's student/, whole files, declared shapes): what every model loader starts with, in
    memory or one layer at a time (``models.stream``)."""
    folder = ModelDir(model_dir)
    if not (folder.path / CONFIG).exists():
        raise ModelError(f"{folder.path}: not a model folder (no config.json); pass a `bdlora compress` output or a "
                         "Hugging Face model folder")
    if (folder.path / STUDENT_META).exists():  # its weights alone are not the model: the adapter or gated paths
        run = folder.path.resolve().parent  # complete them (a whitened start leaves only the residual here)
        raise ModelError(f"{folder.path}: a run's student/ folder (its weights without the trained adapter or gated "
                         f"paths); pass the run directory {run} or its `bdlora compress` output")
    report = folder.report() if folder.finished() else None
    check_model_folder(folder.path, report)
    check_tensor_shapes(folder.path)
    return folder.path, report


def checked_model(folder: Path, model, tok):
    """``model`` (eval mode) once its architecture and its tokenizer's vocabulary are what bdlora reads."""
    check_architecture(model, str(folder))
    check_vocabulary(folder, len(tok), model.get_input_embeddings().num_embeddings)
    return model.eval()


def all_finite(t: torch.Tensor) -> bool:
    """Every element finite: the sum first, a pass at memory speed (a sum is finite when every element is, short of
    an overflow, which the element-wise check then clears)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_finite(folder: Path, model) -> None:
    """Every weight finite: a NaN or an infinity loads, runs and times like any weight (bench --runtime ort wrote its
    timings and NaN perplexities; export genai's validation alone refused it)."""
    bad = [name for name, p in model.state_dict().items() if p.is_floating_point() and not all_finite(p)]
    if bad:
        raise ModelError(f"{folder}: {len(bad)} weight tensor(s) hold NaN or infinity ({', '.join(bad[:3])}); the "
                         "folder is damaged or its training diverged")


def check_weights_match(folder: Path, model, info: dict,
                        cause: str = "the folder is damaged or its config was edited") -> None:
    """Every weight the architecture declares must come from the file, with its shape: a projection whose declared
    form (dense or low-rank) disagrees with the weights would otherwise load randomly initialised. ``info``:
    transformers' loading info (missing, unexpected and mismatched keys); ``cause``: what the refusal says of it."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = [m[0] if isinstance(m, (tuple, list)) else m for m in info.get("mismatched_keys") or ()]
    problems = [f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for what, keys in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched)) if keys]
    if problems:
        raise ModelError(f"{folder}: the weights do not match config.json ({'; '.join(problems)}); {cause}")


def check_tensor_shapes(folder: Path) -> None:
    """Every tensor in the weight files has the shape the architecture builds from config.json (built on the meta
    device: nothing allocated), checked before transformers loads them: a pruned site whose declaration was lost, or
    a norm of the wrong length, otherwise failed as "You set `ignore_mismatched_sizes`... see the above report",
    naming no tensor."""
    try:
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  the folder checks ran first; this names whatever they did not foresee
        raise ModelError(f"{folder}: could not build the architecture config.json declares ({_first_line(e)})") \
            from None
    want = {k: tuple(v.shape) for k, v in built.state_dict().items()}
    for p in weight_files(Path(folder)):
        for name, shape in sorted(check_safetensors(p).items()):
            if name in want and want[name] != tuple(shape):
                raise ModelError(f"{folder}: tensor {name} is {list(shape)} in {p.name} but config.json declares "
                                 f"{list(want[name])}; the folder is damaged or its config was edited")


def _first_line(e: Exception) -> str:
    return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:200]
