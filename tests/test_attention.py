"""fsdp_jax.attention: the blockwise kernel against a plain reference.

* outputs and gradients (q, k, v) equal the reference (einsum, mask,
  float32 softmax) to float32 rounding, for causal and bidirectional
  attention, grouped-query heads, segment ids, windows (static and traced),
  soft-capping and explicit positions (shuffled, as a context-parallel
  chunk holds them), with block sizes that divide neither length; bfloat16
  to 2e-3;
* fully hidden key blocks are skipped (the count of visited blocks);
* ``jax.grad`` at 8,192 tokens compiles to temporaries far below the
  plain path's ``[T, T]`` scores (abstract shapes, nothing allocated);
* :func:`attention.match` finds the call and its options in a jaxpr;
* the model families run the kernel (loss, gradients, cached generation),
  and tensor parallelism runs it on each device's heads or, where the
  tensor axis splits a key/value head, whole on gathered operands;
* bad input is refused with a message naming the fix.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import attention as A
from fsdp_jax._src import collectives
from fsdp_jax._src.planner import programs
from fsdp_jax._src.schedule import checkpoints


def _reference(q, k, v, *, q_pos, k_pos, q_seg=None, k_seg=None, causal=True, window=None,
               cap=None, scale=None):
  """The plain computation, every score at once."""
  b, t, n, h = q.shape
  kv = k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kv, n // kv, h), k,
                 preferred_element_type=jnp.float32) * scale
  if cap is not None:
    s = jnp.tanh(s / cap) * cap
  d = q_pos[:, :, None] - k_pos[:, None, :]
  m = jnp.ones(d.shape, bool)
  if causal:
    m = m & (d >= 0)
  if window is not None:
    m = m & (d < window) & (True if causal else (-d < window))
  if q_seg is not None:
    m = m & (q_seg[:, :, None] == k_seg[:, None, :])
  p = jax.nn.softmax(jnp.where(m[:, None, None], s, -1e30), -1).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h).astype(q.dtype)


def _inputs(tq=37, tk=37, heads=4, kv=2, dtype=jnp.float32, seed=0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(2, tq, heads, 8)), dtype)
  k = jnp.asarray(r.normal(size=(2, tk, kv, 8)), dtype)
  v = jnp.asarray(r.normal(size=(2, tk, kv, 8)), dtype)
  return q, k, v


def _docs(t, seed=1):
  """Two rows of packed documents (1, 2, ...) ending in padding (0)."""
  r = np.random.default_rng(seed)
  rows = []
  for _ in range(2):
    cuts = np.sort(r.choice(np.arange(1, t - 3), 3, replace=False))
    row = np.zeros(t, np.int32)
    for i, (a, b) in enumerate(zip((0, *cuts[:-1]), cuts)):
      row[a:b] = i + 1
    rows.append(row)
  return jnp.asarray(np.stack(rows))


def _with_grads(fn):
  """Jitted: the output and the q/k/v gradients of ``sum(sin(output))``."""
  def run(*args):
    out, pull = jax.vjp(fn, *args)
    return out, pull(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))
  return jax.jit(run)


def _compare(fn, ref, args, tol):
  """Outputs and q/k/v gradients of a non-linear function of them; the
  output's largest error."""
  (out, grads), (want, wants) = _with_grads(fn)(*args), _with_grads(ref)(*args)
  assert out.dtype == want.dtype
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
  assert err <= tol, err
  for name, g, w in zip("qkv", grads, wants):
    g, w = g.astype(jnp.float32), w.astype(jnp.float32)
    rel = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(1.0, jnp.max(jnp.abs(w))))
    assert rel <= tol, (name, rel)
  return err


