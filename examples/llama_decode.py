"""Sampling from ``examples/llama.py``'s Llama with a KV cache, in plain JAX.

The parameters are the model's own tree (what ``model.init`` returns), for
example from ``fsdp_jax.reshard_params``: replicated over the devices, or
split over a ``"tensor"`` axis, in which case ``jax.jit`` partitions every
step across the tensor group (GSPMD) and each device holds its share of the
weights and of the cache.

    params = fsdp_jax.reshard_params(state, mesh=fsdp_jax.make_mesh(tensor=8),
                                     tensor_parallel=TP_RULES, dtype=jnp.bfloat16)
    tokens = generate(params, config, prompt, max_new_tokens=32)           # greedy
    tokens = generate(params, config, prompt, max_new_tokens=32, temperature=0.8,
                      top_p=0.9, rng=jax.random.key(0))                     # sampled

The prompt is run once (the prefill), writing every layer's keys and values
into a cache of ``prompt + max_new_tokens`` positions; each new token then
runs one position through the model, attending over the cache. The
arithmetic is the model's own (the same rotary embedding, RMSNorm and
attention), so greedy decoding gives ``transformers``'
``generate(do_sample=False)`` on the same checkpoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import llama

# Megatron's split of a Llama over a "tensor" axis, in examples/llama.py's
# names: the query/key/value and gate/up projections by output (heads, MLP
# columns), the output and down projections by input, the head by
# vocabulary; norms and the embedding replicated.
TP_RULES = (("*.attn.q", "colwise"), ("*.attn.k", "colwise"), ("*.attn.v", "colwise"),
            ("*.attn.o", "rowwise"), ("*.mlp.gate", "colwise"), ("*.mlp.up", "colwise"),
            ("*.mlp.down", "rowwise"), ("lm_head", "colwise"))


def _rms(x, weight, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * y.astype(x.dtype)


def _layers(params, config: llama.LlamaConfig):
  """Each block's parameters (a stacked ``layers.block`` sliced per layer)."""
  if "layers" in params:
    stacked = params["layers"]["block"]
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(config.num_hidden_layers)]
  return [params[f"layers_{i}"] for i in range(config.num_hidden_layers)]


def _attend(p, x, cache_k, cache_v, start, config: llama.LlamaConfig):
  """Self-attention of ``x`` (positions ``start ...``) over the cache, into
  which the chunk's keys and values are written first."""
  c = config
  b, t, _ = x.shape
  nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.dim_per_head
  q = (x @ p["q"]["kernel"]).reshape(b, t, nh, hd)
  k = (x @ p["k"]["kernel"]).reshape(b, t, nkv, hd)
  v = (x @ p["v"]["kernel"]).reshape(b, t, nkv, hd)
  positions = start + jnp.arange(t)
  q, k = llama.rotary(q, positions, c.rope_theta), llama.rotary(k, positions, c.rope_theta)
  cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), start, axis=1)
  cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), start, axis=1)
  keys = jnp.repeat(cache_k, nh // nkv, axis=2)
  values = jnp.repeat(cache_v, nh // nkv, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys) / jnp.sqrt(jnp.asarray(hd, x.dtype))
  visible = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]  # [t, cache]
  scores = jnp.where(visible, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  w = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", w, values).reshape(b, t, nh * hd)
  return out @ p["o"]["kernel"], cache_k, cache_v


@functools.partial(jax.jit, static_argnames=("config",))
def forward(params, tokens, cache, start, *, config: llama.LlamaConfig):
  """Runs ``tokens`` ``[batch, t]`` at positions ``start ... start + t - 1``:
  ``(logits of the last position [batch, vocab], the updated cache)``.
  ``cache``: ``(keys, values)``, each ``[layers, batch, length, kv heads,
  head dim]``."""
  c = config
  p = params["params"] if "params" in params else params
  x = p["embed"]["embedding"][tokens]
  keys, values = cache
  new_k, new_v = [], []
  for i, layer in enumerate(_layers(p, c)):
    a, k, v = _attend(layer["attn"], _rms(x, layer["input_norm"]["weight"], c.rms_norm_eps),
                      keys[i], values[i], start, c)
    x = x + a
    h = _rms(x, layer["post_norm"]["weight"], c.rms_norm_eps)
    m = layer["mlp"]
    x = x + (jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
    new_k.append(k)
    new_v.append(v)
  x = _rms(x[:, -1], p["norm"]["weight"], c.rms_norm_eps)
  logits = x @ (p["embed"]["embedding"].T if c.tie_word_embeddings else p["lm_head"]["kernel"])
  return logits, (jnp.stack(new_k), jnp.stack(new_v))


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample_token(logits, rng, *, temperature: float = 0.0, top_p: float = 1.0):
  """The next token of each row: the most likely (``temperature=0``: greedy),
  or drawn from ``softmax(logits / temperature)`` restricted to the smallest
  set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the tokens before it have not reached top_p yet.
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(params, config: llama.LlamaConfig, prompt, *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, rng=None):
  """``prompt`` ``[batch, length]`` (int) followed by ``max_new_tokens``
  generated tokens: ``[batch, length + max_new_tokens]`` (numpy)."""
  prompt = jnp.asarray(prompt, jnp.int32)
  b, t = prompt.shape
  if temperature > 0.0 and rng is None:
    raise ValueError("sampling with temperature > 0 needs rng=jax.random.key(seed)")
  p = params["params"] if "params" in params else params
  dtype = p["embed"]["embedding"].dtype
  shape = (config.num_hidden_layers, b, t + max_new_tokens, config.num_key_value_heads,
           config.dim_per_head)
  cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
  out = [np.asarray(prompt)]
  logits, cache = forward(params, prompt, cache, 0, config=config)  # the prefill
  for i in range(max_new_tokens):
    key = None if rng is None else jax.random.fold_in(rng, i)
    token = sample_token(logits, key, temperature=temperature, top_p=top_p)
    out.append(np.asarray(token)[:, None])
    if i + 1 < max_new_tokens:
      logits, cache = forward(params, token[:, None], cache, t + i, config=config)
  return np.concatenate(out, axis=1)
