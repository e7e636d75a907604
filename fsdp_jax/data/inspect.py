"""``python -m fsdp_jax.data.inspect data.jsonl --tokenizer DIR --seq-len N``:
rows, documents per row and padding, tokens in the loss, examples dropped or
truncated, and one row decoded with its loss mask."""

from fsdp_jax._src.data.stats import main

__all__ = ["main"]

if __name__ == "__main__":
  main()
