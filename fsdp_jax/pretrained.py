"""Pretrained checkpoints: Hugging Face safetensors (a file, or a directory
with or without ``model.safetensors.index.json``) and PyTorch state dicts in,
Hugging Face's safetensors layout out.

A :class:`WeightMap` names where each checkpoint tensor goes, with
invertible transforms (:func:`transpose`, :func:`rope_interleave`,
:func:`reshape`, or your own pair of functions), and fused tensors cut
(:func:`split`: one tensor into several parameters) or joined
(:func:`concat`). :func:`load` reads headers
only; ``fsdp_jax.init_train_state(init_fn=..., pretrained=load(...))`` reads
each device's shard as a slice of the file, so no host ever holds the whole
model. :func:`save` writes the parameters back, file by file, for
transformers, vLLM and PEFT (a LoRA state's merged). :func:`save_adapter`
and :func:`load_adapter` write and read a LoRA state's adapters in PEFT's
format. See docs/pretrained.md.

Example:
  >>> from fsdp_jax import pretrained
  >>> wm = pretrained.WeightMap([
  ...     ("model.layers.{i}.mlp.up_proj.weight", "layers_{i}.mlp.up.kernel",
  ...      pretrained.transpose()),
  ... ])
  >>> wm.rules[0].param_name({"i": 3})
  'layers_3.mlp.up.kernel'
"""

from fsdp_jax._src.pretrained import (
    PretrainedSource as PretrainedSource,
    Transform as Transform,
    WeightMap as WeightMap,
    concat as concat,
    load as load,
    load_adapter as load_adapter,
    reshape as reshape,
    rope_interleave as rope_interleave,
    save as save,
    save_adapter as save_adapter,
    split as split,
    transpose as transpose,
)

__all__ = ["PretrainedSource", "Transform", "WeightMap", "concat", "load", "load_adapter",
           "reshape", "rope_interleave", "save", "save_adapter", "split", "transpose"]