CASES = [  # causal, window, soft cap, segments, grouped (heads, kv heads)
    dict(causal=True, window=None, cap=None, seg=False, heads=(4, 2)),
    dict(causal=True, window=6, cap=None, seg=True, heads=(4, 1)),
    dict(causal=True, window=None, cap=2.5, seg=True, heads=(2, 2)),
    dict(causal=True, window=9, cap=2.5, seg=False, heads=(4, 2)),
    dict(causal=False, window=None, cap=None, seg=True, heads=(4, 2)),
    dict(causal=False, window=7, cap=3.0, seg=False, heads=(6, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_blockwise_equals_reference_float32(case):
  t = 37
  q, k, v = _inputs(t, t, *case["heads"])
  seg = _docs(t) if case["seg"] else None
  pos = jnp.broadcast_to(jnp.arange(t), (2, t))
  opts = dict(causal=case["causal"], window=case["window"])

  def fn(q, k, v):  # blocks of 8 queries and 5 keys: neither divides 37
    return A.attend_local(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, soft_cap=case["cap"],
                          block_q=8, block_k=5, **opts)

  def ref(q, k, v):
    return _reference(q, k, v, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg, cap=case["cap"],
                      **opts)

  _compare(fn, ref, (q, k, v), 1e-6)
  # The public function: the plain path (one block), then the kernel.
  pub = dict(segment_ids=seg, soft_cap=case["cap"], **opts)
  _compare(lambda *a: fsdp_jax.attention(*a, **pub), ref, (q, k, v), 1e-6)


def test_positions_and_cross_lengths():
  """Shuffled query positions against keys of another length (a device's
  load-balanced chunk against all keys), a pair of segment ids, a traced
  window, a scale; and the decoding shape: one query against a cache."""
  tq, tk = 19, 43
  q, k, v = _inputs(tq, tk, 4, 2)
  r = np.random.default_rng(3)
  q_pos = jnp.asarray(np.stack([r.permutation(tk)[:tq] for _ in range(2)]), jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(tk), (2, tk))
  k_seg = _docs(tk)
  q_seg = jnp.take_along_axis(k_seg, q_pos, 1)
  w = jnp.int32(11)
  ref = lambda q, k, v: _reference(q, k, v, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg,
                                   window=11, scale=0.3)
  fn = lambda q, k, v: A.attend_local(q, k, v, q_positions=q_pos, kv_positions=k_pos[0],
                                      q_segment_ids=q_seg, kv_segment_ids=k_seg, window=w,
                                      scale=0.3, block_q=4, block_k=8)
  _compare(jax.jit(fn), ref, (q, k, v), 1e-6)
  pub = lambda q, k, v: fsdp_jax.attention(q, k, v, segment_ids=(q_seg, k_seg), window=w,
                                           scale=0.3, q_positions=q_pos, kv_positions=k_pos)
  _compare(pub, ref, (q, k, v), 1e-6)
  # One new token at slot 30 of a 43-slot cache.
  q1 = q[:, :1]
  at = jnp.full((2, 1), 30, jnp.int32)
  one = A.attend_local(q1, k, v, q_positions=at, kv_positions=k_pos, block_k=8)
  np.testing.assert_allclose(one, _reference(q1, k, v, q_pos=at, k_pos=k_pos), atol=1e-6)


def test_bfloat16():
  t = 37
  q, k, v = _inputs(t, t, 4, 2, jnp.bfloat16)
  seg = _docs(t)
  pos = jnp.broadcast_to(jnp.arange(t), (2, t))
  fn = lambda q, k, v: A.attend_local(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, window=9,
                                      soft_cap=3.0, block_q=8, block_k=5)
  ref = lambda q, k, v: _reference(q, k, v, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg,
                                   window=9, cap=3.0)
  f32 = lambda x: x.astype(jnp.float32)
  exact = lambda q, k, v: _reference(f32(q), f32(k), f32(v), q_pos=pos, k_pos=pos, q_seg=seg,
                                     k_seg=seg, window=9, cap=3.0)
  # Both against float32 math on the same bfloat16 inputs: the kernel no
  # further from it than the plain bfloat16 computation, and within 2e-3.
  assert _compare(fn, lambda *a: exact(*a).astype(jnp.bfloat16), (q, k, v), 2e-2) <= 2e-2
  out = fn(q, k, v).astype(jnp.float32)
  err = float(jnp.max(jnp.abs(out - exact(q, k, v))))
  plain = float(jnp.max(jnp.abs(ref(q, k, v).astype(jnp.float32) - exact(q, k, v))))
  assert err <= max(2e-3, plain), (err, plain)


def test_hidden_blocks_are_skipped(monkeypatch):
  """Causal: 4 query blocks of 8 visit 4 + 3 + 2 + 1 key blocks of 8; a
  window of 8 visits at most 2 a row; disjoint documents only their own."""
  visited = []
  real = A._scores

  def counting(spec, q, k):
    jax.debug.callback(lambda: visited.append(1))
    return real(spec, q, k)

  monkeypatch.setattr(A, "_scores", counting)
  q, k, v = _inputs(32, 32, 2, 1)

  def run(**kw):
    visited.clear()
    A.attend_local(q, k, v, block_q=8, block_k=8, **kw).block_until_ready()
    return len(visited)

  assert run(causal=False) == 16
  assert run() == 10
  assert run(window=8) == 7
  seg = jnp.asarray(np.repeat([[1] * 16 + [2] * 16], 2, 0))
  assert run(causal=False, q_segment_ids=seg, kv_segment_ids=seg) == 8


def test_grad_memory_is_linear():
  """``jax.grad`` at 8,192 tokens (4 heads): the compiled temporaries
  against the plain path's (whose scores alone are 4 * T * T * 4 bytes)."""
  t = 8192
  q = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)

  def temp(block):
    f = lambda q, k, v: jnp.sum(A.attend_local(q, k, v, block_q=block, block_k=block))
    g = jax.jit(jax.grad(f, (0, 1, 2)))
    return g.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

  blocked, plain = temp(512), temp(t)  # one block of the whole sequence: the plain path
  scores = 4 * t * t * 4
  print(f"grad temporaries at T={t}: blockwise {blocked / 2**20:.1f} MiB, plain "
        f"{plain / 2**20:.1f} MiB, the scores {scores / 2**20:.0f} MiB")
  assert plain >= scores
  assert blocked < plain / 8 and blocked < scores / 8


def test_a_short_query_chunk_takes_smaller_blocks():
  """A device's chunk under ``context=8`` (512 of 4,096 tokens) against the
  gathered keys: by default its query blocks are a quarter of it, so the
  backward's block temporaries (``[1, 8 heads, block_q, 512]`` float32
  scores, probabilities and cotangents) are a quarter of one 512-row
  block's: 7.3 against 25.5 MiB of temporaries (jax 0.10.2 CPU), the same
  gradients."""
  q = jax.random.normal(jax.random.key(0), (1, 512, 8, 32))
  k, v = jax.random.normal(jax.random.key(1), (2, 1, 4096, 2, 32))
  qpos = jnp.arange(3584, 4096)  # the last chunk: it sees every key block

  def grad(block):
    f = lambda q, k, v: jnp.sum(A.attend_local(q, k, v, q_positions=qpos, block_q=block) ** 2)
    return jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v).compile()

  default, whole = grad(None), grad(512)
  temp = [c.memory_analysis().temp_size_in_bytes for c in (default, whole)]
  print(f"grad temporaries: default blocks {temp[0] / 2**20:.1f} MiB, 512 rows "
        f"{temp[1] / 2**20:.1f} MiB")
  assert temp[0] < temp[1] / 2
  for a, b in zip(default(q, k, v), whole(q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_grad_memory_is_linear_under_scan():
  """Calls inside a ``lax.scan`` (scanned layers): the mask's positions are
  loop-invariant there, and without their tie to the operands JAX's
  partial evaluation of the scan hoisted each block pair's mask and
  ``jnp.where`` fill values out of the loop, stacked over every (query
  block, key block) pair: ``[T, T]`` arrays (at 2,048 tokens, 4 heads:
  227 MiB of temporaries against 23 MiB)."""
  t = 2048
  q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)

  def f(x):
    body = lambda h, _: (A.attend_local(h, h[:, :, :2], h[:, :, 2:]), None)
    return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])

  temp = jax.jit(jax.grad(f)).lower(q).compile().memory_analysis().temp_size_in_bytes
  scores = 4 * t * t * 4
  print(f"grad temporaries of 2 scanned calls at T={t}: {temp / 2**20:.1f} MiB")
  assert temp < scores / 2



