#!/usr/bin/env python
"""How fast the pretrained loader's host copies run on this machine's CPU.

    python benchmarks/pretrained_copy.py

A ``[5632, 2048]`` fp32 tensor (a Llama MLP projection in PyTorch's
``[out, in]``) is read from a memory map of its file, transposed (a view)
or not, and copied into fresh memory. Printed: GB/s of each way to copy,
best of 4, and of ``copy_into``, the loader's own. The ways that are fastest
differ between CPUs (benchmarks/GPU.md, runs 4 and 5).
"""

import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_jax._src.pretrained import files  # noqa: E402  pylint: disable=wrong-import-position

R, C = 5632, 2048


def _slab(dst, src):
  """32 bytes of each row at a time (the loader's copy before run 5)."""
  for j in range(0, src.shape[-1], 8):
    np.copyto(dst[..., j:j + 8], src[..., j:j + 8])


def _tiles(dst, src, b=256, a=None):
  a = a or b
  for i in range(0, src.shape[0], a):
    for j in range(0, src.shape[1], b):
      dst[i:i + a, j:j + b] = src[i:i + a, j:j + b]


def _threaded(fn, pool, n):
  def copy(dst, src):
    step = -(-src.shape[0] // (4 * n))
    step = -(-step // 256) * 256
    list(pool.map(lambda k: fn(dst[k:k + step], src[k:k + step]), range(0, src.shape[0], step)))
  return copy


def main(argv=None):
  del argv  # no options
  path = os.path.join(tempfile.mkdtemp(), "t.bin")
  np.random.default_rng(0).standard_normal((R, C), dtype=np.float32).tofile(path)
  nbytes = R * C * 4

  def mapped():
    with open(path, "rb") as f:
      m = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    return np.frombuffer(m, np.float32).reshape(R, C)

  def run(label, copy, transposed=True):
    best = 1e9
    for _ in range(4):
      t = time.perf_counter()
      src = mapped()
      src = src.T if transposed else src
      copy(np.empty(src.shape, np.float32), src)
      best = min(best, time.perf_counter() - t)
    print(f"{label:44s} {best * 1e3:8.1f} ms {nbytes / best / 1e9:6.2f} GB/s", flush=True)

  print(f"{os.cpu_count()} CPUs")
  run("contiguous, np.copyto", np.copyto, transposed=False)
  run("transposed, np.copyto", np.copyto)
  run("transposed, 32 bytes of each row at a time", _slab)
  for b in (64, 128, 256, 512):
    run(f"transposed, tiles {b} x {b}", lambda d, s, b=b: _tiles(d, s, b))
  for n in (2, 4, 8):
    with ThreadPoolExecutor(n) as pool:
      run(f"transposed, tiles 256 x 256, {n} threads", _threaded(_tiles, pool, n))
      run(f"contiguous, np.copyto, {n} threads", _threaded(np.copyto, pool, n), False)
  kernel = files._transposed_copy().__name__  # pylint: disable=protected-access
  print(f"copy_into copies a transposed view with {kernel} here")
  run("transposed, files.copy_into", files.copy_into)
  run("contiguous, files.copy_into", files.copy_into, transposed=False)


if __name__ == "__main__":
  main()
