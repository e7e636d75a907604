"""Checkpoint files: Hugging Face safetensors (a file, or a directory with or
without ``model.safetensors.index.json``) and PyTorch state dicts, read
tensor slice by tensor slice, and safetensors written tensor by tensor.

Reading a slice of a safetensors tensor reads exactly its bytes, so a
device's shard costs its own bytes and no more: a contiguous slice is a
read-only view of a memory map of its pages (the kernel's page cache, no
copy), a strided one (columns) an ``os.preadv`` of each contiguous run.
The loader copies what it reads into the shards, so no array it returns
shares memory with a file.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import mmap
import os
import re
import struct
import time
from typing import Optional

import ml_dtypes
import numpy as np
import safetensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' dtype names <-> numpy (ml_dtypes for bfloat16 and float8).
_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_), "C64": np.dtype(np.complex64),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointFileError(ValueError):
  """A checkpoint file that is missing, truncated or not what it says."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor of a checkpoint is."""

  name: str
  dtype: np.dtype
  shape: tuple
  path: str
  offset: int  # of its first byte in the file; -1 for a PyTorch state dict

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype) -> str:
  dtype = np.dtype(dtype)
  if dtype not in _NAMES:
    raise ValueError(f"dtype {dtype} has no safetensors name; supported: "
                     f"{sorted(str(d) for d in _DTYPES.values())}.")
  return _NAMES[dtype]


