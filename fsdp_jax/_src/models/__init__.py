"""Model families ready to load: :func:`from_pretrained` reads a Hugging Face
``config.json`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3,
GPT-2) into a :class:`CausalLM` of pure functions with the checkpoint's
WeightMap, wrap policy, tensor-parallel rules and LoRA targets;
:func:`generate` samples from it. Modules: ``config`` (``config.json`` ->
the decoder's options), ``layers`` (norms, rotary, attention, MLPs),
``decoder`` (parameters and the forward pass), ``families`` (the bundle,
names, fused tensors, rules), ``generate``."""

from fsdp_jax._src.models.config import FAMILIES as FAMILIES
from fsdp_jax._src.models.config import ModelConfig as ModelConfig
from fsdp_jax._src.models.families import CausalLM as CausalLM
from fsdp_jax._src.models.families import from_pretrained as from_pretrained
from fsdp_jax._src.models.generate import generate as generate
