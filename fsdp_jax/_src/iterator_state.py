"""Each process's input-pipeline iterator state, in the same orbax commit
as the train state.

An orbax ``CheckpointHandler`` whose item is a directory of
``process_<i>-of-<n>.json`` files, one written by each process: the layout
grain's own ``grain.checkpoint.CheckpointHandler`` writes and reads, so
either reads the other's files. It needs no grain: the state is the text of
``iterator.get_state()`` (JSON for grain's ``DatasetIterator`` and
``fsdp_jax.data.batches``' iterator, bytes for grain's ``DataLoader``
iterator), captured when ``save`` is called.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["IteratorStateHandler", "IteratorStateRestore", "IteratorStateSave", "capture",
           "file_name", "restore_into"]


def file_name(process_index: int, process_count: int) -> str:
  """grain's name for process ``process_index``'s state."""
  return f"process_{process_index}-of-{process_count}.json"


class IteratorStateHandler(ocp.CheckpointHandler):
  """Writes this process's state text; reads it back (the save's process
  count must be this job's)."""

  def save(self, directory: epath.Path, args: "IteratorStateSave") -> None:
    path = epath.Path(directory) / file_name(jax.process_index(), jax.process_count())
    path.write_text(args.text)

  def restore(self, directory: epath.Path, args: "IteratorStateRestore" = None) -> str:
    del args
    directory = epath.Path(directory)
    path = directory / file_name(jax.process_index(), jax.process_count())
    if not path.exists():
      saved = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
      raise FileNotFoundError(
          f"No iterator state {path.name} in {directory} (saved: {saved}): the checkpoint "
          f"was saved by another number of processes than this job's "
          f"{jax.process_count()}. Fix: resume with as many processes as saved it, or "
          "restore without data_iterator= and start the data afresh.")
    return path.read_text()

  def metadata(self, directory: epath.Path) -> Any:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


@ocp.args.register_with_handler(IteratorStateHandler, for_save=True)
@dataclasses.dataclass
class IteratorStateSave(ocp.args.CheckpointArgs):
  text: str


@ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)
@dataclasses.dataclass
class IteratorStateRestore(ocp.args.CheckpointArgs):
  pass


def capture(iterator) -> tuple[str, str]:
  """``(kind, text)`` of ``iterator.get_state()`` now: ``"json"`` for a
  JSON-serialisable state, ``"bytes"`` for bytes (grain's DataLoader)."""
  if not callable(getattr(iterator, "get_state", None)) or not callable(
      getattr(iterator, "set_state", None)):
    raise TypeError(
        f"data_iterator is a {type(iterator).__name__} without get_state() / set_state(). "
        "Fix: pass a checkpointable iterator: fsdp_jax.data.batches(...), or "
        "iter(grain_dataset); for your own pipeline pass data_state= (a JSON dict).")
  state = iterator.get_state()
  if isinstance(state, bytes):
    return "bytes", state.decode()
  try:
    return "json", json.dumps(state, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise TypeError(f"data_iterator.get_state() gave a state that is neither bytes nor JSON "
                    f"({e}). Fix: return plain JSON values from get_state().") from None


def restore_into(iterator, kind: str, text: str) -> None:
  """Sets ``iterator``'s state from the saved text."""
  iterator.set_state(text.encode() if kind == "bytes" else json.loads(text))
