"""``batches``: a dataset's rows as global ``jax.Array`` batches, split
along dim 0 over the mesh's data-parallel axes as ``shard_train_step``
places a batch (every axis but ``"tensor"`` and ``"context"``), each process contributing its
own rows (``jax.make_array_from_process_local_data``). The iterator is
checkpointable: ``get_state()`` / ``set_state()``, which
``CheckpointManager.save(..., data_iterator=it)`` / ``restore`` call.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import mesh as mesh_lib

__all__ = ["DataIterator", "batches", "data_axes"]


def data_axes(mesh: Mesh) -> tuple[str, ...]:
  """The axes a batch's rows are split over: every mesh axis but
  ``"tensor"`` and ``"context"`` (context parallelism splits each row's
  sequence over it, inside the step)."""
  return tuple(a for a in mesh.axis_names if a not in (mesh_lib.TENSOR, mesh_lib.CONTEXT))


def _local_rows(sharding: NamedSharding, global_batch: int) -> int:
  """Rows of the global batch this process's devices hold."""
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_batch,)).values():
    s = index[0]
    rows.update(range(*s.indices(global_batch)))
  return len(rows)


class DataIterator:
  """Global batches from a dataset's rows; see :func:`batches`.

  ``next(it)`` gives ``{feature: jax.Array of shape (global_batch, ...)}``;
  ``get_state()`` is a JSON dict (the grain iterator's state and the batches
  given); ``set_state(state)`` continues from it; ``local_batch`` is the
  rows each process reads per batch.

  Example:
    >>> import jax, numpy as np, grain, fsdp_jax, fsdp_jax.data
    >>> rows = grain.MapDataset.source([{"x": np.arange(3)}] * 4).to_iter_dataset()
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> it = fsdp_jax.data.DataIterator(rows, global_batch=2, mesh=mesh)
    >>> it.local_batch, len(list(it)), it.get_state()["batches"]
    (2, 2, 2)
  """

  def __init__(self, dataset, *, global_batch: int, mesh: Mesh):
    if not isinstance(mesh, Mesh):
      raise TypeError(f"batches: mesh is a {type(mesh).__name__}. Fix: pass the train "
                      "state's mesh (state.plan.mesh) or fsdp_jax.make_mesh(...).")
    axes = data_axes(mesh)
    world = int(np.prod([mesh.shape[a] for a in axes]))
    if not isinstance(global_batch, (int, np.integer)) or global_batch < 1 or (
        global_batch % world):
      up = -(-int(global_batch) // world) * world if isinstance(
          global_batch, (int, np.integer)) and global_batch > 0 else world
      raise ValueError(
          f"batches: global_batch={global_batch!r} is not a positive multiple of the "
          f"data-parallel size {world} (mesh axes {axes} of sizes {dict(mesh.shape)}): each "
          f"device takes an equal part of the batch. Fix: global_batch={up} (or another "
          f"multiple of {world}).")
    self.global_batch = int(global_batch)
    self.mesh = mesh
    self.sharding = NamedSharding(mesh, P(axes[0] if len(axes) == 1 else axes))
    self.local_batch = _local_rows(self.sharding, self.global_batch)
    processes = jax.process_count()
    if self.local_batch * processes != self.global_batch:
      raise ValueError(
          f"batches: this process's devices hold {self.local_batch} of the "
          f"{self.global_batch} rows, not 1/{processes} of them (mesh {dict(mesh.shape)}): "
          "each process reads its own share of the data, so the data-parallel axes must "
          "split the batch evenly over the processes. Fix: build the mesh with "
          "fsdp_jax.make_mesh over every process's devices, the tensor and context axes "
          "within a process.")
    self.dataset = dataset
    self._iterator = iter(dataset)
    self.batches_given = 0

  def __iter__(self) -> "DataIterator":
    return self

  def _rows(self) -> list:
    rows = []
    for _ in range(self.local_batch):
      try:
        rows.append(next(self._iterator))
      except StopIteration:
        break
    full = len(rows) == self.local_batch
    if jax.process_count() > 1:  # stop together: one process's data may end first
      full = bool(np.all(multihost_utils.process_allgather(np.asarray(full))))
    if not full:
      raise StopIteration
    return rows

  def __next__(self) -> dict:
    rows = self._rows()
    out = {}
    for key in rows[0]:
      local = np.stack([np.asarray(r[key]) for r in rows])
      out[key] = jax.make_array_from_process_local_data(
          self.sharding, local, (self.global_batch,) + local.shape[1:])
    self.batches_given += 1
    return out

  def get_state(self) -> dict:
    """This process's position: JSON, for ``CheckpointManager.save(...,
    data_iterator=it)``."""
    return {"grain": self._iterator.get_state(), "batches": self.batches_given,
            "global_batch": self.global_batch, "process_count": jax.process_count()}

  def set_state(self, state: dict) -> None:
    """Continues from ``get_state()``'s ``state`` (the same dataset, global
    batch and process count)."""
    if not isinstance(state, dict) or "grain" not in state:
      raise ValueError(
          f"DataIterator.set_state: not a state of fsdp_jax.data.batches (keys "
          f"{sorted(state) if isinstance(state, dict) else type(state).__name__}). Fix: pass "
          "what get_state() returned.")
    for key, mine in (("global_batch", self.global_batch),
                      ("process_count", jax.process_count())):
      if state.get(key) != mine:
        raise ValueError(
            f"DataIterator.set_state: the state was saved with {key}={state.get(key)}, this "
            f"iterator has {key}={mine}; the rows would not continue where they stopped. "
            f"Fix: resume with {key}={state.get(key)}.")
    self._iterator.set_state(state["grain"])
    self.batches_given = int(state["batches"])

  def __repr__(self) -> str:
    return (f"DataIterator(global_batch={self.global_batch}, local_batch={self.local_batch}, "
            f"mesh={dict(self.mesh.shape)}, batches_given={self.batches_given})")


