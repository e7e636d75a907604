""":func:`generate`: prompt + new tokens from a :class:`CausalLM`, with a
key/value cache, as one jitted program (the prompt's forward pass, then a
``lax.scan`` of one-token steps), greedy or sampled with temperature and
top-p (transformers' ``TopPLogitsWarper``)."""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp

from fsdp_jax._src.models import checks, decoder
from fsdp_jax._src.models.families import CausalLM, cache_spec


def _top_p(logits, top_p):
  """transformers' top-p filter: sorted ascending, the tokens whose
  cumulative probability is at most ``1 - top_p`` removed (the most
  likely one always kept)."""
  order = jnp.argsort(logits, axis=-1)
  ranked = jnp.take_along_axis(logits, order, -1)
  cumulative = jnp.cumsum(jax.nn.softmax(ranked, -1), -1)
  remove = cumulative <= 1 - top_p
  remove = remove.at[..., -1].set(False)
  remove = jnp.zeros_like(remove).at[
      jnp.arange(logits.shape[0])[:, None], order].set(remove)
  return jnp.where(remove, -jnp.inf, logits)


def _pick(logits, key, temperature, top_p, sample: bool):
  logits = logits.astype(jnp.float32)
  if not sample:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  logits = _top_p(logits / temperature, top_p)
  return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def _recompute_at(b: CausalLM, prompt: int, max_new_tokens: int):
  """The decode step at which transformers' Phi-3 drops its cache and runs
  the whole sequence again: LongRoPE switches to its long factors when the
  sequence first reaches past ``original_max`` (``prepare_inputs_for_generation``),
  so the cached keys are rotated again with them. None where that does not
  happen within this generation."""
  ropes = [r for r in (b.config.rope or {}).values() if r.long_inv_freq is not None]
  if not ropes:
    return None
  k = ropes[0].original_max - prompt + 1  # the step that feeds position original_max
  return k if 1 <= k <= max_new_tokens - 1 else None


@functools.partial(jax.jit, static_argnames=("b", "max_new_tokens", "sample"))
def _run(b: CausalLM, params, input_ids, key, temperature, top_p, *, max_new_tokens: int,
         sample: bool):
  checks.check_params(b.config, b.scan, params, "generate")
  batch, prompt = input_ids.shape
  length = prompt + max_new_tokens
  spec = cache_spec(b, batch, length)
  dtype = jax.tree.leaves(params)[0].dtype
  fresh = lambda: (jnp.zeros(spec.shape, dtype), jnp.zeros(spec.shape, dtype))
  run = functools.partial(decoder.forward, b.config, params, scan=b.scan,
                          implementation=b.attn_implementation)
  keys = jax.random.split(key, max_new_tokens)
  seq = jnp.zeros((batch, length), jnp.int32).at[:, :prompt].set(input_ids)
  logits, cache = run(input_ids, cache=fresh(), start=0)
  seq = seq.at[:, prompt].set(_pick(logits[:, -1], keys[0], temperature, top_p, sample))

  def step(carry, k):
    seq, cache, pos = carry  # pos: the position of the token fed now
    token = jax.lax.dynamic_slice_in_dim(seq, pos, 1, axis=1)
    logits, cache = run(token, cache=cache, start=pos)
    new = _pick(logits[:, -1], k, temperature, top_p, sample)
    return (jax.lax.dynamic_update_slice_in_dim(seq, new[:, None], pos + 1, axis=1), cache,
            pos + 1), None

  again = _recompute_at(b, prompt, max_new_tokens)
  first, last = 1, max_new_tokens
  carry = (seq, cache, jnp.int32(prompt))
  if again is not None:
    carry, _ = jax.lax.scan(step, carry, keys[first:again])
    seq = carry[0]
    at = prompt + again - 1  # the whole sequence so far, cache dropped
    logits, cache = run(seq[:, :at + 1], cache=fresh(), start=0)
    seq = seq.at[:, at + 1].set(_pick(logits[:, -1], keys[again], temperature, top_p, sample))
    carry, first = (seq, cache, jnp.int32(at + 1)), again + 1
  carry, _ = jax.lax.scan(step, carry, keys[first:last])
  return carry[0]


def generate(b: CausalLM, params, input_ids, *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, rng=None):
  """``input_ids`` ``[B, P]`` followed by ``max_new_tokens`` new tokens:
  ``[B, P + max_new_tokens]``.

  A key/value cache of ``P + max_new_tokens`` positions; the prompt runs in
  one pass, then one token per step of a ``lax.scan``, all in one jitted
  program (compiled once per shape). LongRoPE models (Phi-3) run the whole
  sequence again when it first reaches past the original length, as
  transformers does, so the cached keys take the long factors. Greedy at ``temperature=0`` (the
  most likely token: transformers' ``generate(do_sample=False)``), else
  sampled from ``softmax(logits / temperature)`` restricted to the top-p
  nucleus, with ``rng``. Every sequence runs the whole length (no stop
  token); the prompts share one length.

  ``params`` may be in any sharding: ``summon_full_params(state)`` (the
  whole tree on each device), or a copy sharded over a mesh (e.g. by the
  family's tensor-parallel rules); ``jax.jit`` partitions the program
  accordingly.

  Example:
    >>> import json, os, tempfile, jax, jax.numpy as jnp
    >>> from fsdp_jax import models
    >>> d = tempfile.mkdtemp()
    >>> json.dump({"model_type": "mistral", "vocab_size": 64, "hidden_size": 16,
    ...            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...            "num_key_value_heads": 2, "sliding_window": 4},
    ...           open(os.path.join(d, "config.json"), "w"))
    >>> b = models.from_pretrained(d)
    >>> params = jax.jit(b.init_fn)(jax.random.key(0))
    >>> out = models.generate(b, params, jnp.array([[1, 2, 3]]), max_new_tokens=5)
    >>> out.shape, out[0, :3].tolist()
    ((1, 8), [1, 2, 3])
  """
  if not isinstance(b, CausalLM):
    raise TypeError(f"generate: the first argument is the model bundle "
                    f"(fsdp_jax.models.from_pretrained(...)), got {type(b).__name__}.")
  ids = jnp.asarray(input_ids)
  if ids.ndim == 1:
    ids = ids[None]
  checks.check_input_ids(b.config, ids, "generate")
  if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"generate: input_ids must be integer token ids [batch, length], got "
                     f"{ids.dtype} {list(ids.shape)}.")
  if int(max_new_tokens) < 1:
    raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be at least 1.")
  if not 0 < float(top_p) <= 1:
    raise ValueError(f"generate: top_p={top_p} must be in (0, 1].")
  if float(temperature) < 0:
    raise ValueError(f"generate: temperature={temperature} must be >= 0 (0: greedy).")
  length = ids.shape[1] + int(max_new_tokens)
  if b.config.rope is None and length > b.config.max_positions:
    raise ValueError(f"generate: {length} positions, past the model's "
                     f"{b.config.max_positions} learned position embeddings.")
  sample = float(temperature) > 0
  if sample and rng is None:
    raise ValueError("generate: sampling (temperature > 0) needs rng=jax.random.key(...).")
  key = rng if rng is not None else jax.random.key(0)
  return _run(b, params, ids.astype(jnp.int32), key, jnp.float32(max(temperature, 1e-6)),
              jnp.float32(top_p), max_new_tokens=int(max_new_tokens), sample=sample)

