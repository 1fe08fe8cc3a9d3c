"""Tiny, seeded fixtures: a synthetic corpus, a byte-level BPE tokenizer and a 4-layer Mistral-style teacher
(hidden 32, GQA 4/2) pretrained for a few seconds, all built in a temp dir (no network)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

# The models here are tiny (hidden 32-64): one intra-op thread per test process is as fast as two, and never
# oversubscribes the cores when another job (or another pytest-xdist worker) holds one. Measured: the session's
# teacher fixture took 99.7 s at torch's default threads beside another job, 4.8 s with one thread. Subprocesses
# (the end-to-end tests' console scripts) keep their defaults.
torch.set_num_threads(1)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # under pytest-xdist (the default: -n 2 in pyproject.toml) each worker has a core: the console scripts the
    # end-to-end tests launch inherit one thread too, instead of two per process on two cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _a_quiet_machine(monkeypatch):
    """What is timed beside another process, or whose repeats disagree, is marked unclean (cached so, and no refusal
    rests on it: ``latency.LoadWatch``, ``latency.agree``); the tests' own workers are such processes and a test
    machine is busy, so every test takes the machine as quiet and its repeats as agreeing, and a test's refusals
    do not depend on the load (test_latency tests the guards themselves by setting them back)."""
    from bdlora.base import load

    monkeypatch.setattr(load, "others_busy", lambda seconds=0.5: 0.0)
    monkeypatch.setattr(load, "others_since", lambda mark: 0.0)
    monkeypatch.setattr(load, "agree", lambda times: True)


def _has_optimum() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("optimum.onnxruntime") is not None
    except ModuleNotFoundError:
        return False


# The longest tests first in the collection, longest first, so pytest-xdist's loadgroup scheduler starts them at once
# on separate workers and the short ones fill in around them (a long test started last holds the run's end alone): the
# two of `pytest -m full` (the default teacher's build; SmolLM2 through the chain), then those of the default run
# that took 25 s or more on 2 busy cores.
LONGEST = ("test_builtin_teacher_and_student", "test_real_pretrained_teacher_preset_through_the_chain",
           "test_builtin_chain_on_a_short_teacher", "test_lm_eval_scores_the_served_student_and_its_hf_folder_alike",
           "test_console_chain_train_compress_export_bench_eval", "test_sigint_saves_a_checkpoint_and_resume_finishes",
           "test_bench_puts_the_student_and_its_teachers_exports_on_one_front",
           "test_sampled_speculative_output_is_distributed_as_the_target",
           "test_an_export_killed_half_way_leaves_nothing_that_looks_whole",
           "test_a_single_line_corpus_tokenises_in_bounded_memory",
           "test_ship_runs_every_step_then_resumes_without_redoing_any",
           "test_two_commands_writing_one_new_output_at_once_leave_one_whole_winner")


def _start_order(item) -> int:
    if item.originalname in LONGEST:
        return LONGEST.index(item.originalname)
    return len(LONGEST) + (0 if "slow" in item.keywords else 1)


# tests/test_serve.py's cases of the server's own layer (HTTP parsing, its refusals, its time limits, admission,
# authentication, serialisation, the load-test client): the same code in front of either engine, so the README's test
# command runs them on the onnxruntime engine and pytest -m full (CI runs it) on onnxruntime-genai's too; the
# engine's own cases (generation, batching, cancellation, shutdown, a dead engine) run on both in either
SERVER_LAYER = ("test_echo_with_logprobs_at_scale_is_whole_and_leaves_the_server_answering",
                "test_idle_and_trickling_clients_are_cut_off_and_never_block_others",
                "test_prompts_per_request_are_capped_and_admitted_as_one_decision",
                "test_oversize_prompts_are_refused_before_tokenising_and_never_stall_others",
                "test_api_key_guards_the_api_and_leaves_health_open",
                "test_malformed_requests_get_the_openai_error_shape_and_are_counted",
                "test_bad_input_gets_4xx_with_an_openai_error_body_and_the_server_keeps_serving",
                "test_hostile_sampling_fields_are_refused_and_the_engine_keeps_serving",
                "test_loadtest_command_against_the_server",
                "test_streaming_loadtest_reports_ttft_and_inter_token_latency")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """The longest tests, then the other end-to-end tests (``slow``), run first, so under pytest-xdist the longest
    ones start at once on their own workers while the other tests fill the rest (collected in file order, the
    builtin teacher's build started late and alone: 15.5 minutes). Tests marked ``optimum`` need the [optimum]
    extra (its own CI leg). Without it they skip, unless BDLORA_REQUIRE_OPTIMUM=1 (set by that leg): then they run,
    and a missing extra fails them. The server layer's cases on the genai engine are ``full`` (``SERVER_LAYER``)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname in SERVER_LAYER and params.get("served_model") == "genai":
            item.add_marker(pytest.mark.full)
    items.sort(key=_start_order)  # stable: the order within each kind is kept
    if _has_optimum():
        return
    if os.environ.get("BDLORA_REQUIRE_OPTIMUM") == "1":
        return  # the optimum leg: the tests run and fail loudly
    skip = pytest.mark.skip(reason='needs the [optimum] extra: pip install -e ".[optimum]"')
    for item in items:
        if "optimum" in item.keywords:
            item.add_marker(skip)


WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega red green blue cyan magenta yellow black white one two three four five six "
         "seven eight nine ten monday tuesday wednesday thursday friday saturday sunday").split()


