"""Every bad input of `bdlora train`: one clear line naming the value and what is allowed, exit code 2, no
traceback, and no run directory left behind."""

import pytest
from typer.testing import CliRunner

from bdlora.cli import app
from conftest import train_args


def _run(args):
    return CliRunner().invoke(app, args)


def _assert_usage_error(res, needle, out):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    text = res.stderr.strip()  # progress lines go to stdout; the error is one line on stderr
    assert needle in text, text
    assert len(text.splitlines()) == 1, text
    assert not out.exists()


@pytest.mark.parametrize("extra,needle", [
    (["--method", "kd-magic"], "--method 'kd-magic': unknown (allowed: kd-full, kd-lora, budgeted)"),
    (["--layer-selection", "random"], "--layer-selection 'random': unknown (allowed: first, middle, last, mixed"),
    (["--student-layers", "0"], "--student-layers 0: must be a positive integer"),
    (["--student-layers", "5"], "--student-layers 5: must be between 1 and the teacher's 4"),
    (["--seq-len", "256"], "--seq-len 256: above the model's max_position_embeddings (128)"),
    (["--max-steps", "0"], "--max-steps 0: must be a positive integer"),
    (["--max-steps", "-3"], "--max-steps -3: must be a positive integer"),
    (["--batch-size", "0"], "--batch-size 0: must be a positive integer"),
    (["--budget", "1.5"], "--budget 1.5: must be in [0, 1]"),
    (["--decay-start", "0.5", "--decay-end", "0.2"], "--decay-start 0.5 > --decay-end 0.2"),
    (["--lora-rank", "0"], "--lora-rank 0: must be a positive integer"),
    (["--lora-alpha", "0"], "--lora-alpha 0.0: must be > 0"),
    (["--retention-ema", "1"], "--retention-ema 1.0: must be in [0, 1)"),
    (["--device", "tpu"], "--device 'tpu': unknown (allowed: auto, cpu, cuda)"),
    (["--nproc", "0"], "--nproc 0: must be a positive integer"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be >= 0"),
    (["--weight-decay", "-1"], "--weight-decay -1.0: must be >= 0"),
    (["--seq-len", "1"], "--seq-len 1: must be >= 2"),
    (["--lora-rank", "100000"], "--lora-rank 100000: above this model's largest useful rank 16"),
])
def test_bad_options(tiny_env, tmp_path, extra, needle):
    out = tmp_path / "run"
    _assert_usage_error(_run([*train_args(tiny_env, out), *extra]), needle, out)


def _args_with(env, out, **swap):
    args = train_args(env, out)
    for flag, value in swap.items():
        args[args.index(flag) + 1] = value
    return args


def test_missing_teacher(tiny_env, tmp_path):
    out = tmp_path / "run"
    res = _run(_args_with(tiny_env, out, **{"--teacher": str(tmp_path / "nope")}))
    _assert_usage_error(res, "--teacher", out)
    assert "no such directory" in res.output


def test_corrupt_teacher(tiny_env, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    out = tmp_path / "run"
    _assert_usage_error(_run(_args_with(tiny_env, out, **{"--teacher": str(bad)})), "config.json: not valid JSON",
                        out)


def test_teacher_without_projections(tiny_env, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=len(tiny_env["tokenizer"]))
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tiny_env["tokenizer"].save_pretrained(d)
    out = tmp_path / "run"
    _assert_usage_error(_run(_args_with(tiny_env, out, **{"--teacher": str(d)})), "not a family bdlora adapts", out)


def test_mismatched_vocabularies(tiny_env, tmp_path):
    from transformers import MistralForCausalLM

    from conftest import tiny_config, train_tokenizer

    tok = train_tokenizer(tiny_env["corpus"], vocab_size=300)
    d = tmp_path / "other"
    MistralForCausalLM(tiny_config(len(tok))).save_pretrained(d)
    tok.save_pretrained(d)
    out = tmp_path / "run"
    _assert_usage_error(_run([*train_args(tiny_env, out), "--student-init", str(d)]), "vocabulary differs", out)


def test_empty_corpus(tiny_env, tmp_path):
    c = tmp_path / "empty"
    c.mkdir()
    (c / "a.txt").write_text("   \n")
    out = tmp_path / "run"
    _assert_usage_error(_run(_args_with(tiny_env, out, **{"--data": str(c)})), "the corpus is empty", out)


def test_corpus_shorter_than_one_block(tiny_env, tmp_path):
    c = tmp_path / "short"
    c.mkdir()
    (c / "a.txt").write_text("alpha beta")
    out = tmp_path / "run"
    _assert_usage_error(_run(_args_with(tiny_env, out, **{"--data": str(c), "--heldout-fraction": "0.5"})),
                        "fewer than one block", out)


def test_missing_corpus(tiny_env, tmp_path):
    out = tmp_path / "run"
    _assert_usage_error(_run(_args_with(tiny_env, out, **{"--data": str(tmp_path / "nope")})), "--data", out)


def test_resume_of_a_non_run(tmp_path):
    (tmp_path / "x").mkdir()
    res = _run(["train", "--resume", str(tmp_path / "x")])
    assert res.exit_code == 2 and "not a bdlora run directory" in res.output
    res = _run(["train", "--resume", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such run directory" in res.output


def test_existing_out_is_not_overwritten(tiny_env, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = _run(train_args(tiny_env, out) + ["--max-steps", "1"])
    assert res.exit_code == 2 and "exists and is not empty" in res.output
    assert (out / "keep.txt").read_text() == "mine"


def test_bad_yaml(tiny_env, tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("not_an_option: 3\n")
    res = _run([*train_args(tiny_env, tmp_path / "run"), "--config", str(y)])
    assert res.exit_code == 2 and "unknown option(s) not_an_option" in res.output


def test_lora_rank_is_bounded_by_the_model(tiny_env, tmp_path):
    """The tiny teacher's narrowest projections are k/v (hidden 32 -> 2 KV heads x head_dim 8 = 16)."""
    from bdlora.models.arch import max_lora_rank
    from bdlora.models.load import load_model_folder

    model, _, _ = load_model_folder(tiny_env["teacher"])
    assert max_lora_rank(model.config) == (16, "k_proj/v_proj")
    res = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--lora-rank", "100000"))
    assert res.exit_code == 2 and "--lora-rank 100000: above this model's largest useful rank 16" in res.stderr
    assert not (tmp_path / "r").exists()
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tiny_env["teacher"]), "--lora-rank", "99999999999"])
    assert res.exit_code == 2 and "largest useful rank 16" in res.stderr
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tiny_env["teacher"]), "--lora-rank", "16", "--json"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("yaml_text,needle", [
    ('budget: "0.4"\n', "budget"),  # a string where a number belongs: the same type checks as the flag
    ("batch_size: true\n", "batch_size"),
    ("grad_clip: .nan\n", "grad"),
])
def test_yaml_values_get_the_flags_checks(tiny_env, tmp_path, yaml_text, needle):
    y = tmp_path / "c.yaml"
    y.write_text(yaml_text)
    out = tmp_path / "run"
    _assert_usage_error(_run([*train_args(tiny_env, out), "--config", str(y)]), needle, out)


@pytest.mark.parametrize("make_out,needle", [
    (lambda t: "/proc/x", "--out /proc/x: cannot create it (/proc is not a writable folder)"),
    (lambda t: str(t / "afile" / "sub"), "afile is not a writable folder"),
    (lambda t: str(t / "afile"), "is a file, not a folder"),
])
def test_unusable_out_is_one_line_before_any_work(tiny_env, tmp_path, make_out, needle):
    (tmp_path / "afile").write_text("mine")
    out = make_out(tmp_path)
    res = _run([*train_args(tiny_env, tmp_path / "unused"), "--out", out])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert (tmp_path / "afile").read_text() == "mine"


def test_the_paper_recipe_ships_with_the_package(monkeypatch):
    """--config paper: the paper's budget, not the first-run defaults (2^14 tokens per device and step, 2.55B tokens
    in all over its two devices, a 10M-token validation set, rank 128 / alpha 256)."""
    from bdlora.train.config import TrainConfig, merge
    from bdlora.train.option_files import load_yaml

    values = load_yaml("paper")
    cfg = merge(values, {}).validate()
    assert isinstance(cfg, TrainConfig)
    assert cfg.batch_size * cfg.seq_len == 2 ** 14 and cfg.tokens == 2_550_000_000 and cfg.eval_tokens == 10_000_000
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lr, cfg.weight_decay) == (128, 256.0, 3e-4, 0.0)
    assert (cfg.lora_init, cfg.allocation) == ("zero", "cost")  # the paper's init and removal order, for fidelity
    from types import SimpleNamespace

    from transformers import MistralConfig

    from bdlora.train.session import _resolve_sizes

    teacher = SimpleNamespace(config=MistralConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                                                   intermediate_size=1024, num_hidden_layers=2,
                                                   max_position_embeddings=2048))
    monkeypatch.setenv("WORLD_SIZE", "2")  # the paper's two devices: --tokens is a global budget
    assert _resolve_sizes(cfg, teacher).max_steps == 2_550_000_000 // (16 * 1024 * 2) == 77_819
    res = CliRunner().invoke(app, ["train", "--config", "nonesuch"])
    assert res.exit_code == 2 and "a recipe shipped with bdlora: paper" in res.stderr