@pytest.mark.parametrize("policy", ["units", "dots", "dots_saveable"])
def test_grad_memory_under_the_units_remat_policy(policy):
  """Under a ``jax.checkpoint`` with a rematerialisation policy (fsdp_jax's
  unit policy, what a FULL_SHARD unit rematerialises with;
  ``ActivationCheckpointing(policy="dots")``'s; a user's ``dots_saveable``)
  the forward's loops keep nothing per (query block, key block) pair: the
  kernel's forward saves its output and logsumexp only (at 4,096 tokens,
  4 heads, jax 0.10.2 CPU: 19-21 MiB of temporaries under each; with the
  forward's loops as scans JAX saved ``f32[8, 8, ...]`` arrays: the
  carries under the unit policy, 44 MiB, and every pair's scores and
  ``p @ v`` under ``dots_saveable``, 319 MiB)."""
  t = 4096
  q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
  pol = {"units": collectives.remat_policy,
         "dots": checkpoints.checkpoint_policy(fsdp_jax.ActivationCheckpointing("dots")),
         "dots_saveable": jax.checkpoint_policies.dots_saveable}[policy]

  def f(x):
    g = jax.checkpoint(lambda h: A.attend_local(h, h[:, :, :2], h[:, :, 2:]) * 2.0, policy=pol)
    return jnp.sum(g(x))

  compiled = jax.jit(jax.grad(f)).lower(q).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  scores = 4 * t * t * 4
  print(f"grad temporaries under {policy} at T={t}: {temp / 2**20:.1f} MiB")
  assert "f32[8,8," not in compiled.as_text()
  assert temp < scores / 4


