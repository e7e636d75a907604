""":func:`generate`: prompts + new tokens from a :class:`CausalLM`, with a
key/value cache, as one jitted program (the prompts' forward pass, then a
``lax.while_loop`` of one-token steps), greedy or sampled with temperature
and top-p (transformers' ``TopPLogitsWarper``), stopping at the
end-of-sequence tokens. A batch of prompts of different lengths runs
left-padded (padding as segment 0: its keys masked, positions counted from
each row's first token), compiled once per bucket of lengths."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src.models import checks, decoder
from fsdp_jax._src.models.families import CausalLM, cache_spec


def bucket(n: int) -> int:
  """The static length ``n`` is padded to: the next power of two (at least
  8) up to 256, then the next multiple of 256."""
  if n <= 256:
    return max(8, 1 << (int(n) - 1).bit_length())
  return -(-int(n) // 256) * 256


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


def _longrope(b: CausalLM):
  """LongRoPE's original length where the model has one (Phi-3), else None."""
  ropes = [r for r in (b.config.rope or {}).values() if r.long_inv_freq is not None]
  return ropes[0].original_max if ropes else None


def _is_eos(tokens, eos):
  return jnp.any(tokens[:, None] == eos[None, :], -1)


@functools.partial(jax.jit, static_argnames=("b", "new_bucket", "sample"))
def _run(b: CausalLM, params, ids, mask, key, temperature, top_p, max_new, eos, pad, width, *,
         new_bucket: int, sample: bool):
  """``ids`` / ``mask`` ``[B, P]`` left-padded to the prompt bucket; the
  sequence ``[B, P + new_bucket]`` and the number of tokens made."""
  checks.check_params(b.config, b.scan, params, "generate")
  batch, prompt = ids.shape
  length = prompt + new_bucket
  spec = cache_spec(b, batch, length)
  dtype = jax.tree.leaves(params)[0].dtype
  fresh = lambda: (jnp.zeros(spec.shape, dtype), jnp.zeros(spec.shape, dtype))
  # Every slot's segment (0: padding) and position, counted from each row's
  # first token (transformers: cumsum(attention_mask) - 1, padding at 0).
  seg = jnp.concatenate([mask, jnp.ones((batch, new_bucket), jnp.int32)], 1)
  pos = jnp.where(seg > 0, jnp.cumsum(seg, 1) - 1, 0)
  run = functools.partial(decoder.forward, b.config, params, scan=b.scan,
                          implementation=b.attn_implementation, kv_segment_ids=seg)
  keys = jax.random.split(key, new_bucket)
  seq = jnp.concatenate([ids, jnp.full((batch, new_bucket), pad, jnp.int32)], 1)
  logits, cache = run(ids, cache=fresh(), start=0, segment_ids=mask, positions=pos[:, :prompt])
  first = _pick(logits[:, -1], keys[0], temperature, top_p, sample)
  seq = seq.at[:, prompt].set(first)
  live = ~_is_eos(first, eos)

  def one(seq, cache, slot):  # the token at slot, fed to the cache
    token = jax.lax.dynamic_slice_in_dim(seq, slot, 1, axis=1)
    logits, cache = run(token, cache=cache, start=slot, segment_ids=jnp.ones_like(token),
                        positions=jax.lax.dynamic_slice_in_dim(pos, slot, 1, axis=1))
    return logits[:, -1], cache

  def again(seq, cache, slot):  # the whole sequence so far, the cache dropped
    upto = jnp.arange(length)[None, :] <= slot  # later slots: causally masked
    logits, cache = run(seq, cache=fresh(), start=0, segment_ids=seg,
                        positions=jnp.where(upto, pos, 0))
    return jax.lax.dynamic_index_in_dim(logits, slot, axis=1, keepdims=False), cache

  original = _longrope(b)
  # transformers' Phi-3 drops its cache and runs the whole sequence again
  # when the (padded) sequence first reaches past original_max
  # (prepare_inputs_for_generation), so the cached keys take LongRoPE's long
  # factors: at the step that makes token number original_max + 1 - width.
  redo = None if original is None else original + 1 - width

  def body(carry):
    seq, cache, i, live = carry  # i tokens made; the last at slot prompt + i - 1
    slot = prompt + i - 1
    if redo is None:
      logits, cache = one(seq, cache, slot)
    else:
      logits, cache = jax.lax.cond(i == redo, again, one, seq, cache, slot)
    new = _pick(logits, keys[i], temperature, top_p, sample)
    new = jnp.where(live, new, pad)  # a finished row emits padding
    live = live & ~_is_eos(new, eos)
    seq = jax.lax.dynamic_update_slice_in_dim(seq, new[:, None], slot + 1, axis=1)
    return seq, cache, i + 1, live

  cond = lambda carry: (carry[2] < max_new) & jnp.any(carry[3])
  seq, _, made, _ = jax.lax.while_loop(cond, body, (seq, cache, jnp.int32(1), live))
  return seq, made


