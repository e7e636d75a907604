"""JAX's coordination-service client as the runtime uses it: whether JAX's
backends have started, the client (the key-value store and barriers), each
process's record in it and the description of a process that record gives.
"""

from __future__ import annotations

import json
import os
import socket

from fsdp_jax._src import _compat
from fsdp_jax._src.runtime.cluster import INFO, DistributedInfo


def backends_started() -> bool:
  return _compat.backends_initialized()


def jax_client():
  """JAX's coordination-service client, or None without jax.distributed."""
  return _compat.distributed_state().client


def publish_info(info: DistributedInfo) -> None:
  client = jax_client()
  record = {"host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": info.local_rank, "node_rank": info.node_rank}
  try:
    client.key_value_set(f"{INFO}{info.rank}", json.dumps(record), allow_overwrite=True)
  except Exception:  # pragma: no cover - informational only
    pass


def describe_process(rank: int, world: int, client=None) -> str:
  """``"process 1 of 2 (host h, pid 123, LOCAL_RANK 1)"`` from the KV store
  (``world``: the number of processes)."""
  text = f"process {rank} of {world}"
  client = client or jax_client()
  if client is None:
    return text
  try:
    record = json.loads(client.key_value_try_get(f"{INFO}{rank}"))
    text += (f" (host {record['host']}, pid {record['pid']}, "
             f"LOCAL_RANK {record['local_rank']})")
  except Exception:
    pass
  return text