def test_match_finds_the_call():
  q, k, v = _inputs(9, 9, 4, 2)
  seg = jnp.ones((2, 9), jnp.int32)

  def loss(q, k, v, seg, w):
    scaled = q * np.float32(2.0)  # a constant in the jaxpr
    return jnp.sum(fsdp_jax.attention(scaled, k, v, segment_ids=seg, window=w, soft_cap=5.0,
                                      q_positions=jnp.arange(9)))

  jaxpr = jax.make_jaxpr(loss)(q, k, v, seg, jnp.int32(3)).jaxpr
  calls = [(e, A.match(e)) for e in jaxpr.eqns if A.match(e) is not None]
  assert len(calls) == 1
  eqn, call = calls[0]
  shapes = {n: eqn.invars[getattr(call, n)].aval.shape
            for n in ("q", "k", "v", "q_positions", "q_segment_ids", "kv_segment_ids",
                      "window_operand")}
  assert shapes == {"q": (2, 9, 4, 8), "k": (2, 9, 2, 8), "v": (2, 9, 2, 8),
                    "q_positions": (1, 9), "q_segment_ids": (2, 9), "kv_segment_ids": (2, 9),
                    "window_operand": ()}
  assert call.kv_positions is None and call.window is None
  assert (call.causal, call.soft_cap, call.scale, call.implementation) == (
      True, 5.0, 8 ** -0.5, None)
  assert eqn.invars[call.k] is jaxpr.invars[1] and eqn.invars[call.v] is jaxpr.invars[2]
  # Re-running the call from the match gives the call's numbers.
  ops = call.operands([jnp.asarray(x) for x in (q * 2, k, v, jnp.arange(9)[None], seg, seg,
                                                 jnp.int32(3))])
  again = A.attend_local(ops.pop("q"), ops.pop("k"), ops.pop("v"), **ops, **call.options())
  direct = fsdp_jax.attention(q * 2, k, v, segment_ids=seg, window=3, soft_cap=5.0)
  np.testing.assert_allclose(again, direct, atol=1e-6)
  plain = jax.make_jaxpr(lambda q: jnp.sum(jnp.tanh(q)))(q).jaxpr
  assert all(A.match(e) is None for e in plain.eqns)



@pytest.mark.parametrize("block", [None, 4], ids=["plain", "blocked"])
def test_a_row_that_sees_nothing_gives_zeros(block):
  """A query whose segment has no key: zeros and zero gradients, no NaN;
  the other rows as the reference."""
  q, k, v = _inputs(6, 9, 2, 1)
  q_seg = jnp.asarray([[1, 1, 3, 2, 2, 2]] * 2)
  k_seg = jnp.asarray([[1] * 4 + [2] * 5] * 2)
  fn = lambda q, k, v: A.attend_local(q, k, v, q_segment_ids=q_seg, kv_segment_ids=k_seg,
                                      causal=False, block_q=block, block_k=block)
  (out, grads) = _with_grads(fn)(q, k, v)
  assert bool(jnp.all(out[:, 2] == 0)) and bool(jnp.all(grads[0][:, 2] == 0))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  want = _reference(q, k, v, q_pos=pos[:, :6], k_pos=pos, q_seg=q_seg, k_seg=k_seg, causal=False)
  keep = np.asarray([0, 1, 3, 4, 5])
  np.testing.assert_allclose(out[:, keep], want[:, keep], atol=1e-6)