def _token_ids(value, name: str) -> list:
  if value is None:
    return []
  values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
  if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
    raise ValueError(f"generate: {name}={value!r}: pass a token id (an int) or a list of them.")
  return [int(v) for v in values]


def special_tokens(b: CausalLM, eos_token_id=None, pad_token_id=None) -> tuple:
  """``(eos ids, pad id or None)``: the arguments, else
  ``generation_config.json``'s, else ``config.json``'s; the pad id defaults
  to the first end-of-sequence id (as transformers' ``generate``)."""
  gen, raw = b.generation_config or {}, b.config.raw or {}

  def read(name, given):
    if given is not None:
      return given
    return gen[name] if gen.get(name) is not None else raw.get(name)

  eos = _token_ids(read("eos_token_id", eos_token_id), "eos_token_id")
  pad = _token_ids(read("pad_token_id", pad_token_id), "pad_token_id")
  pad = pad[0] if pad else (eos[0] if eos else None)
  return eos, pad


def _prompts(input_ids, attention_mask, pad: int) -> tuple:
  """``(ids, mask)`` ``[B, width]`` numpy, left-padded, checked."""
  ragged = (isinstance(input_ids, (list, tuple)) and len(input_ids) > 0
            and not isinstance(input_ids[0], (int, np.integer)))
  if ragged:
    if attention_mask is not None:
      raise ValueError("generate: pass either a list of prompts (of any lengths) or input_ids "
                       "[batch, length] with its attention_mask, not both.")
    rows = [np.asarray(r) for r in input_ids]
    for i, r in enumerate(rows):
      if r.ndim != 1 or r.size == 0 or not np.issubdtype(r.dtype, np.integer):
        raise ValueError(f"generate: prompt {i} is {r.dtype} {list(r.shape)}: each prompt is a "
                         "non-empty sequence of integer token ids.")
    width = max(r.size for r in rows)
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
      ids[i, width - r.size:] = r
      mask[i, width - r.size:] = 1
    return ids, mask
  ids = np.asarray(input_ids)
  if ids.ndim == 1:
    ids = ids[None]
  if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"generate: input_ids must be integer token ids [batch, length], got "
                     f"{ids.dtype} {list(ids.shape)}.")
  if attention_mask is None:
    return ids.astype(np.int32), np.ones(ids.shape, np.int32)
  mask = np.asarray(attention_mask)
  if mask.ndim == 1:
    mask = mask[None]
  if mask.shape != ids.shape:
    raise ValueError(f"generate: attention_mask has shape {list(mask.shape)} where input_ids has "
                     f"{list(ids.shape)}: pass one 0/1 mask entry per token (or a list of "
                     "prompts of any lengths instead).")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("generate: attention_mask holds values other than 0 and 1.")
  empty = np.flatnonzero(mask.sum(1) == 0)
  if empty.size:
    raise ValueError(f"generate: row {int(empty[0])} of attention_mask is all padding: every "
                     "prompt needs at least one token (drop the empty rows).")
  right = np.flatnonzero((np.diff(mask, axis=1) < 0).any(1))
  if right.size:
    raise ValueError(f"generate: row {int(right[0])} of attention_mask is right-padded (or has "
                     "a gap): decoder-only generation pads on the left (a tokenizer's "
                     "padding_side='left'), or pass the prompts as a list of sequences.")
  return ids.astype(np.int32), mask.astype(np.int32)