def batches(dataset: Any, *, global_batch: int, mesh: Mesh) -> DataIterator:
  """Global batches of ``global_batch`` rows of ``dataset`` (e.g.
  :func:`sft_dataset`), split along dim 0 over ``mesh``'s data-parallel
  axes (all but ``"tensor"`` and ``"context"``) as the train step places a
  batch; under context parallelism each row whole, the step splitting its
  sequence.

  Each process reads its own rows (``dataset`` is this process's share:
  :func:`sft_dataset` shards by process) and contributes
  ``global_batch / process_count`` of them to each batch
  (``jax.make_array_from_process_local_data``). The last, partial batch is
  dropped (with several processes, as soon as any process runs out).

  Returns:
    A :class:`DataIterator`: iterate it for batches; ``get_state()`` /
    ``set_state()`` (or ``CheckpointManager.save(..., data_iterator=it)``)
    resume it on exactly the next batch.

  Raises:
    ValueError: ``global_batch`` is not a multiple of the data-parallel
      size (naming the mesh axes and the nearest multiple).

  Example:
    >>> import jax, numpy as np, grain, fsdp_jax, fsdp_jax.data
    >>> rows = grain.MapDataset.source(
    ...     [{"input_ids": np.full(4, i, np.int32)} for i in range(6)]).to_iter_dataset()
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> it = fsdp_jax.data.batches(rows, global_batch=2, mesh=mesh)
    >>> batch = next(it)
    >>> batch["input_ids"].shape, batch["input_ids"].sharding.spec == jax.P("shard")
    ((2, 4), True)
    >>> state = it.get_state(); next(it)["input_ids"][:, 0].tolist()
    [2, 3]
    >>> it.set_state(state); next(it)["input_ids"][:, 0].tolist()   # the same batch again
    [2, 3]
  """
  return DataIterator(dataset, global_batch=global_batch, mesh=mesh)
