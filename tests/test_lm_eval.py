"""lm-evaluation-harness against both forms of a compressed student: `lm_eval --model local-completions` through
`bdlora serve` (echo + logprobs), and `lm_eval --model hf` on the HF folder with trust_remote_code. A local
multiple-choice task over a jsonl file the test writes; nothing is downloaded."""

import json
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import WORDS, start_server

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval", reason="lm-eval is part of the [dev] extra")

TASK = """task: bdlora_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def student(tiny_env, tmp_path_factory):
    """A mixed dense/low-rank student of the tiny teacher: its HF folder and its ONNX export."""
    from bdlora.deployed.folder import save_model_folder
    from bdlora.export.onnx import export_onnx_folder
    from bdlora.models.load import load_model_folder
    from conftest import compressed_student

    teacher, _, _ = load_model_folder(tiny_env["teacher"])
    torch.manual_seed(0)
    _, model, report = compressed_student(teacher, [0.0, 1.0, 0.3, 0.9], seed=1)
    root = tmp_path_factory.mktemp("lmeval")
    folder = save_model_folder(model, tiny_env["tokenizer"], root / "student", report)
    export_onnx_folder(folder, root / "student.onnx", run_validation=False)
    return folder, root / "student.onnx"


def _task(tmp_path):
    rng = random.Random(0)
    docs = []
    for _ in range(24):  # continue a run of consecutive words: the teacher's corpus is made of them
        i = rng.randrange(len(WORDS) - 5)
        wrong = rng.sample([w for w in WORDS if w != WORDS[i + 3]], 2)
        choices = [f" {w}" for w in [WORDS[i + 3], *wrong]]
        order = rng.sample(range(3), 3)
        docs.append({"context": " ".join(WORDS[i : i + 3]), "choices": [choices[k] for k in order],
                     "answer": order.index(0)})
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "bdlora_local_mc.yaml").write_text(TASK.format(data=data))
    return tmp_path / "tasks"


def _lm_eval(tmp_path, name, *model_args):
    out = tmp_path / name
    exe = shutil.which("lm_eval") or str(__import__("pathlib").Path(sys.executable).parent / "lm_eval")
    res = subprocess.run([exe, *model_args, "--tasks", "bdlora_local_mc", "--include_path", str(tmp_path / "tasks"),
                          "--output_path", str(out), "--batch_size", "1", "--log_samples"], capture_output=True,
                         text=True,
                         timeout=600, env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1",
                                           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert res.returncode == 0, res.stderr[-4000:]
    (found,) = list(out.rglob("results_*.json"))
    (samples,) = list(out.rglob("samples_bdlora_local_mc_*.jsonl"))
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda d: d["doc_id"])
    # per document, per choice: (log-likelihood of the choice, whether it is the greedy continuation)
    logliks = [[(float(r[0][0]), r[0][1] in (True, "True")) for r in d["resps"]] for d in docs]
    return json.loads(found.read_text())["results"]["bdlora_local_mc"], logliks


@pytest.mark.full  # 48 s: lm-evaluation-harness against a served student (the server's logprobs are tested alone)
def test_lm_eval_scores_the_served_student_and_its_hf_folder_alike(student, tmp_path):
    folder, onnx_dir = student
    _task(tmp_path)
    hf, hf_ll = _lm_eval(tmp_path, "hf", "--model", "hf", "--model_args",
                  f"pretrained={folder},trust_remote_code=True,dtype=float32", "--device", "cpu")
    proc, url = start_server(onnx_dir)
    try:
        served, served_ll = _lm_eval(tmp_path, "served", "--model", "local-completions", "--model_args",
                          f"model={onnx_dir.name},base_url={url}/v1/completions,tokenizer={onnx_dir},"
                          "tokenized_requests=True,num_concurrent=1,max_retries=1")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert served["acc,none"] == hf["acc,none"] and served["acc_norm,none"] == hf["acc_norm,none"]
    assert len(hf_ll) == len(served_ll) == 24
    for a, b in zip(hf_ll, served_ll):  # the same log-likelihoods (torch fp32 vs onnxruntime fp32)
        assert [g for _, g in a] == [g for _, g in b]
        assert [ll for ll, _ in a] == pytest.approx([ll for ll, _ in b], abs=1e-3)
