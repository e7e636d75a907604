"""``sft_dataset``: fine-tuning rows -> fixed-length token rows, a grain
``IterDataset``.

The pipeline: the source's rows (``(where, row)``), shuffled with
``shuffle_seed`` (a new order each epoch), repeated ``num_epochs`` times,
this process's share taken (``grain.sharding.ShardByJaxProcess``: every
``process_count``-th row from ``process_index``, the remainder dropped so
the processes read as many rows), tokenized (:mod:`.encode`), then packed
(``grain.experimental.FirstFitPackIterDataset`` /
``BestFitPackIterDataset``) or padded, one example a row. Every step is a
grain dataset, so the iterator's ``get_state()`` / ``set_state()`` resume
it exactly.

Rows are ``{"input_ids", "labels", "segment_ids", "positions"}``, int32 of
length ``seq_len``: segment ids 1..n number the documents of a row and 0
marks padding; positions restart at 0 in each document; labels are -100
where no loss is taken (padding, the first token of each document, and what
``loss_on`` leaves out); padding's input ids are the tokenizer's pad token
(else 0).
"""

from __future__ import annotations

import functools
from typing import Optional

import grain
import grain.experimental as grain_experimental
import numpy as np

from fsdp_jax._src.data import sources
from fsdp_jax._src.data.encode import IGNORE, LOSS_ON, TRUNCATION, Encoder, load_tokenizer

__all__ = ["PACKING", "FEATURES", "sft_dataset"]

PACKING = ("first_fit", "best_fit", None)
FEATURES = ("input_ids", "labels", "segment_ids", "positions")
_PACKERS = {"first_fit": grain_experimental.FirstFitPackIterDataset,
            "best_fit": grain_experimental.BestFitPackIterDataset}


def _check_args(seq_len, packing, loss_on, truncation, num_epochs, packing_bins) -> None:
  if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 2:
    raise ValueError(f"sft_dataset: seq_len={seq_len!r}. Fix: pass an int >= 2, e.g. "
                     "seq_len=2048.")
  for name, value, allowed in (("packing", packing, PACKING), ("loss_on", loss_on, LOSS_ON),
                               ("truncation", truncation, TRUNCATION)):
    if value not in allowed:
      raise ValueError(f"sft_dataset: {name}={value!r}. Fix: pass one of {allowed}.")
  if num_epochs is not None and (not isinstance(num_epochs, (int, np.integer))
                                 or num_epochs < 1):
    raise ValueError(f"sft_dataset: num_epochs={num_epochs!r}. Fix: pass an int >= 1, or "
                     "None to repeat forever.")
  if not isinstance(packing_bins, (int, np.integer)) or packing_bins < 1:
    raise ValueError(f"sft_dataset: packing_bins={packing_bins!r}. Fix: pass an int >= 1.")


def _pad_id(tokenizer) -> int:
  pad = getattr(tokenizer, "pad_token_id", None)
  return 0 if pad is None else int(pad)


def _padded(example: dict, *, seq_len: int, pad_id: int) -> dict:
  """One example -> one row, padded to ``seq_len`` (segment 1, then 0).
  Module-level functions (with ``functools.partial``), not closures: the
  dataset pickles for grain's worker processes."""
  n = len(example["input_ids"])
  out = {"input_ids": np.full(seq_len, pad_id, np.int32),
         "labels": np.full(seq_len, IGNORE, np.int32),
         "segment_ids": np.zeros(seq_len, np.int32),
         "positions": np.zeros(seq_len, np.int32)}
  out["input_ids"][:n] = example["input_ids"]
  out["labels"][:n] = example["labels"]
  out["segment_ids"][:n] = 1
  out["positions"][:n] = np.arange(n, dtype=np.int32)
  return out


def _from_packed(packed: dict, *, pad_id: int) -> dict:
  """grain's packed row (``input_ids_segment_ids``, ...) -> our features,
  padding's ids and labels set."""
  segment_ids = np.asarray(packed["input_ids_segment_ids"], np.int32)
  padding = segment_ids == 0
  return {"input_ids": np.where(padding, pad_id, packed["input_ids"]).astype(np.int32),
          "labels": np.where(padding, IGNORE, packed["labels"]).astype(np.int32),
          "segment_ids": segment_ids,
          "positions": np.asarray(packed["input_ids_positions"], np.int32)}