def make_corpus(root, n_docs: int = 120, seed: int = 0):
    """Documents with learnable structure: counting sequences and repeated phrases."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = []
        for _ in range(rng.randint(8, 16)):
            start = rng.randrange(len(WORDS) - 6)
            lines.append(" ".join(WORDS[start : start + rng.randint(3, 6)]) + ".")
        (root / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return root


def tiny_config(vocab_size: int, layers: int = 4, hidden: int = 32, **kw):
    from transformers import MistralConfig

    base = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=None,
                tie_word_embeddings=False)
    base.update(kw)
    return MistralConfig(**base)


def genai_teacher(tok, folder=None, seed: int = 0, layers: int = 2):
    """A tiny Mistral (2 layers by default) with head dim 16 (what GroupQueryAttention, the genai graph's attention,
    takes), seeded; with ``folder``, saved there with ``tok`` as a teacher folder."""
    import torch
    from transformers import MistralForCausalLM

    torch.manual_seed(seed)
    teacher = MistralForCausalLM(tiny_config(len(tok), layers=layers, hidden=64, eos_token_id=tok.eos_token_id,
                                             bos_token_id=tok.bos_token_id)).eval()
    if folder is not None:
        teacher.save_pretrained(folder)
        tok.save_pretrained(folder)
    return teacher


def train_tokenizer(corpus_dir, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p.read_text() for p in sorted(corpus_dir.glob("*.txt"))), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def put_foreign_tokenizer(folder, corpus) -> None:
    """Replace ``folder``'s tokenizer by another trained on the same corpus with a smaller vocabulary (so every id it
    makes is valid for the model): it loads and runs, and maps text to other ids."""
    train_tokenizer(corpus, vocab_size=300).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_env(tmp_path_factory):
    from transformers import MistralForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    corpus = make_corpus(root / "corpus")
    tok = train_tokenizer(corpus)
    torch.manual_seed(0)
    model = MistralForCausalLM(tiny_config(len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))
    # a few seconds of pretraining so the teacher is better than chance and KD has something to transfer
    ids = tok("\n".join(p.read_text() for p in sorted(corpus.glob("*.txt"))))["input_ids"]
    data = torch.tensor(ids[: (len(ids) // 64) * 64]).view(-1, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        x = data[torch.randint(0, len(data), (16,), generator=g)]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    teacher_dir = root / "teacher"
    model.save_pretrained(teacher_dir)
    tok.save_pretrained(teacher_dir)
    return {"root": root, "corpus": corpus, "teacher": teacher_dir, "cache": root / "cache", "tokenizer": tok}


def pretrained(model, env, steps: int = 30, seq: int = 32):
    """``model`` after ``steps`` seeded AdamW steps on the tiny corpus (a few seconds): better than chance, so
    rounding its weights measurably costs perplexity."""
    tok = env["tokenizer"]
    ids = tok("\n".join(p.read_text() for p in sorted(env["corpus"].glob("*.txt"))))["input_ids"]
    data = torch.tensor(ids[: (len(ids) // seq) * seq]).view(-1, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (8,), generator=g)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture
def tiny_model(tiny_env):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32).eval()


def stop_at(step: int):
    """A reporter that interrupts a training run (KeyboardInterrupt, as Ctrl-C does) when it reports ``step``."""
    from bdlora.base.reporter import Reporter

    class StopAt(Reporter):
        def step(self, at, metrics):
            if at == step:
                raise KeyboardInterrupt

    return StopAt()


def assert_same_tensors(a, b, files) -> None:
    """Each of ``files`` (safetensors, relative to folders ``a`` and ``b``) holds the same tensors, bit for bit."""
    from safetensors.torch import load_file

    for f in files:
        x, y = load_file(a / f), load_file(b / f)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f


def train_args(env, out, *extra):
    """CLI arguments of a short, fast training run on the tiny fixtures."""
    return ["train", "--teacher", str(env["teacher"]), "--data", str(env["corpus"]), "--cache-dir",
            str(env["cache"]), "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "512",
            "--heldout-fraction", "0.1", "--lora-rank", "4", "--lora-alpha", "8", "--out", str(out),
            "--lr", "3e-3", "--no-measure-step-time", *extra]


def budgeted_student(model, d_values=None, seed=0, rank=4, alpha=8.0):
    """A copy of ``model`` with gated LoRA modules whose B factors are non-zero (so the low-rank path matters) and
    whose retentions cycle through ``d_values`` (module i gets d_values[i % len]); gates stay at their init."""
    import copy

    from bdlora.models.budgeted.model import apply_budgeted_lora, gated_modules

    s = copy.deepcopy(model)
    apply_budgeted_lora(s, rank=rank, alpha=alpha)
    torch.manual_seed(seed)
    for i, m in enumerate(gated_modules(s).values()):
        torch.nn.init.normal_(m.lora_B, std=0.05)
        if d_values is not None:
            m.set_retention(d_values[i % len(d_values)])
    return s


def compressed_student(model, d_values, seed=0, budget=0.4):
    """(trained gated student, compressed bdlora model, report) with SVD rank cap 8 for the tiny shapes."""
    from bdlora.models.budgeted.config import BudgetedConfig
    from bdlora.models.budgeted.model import compress_budgeted

    trained = budgeted_student(model, d_values, seed)
    compressed, report = compress_budgeted(trained, BudgetedConfig(svd_max_rank=8), {"budget": budget})
    return trained, compressed, report


# ------------------------------------------------------------------------------------------------------------------
# A real `bdlora serve` process on 127.0.0.1 (test_serve, test_lm_eval)
# ------------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, *args, env=None, own_group=False):
    """``bdlora serve FOLDER ARGS`` on a free port; returns (process, base URL) once /health answers 200.
    ``own_group``: in a new session, so a test can signal its whole process group as a terminal's Ctrl-C does."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bdlora.cli", "serve", str(folder), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=own_group)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    return proc, url


