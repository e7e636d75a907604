"""Writes ``tests/golden/llama_generate/``: a tiny random transformers Llama
and the tokens its ``generate(do_sample=False)`` continues two prompts with,
for ``tests/test_eval.py`` (a KV-cache greedy decode on ``reshard_params``
weights gives the same tokens, without torch).

Not part of the library or the test suite: the committed recipe that made
the directory. Run it where torch and transformers are installed:

    python tests/golden/make_llama_generate.py

The directory holds what ``save_pretrained`` writes (``config.json``,
``model.safetensors``; ``generation_config.json`` is dropped) and
``generate.json``: the prompts, the number of new tokens, the tokens
``generate`` returned (prompts included) and the versions that made them.
Regenerating gives the same files (the model is seeded).
"""

from __future__ import annotations

import json
import pathlib
import platform

OUT = pathlib.Path(__file__).resolve().parent / "llama_generate"
PROMPTS = [[1, 5, 9, 3], [7, 2, 2, 30]]
NEW_TOKENS = 6


def main() -> None:
  import torch  # pylint: disable=import-outside-toplevel  (only to make the files)
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
      tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(OUT)
  (OUT / "generation_config.json").unlink(missing_ok=True)
  prompt = torch.tensor(PROMPTS)
  with torch.no_grad():
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                            max_new_tokens=NEW_TOKENS, do_sample=False)
  meta = {"generator": "tests/golden/make_llama_generate.py", "torch": torch.__version__,
          "transformers": transformers.__version__, "python": platform.python_version(),
          "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS, "tokens": tokens.tolist()}
  (OUT / "generate.json").write_text(json.dumps(meta) + "\n")
  print(f"wrote {OUT}: {meta['tokens']}")


if __name__ == "__main__":
  main()
