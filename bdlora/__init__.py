"""bdlora: Budgeted LoRA distillation toolkit (the method of the paper "Budgeted LoRA"; usage in README.md, design in
docs/design.md, where "SPEC N" in the docstrings is section N of the contract).

Importing bdlora is cheap (standard library only), so code that never touches transformers (serving, the bench
worker, ONNX-side evaluation) never loads torch. ``import bdlora.deployed`` registers the compressed architectures
(``bdlora_mistral``, ``bdlora_llama``, ``bdlora_qwen2``) with transformers' Auto classes, after which
``AutoModelForCausalLM.from_pretrained(compressed_folder)`` works without remote code (every folder also carries
its modeling file for ``trust_remote_code=True`` where bdlora is not installed).
"""

__version__ = "0.1.0"

# Version of every JSON report and config bdlora writes; bump when a key changes meaning.
SCHEMA_VERSION = 1