def read_header(path: str) -> tuple[dict, int, dict]:
  """``({name: (dtype, shape, (begin, end))}, data start, metadata)`` of a
  safetensors file, checked against the file's size."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointFileError(f"{path}: {size} bytes, too short for a safetensors file.")
      (n,) = struct.unpack("<Q", head)
      if n > size - 8 or n > 100 * 2**20:
        raise CheckpointFileError(
            f"{path}: its header claims {n} bytes but the file has {size}: truncated or "
            "not a safetensors file.")
      header = json.loads(f.read(n))
  except FileNotFoundError:
    raise CheckpointFileError(f"{path}: no such file.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFileError(f"{path}: the header is not valid JSON ({e}): a damaged or "
                              "truncated file.") from None
  metadata = header.pop("__metadata__", None) or {}
  start = 8 + n
  out = {}
  for name, entry in header.items():
    try:
      dtype = _DTYPES[entry["dtype"]]
      shape = tuple(int(s) for s in entry["shape"])
      begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
      raise CheckpointFileError(f"{path}: tensor {name!r} has a malformed header entry "
                                f"{entry!r}.") from None
    if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
      raise CheckpointFileError(
          f"{path}: tensor {name!r} ({entry['dtype']}{list(shape)}) needs bytes "
          f"{start + begin}..{start + end} but the file has {size}: a truncated file.")
    out[name] = (dtype, shape, (begin, end))
  return out, start, metadata


def _slices(index, shape) -> list[tuple[int, int]]:
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape):
    a, b, step = s.indices(n)
    if step != 1:
      raise ValueError("only unit-step slices are read from a file")
    out.append((a, max(a, b)))
  return out


class Reader:
  """The tensors of one checkpoint (``tensors``: ``{name: TensorInfo}``),
  read slice by slice. ``bytes_read`` counts the tensor bytes read;
  ``page_bytes_read`` the bytes of the file pages those lie in (what
  storage moves), each page counted once per read."""

  def __init__(self, tensors: dict, description: str):
    self.tensors = tensors
    self.description = description
    self.bytes_read = 0
    self.page_bytes_read = 0

  def read(self, name: str, index=()) -> np.ndarray:
    raise NotImplementedError


class SafetensorsReader(Reader):
  """One or more safetensors files."""

  def read(self, name: str, index=()) -> np.ndarray:
    info = self.tensors[name]
    ranges = _slices(index, info.shape)
    out_shape = tuple(b - a for a, b in ranges)
    item = info.dtype.itemsize
    nbytes = math.prod(out_shape) * item
    if not nbytes:
      return np.empty(out_shape, info.dtype)
    # Axes after ``k`` are whole: each run is rows of axis k, contiguous.
    k = len(ranges) - 1
    while k >= 0 and ranges[k] == (0, info.shape[k]):
      k -= 1
    strides = [math.prod(info.shape[d + 1:]) * item for d in range(len(info.shape))]
    if k < 0:
      runs, run = [info.offset], nbytes
    else:
      run = (ranges[k][1] - ranges[k][0]) * strides[k]
      base = info.offset + ranges[k][0] * strides[k]
      runs = [base]
      for d in range(k - 1, -1, -1):
        a, b = ranges[d]
        runs = [r + i * strides[d] for i in range(a, b) for r in runs]
      runs.sort()
    self.bytes_read += nbytes
    self.page_bytes_read += _pages(runs, run) * mmap.PAGESIZE
    if len(runs) == 1:  # one contiguous run: a read-only view of a memory map
      return _mapped(info, runs[0], nbytes).view(info.dtype).reshape(out_shape)
    out = np.empty(nbytes, np.uint8)
    fd = os.open(info.path, os.O_RDONLY)
    try:
      pos = 0
      for off in runs:
        got = os.preadv(fd, [memoryview(out)[pos:pos + run]], off)
        if got != run:
          raise CheckpointFileError(
              f"{info.path}: tensor {name!r} ends early (read {got} of {run} bytes at "
              f"{off}): a truncated file.")
        pos += run
    finally:
      os.close(fd)
    return out.view(info.dtype).reshape(out_shape)


def _pages(runs: list, run: int) -> int:
  """Distinct file pages that sorted runs of ``run`` bytes lie in."""
  pages, last = 0, -1
  for off in runs:
    first, end = off // mmap.PAGESIZE, (off + run - 1) // mmap.PAGESIZE
    if end > last:
      pages += end - max(first, last + 1) + 1
      last = end
  return pages


def _mapped(info: TensorInfo, offset: int, size: int) -> np.ndarray:
  """``size`` bytes of ``info.path`` from ``offset``: a read-only view of a
  memory map of just those pages, which the kernel fills from its page
  cache (no copy, no fresh memory). The map lives as long as the view."""
  if offset + size > os.path.getsize(info.path):
    raise CheckpointFileError(
        f"{info.path}: tensor {info.name!r} ends early (needs bytes up to {offset + size}, "
        f"the file has {os.path.getsize(info.path)}): a truncated file.")
  start = offset - offset % mmap.ALLOCATIONGRANULARITY
  with open(info.path, "rb") as f:
    m = mmap.mmap(f.fileno(), offset + size - start, access=mmap.ACCESS_READ, offset=start)
  return np.frombuffer(m, np.uint8, count=size, offset=offset - start)


class TorchReader(Reader):
  """A PyTorch state dict (``.bin`` / ``.pt``), memory-mapped by
  ``torch.load(weights_only=True, mmap=True)``."""

  def __init__(self, path: str):
    try:
      import torch  # pylint: disable=import-outside-toplevel  (optional dependency)
    except ImportError:
      raise ImportError(
          f"Reading the PyTorch state dict {path} needs torch. Fix: pip install torch "
          "(a CPU build is enough), or convert the checkpoint to safetensors.") from None
    try:
      sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
      raise CheckpointFileError(f"{path}: no such file.") from None
    except Exception as e:  # pylint: disable=broad-except  (torch's own errors)
      raise CheckpointFileError(f"{path}: not a readable PyTorch state dict ({e}).") from None
    if not isinstance(sd, dict):
      raise CheckpointFileError(f"{path}: holds a {type(sd).__name__}, not a state dict.")
    self._torch = torch
    self._sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    tensors = {k: TensorInfo(k, _torch_dtype(v.dtype), tuple(v.shape), path, -1)
               for k, v in self._sd.items()}
    super().__init__(tensors, path)

  def read(self, name: str, index=()) -> np.ndarray:
    t = self._sd[name]
    ranges = _slices(index, tuple(t.shape))
    part = t[tuple(slice(a, b) for a, b in ranges)].contiguous()
    if part.dtype == self._torch.bfloat16:
      arr = part.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
      arr = part.numpy()
    self.bytes_read += arr.nbytes
    return np.array(arr)


def _torch_dtype(dtype) -> np.dtype:
  import torch  # pylint: disable=import-outside-toplevel  (only with a torch checkpoint)
  table = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
           torch.bfloat16: ml_dtypes.bfloat16, torch.int64: np.int64, torch.int32: np.int32,
           torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
           torch.bool: np.bool_, torch.complex64: np.complex64}
  if dtype not in table:
    raise CheckpointFileError(f"torch dtype {dtype} is not supported.")
  return np.dtype(table[dtype])


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ADAPTER_CONFIG = "adapter_config.json"


def check_local(path: str, what: str = "checkpoint") -> None:
  """A ``CheckpointFileError`` for a path that is not here but reads as a
  Hugging Face Hub id (``org/name``: fsdp_jax has no hub access), and for a
  PEFT adapter directory given where a base model is wanted."""
  if not os.path.exists(path) and _HUB_ID.match(path) and not os.path.isabs(path):
    raise CheckpointFileError(
        f"{path!r} is not a local file or directory; it reads as a Hugging Face Hub id, and "
        f"fsdp_jax reads local {what}s only (no hub access). Fix: download it first, e.g. "
        f"`huggingface-cli download {path} --local-dir DIR` (or "
        f"`huggingface_hub.snapshot_download({path!r})`), then pass DIR.")
  if os.path.isdir(path) and os.path.exists(os.path.join(path, ADAPTER_CONFIG)) and not (
      os.path.exists(os.path.join(path, "config.json"))):
    raise CheckpointFileError(
        f"{path} is a PEFT adapter (it holds {ADAPTER_CONFIG}), not a base model: this is an "
        "adapter: load the base, then load_adapter. Fix: build and load the base model its "
        "adapter_config.json names (base_model_name_or_path), then read the adapter into a "
        "LoRA state with fsdp_jax.pretrained.load_adapter(state, directory, weight_map).")


def open_checkpoint(path: str) -> Reader:
  """A reader of ``path``: a ``.safetensors`` file, a directory of them
  (with or without ``model.safetensors.index.json``), or a PyTorch state
  dict (``.bin`` / ``.pt`` / ``.pth``). Only headers are read."""
  path = os.fspath(path)
  check_local(path)
  if os.path.isdir(path):
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{index}: not a safetensors index ({e}).") from None
      files = sorted(set(weight_map.values()))
      for name in files:
        if not os.path.exists(os.path.join(path, name)):
          raise CheckpointFileError(
              f"{index} lists {name}, which is not in {path}: an incomplete download or "
              "copy. Fix: fetch the missing shard.")
      tensors = _safetensors_tensors([os.path.join(path, f) for f in files])
      listed = {k for k, f in weight_map.items()}
      missing = sorted(listed - set(tensors))
      if missing:
        raise CheckpointFileError(
            f"{index} lists tensors that its files do not hold: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}.")
      return SafetensorsReader(tensors, path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
      return SafetensorsReader(_safetensors_tensors([os.path.join(path, f) for f in files]),
                               path)
    bins = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
    if len(bins) == 1:
      return TorchReader(os.path.join(path, bins[0]))
    raise CheckpointFileError(
        f"{path} holds no .safetensors file (nor exactly one PyTorch .bin / .pt); "
        f"it holds {sorted(os.listdir(path))[:10]}.")
  if path.endswith(".safetensors"):
    return SafetensorsReader(_safetensors_tensors([path]), path)
  if path.endswith((".bin", ".pt", ".pth")):
    if not os.path.exists(path):
      raise CheckpointFileError(f"{path}: no such file.")
    return TorchReader(path)
  if not os.path.exists(path):
    raise CheckpointFileError(f"{path}: no such file or directory.")
  raise CheckpointFileError(
      f"{path}: not a .safetensors file, a directory of them, or a PyTorch .bin / .pt.")


def _safetensors_tensors(paths) -> dict:
  out = {}
  for path in paths:
    header, start, _ = read_header(path)
    for name, (dtype, shape, (begin, _)) in header.items():
      if name in out:
        raise CheckpointFileError(f"tensor {name!r} is in both {out[name].path} and {path}.")
      out[name] = TensorInfo(name, dtype, shape, path, start + begin)
  return out


_TILE = 256  # elements of a tile's side, for a copy across the source's last axis
_TASK_BYTES = 4 * 2**20  # the least bytes a worker thread copies


@functools.lru_cache(maxsize=1)
def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Worker threads for large copies (numpy releases the GIL while it
  copies), up to 8, one per CPU."""
  return concurrent.futures.ThreadPoolExecutor(
      min(8, os.cpu_count() or 1), thread_name_prefix="fsdp_jax-copy")


