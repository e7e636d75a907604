"""The benchmark model: a GPT-style decoder in Flax linen.

Pre-LayerNorm transformer blocks (causal multi-head self-attention + 4x GELU
MLP), token and position embeddings, a final LayerNorm and an untied LM head.
``benchmarks/torch_fsdp.py`` builds the same architecture in PyTorch
(same parameter shapes and count) for the PyTorch FSDP baseline.

The default size (``GPTConfig()``): d_model 512, 8 layers, 8 heads, vocab
256, context 64 -> 25.5M parameters; each ``Block`` (3.15M parameters,
12.6 MB in fp32) is one FSDP unit, the root unit holds the embeddings, the
final LayerNorm and the LM head.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import GPTConfig, make_batch  # noqa: F401 (re-exported)


class CausalSelfAttention(nn.Module):
  num_heads: int

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    hd = d // self.num_heads
    qkv = nn.Dense(3 * d, name="qkv", dtype=x.dtype)(x)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.num_heads, hd), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d)
    return nn.Dense(d, name="proj", dtype=x.dtype)(out)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.gelu(nn.Dense(4 * d, name="fc", dtype=x.dtype)(x))
    return nn.Dense(d, name="proj", dtype=x.dtype)(h)


class Block(nn.Module):
  num_heads: int

  @nn.compact
  def __call__(self, x):
    x = x + CausalSelfAttention(self.num_heads, name="attn")(
        nn.LayerNorm(name="ln_1", dtype=x.dtype)(x))
    return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2", dtype=x.dtype)(x))


class GPT(nn.Module):
  """``constrain``, when given, is applied to the residual stream after the
  embeddings and after every block (e.g. a ``with_sharding_constraint``
  that keeps activations batch-sharded under ``jax.jit``); it does not
  change the parameters or the math."""

  cfg: GPTConfig
  constrain: Optional[Callable] = None
  remat: bool = False  # nn.remat on every block

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    t = tokens.shape[1]
    fix = self.constrain or (lambda x: x)
    block = nn.remat(Block) if self.remat else Block
    tok = nn.Embed(c.vocab_size, c.d_model, name="tok_embed")
    pos = nn.Embed(c.seq_len, c.d_model, name="pos_embed")
    x = fix(tok(tokens) + pos(jnp.arange(t)))
    for i in range(c.num_layers):
      x = fix(block(c.num_heads, name=f"block_{i}")(x))
    x = nn.LayerNorm(name="ln_f", dtype=x.dtype)(x)
    return nn.Dense(c.vocab_size, name="lm_head", dtype=x.dtype)(x)


class _ScanBlock(nn.Module):
  """``Block`` as a scan body: ``(carry, _) -> (carry, None)``."""

  num_heads: int

  @nn.compact
  def __call__(self, x, _):
    return Block(self.num_heads, name="block")(x), None


class ScanGPT(nn.Module):
  """The same GPT with its blocks stacked and run by ``nn.scan``: every block
  leaf gets a leading layer axis under ``params.blocks`` (declare it with
  ``FSDPConfig(stacked_layers=("params.blocks",))``; fsdp_jax then gathers
  one layer per scan iteration)."""

  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    t = tokens.shape[1]
    x = nn.Embed(c.vocab_size, c.d_model, name="tok_embed")(tokens)
    x = x + nn.Embed(c.seq_len, c.d_model, name="pos_embed")(jnp.arange(t))
    blocks = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=c.num_layers)(c.num_heads, name="blocks")
    x, _ = blocks(x, None)
    x = nn.LayerNorm(name="ln_f", dtype=x.dtype)(x)
    return nn.Dense(c.vocab_size, name="lm_head", dtype=x.dtype)(x)


def make_model(cfg: GPTConfig, scan: bool = False, constrain: Optional[Callable] = None,
               remat: bool = False):
  """Returns ``(model, init_fn, loss_fn)``; ``scan=True`` gives
  :class:`ScanGPT` (same architecture and parameter count, stacked blocks);
  ``constrain`` and ``remat`` are passed to :class:`GPT`.

  ``init_fn(rng)`` gives the linen variables ``{"params": ...}`` (fp32);
  ``loss_fn(params, batch)`` is the mean next-token cross entropy over the
  batch it is given, computed in fp32 whatever the parameter dtype.
  """
  model = ScanGPT(cfg) if scan else GPT(cfg, constrain=constrain, remat=remat)
  dummy = np.zeros((1, cfg.seq_len), np.int32)

  def init_fn(rng):
    return model.init(rng, dummy)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

  return model, init_fn, loss_fn


def count_params(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