def test_errors():
  q, k, v = _inputs(6, 6, 3, 2)
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    fsdp_jax.attention(q, k, v)
  q, k, v = _inputs(6, 5, 4, 2)
  with pytest.raises(ValueError, match=r"segment_ids=\(q_segment_ids, kv_segment_ids\)"):
    fsdp_jax.attention(q, k, v, segment_ids=jnp.ones((2, 6), jnp.int32))
  with pytest.raises(ValueError, match=r"kv_positions has shape \(2, 6\).*\[2, 5\]"):
    fsdp_jax.attention(q, k, v, kv_positions=jnp.ones((2, 6), jnp.int32))
  with pytest.raises(ValueError, match="window=0"):
    fsdp_jax.attention(q, k, v, window=0)
  with pytest.raises(ValueError, match="soft_cap=-1"):
    fsdp_jax.attention(q, k, v, soft_cap=-1.0)
  with pytest.raises(ValueError, match="implementation='flash'"):
    fsdp_jax.attention(q, k, v, implementation="flash")


def test_families_run_the_kernel(tmp_path, monkeypatch):
  """A Gemma 3 decoder (scanned sliding and full layers: a traced window;
  soft-capped Gemma 2 scores) on packed rows, and its cached generation
  from left-padded prompts, give with blocks of 4 queries and 3 keys what
  they give with one block (the plain path)."""
  config = dict(model_type="gemma3_text", vocab_size=32, hidden_size=16, intermediate_size=24,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                query_pre_attn_scalar=8, sliding_window=3, attn_logit_softcapping=2.0,
                layer_types=["sliding_attention", "full_attention"])
  (tmp_path / "config.json").write_text(json.dumps(config))
  b = fsdp_jax.models.from_pretrained(str(tmp_path), scan=True)
  r = np.random.default_rng(0)
  params = jax.tree.map(lambda x: np.asarray(r.normal(0.0, 0.3, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  ids = r.integers(0, 32, (2, 11)).astype(np.int32)
  seg = np.asarray([[1] * 5 + [2] * 4 + [0] * 2, [1] * 11], np.int32)
  pos = np.asarray([list(range(5)) + list(range(4)) + [0, 0], list(range(11))], np.int32)
  batch = {"input_ids": ids, "labels": ids, "segment_ids": seg, "positions": pos}
  mask = np.asarray([[0, 0, 1, 1, 1, 1], [1] * 6], np.int32)

  def run():
    loss, grads = jax.jit(jax.value_and_grad(lambda p: b.loss_fn(p, batch).total))(params)
    out = fsdp_jax.models.generate(b, params, ids[:, :6], attention_mask=mask, max_new_tokens=3)
    return loss, grads, np.asarray(out)

  whole = run()
  calls = []
  real = A._blocked_forward
  monkeypatch.setattr(A, "_blocked_forward", lambda *a: calls.append(1) or real(*a))
  monkeypatch.setattr(A, "BLOCK_Q", 4)
  monkeypatch.setattr(A, "BLOCK_K", 3)
  jax.clear_caches()  # generate's jitted program is traced again
  blocked = run()
  assert len(calls) >= 3  # the kernel ran: the loss, the prompts' pass, the cached steps
  np.testing.assert_allclose(blocked[0], whole[0], rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(whole[1]))
  for g, w in zip(jax.tree.leaves(blocked[1]), jax.tree.leaves(whole[1])):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * max(1.0, scale))
  np.testing.assert_array_equal(blocked[2], whole[2])


def test_tensor_axis_over_the_key_value_heads_trains_exactly(tmp_path):
  """``tensor=4`` over 2 key/value heads: a device's slice is part of a
  head, so the attention runs whole on every device (its operands gathered
  over 'tensor', named in the report); 2 SGD steps equal one device's."""
  config = dict(model_type="gemma2", vocab_size=32, hidden_size=16, intermediate_size=24,
                num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                query_pre_attn_scalar=8, sliding_window=3, attn_logit_softcapping=2.0)
  (tmp_path / "config.json").write_text(json.dumps(config))
  b = fsdp_jax.models.from_pretrained(str(tmp_path))
  ids = np.random.default_rng(0).integers(0, 32, (2, 10)).astype(np.int32)
  batch = {"input_ids": ids, "labels": ids}
  opt = optax.sgd(0.5)
  state = fsdp_jax.init_train_state(
      init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt,
      mesh=fsdp_jax.make_mesh(shard=2, tensor=4), config=b.fsdp_config(tensor_parallel=True))
  step = fsdp_jax.shard_train_step(b.loss_fn, opt)
  params = b.init_fn(jax.random.key(0))

  def float_mean(loss):
    return loss.total / loss.weight

  @jax.jit
  def reference(p):
    loss, g = jax.value_and_grad(lambda p: float_mean(b.loss_fn(p, batch)))(p)
    return jax.tree.map(lambda w, d: w - 0.5 * d, p, g), loss

  for _ in range(2):
    state, metrics = step(state, batch)
    params, loss = reference(params)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  assert state.plan.tensor_report.gathered.get(
      "attention of heads not split as whole key/value groups") == 1


def _call_eqn(f, *shapes):
  jaxpr = jax.make_jaxpr(f)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).jaxpr
  return next(e for e in jaxpr.eqns if A.match(e) is not None)


@pytest.mark.parametrize("causal,window,tq", [(True, None, 1024), (True, 300, 1024),
                                              (True, 300, 256), (False, 700, 1024)])
def test_kernel_work_counts_the_visible_pairs(causal, window, tq):
  """The planner's count of the kernel's work (XLA's cost_analysis()
  counts a loop body once: the blockwise kernel's forward at 4,096 tokens
  as 0.56 of its 17 GFLOP). Visible pairs: against a brute-force count over
  the [Tq, Tk] mask (queries as the last Tq of 1,024 positions, as the
  device holding a split sequence's end); FLOPs: the plain path's matmuls
  (every pair, one program XLA counts whole) for a mask hiding nothing."""
  tk = 1024
  eqn = _call_eqn(lambda q, k, v: A.attend_local(
      q, k, v, causal=causal, window=window, q_positions=jnp.arange(tk - tq, tk)[None]),
      (1, tq, 4, 16), (1, tk, 2, 16), (1, tk, 2, 16))
  work = A.kernel_work(eqn)
  qp, kp = np.arange(tk - tq, tk)[:, None], np.arange(tk)[None]
  seen = np.ones((tq, tk), bool)
  if causal:
    seen &= kp <= qp
  if window is not None:
    seen &= (qp - kp < window) & ((kp - qp < window) | causal)
  bq, bk = A._default_block_q(tq, tk), A.BLOCK_K
  blocks = seen.reshape(tq // bq, bq, tk // bk, bk).any(axis=(1, 3))
  assert work.pairs == blocks.sum(), (work.pairs, blocks.sum())
  assert work.forward_per_pair == 4 * bq * bk * 4 * 16


def test_uncounted_loop_flops_complete_xlas_count():
  """Non-causal 1,024 x 1,024 (8 pairs of blocks): XLA's count of the
  blockwise forward plus planner.programs.uncounted_loop_flops' addition is the
  plain path's count (one block of 1,024: no loop) to 2% (the addition is
  matmuls only; the softmax's elementwise work on the 7 uncounted pairs,
  about 5 FLOPs a score, is 1.7% here; a pair more or less would be 12.5%),
  and over a scan of 3 layers of it (XLA: one iteration) 3 times the
  plain path's.""" 
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
            ((1, 1024, 4, 64), (1, 1024, 2, 64), (1, 1024, 2, 64))]

  def flops(f):
    return jax.jit(f).lower(*shapes).compile().cost_analysis()["flops"]

  blocked = lambda q, k, v: A.attend_local(q, k, v, causal=False)
  plain = lambda q, k, v: A.attend_local(q, k, v, causal=False, block_q=1024, block_k=1024)
  extra, _ = programs.uncounted_loop_flops(jax.make_jaxpr(blocked)(*shapes).jaxpr.eqns)
  assert extra > 0
  np.testing.assert_allclose(flops(blocked) + extra, flops(plain), rtol=0.02)

  def scanned(q, k, v):
    return jax.lax.scan(lambda c, _: (blocked(c, k, v), None), q, None, length=3)[0]
  extra3, _ = programs.uncounted_loop_flops(jax.make_jaxpr(scanned)(*shapes).jaxpr.eqns)
  np.testing.assert_allclose(flops(scanned) + extra3, 3 * flops(plain), rtol=0.02)
