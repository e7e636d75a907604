"""Model families ready to load, exact against transformers.

``fsdp_jax.models.from_pretrained(directory)`` reads a Hugging Face
``config.json`` and returns a :class:`CausalLM`: ``init_fn``, ``apply``,
``loss_fn`` (pure functions over parameters named as the checkpoint's
modules), ``weight_map`` (for :func:`fsdp_jax.pretrained.load` / ``save``),
``wrap_policy`` (one FSDP unit per decoder layer), ``tensor_parallel``
(Megatron's rules) and ``lora_targets``; ``apply`` and ``loss_fn`` take
packed rows (``segment_ids``, ``positions``). :func:`generate` continues a
batch of prompts of any lengths with a key/value cache, stopping at the
end-of-sequence tokens. Families: ``llama``, ``mistral``,
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
