"""bdlora: Budgeted LoRA distillation toolkit (see ../shared/SPEC.md for the contract)."""

__version__ = "0.1.0"

# Version of every JSON report and config bdlora writes; bump when a key changes meaning.
SCHEMA_VERSION = 1


def _register_architectures() -> None:
    # With bdlora imported, AutoConfig / AutoModelForCausalLM load the compressed architectures without remote code.
    from bdlora.export.hf import register

    register()


_register_architectures()