def _common_options() -> dict[str, dict[str, tuple]]:
    """--flag -> {command: (help, default, is_flag)} over every command of the app."""
    import typer.main

    from bdlora.cli.app import app as typer_app

    seen: dict[str, dict[str, tuple]] = {}

    def walk(cmd, path):
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])
        for p in [] if getattr(cmd, "commands", None) else cmd.params:
            if type(p).__name__ == "TyperOption":
                for flag in p.opts:
                    seen.setdefault(flag, {})[" ".join(path)] = (p.help, p.default, p.is_flag)

    walk(typer.main.get_command(typer_app), [])
    return seen


# Options declared once (bdlora.cli.options.COMMON) and composed into every command: one wording, one default (None
# where a settings dataclass's field is the option: the field's default then applies, and the wording names it).
DECLARED_ONCE = ("--runs-dir", "--force", "--json", "--report", "--out", "--precision", "--quant", "--threads",
                 "--forms")
# Other options that two commands give different help or defaults, each for its own meaning there (--max-tokens is a
# generation's length in generate, a request's limit in serve, a request's ask in loadtest; --teacher is a model in
# train, a switch in bench): the count may only fall, so an option a second command copies gets the first's wording
# or a reason here. --max-ppl-change: export genai's bounds a rounded graph against the fp32 graph, export gguf's a
# llama.cpp file of any type against PyTorch. --gguf: the GGUF type in both, ship's also "none" (no llama.cpp rows)
# and its rows timed beside genai's, plan's the type its --runtime llamacpp prediction is timed at.
DIFFERING = 45