def generate(b: CausalLM, params, input_ids, *, max_new_tokens: int,
             attention_mask=None, eos_token_id=None, pad_token_id=None,
             temperature: float = 0.0, top_p: float = 1.0, rng=None):
  """Prompts followed by up to ``max_new_tokens`` new tokens:
  ``[B, width + n]``, ``n <= max_new_tokens``, as transformers'
  ``generate`` returns them.

  Prompts: ``input_ids`` ``[B, width]`` (one length, or left-padded with
  its ``attention_mask``: 0 on the padding, as a tokenizer with
  ``padding_side="left"`` makes it), or a list of sequences of token ids of
  any lengths (left-padded here with the pad token). Padding is masked out
  of attention at every step and positions count from each row's first
  token (transformers' ``cumsum(attention_mask) - 1``); the output keeps
  the prompt as padded.

  Stopping: at the end-of-sequence tokens (``eos_token_id``: an int or a
  list; default ``generation_config.json``'s, else ``config.json``'s; none:
  run to ``max_new_tokens``). A row that has finished emits the pad token
  (``pad_token_id``, default the same files' ``pad_token_id``, else the
  first end-of-sequence id); the loop stops when every row has finished
  (``n`` is then the last row's length), as transformers does.

  One jitted program: a key/value cache, the prompts' pass, then one token
  per step of a ``lax.while_loop``. Compiled once per batch size, prompt
  bucket and new-token bucket: the width and ``max_new_tokens`` are padded
  up to the next power of two (at least 8) up to 256, then to the next
  multiple of 256 (the extra prompt slots are padding, the extra new ones
  never run). LongRoPE models (Phi-3) run the whole sequence again when it
  first reaches past the original length, as transformers does, so the
  cached keys take the long factors. Greedy at ``temperature=0`` (the most
  likely token: transformers' ``generate(do_sample=False)``), else sampled
  from ``softmax(logits / temperature)`` restricted to the top-p nucleus,
  with ``rng``.

  ``params`` may be in any sharding: ``summon_full_params(state)`` (the
  whole tree on each device), or a copy sharded over a mesh (e.g. by the
  family's tensor-parallel rules); ``jax.jit`` partitions the program
  accordingly.

  Raises:
    ValueError: an ``attention_mask`` of another shape than ``input_ids``,
      a row of it all padding or padded on the right; a list of prompts
      with a mask; ``max_new_tokens < 1``; ``top_p`` outside ``(0, 1]``;
      sampling without ``rng``; more positions than GPT-2's learned ones.

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
    >>> out = models.generate(b, params, [[1, 2, 3], [4, 5]], max_new_tokens=5,
    ...                       eos_token_id=0, pad_token_id=0)
    >>> out[1, :3].tolist()  # the shorter prompt, left-padded
    [0, 4, 5]
  """
  if not isinstance(b, CausalLM):
    raise TypeError(f"generate: the first argument is the model bundle "
                    f"(fsdp_jax.models.from_pretrained(...)), got {type(b).__name__}.")
  if int(max_new_tokens) < 1:
    raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be at least 1.")
  if not 0 < float(top_p) <= 1:
    raise ValueError(f"generate: top_p={top_p} must be in (0, 1].")
  if float(temperature) < 0:
    raise ValueError(f"generate: temperature={temperature} must be >= 0 (0: greedy).")
  eos, pad = special_tokens(b, eos_token_id, pad_token_id)
  ids, mask = _prompts(input_ids, attention_mask, 0 if pad is None else pad)
  checks.check_input_ids(b.config, ids, "generate")
  longest = int(mask.sum(1).max()) + int(max_new_tokens)
  if b.config.rope is None and longest > b.config.max_positions:
    raise ValueError(f"generate: {longest} positions, past the model's "
                     f"{b.config.max_positions} learned position embeddings.")
  sample = float(temperature) > 0
  if sample and rng is None:
    raise ValueError("generate: sampling (temperature > 0) needs rng=jax.random.key(...).")
  key = rng if rng is not None else jax.random.key(0)
  batch, width = ids.shape
  prompt = bucket(width)
  padded_ids = np.full((batch, prompt), 0 if pad is None else pad, np.int32)
  padded_ids[:, prompt - width:] = ids
  padded_mask = np.zeros((batch, prompt), np.int32)
  padded_mask[:, prompt - width:] = mask
  seq, made = _run(b, params, padded_ids, padded_mask, key, jnp.float32(max(temperature, 1e-6)),
                   jnp.float32(top_p), jnp.int32(max_new_tokens),
                   jnp.asarray(eos + [-1] * (-len(eos) % 4 or (0 if eos else 4)), jnp.int32),
                   jnp.int32(0 if pad is None else pad), jnp.int32(width),
                   new_bucket=bucket(int(max_new_tokens)), sample=sample)
  return seq[:, prompt - width:prompt + int(made)]
