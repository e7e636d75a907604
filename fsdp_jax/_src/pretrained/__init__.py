"""Pretrained weights in and out: Hugging Face safetensors and PyTorch state
dicts loaded straight into shards (:func:`load`, then
``init_train_state(pretrained=...)``), and parameters saved back in Hugging
Face's layout (:func:`save`), through a :class:`WeightMap` of names and
invertible transforms. Modules: ``weight_map`` (rules and transforms),
``files`` (reading and writing the formats), ``loading``, ``saving``, ``peft``
(LoRA adapters in PEFT's format: :func:`save_adapter`, :func:`load_adapter`)."""

from fsdp_jax._src.pretrained.loading import PretrainedSource as PretrainedSource
from fsdp_jax._src.pretrained.loading import load as load
from fsdp_jax._src.pretrained.peft import load_adapter as load_adapter
from fsdp_jax._src.pretrained.peft import save_adapter as save_adapter
from fsdp_jax._src.pretrained.saving import save as save
from fsdp_jax._src.pretrained.weight_map import (
    Transform as Transform,
    WeightMap as WeightMap,
    concat as concat,
    reshape as reshape,
    rope_interleave as rope_interleave,
    split as split,
    transpose as transpose,
)