def test_an_option_many_commands_take_reads_the_same_in_each():
    seen = _common_options()
    for flag in DECLARED_ONCE:
        commands = seen[flag]
        assert len(commands) >= 3, (flag, sorted(commands))
        assert len({h for h, _, _ in commands.values()}) == 1, (flag, commands)
        assert len({d for _, d, _ in commands.values() if d is not None}) <= 1, (flag, commands)
        assert len({f for _, _, f in commands.values()}) == 1, (flag, commands)  # a switch everywhere, or a value
    differing = sorted(f for f, commands in seen.items() if len(commands) > 1 and (
        len({h for h, _, _ in commands.values()}) > 1
        or len({repr(d) for _, d, _ in commands.values() if d is not None}) > 1))
    assert not set(differing) & set(DECLARED_ONCE)
    assert len(differing) <= DIFFERING, differing


def test_a_common_option_has_one_declaration():
    """The common options' help lives in cli/options.COMMON: no command declares one of their flags by hand."""
    import re
    from pathlib import Path

    from bdlora.cli import options

    for path in sorted(Path(options.__file__).parent.glob("*.py")):
        if path.name != "options.py":
            hand = re.findall(r'typer\.Option\("(--(?:json|report|out|precision|quant|threads|forms|runs-dir|force))"',
                              path.read_text())
            assert not hand, (path.name, hand)


@pytest.mark.parametrize("argv,text", [
    (["export", "gguf", "--help"], "[llamacpp]"), (["export", "onnx", "--help"], "[optimum]"),
    (["bench", "--help"], "[llamacpp]"), (["plan", "--help"], "[llamacpp]"), (["compress", "--help"], "[llamacpp]"),
])
def test_help_keeps_bracketed_words(argv, text):
    """Help is written as plain text: typer reads it as rich markup, where "the [llamacpp] extra" lost its name."""
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    assert r.exit_code == 0 and text in r.output, r.output


def test_train_refuses_a_bad_option_before_it_imports_the_training_stack():
    """`bdlora train --method nope` imported the training loop (torch, every model family: 6 s) before checking its
    options; it is refused first, in a process that never imports the loop."""
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from bdlora.cli import app; "
            "r = CliRunner().invoke(app, ['train', '--method', 'nope', '--lr', '-1']); "
            "print(r.exit_code, 'bdlora.train.loop' in sys.modules, r.output.count('--lr -1'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.stdout.split() == ["2", "False", "1"], res.stdout + res.stderr
