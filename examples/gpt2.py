"""GPT-2 in Flax linen that loads Hugging Face GPT-2 checkpoints.

The architecture of ``transformers.GPT2LMHeadModel``: token and learned
position embeddings, pre-LayerNorm blocks (fused query/key/value projection,
causal attention, a 4x MLP with the tanh approximation of GELU), a final
LayerNorm, and a head tied to the token embedding. GPT-2's ``Conv1D`` stores
its weights ``[in, out]`` already, so :func:`weight_map` needs no transpose,
and the tied head has no weight of its own.

    config = GPT2Config.from_pretrained("path/to/checkpoint")
    model = GPT2(config)
    source = fsdp_jax.pretrained.load("path/to/checkpoint", weight_map(config))
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from fsdp_jax import pretrained


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """The fields of a Hugging Face ``GPT2Config`` this model reads."""

  vocab_size: int = 50257
  n_positions: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  n_inner: int = 0  # 0: 4 * n_embd
  layer_norm_epsilon: float = 1e-5

  @classmethod
  def from_pretrained(cls, directory: str) -> "GPT2Config":
    with open(os.path.join(directory, "config.json")) as f:
      d = json.load(f)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in fields and v is not None})


class Block(nn.Module):
  config: GPT2Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, t, d = x.shape
    hd = d // c.n_head
    h = nn.LayerNorm(epsilon=c.layer_norm_epsilon, name="ln_1", dtype=x.dtype)(x)
    q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn", dtype=x.dtype)(h), 3, axis=-1)
    q, k, v = (y.reshape(b, t, c.n_head, hd) for y in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(hd, x.dtype))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    att = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
    x = x + nn.Dense(d, name="c_proj", dtype=x.dtype)(att)
    h = nn.LayerNorm(epsilon=c.layer_norm_epsilon, name="ln_2", dtype=x.dtype)(x)
    h = nn.gelu(nn.Dense(c.n_inner or 4 * d, name="c_fc", dtype=x.dtype)(h), approximate=True)
    return x + nn.Dense(d, name="mlp_proj", dtype=x.dtype)(h)


class GPT2(nn.Module):
  """``GPT2(config)(tokens) -> logits``, the head tied to the embedding."""

  config: GPT2Config

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    wte = nn.Embed(c.vocab_size, c.n_embd, name="wte")
    x = wte(tokens) + nn.Embed(c.n_positions, c.n_embd, name="wpe")(jnp.arange(tokens.shape[1]))
    for i in range(c.n_layer):
      x = Block(c, name=f"h_{i}")(x)
    x = nn.LayerNorm(epsilon=c.layer_norm_epsilon, name="ln_f", dtype=x.dtype)(x)
    return wte.attend(x)


def weight_map(config: GPT2Config, *, prefix: str = "transformer.") -> pretrained.WeightMap:
  """Hugging Face GPT-2 tensor names -> this model's parameters (no
  transposes: ``Conv1D`` weights are ``[in, out]``)."""
  del config
  h = prefix + "h.{i}"
  rules = [
      (prefix + "wte.weight", "wte.embedding"),
      (prefix + "wpe.weight", "wpe.embedding"),
      (prefix + "ln_f.weight", "ln_f.scale"),
      (prefix + "ln_f.bias", "ln_f.bias"),
      ("lm_head.weight", None),  # tied to wte
      (h + ".attn.bias", None),  # old checkpoints' causal-mask buffers
      (h + ".attn.masked_bias", None),
  ]
  for hf, ours in [("ln_1", "ln_1"), ("ln_2", "ln_2")]:
    rules += [(f"{h}.{hf}.weight", f"h_{{i}}.{ours}.scale"),
              (f"{h}.{hf}.bias", f"h_{{i}}.{ours}.bias")]
  for hf, ours in [("attn.c_attn", "c_attn"), ("attn.c_proj", "c_proj"), ("mlp.c_fc", "c_fc"),
                   ("mlp.c_proj", "mlp_proj")]:
    rules += [(f"{h}.{hf}.weight", f"h_{{i}}.{ours}.kernel"),
              (f"{h}.{hf}.bias", f"h_{{i}}.{ours}.bias")]
  return pretrained.WeightMap(rules)
