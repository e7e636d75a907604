"""One row -> one tokenized example, as TRL's ``SFTTrainer`` tokenizes it.

* ``{"messages": [...]}``: the tokenizer's chat template
  (``apply_chat_template(..., return_dict=True,
  return_assistant_tokens_mask=True)``); with ``loss_on="assistant"`` the
  loss is on the tokens the template's ``{% generation %}`` blocks mark
  (TRL's ``assistant_only_loss``), else on every token.
* ``{"prompt": ..., "completion": ...}``: ``tokenizer(prompt)`` and
  ``tokenizer(prompt + completion + eos)`` (the eos appended as text unless
  the completion ends with it); the loss on the tokens after the prompt's
  (TRL's ``completion_only_loss``) unless ``loss_on="all"``. A
  conversational pair (lists of messages) goes through the chat template,
  the prompt with ``add_generation_prompt=True``, no eos added.
* ``{"text": ...}``: ``tokenizer(text + eos)``, the loss on every token.

The example is ``{"input_ids", "labels"}`` (int32): labels are the input
ids where the loss is taken and -100 elsewhere, aligned with the inputs as
in transformers (the model shifts: position t predicts labels[t + 1]); the
first label of each example is -100, so a packed row never predicts one
document's first token from the previous document.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from typing import Any, Optional

import numpy as np

__all__ = ["Encoder", "IGNORE", "LOSS_ON", "TRUNCATION", "load_tokenizer"]

IGNORE = -100
USUAL_ROLES = ("system", "user", "assistant")
LOSS_ON = ("assistant", "completion", "all")
TRUNCATION = ("error", "drop", "truncate")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_FORMS = ("'messages' (a list of {'role': ..., 'content': ...}), 'prompt' and 'completion', "
          "or 'text'")


def load_tokenizer(tokenizer):
  """A transformers tokenizer, or the one in directory ``tokenizer``
  (``transformers.AutoTokenizer.from_pretrained``)."""
  if isinstance(tokenizer, (str, os.PathLike)):
    try:
      transformers = importlib.import_module("transformers")  # optional: fsdp_jax[data]
    except ImportError as e:
      raise ImportError(
          f"sft_dataset: reading the tokenizer in {os.fspath(tokenizer)!r} needs transformers. "
          "Fix: pip install fsdp_jax[data] (grain, tokenizers, transformers).") from e
    if not os.path.isdir(tokenizer):
      raise FileNotFoundError(
          f"sft_dataset: tokenizer {os.fspath(tokenizer)!r} is not a directory. Fix: pass the "
          "directory tokenizer.save_pretrained() wrote (tokenizer.json, "
          "tokenizer_config.json), or the tokenizer object.")
    return transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer))
  if not callable(tokenizer) or not hasattr(tokenizer, "apply_chat_template"):
    raise TypeError(
        f"sft_dataset: tokenizer is a {type(tokenizer).__name__}, not a transformers "
        "tokenizer. Fix: pass transformers.AutoTokenizer.from_pretrained(dir), or the "
        "directory itself.")
  return tokenizer


def _template_text(template) -> Optional[str]:
  if isinstance(template, dict):  # named templates: the default one
    template = template.get("default")
  return template if isinstance(template, str) else None


class Encoder:
  """``(where, row)`` -> ``{"input_ids", "labels"}`` (or None when the
  example is dropped), with the checks that name the row."""

  def __init__(self, tokenizer, *, seq_len: int, loss_on: str = "assistant",
               chat_template: Optional[str] = None, truncation: str = "error"):
    self.tokenizer = tokenizer
    self.seq_len = int(seq_len)
    self.loss_on = loss_on
    self.truncation = truncation
    self.chat_template = chat_template
    self.template = _template_text(chat_template if chat_template is not None
                                   else getattr(tokenizer, "chat_template", None))
    self.eos = getattr(tokenizer, "eos_token", None)
    self._checked_roles: set = set()
    self._lock = threading.Lock()

  # grain's worker processes (``mp_prefetch``) receive the dataset pickled:
  # the lock is per process, made anew there.
  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  # -- checks ----------------------------------------------------------------
  def _need_template(self, where: str, what: str) -> None:
    name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
    if self.template is None:
      raise ValueError(
          f"{where}: a {what} row is rendered with a chat template, and the tokenizer "
          f"{name!r} has none. Fix: pass sft_dataset(..., chat_template=...) (a Jinja chat "
          "template; with {% generation %} ... {% endgeneration %} around assistant "
          "replies for loss_on='assistant'), or use a tokenizer that has one (an "
          "-Instruct model's).")
    if what == "'messages'" and self.loss_on == "assistant" and not _GENERATION.search(
        self.template):
      raise ValueError(
          f"{where}: loss_on='assistant' takes the loss on the tokens the chat template "
          "marks with {% generation %} ... {% endgeneration %} (transformers' "
          "return_assistant_tokens_mask, TRL's assistant_only_loss), and the template of "
          f"{name!r} has no such block (TRL raises 'the tokenizer's chat template doesn't "
          "generate assistant masks' here). Fix: pass chat_template= a copy of the template "
          "with {% generation %}{{ message['content'] }}{% endgeneration %} around the "
          "assistant turns, or loss_on='all' to take the loss on every token.")

  def _render(self, where: str, messages, **kw) -> dict:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages):
      raise ValueError(
          f"{where}: messages must be a list of {{'role': ..., 'content': ...}} dicts; got "
          f"{str(messages)[:80]!r}. Fix: write each turn as {{\"role\": \"user\", "
          "\"content\": \"...\"}.")
    try:
      out = self.tokenizer.apply_chat_template(
          messages, chat_template=self.chat_template, tokenize=True, return_dict=True, **kw)
    except ImportError as e:  # transformers renders templates with jinja2
      raise ImportError(f"{where}: rendering the chat template needs {e.name or 'jinja2'}: "
                        f"{e}. Fix: pip install fsdp_jax[data].") from e
    except Exception as e:  # jinja's TemplateError (raise_exception), KeyError, ...
      roles = sorted({str(m.get("role")) for m in messages})
      raise ValueError(
          f"{where}: the chat template failed on this row (roles {roles}): "
          f"{type(e).__name__}: {e}. Fix: use the roles the template knows (usually "
          "'system', 'user', 'assistant'), or pass a chat_template= that renders these "
          "roles.") from None
    self._check_roles(where, messages)
    return out

  def _check_roles(self, where: str, messages) -> None:
    """A role other than system/user/assistant, seen for the first time,
    must show its content in the rendered text: a template that silently
    drops a role it does not know would train on a conversation missing
    that turn. (The three usual roles are not checked: templates may
    rewrite their content, e.g. drop an earlier turn's reasoning.)"""
    new = [m for m in messages if m.get("role") not in self._checked_roles]
    if not new:
      return
    text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                              tokenize=False)
    for m in new:
      content = m.get("content")
      if (m.get("role") not in USUAL_ROLES and isinstance(content, str) and content.strip()
          and content.strip() not in text):
        raise ValueError(
            f"{where}: the chat template drops the turns of role {m['role']!r} (its content "
            f"{content[:40]!r} is not in the rendered conversation). Fix: map the role to "
            "one the template knows (usually 'system', 'user', 'assistant'), or pass a "
            "chat_template= that renders it.")
    with self._lock:
      self._checked_roles.update(m.get("role") for m in new)

  # -- tokenization ----------------------------------------------------------
  def _text_ids(self, text: str) -> list:
    return list(self.tokenizer(text=text)["input_ids"])

  def _with_eos(self, text: str) -> str:
    return text if self.eos is None or text.endswith(self.eos) else text + self.eos

  def tokenize(self, where: str, row: Any) -> tuple[list, list]:
    """``(input_ids, loss mask)`` of one row, before truncation."""
    if not isinstance(row, dict):
      raise ValueError(
          f"{where}: the row is a {type(row).__name__}, not a JSON object. Fix: write each "
          f"row as an object with {_FORMS}.")
    if "messages" in row:
      self._need_template(where, "'messages'")
      assistant = self.loss_on == "assistant"
      out = self._render(where, row["messages"], return_assistant_tokens_mask=assistant)
      ids = list(out["input_ids"])
      if not assistant:
        return ids, [1] * len(ids)
      mask = list(out["assistant_masks"])
      if 1 not in mask and any(isinstance(m, dict) and m.get("role") == "assistant"
                               for m in row["messages"]):
        raise ValueError(
            f"{where}: loss_on='assistant' found no assistant tokens in a conversation with "
            "assistant turns: the chat template's {% generation %} blocks do not cover "
            "them (TRL's assistant_only_loss raises here too). Fix: put {% generation %} ... "
            "{% endgeneration %} around the assistant content in chat_template=, or "
            "loss_on='all'.")
      return ids, mask
    if "prompt" in row and "completion" in row:
      prompt, completion = row["prompt"], row["completion"]
      if isinstance(prompt, list) and isinstance(completion, list):
        self._need_template(where, "conversational 'prompt'/'completion'")
        prompt_ids = list(self._render(where, prompt, add_generation_prompt=True)["input_ids"])
        ids = list(self._render(where, prompt + completion)["input_ids"])
      elif isinstance(prompt, str) and isinstance(completion, str):
        prompt_ids = self._text_ids(prompt)
        ids = self._text_ids(prompt + self._with_eos(completion))
      else:
        raise ValueError(
            f"{where}: 'prompt' and 'completion' must both be strings or both lists of "
            f"messages; got {type(prompt).__name__} and {type(completion).__name__}. Fix: "
            "write them as the same kind.")
      if self.loss_on == "all":
        return ids, [1] * len(ids)
      n = min(len(prompt_ids), len(ids))
      return ids, [0] * n + [1] * (len(ids) - n)
    if "text" in row:
      if not isinstance(row["text"], str):
        raise ValueError(f"{where}: 'text' must be a string; got "
                         f"{type(row['text']).__name__}. Fix: write the text as a string.")
      ids = self._text_ids(self._with_eos(row["text"]))
      return ids, [1] * len(ids)
    raise ValueError(
        f"{where}: the row has none of the fields sft_dataset reads (its keys: "
        f"{sorted(map(str, row))}). Fix: give each row {_FORMS}.")

  def encode(self, where: str, row: Any) -> tuple[Optional[dict], str]:
    """``(example or None, what happened: "ok" | "truncated" | "dropped")``."""
    ids, mask = self.tokenize(where, row)
    status = "ok"
    if len(ids) > self.seq_len:
      if self.truncation == "error":
        raise ValueError(
            f"{where}: the example is {len(ids)} tokens, longer than seq_len={self.seq_len}. "
            "Fix: raise seq_len, or pass truncation='truncate' (keep the first seq_len "
            "tokens, as TRL's max_length does) or truncation='drop' (skip such examples).")
      if self.truncation == "drop":
        return None, "dropped"
      ids, mask, status = ids[:self.seq_len], mask[:self.seq_len], "truncated"
    if not ids:
      return None, "dropped"
    input_ids = np.asarray(ids, np.int32)
    labels = np.where(np.asarray(mask, bool), input_ids, IGNORE).astype(np.int32)
    labels[0] = IGNORE
    return {"input_ids": input_ids, "labels": labels}, status

  def __call__(self, item) -> Optional[dict]:
    where, row = item
    return self.encode(where, row)[0]