def wait_healthy(proc, url: str, timeout: float = 180) -> None:
    """Until ``url``/health answers 200; fails with the server's output if it exits first, kills it past
    ``timeout``."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become ready")


def allocate_with(shapes, energy: dict, ratio: float, step: int | None = None, cost=None, unit_name: str = "MAC",
                  sites: dict | None = None, lowrank: bool = True, layers: dict | None = None,
                  rest: dict | None = None, fixed: float = 0.0, wide: dict | None = None, kv_heads: int = 0,
                  head: tuple | None = None, vocab: list | None = None):
    """``compress.allocate.allocate`` of the numbers these tests give each form (their own units), offered as each
    form's module offers them (``forms.context.Choice`` by site): ``energy`` the spectra's (lowrank; ``lowrank``
    False: none), ``sites`` [(keep, cost, error)] per block (channels at an MLP, groups at an attention block),
    ``layers`` each layer's removal error, ``wide`` (8-bit time, error given back) per projection, ``head`` the LM
    head's (8-bit time, 4-bit time, error added) and ``vocab`` its [(tokens kept, 8-bit time, error)] (bits and
    vocab)."""
    from bdlora.compress.allocate import Pricing, allocate
    from bdlora.compress.forms.bits import NARROW_BITS
    from bdlora.compress.forms.bits import STEP as BITS
    from bdlora.compress.forms.layers import STEP as LAYERS
    from bdlora.compress.forms.lowrank import rank_choices
    from bdlora.compress.forms.vocab import STEP as VOCAB
    from bdlora.compress.pricing import RANK_STEP, mac_cost
    from bdlora.forms import CHANNELS, GROUPS, HEAD, WIDE_BITS
    from bdlora.forms.context import Choice

    cost = cost or mac_cost
    offers: dict = {}
    for s in shapes if lowrank else ():
        offers.setdefault(s.name, []).extend(rank_choices(s, energy[s.name], cost, step or RANK_STEP))
    for name, (eight, back) in (wide or {}).items():
        offers.setdefault(name, []).append(Choice(BITS.name, eight, -back, bits=WIDE_BITS))
    for site, options in (sites or {}).items():
        form = GROUPS.name if site.endswith(".self_attn") else CHANNELS.name
        offers[site] = [Choice(form, c, e, keep=k[0] if isinstance(k, tuple) else k) for k, c, e in options]
    for layer, error in (layers or {}).items():
        offers[layer] = [Choice(LAYERS.name, 0.0, error)]
    if head is not None:
        offers[HEAD] = [Choice(BITS.name, head[0], 0.0, bits=WIDE_BITS), Choice(BITS.name, head[1], head[2],
                                                                               bits=NARROW_BITS)]
    if vocab:
        offers.setdefault(HEAD, []).extend(Choice(VOCAB.name, c, e, keep=k) for k, c, e in vocab)
    return allocate(shapes, offers, ratio, Pricing(cost, unit_name, rest or {}, fixed), kv_heads)
