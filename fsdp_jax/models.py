"""Model families ready to load, exact against transformers.

``fsdp_jax.models.from_pretrained(directory)`` reads a Hugging Face
``config.json`` and returns a :class:`CausalLM`: ``init_fn``, ``apply``,
``loss_fn`` (pure functions over parameters named as the checkpoint's
modules), ``weight_map`` (for :func:`fsdp_jax.pretrained.load` / ``save``),
``wrap_policy`` (one FSDP unit per decoder layer), ``tensor_parallel``
(Megatron's rules) and ``lora_targets``. :func:`generate` continues
prompts with a key/value cache. Families: ``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``, ``gpt2``. See
docs/families.md.

Example:
  >>> from fsdp_jax import models
  >>> models.FAMILIES
  ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text', 'phi3', 'gpt2')
"""

from fsdp_jax._src.models import (
    FAMILIES as FAMILIES,
    CausalLM as CausalLM,
    ModelConfig as ModelConfig,
    from_pretrained as from_pretrained,
    generate as generate,
)

__all__ = ["FAMILIES", "CausalLM", "ModelConfig", "from_pretrained", "generate"]
