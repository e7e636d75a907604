"""Numpy-only pieces shared by the JAX benchmark and the PyTorch baseline
(``torch_fsdp.py`` imports this without importing JAX)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Size of the benchmark GPT (see ``models.py``)."""

  vocab_size: int = 256
  seq_len: int = 64
  d_model: int = 512
  num_layers: int = 8
  num_heads: int = 8

  @property
  def block_params(self) -> int:
    d = self.d_model
    # ln_1, ln_2 (scale+bias), qkv (w+b), proj (w+b), fc (w+b), proj (w+b)
    return 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)

  @property
  def root_params(self) -> int:
    """Embeddings, final LayerNorm and LM head: FSDP's root unit."""
    d, v = self.d_model, self.vocab_size
    return v * d + self.seq_len * d + 2 * d + (d * v + v)

  @property
  def num_params(self) -> int:
    return self.num_layers * self.block_params + self.root_params


def make_batch(cfg: GPTConfig, global_batch: int, seed: int = 0) -> dict:
  """A random token batch: ``inputs`` and next-token ``targets`` (int32)."""
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, cfg.vocab_size, size=(global_batch, cfg.seq_len + 1), dtype=np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
