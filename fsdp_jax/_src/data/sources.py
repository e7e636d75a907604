"""Where fine-tuning rows come from: JSONL files read row by row (by byte
offset, so a file is never held in memory), or an iterable of dicts.

Each row comes with where it was read (``"chat.jsonl:12"``, or ``"item 12
of the source"``), which every error about the row names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["JsonlSource", "ListSource", "open_source"]


class JsonlSource:
  """Rows of one or more JSONL files, one JSON object a line (blank lines
  skipped), randomly accessible (grain's ``RandomAccessDataSource``: ``len``
  and ``[i]``). The files are scanned once for each line's byte offset; a
  row is read and parsed when asked for: ``(where, row)``."""

  def __init__(self, paths: list[str]):
    self.paths = [os.fspath(p) for p in paths]
    self._index: list[tuple[int, int, int]] = []  # (file, byte offset, line number)
    for f, path in enumerate(self.paths):
      if not os.path.isfile(path):
        raise FileNotFoundError(
            f"sft_dataset: no such file {path!r}. Fix: pass the path of a JSONL file (one "
            "JSON object a line), a list of such paths, or an iterable of dicts.")
      with open(path, "rb") as fh:
        offset = 0
        for number, line in enumerate(fh, start=1):
          if line.strip():
            self._index.append((f, offset, number))
          offset += len(line)
    if not self._index:
      raise ValueError(
          f"sft_dataset: the source is empty: {', '.join(self.paths)} "
          f"{'has' if len(self.paths) == 1 else 'have'} no rows (blank lines are skipped). "
          "Fix: pass a JSONL file with one JSON object a line, e.g. "
          '{"messages": [{"role": "user", "content": "..."}, '
          '{"role": "assistant", "content": "..."}]}.')

  def __len__(self) -> int:
    return len(self._index)

  def __getitem__(self, i: int) -> tuple[str, Any]:
    f, offset, number = self._index[i]
    path = self.paths[f]
    where = f"{path}:{number}"
    with open(path, "rb") as fh:
      fh.seek(offset)
      line = fh.readline()
    try:
      return where, json.loads(line)
    except ValueError as e:
      raise ValueError(
          f"{where}: the line is not valid JSON ({e}). Fix: write one JSON object a line "
          "(JSONL), e.g. {\"text\": \"...\"}.") from None

  def __repr__(self) -> str:
    return f"JsonlSource({self.paths!r}, rows={len(self)})"


class ListSource:
  """Rows given as an iterable of dicts, held in a list: ``(where, row)``."""

  def __init__(self, rows: Iterable):
    self.rows = list(rows)
    if not self.rows:
      raise ValueError(
          "sft_dataset: the source is empty: the iterable gave no rows. Fix: pass dicts "
          "such as {'text': '...'}, {'prompt': '...', 'completion': '...'} or "
          "{'messages': [...]}, or a JSONL path.")

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, i: int) -> tuple[str, Any]:
    return f"item {i} of the source", self.rows[i]

  def __repr__(self) -> str:
    return f"ListSource(rows={len(self)})"


def open_source(source) -> "JsonlSource | ListSource":
  """A path (str or ``os.PathLike``), a list of paths, or an iterable of
  dicts, as a randomly accessible source of ``(where, row)``."""
  if isinstance(source, (str, os.PathLike)):
    return JsonlSource([source])
  if isinstance(source, Mapping):
    raise TypeError(
        "sft_dataset: source is one dict. Fix: pass a list of rows ([row]), a JSONL path "
        "or a list of JSONL paths.")
  if isinstance(source, (list, tuple)) and source and all(
      isinstance(p, (str, os.PathLike)) for p in source):
    return JsonlSource(list(source))
  if isinstance(source, Iterable):
    return ListSource(source)
  raise TypeError(
      f"sft_dataset: source is a {type(source).__name__}. Fix: pass a JSONL path, a list "
      "of JSONL paths, or an iterable of dicts.")
