"""A Llama decoder in Flax linen that loads Hugging Face Llama checkpoints.

The architecture of ``transformers.LlamaForCausalLM``: token embedding,
pre-RMSNorm blocks of grouped-query self-attention with rotary position
embeddings and a SwiGLU MLP, a final RMSNorm and an untied (or tied) head.
The rotary embedding rotates adjacent pairs ``(x[2k], x[2k+1])`` (Meta's
layout); Hugging Face stores the query and key projections in its half-split
layout, so :func:`weight_map` reorders them with
``fsdp_jax.pretrained.rope_interleave``. Kernels are ``[in, out]``; PyTorch's
``[out, in]`` weights are transposed on the way in and out.

    config = LlamaConfig.from_pretrained("path/to/checkpoint")   # its config.json
    model = Llama(config)                       # or Llama(config, scan=True): stacked layers
    source = fsdp_jax.pretrained.load("path/to/checkpoint", weight_map(config))
    state = fsdp_jax.init_train_state(
        init_fn=lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32)), rng=key,
        optimizer=opt, mesh=mesh, config=fsdp_jax.FSDPConfig(...), pretrained=source)

``examples/finetune.py`` fine-tunes such a model (any ``fsdp_jax.models``
family) and saves it back for transformers.
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
class LlamaConfig:
  """The fields of a Hugging Face ``LlamaConfig`` this model reads."""

  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int = 32
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  tie_word_embeddings: bool = False
  head_dim: int = 0  # 0: hidden_size // num_attention_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @classmethod
  def from_dict(cls, d: dict) -> "LlamaConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields and v is not None}
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "rope_theta" not in kw and isinstance(rope, dict) and "rope_theta" in rope:
      kw["rope_theta"] = rope["rope_theta"]
    if isinstance(rope, dict) and rope.get("rope_type", "default") not in ("default", None):
      raise ValueError(f"rope type {rope.get('rope_type')!r} is not implemented here.")
    return cls(**kw)

  @classmethod
  def from_pretrained(cls, directory: str) -> "LlamaConfig":
    """Reads ``config.json`` of a Hugging Face checkpoint directory."""
    with open(os.path.join(directory, "config.json")) as f:
      return cls.from_dict(json.load(f))


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return weight * y.astype(x.dtype)


def rotary(x, positions, theta: float):
  """Rotates adjacent pairs of the last axis of ``x`` ``[batch, seq, heads,
  head_dim]`` by ``positions * theta ** (-2k / head_dim)``."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [seq, d/2]
  cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
  sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
  pairs = x.reshape(x.shape[:-1] + (d // 2, 2))
  x0, x1 = pairs[..., 0], pairs[..., 1]
  return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)


class Attention(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, t, _ = x.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.dim_per_head
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name, dtype=x.dtype)
    q = dense(nh * hd, "q")(x).reshape(b, t, nh, hd)
    k = dense(nkv * hd, "k")(x).reshape(b, t, nkv, hd)
    v = dense(nkv * hd, "v")(x).reshape(b, t, nkv, hd)
    positions = jnp.arange(t)
    q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
    k = jnp.repeat(k, nh // nkv, axis=2)  # key/value head j serves query heads j*r..j*r+r-1
    v = jnp.repeat(v, nh // nkv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(hd, x.dtype))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, nh * hd)
    return dense(c.hidden_size, "o")(out)


class MLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name, dtype=x.dtype)
    return dense(c.hidden_size, "down")(
        nn.silu(dense(c.intermediate_size, "gate")(x)) * dense(c.intermediate_size, "up")(x))


class Block(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = x + Attention(c, name="attn")(RMSNorm(c.rms_norm_eps, name="input_norm")(x))
    return x + MLP(c, name="mlp")(RMSNorm(c.rms_norm_eps, name="post_norm")(x))


class _ScanBlock(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, _):
    return Block(self.config, name="block")(x), None


class Llama(nn.Module):
  """``Llama(config)(tokens) -> logits``; ``scan=True`` runs the blocks with
  ``nn.scan`` (parameters stacked under ``layers``: declare
  ``FSDPConfig(stacked_layers=("params.layers",))``)."""

  config: LlamaConfig
  scan: bool = False

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden_size, name="embed")
    x = embed(tokens)
    if self.scan:
      layers = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=c.num_hidden_layers)(c, name="layers")
      x, _ = layers(x, None)
    else:
      for i in range(c.num_hidden_layers):
        x = Block(c, name=f"layers_{i}")(x)
    x = RMSNorm(c.rms_norm_eps, name="norm")(x)
    if c.tie_word_embeddings:
      return embed.attend(x)
    return nn.Dense(c.vocab_size, use_bias=False, name="lm_head", dtype=x.dtype)(x)


def weight_map(config: LlamaConfig, *, scan: bool = False) -> pretrained.WeightMap:
  """Hugging Face Llama tensor names -> this model's parameters."""
  t = pretrained.transpose()
  layer = "layers.block" if scan else "layers_{i}"
  hf = "model.layers.{i}"
  rules = [
      ("model.embed_tokens.weight", "embed.embedding"),
      (f"{hf}.self_attn.q_proj.weight", f"{layer}.attn.q.kernel", t,
       pretrained.rope_interleave(config.num_attention_heads)),
      (f"{hf}.self_attn.k_proj.weight", f"{layer}.attn.k.kernel", t,
       pretrained.rope_interleave(config.num_key_value_heads)),
      (f"{hf}.self_attn.v_proj.weight", f"{layer}.attn.v.kernel", t),
      (f"{hf}.self_attn.o_proj.weight", f"{layer}.attn.o.kernel", t),
      (f"{hf}.mlp.gate_proj.weight", f"{layer}.mlp.gate.kernel", t),
      (f"{hf}.mlp.up_proj.weight", f"{layer}.mlp.up.kernel", t),
      (f"{hf}.mlp.down_proj.weight", f"{layer}.mlp.down.kernel", t),
      (f"{hf}.input_layernorm.weight", f"{layer}.input_norm.weight"),
      (f"{hf}.post_attention_layernorm.weight", f"{layer}.post_norm.weight"),
      ("model.norm.weight", "norm.weight"),
      ("model.rotary_emb.inv_freq", None),  # recomputed, never trained
      ("model.layers.{i}.self_attn.rotary_emb.inv_freq", None),
  ]
  if not config.tie_word_embeddings:
    rules.append(("lm_head.weight", "lm_head.kernel", t))
  else:
    rules.append(("lm_head.weight", None))  # the embedding, tied
  return pretrained.WeightMap(rules)