def _tiles(dst: np.ndarray, src: np.ndarray) -> None:
  """Tiles of 256 x 256 elements of the last two axes."""
  rows, cols = src.shape[-2:]
  for i in range(0, rows, _TILE):
    for j in range(0, cols, _TILE):
      np.copyto(dst[..., i:i + _TILE, j:j + _TILE], src[..., i:i + _TILE, j:j + _TILE],
                casting="same_kind")


def _slabs(dst: np.ndarray, src: np.ndarray) -> None:
  """32 bytes of each row of the source's last axis at a time."""
  step = max(1, 32 // src.dtype.itemsize)
  for j in range(0, src.shape[-1], step):
    np.copyto(dst[..., j:j + step], src[..., j:j + step], casting="same_kind")


@functools.lru_cache(maxsize=1)
def _transposed_copy():
  """The faster on this CPU of two ways to copy a transposed view, timed
  once per process on a 1024 x 1024 fp32 copy (a few milliseconds). Which
  one wins depends on the CPU, by up to 8x each way (benchmarks/GPU.md,
  runs 4 and 5); both give the same values."""
  src = np.ones((1024, 1024), np.float32).T
  dst = np.empty(src.shape, np.float32)
  best, best_t = None, math.inf
  for fn in (_tiles, _slabs):
    fn(dst, src)
    t = time.perf_counter()
    fn(dst, src)
    fn(dst, src)
    t = time.perf_counter() - t
    if t < best_t:
      best, best_t = fn, t
  return best


def _copy(dst: np.ndarray, src: np.ndarray, transposed) -> None:
  if transposed is None:
    np.copyto(dst, src, casting="same_kind")
  else:
    transposed(dst, src)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
  """``dst[...] = src``, converting the dtype. A source read across its
  last axis (a transposed view) is copied in tiles of its last two axes or
  a slab of each row at a time, whichever is faster on this CPU; a copy of
  more than 4 MiB is split over worker threads along its first axis (the
  second to last for a transposed one)."""
  transposed = (src.ndim >= 2 and src.strides[-1] != src.dtype.itemsize and src.shape[-1] > 1
                and src.shape[-2] > 1)
  kernel = _transposed_copy() if transposed else None
  axis = src.ndim - 2 if transposed else 0
  workers = _copy_pool()._max_workers  # pylint: disable=protected-access
  tasks = min(workers, dst.nbytes // _TASK_BYTES) if src.ndim else 1
  if tasks < 2 or src.shape[axis] < 2:
    _copy(dst, src, kernel)
    return
  step = -(-src.shape[axis] // tasks)
  if transposed:
    step = -(-step // _TILE) * _TILE
  lead = (slice(None),) * axis
  parts = [lead + (slice(k, k + step),) for k in range(0, src.shape[axis], step)]
  for f in [_copy_pool().submit(_copy, dst[p], src[p], kernel) for p in parts]:
    f.result()


_WRITE_CHUNK = 16 * 2**20  # bytes of a non-contiguous tensor converted at a time


class SafetensorsWriter:
  """Writes one safetensors file tensor by tensor: the header (from every
  tensor's name, dtype and shape, given up front) first, then each tensor's
  bytes in order, so a file never needs its tensors in memory together."""

  def __init__(self, path: str, entries: list, metadata: Optional[dict] = None):
    header = {}
    offset = 0
    for name, dtype, shape in entries:
      n = math.prod(shape) * np.dtype(dtype).itemsize
      header[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                      "data_offsets": [offset, offset + n]}
      offset += n
    if metadata:
      header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    self.path = path
    self._order = [(name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in entries]
    self._next = 0
    self._f = open(path, "wb")
    self._f.write(struct.pack("<Q", len(blob)))
    self._f.write(blob)
    self.nbytes = offset

  def write(self, name: str, array: np.ndarray) -> None:
    """The next tensor's values (any layout; converted to its dtype, a
    strided view a slab at a time)."""
    want, dtype, shape = self._order[self._next]
    array = np.asarray(array)
    if name != want or tuple(array.shape) != shape:
      raise ValueError(f"{self.path}: expected tensor {want!r} {list(shape)}, got {name!r} "
                       f"{list(array.shape)}.")
    self._next += 1
    if array.ndim == 0 or (array.dtype == dtype and array.flags.c_contiguous):
      self._f.write(np.ascontiguousarray(array, dtype).reshape(-1).view(np.uint8).data)
      return
    rows = max(1, _WRITE_CHUNK // max(1, math.prod(shape[1:]) * dtype.itemsize))
    buf = np.empty((min(rows, shape[0]),) + shape[1:], dtype)
    for r in range(0, shape[0], rows):
      part = array[r:r + rows]
      out = buf[:part.shape[0]]
      copy_into(out, part)
      self._f.write(out.reshape(-1).view(np.uint8).data)

  def close(self) -> None:
    assert self._next == len(self._order)
    self._f.flush()
    os.fsync(self._f.fileno())
    self._f.close()


def check_readable(path: str) -> None:
  """Opens a written file with the ``safetensors`` library (the reader
  transformers and vLLM use), which checks its header against its size."""
  try:
    with safetensors.safe_open(path, framework="numpy") as f:
      f.keys()
  except Exception as e:  # pylint: disable=broad-except  (safetensors' own errors)
    raise CheckpointFileError(f"{path}: written, but the safetensors library cannot read it "
                              f"({e}).") from None
