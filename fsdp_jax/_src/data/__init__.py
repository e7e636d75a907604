"""Fine-tuning data: JSONL rows as TRL reads them, tokenized, packed and
batched onto the mesh, resumable from a checkpoint (``fsdp_jax.data``).

Needs the optional extra ``pip install fsdp_jax[data]`` (grain, tokenizers,
transformers); ``import fsdp_jax`` imports none of them.
"""

try:
  import grain as _grain  # noqa: F401  (the extra's marker)
  import grain.experimental as _grain_experimental  # noqa: F401
except ImportError as _e:  # pragma: no cover  (depends on the environment)
  raise ImportError(
      "fsdp_jax.data needs grain (and tokenizers, transformers for the tokenizer). Fix: "
      "pip install fsdp_jax[data]") from _e

from fsdp_jax._src.data.batching import DataIterator, batches, data_axes
from fsdp_jax._src.data.encode import IGNORE, Encoder, load_tokenizer
from fsdp_jax._src.data.pipeline import FEATURES, PACKING, sft_dataset

__all__ = ["DataIterator", "Encoder", "FEATURES", "IGNORE", "PACKING", "batches",
           "data_axes", "load_tokenizer", "sft_dataset"]