def _shard(ds: "grain.MapDataset", shard_options) -> "grain.MapDataset":
  """This process's rows: every ``shard_count``-th from ``shard_index``,
  equal counts (the remainder dropped) when ``drop_remainder``."""
  count, index = int(shard_options.shard_count), int(shard_options.shard_index)
  if count == 1:
    return ds
  if shard_options.drop_remainder:
    ds = ds[:len(ds) // count * count]
  return ds[index::count]



def _kept(example) -> bool:
  """An example the encoder did not drop (module-level: the dataset pickles
  for grain's worker processes)."""
  return example is not None

def sft_dataset(source, tokenizer, *, seq_len: int, packing: Optional[str] = "first_fit",
                loss_on: str = "assistant", chat_template: Optional[str] = None,
                shuffle_seed: Optional[int] = 0, num_epochs: Optional[int] = 1,
                truncation: str = "error", packing_bins: int = 64,
                shard_options: Optional["grain.sharding.ShardOptions"] = None,
                read_options: Optional["grain.ReadOptions"] = None) -> "grain.IterDataset":
  """Supervised fine-tuning data as TRL's ``SFTTrainer`` reads it, as
  fixed-length token rows (a grain ``IterDataset``).

  Args:
    source: a JSONL path, a list of paths, or an iterable of dicts. A row is
      ``{"messages": [{"role", "content"}, ...]}`` (rendered with the chat
      template), ``{"prompt": ..., "completion": ...}`` (strings, or lists of
      messages) or ``{"text": ...}``.
    tokenizer: a transformers tokenizer, or its directory.
    seq_len: the length of every row.
    packing: ``"first_fit"`` / ``"best_fit"`` (grain's packers; several
      examples a row, each a segment) or None (one example a row, padded).
    loss_on: ``"assistant"``: the assistant turns of ``messages`` (TRL's
      ``assistant_only_loss``; needs ``{% generation %}`` in the template)
      and the completions of prompt/completion rows; ``"completion"``: the
      completions, every token of ``messages`` rows (TRL's defaults);
      ``"all"``: every token. ``text`` rows: every token.
    chat_template: a Jinja chat template replacing the tokenizer's.
    shuffle_seed: the row order's seed (a new order each epoch); None keeps
      the source's order.
    num_epochs: passes over the source; None repeats forever.
    truncation: an example longer than ``seq_len``: ``"error"`` (naming
      its file and line), ``"drop"``, or ``"truncate"`` (its first
      ``seq_len`` tokens, as TRL's ``max_length``).
    packing_bins: rows the packer fills at once (more: less padding, rows
      from further apart).
    shard_options: which share of the rows this process reads (default
      ``grain.sharding.ShardByJaxProcess(drop_remainder=True)``).
    read_options: grain's ``ReadOptions`` for tokenizing in threads
      (default grain's: 16 threads).

  Returns:
    A ``grain.IterDataset`` of ``{"input_ids", "labels", "segment_ids",
    "positions"}`` rows (int32, length ``seq_len``); labels are -100 where
    no loss is taken, aligned with the inputs (the model shifts). Iterate
    it, or hand it to :func:`batches`.

  Raises:
    ValueError: a bad argument, an empty source, or a bad first row (a later
      bad row raises when it is read), each naming the file and line and
      the fix.

  Example:
    >>> import tokenizers, transformers, fsdp_jax.data
    >>> words = tokenizers.models.WordLevel(
    ...     {"<pad>": 0, "</s>": 1, "<unk>": 2, "hi": 3, "there": 4}, unk_token="<unk>")
    >>> backend = tokenizers.Tokenizer(words)
    >>> backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    >>> tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
    ...                                            pad_token="<pad>", eos_token="</s>")
    >>> rows = [{"prompt": "hi", "completion": " there"}, {"text": "hi hi"}]
    >>> row = next(iter(fsdp_jax.data.sft_dataset(rows, tok, seq_len=8, shuffle_seed=None)))
    >>> row["input_ids"].tolist()     # both examples, each with its eos, then padding
    [3, 4, 1, 3, 3, 1, 0, 0]
    >>> row["labels"].tolist()        # the completion; the text but its first token
    [-100, 4, 1, -100, 3, 1, -100, -100]
    >>> row["segment_ids"].tolist(), row["positions"].tolist()
    ([1, 1, 1, 2, 2, 2, 0, 0], [0, 1, 2, 0, 1, 2, 0, 0])
  """
  _check_args(seq_len, packing, loss_on, truncation, num_epochs, packing_bins)
  src = sources.open_source(source)
  tok = load_tokenizer(tokenizer)
  encoder = Encoder(tok, seq_len=int(seq_len), loss_on=loss_on, chat_template=chat_template,
                    truncation=truncation)
  encoder.encode(*src[0])  # the first row's errors now, not at the first batch
  ds = grain.MapDataset.source(src)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=int(shuffle_seed))
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = _shard(ds, shard_options or grain.sharding.ShardByJaxProcess(drop_remainder=True))
  ds = ds.map(encoder).filter(_kept)
  it = ds.to_iter_dataset(read_options)
  pad_id = _pad_id(tok)
  if packing is None:
    return it.map(functools.partial(_padded, seq_len=int(seq_len), pad_id=pad_id))
  packed = _PACKERS[packing](
      it, length_struct={"input_ids": int(seq_len), "labels": int(seq_len)},
      num_packing_bins=int(packing_bins), seed=int(shuffle_seed or 0),
      shuffle_bins=shuffle_seed is not None)
  return packed.map(functools.partial(_from_packed, pad_id=pad_id))
