"""Fine-tuning data as users have it: JSONL rows in TRL's forms
(``messages``, ``prompt``/``completion``, ``text``), tokenized with a
transformers tokenizer, packed or padded into fixed-length rows (grain),
and batched onto the mesh as global ``jax.Array`` s, resumable with the
train state. Needs ``pip install fsdp_jax[data]``. See docs/data.md.

    ds = fsdp_jax.data.sft_dataset("chat.jsonl", "path/to/tokenizer", seq_len=2048)
    it = fsdp_jax.data.batches(ds, global_batch=64, mesh=state.plan.mesh)
    for batch in it:                     # input_ids, labels, segment_ids, positions
      state, metrics = step(state, batch)
      manager.save(state, data_iterator=it)
    # after a restart:
    state = manager.restore(target, data_iterator=it)   # the next batch is the same

``python -m fsdp_jax.data.inspect chat.jsonl --tokenizer DIR --seq-len N``
prints what the data becomes: rows, documents per row, padding, loss
tokens, dropped or truncated examples and one row with its loss mask.
"""

from fsdp_jax._src.data import (
    FEATURES as FEATURES,
    DataIterator as DataIterator,
    batches as batches,
    sft_dataset as sft_dataset,
)

__all__ = ["FEATURES", "DataIterator", "batches", "sft_dataset"]
