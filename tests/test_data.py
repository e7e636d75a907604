"""fsdp_jax.data: TRL's rows tokenized as TRL does, packed, sharded by
process, batched onto the mesh, resumed bit for bit; the bad inputs.

A tiny word-level tokenizer is built here (transformers'
``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model) with a
chat template whose assistant turns sit in ``{% generation %}`` blocks.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import io
import itertools
import json
import os
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from tests.helpers import lazy_modules, subprocess_env

grain, tokenizers, transformers = lazy_modules("grain", "tokenizers", "transformers")
pytestmark = pytest.mark.skipif(
    grain is None or transformers is None,
    reason="fsdp_jax[data] (grain, tokenizers, transformers) is not installed")
if grain is not None and transformers is not None:
  from fsdp_jax import data
  from fsdp_jax._src.data import stats
  from fsdp_jax._src.data.encode import Encoder

SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = ("hello hi how are you fine thanks what is two plus three five the answer tell me a "
         "joke no ok bye").split()
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'system' %}<|system|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
    "<|end|>{% endgeneration %} "
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHAT = [
    {"messages": [{"role": "system", "content": "hi"},
                  {"role": "user", "content": "what is two plus three"},
                  {"role": "assistant", "content": "five"},
                  {"role": "user", "content": "thanks"},
                  {"role": "assistant", "content": "ok bye"}]},
    {"messages": [{"role": "user", "content": "tell me a joke"},
                  {"role": "assistant", "content": "no"}]},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  vocab = {t: i for i, t in enumerate(SPECIAL + ["<unk>"] + WORDS)}
  model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=model, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
      unk_token="<unk>", additional_special_tokens=SPECIAL[3:])
  tok.chat_template = TEMPLATE
  path = tmp_path_factory.mktemp("tokenizer")
  tok.save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def tok(tok_dir):
  return transformers.AutoTokenizer.from_pretrained(tok_dir)


def write_jsonl(path, rows, blank_at=()):
  with open(path, "w") as f:
    for i, r in enumerate(rows):
      if i in blank_at:
        f.write("\n")
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def unpacked(rows, tok, seq_len=32, **kw):
  return list(data.sft_dataset(rows, tok, seq_len=seq_len, packing=None, shuffle_seed=None,
                               **kw))


def loss_ids(row):
  return row["input_ids"][row["labels"] != -100].tolist()


# ---------------------------------------------------------------------------
# Tokenization as TRL does it


def test_assistant_loss_is_the_generation_mask(tok):
  out = unpacked(CHAT, tok)
  for row, example in zip(out, CHAT):
    ref = tok.apply_chat_template(example["messages"], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    n = len(ref["input_ids"])
    assert row["input_ids"][:n].tolist() == list(ref["input_ids"])
    expected = np.where(np.asarray(ref["assistant_masks"], bool), ref["input_ids"], -100)
    np.testing.assert_array_equal(row["labels"][:n], expected)
    assert (row["labels"][n:] == -100).all() and (row["segment_ids"] == (np.arange(32) < n)).all()
    np.testing.assert_array_equal(row["positions"][:n], np.arange(n))
  assert tok.decode(loss_ids(out[0])) == "five <|end|> ok bye <|end|>"
  # TRL's default for conversations (assistant_only_loss=False): every token.
  every = unpacked(CHAT[1:], tok, loss_on="completion")[0]
  n = int((every["segment_ids"] > 0).sum())
  assert (every["labels"][1:n] == every["input_ids"][1:n]).all() and every["labels"][0] == -100


def test_prompt_completion_and_text_rows(tok):
  rows = [{"prompt": "tell me a joke", "completion": " no"},
          {"prompt": [{"role": "user", "content": "hi"}],
           "completion": [{"role": "assistant", "content": "hello"}]},
          {"text": "hello how are you"}]
  pc, conv, text = unpacked(rows, tok)
  # TRL: tokenizer(prompt), tokenizer(prompt + completion + eos), loss after the prompt.
  assert tok.decode(loss_ids(pc)) == "no </s>"
  assert tok.decode(pc["input_ids"][pc["segment_ids"] > 0]) == "tell me a joke no </s>"
  # Conversational: the prompt rendered with the generation prompt, no eos added.
  assert tok.decode(loss_ids(conv)) == "hello <|end|>"
  # Text: eos appended, every token but the first (never predicted) in the loss.
  assert tok.decode(text["input_ids"][text["segment_ids"] > 0]) == "hello how are you </s>"
  assert tok.decode(loss_ids(text)) == "how are you </s>"
  assert tok.decode(loss_ids(unpacked(rows[:1], tok, loss_on="all")[0])) == (
      "me a joke no </s>")


# ---------------------------------------------------------------------------
# Packing


def long_tailed_rows(n, seq_len, seed=0):
  """Word counts from a log-normal (median seq_len / 8, sigma 0.9: p50 16,
  p90 49, p99 114 tokens at seq_len 128), clipped below seq_len."""
  rng = np.random.default_rng(seed)
  lens = np.clip(rng.lognormal(np.log(seq_len / 8), 0.9, n).astype(int), 1, seq_len - 1)
  return [{"text": " ".join(rng.choice(WORDS, k))} for k in lens]


@pytest.mark.parametrize("packing", ["first_fit", "best_fit"])
def test_packing_keeps_every_document_whole(tok, packing):
  rows = long_tailed_rows(400, 128)
  reference = unpacked(rows, tok, seq_len=128)
  docs = collections.Counter()
  for r in reference:
    n = int(r["segment_ids"].sum())
    docs[(tuple(r["input_ids"][:n]), tuple(r["labels"][:n]))] += 1
  packed = list(data.sft_dataset(rows, tok, seq_len=128, packing=packing))
  got = collections.Counter()
  for r in packed:
    seg = r["segment_ids"]
    n = int((seg > 0).sum())
    assert (seg[n:] == 0).all() and (np.diff(seg[:n]) >= 0).all()  # documents, then padding
    assert set(seg[:n].tolist()) == set(range(1, seg.max() + 1))
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      np.testing.assert_array_equal(r["positions"][idx], np.arange(len(idx)))
      assert r["labels"][idx[0]] == -100  # no prediction across documents
      got[(tuple(r["input_ids"][idx]), tuple(r["labels"][idx]))] += 1
    assert (r["labels"][seg == 0] == -100).all() and (r["input_ids"][seg == 0] == 0).all()
  assert got == docs
  padding = float(np.mean([r["segment_ids"] == 0 for r in packed]))
  assert padding <= 0.05, padding  # 2.3% here; unpacked rows are 80% padding
  assert float(np.mean([r["segment_ids"] == 0 for r in reference])) > 0.7


def test_dataset_pickles_for_worker_processes(tok):
  """grain's worker processes (``mp_prefetch``) get the dataset pickled: the
  copy gives the same rows."""
  rows = long_tailed_rows(40, 64)
  ds = data.sft_dataset(rows, tok, seq_len=64)
  copy = pickle.loads(pickle.dumps(ds))
  for a, b in zip(itertools.islice(iter(ds), 3), itertools.islice(iter(copy), 3)):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_processes_read_disjoint_equal_shares(tok):
  rows = [{"text": WORDS[i]} for i in range(20)]  # 20 different rows
  everything = unpacked(rows, tok, seq_len=16)
  shares = [list(data.sft_dataset(
      rows, tok, seq_len=16, packing=None, shuffle_seed=3, num_epochs=2,
      shard_options=grain.sharding.ShardOptions(shard_index=i, shard_count=3,
                                                drop_remainder=True)))
            for i in range(3)]
  assert [len(s) for s in shares] == [13, 13, 13]  # 40 rows over 3: the remainder dropped
  key = lambda r: tuple(r["input_ids"].tolist())
  seen = collections.Counter(key(r) for s in shares for r in s)
  assert set(seen) == {key(r) for r in everything}
  # Each row once per epoch over all processes, but the one dropped remainder.
  assert sorted(seen.values()) == [1] + [2] * 19


# ---------------------------------------------------------------------------
# Batches on the mesh, resume


@pytest.mark.parametrize("axes", [dict(replicate=2, shard=4), dict(shard=4, tensor=2),
                                  dict(shard=2, context=4)])
def test_batches_are_split_over_the_data_axes(tok, axes):
  """Rows over the data axes; a tensor axis holds copies of a row, a context
  axis whole rows too (the step splits their sequence)."""
  mesh = fsdp_jax.make_mesh(**axes)
  ds = data.sft_dataset(CHAT * 8, tok, seq_len=16, packing=None, truncation="truncate")
  rows = list(ds)
  it = data.batches(ds, global_batch=8, mesh=mesh)
  first = next(it)
  spec = jax.sharding.PartitionSpec(("replicate", "shard") if "replicate" in axes else "shard")
  for key in data.FEATURES:
    x = first[key]
    assert x.shape == (8, 16) and x.dtype == jnp.int32 and x.sharding.spec == spec
    assert x.sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(x), np.stack([r[key] for r in rows[:8]]))
  assert len(list(it)) == 1  # 16 rows: two batches, nothing partial
  dp = axes.get("replicate", 1) * axes["shard"]
  with pytest.raises(ValueError, match=rf"global_batch={dp + 1} is not a positive multiple "
                     rf"of the data-parallel size {dp} .* Fix: global_batch={2 * dp}"):
    data.batches(ds, global_batch=dp + 1, mesh=mesh)


def test_resume_gives_the_same_batches_bitwise(tok, tmp_path):
  rows = long_tailed_rows(120, 32, seed=1)
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=fsdp_jax.FSDPConfig())
  make = lambda: data.batches(
      data.sft_dataset(rows, tok, seq_len=32, packing="first_fit", num_epochs=2,
                       shuffle_seed=7, packing_bins=4), global_batch=4, mesh=mesh)
  it = make()
  for _ in range(5):
    next(it)
  with fsdp_jax.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(state, data_iterator=it)
    expected = [next(it) for _ in range(4)]
    mngr.wait_until_finished()
    assert [f for f in os.listdir(tmp_path / "ckpt" / "0" / "data_iterator")
            if f.endswith(".json")] == ["process_0-of-1.json"]
    again = make()
    mngr.restore(state, data_iterator=again)
  assert again.batches_given == 5
  for want in expected:
    got = next(again)
    for key in data.FEATURES:
      np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
  # grain's own iterators too, in grain's file layout (its handler reads it).
  plain = iter(data.sft_dataset(rows, tok, seq_len=32))
  next(plain)
  with fsdp_jax.CheckpointManager(tmp_path / "grain") as mngr:
    mngr.save(state, data_iterator=plain)
    mngr.wait_until_finished()
  fresh = iter(data.sft_dataset(rows, tok, seq_len=32))
  grain.checkpoint.CheckpointHandler().restore(tmp_path / "grain" / "0" / "data_iterator",
                                               item=fresh)
  np.testing.assert_array_equal(next(fresh)["input_ids"], next(plain)["input_ids"])


# ---------------------------------------------------------------------------
# Bad input: each error names the file and line (or the value) and the fix


def test_bad_rows_name_file_line_and_fix(tok, tmp_path):
  good = CHAT[1]
  path = write_jsonl(tmp_path / "bad.jsonl", [good, good, {"question": "x"}], blank_at=(1,))
  ds = data.sft_dataset(path, tok, seq_len=32, shuffle_seed=None, packing=None)
  with pytest.raises(ValueError, match=r"bad\.jsonl:4: the row has none of the fields .*"
                     r"\['question'\]\)\. Fix: give each row 'messages'"):
    list(ds)
  first = write_jsonl(tmp_path / "first.jsonl", [{"question": "x"}])
  with pytest.raises(ValueError, match=r"first\.jsonl:1: the row has none"):  # at once
    data.sft_dataset(first, tok, seq_len=32)
  tool = {"messages": [{"role": "tool", "content": "five"}]}
  with pytest.raises(ValueError, match=r"role.*\['tool'\].*unknown role tool\. Fix: use the "
                     "roles the template knows"):
    data.sft_dataset(write_jsonl(tmp_path / "role.jsonl", [tool]), tok, seq_len=32)
  dropping = Encoder(tok, seq_len=32, chat_template=TEMPLATE.replace(
      "{{ raise_exception('unknown role ' + m['role']) }}", ""))
  with pytest.raises(ValueError, match=r"x:9: the chat template drops the turns of role "
                     "'tool'"):
    dropping.encode("x:9", {"messages": [tool["messages"][0], *good["messages"]]})
  with pytest.raises(ValueError, match=r"long\.jsonl:1: the example is 5 tokens, longer than "
                     r"seq_len=4\. Fix: .*truncation='truncate'"):
    data.sft_dataset(write_jsonl(tmp_path / "long.jsonl", [{"text": "a b c d"}]), tok,
                     seq_len=4)
  assert unpacked([{"text": "a b c d"}], tok, seq_len=4, truncation="truncate")[0][
      "segment_ids"].tolist() == [1, 1, 1, 1]
  with pytest.raises(ValueError, match=r"empty\.jsonl has no rows"):
    data.sft_dataset(write_jsonl(tmp_path / "empty.jsonl", [""]), tok, seq_len=8)
  plain = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
  plain.chat_template = None
  with pytest.raises(ValueError, match=r"item 0 of the source: a 'messages' row .* has none\. "
                     "Fix: pass sft_dataset"):
    data.sft_dataset(CHAT, plain, seq_len=32)
  no_markers = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
  with pytest.raises(ValueError, match=r"has no such block .* Fix: pass chat_template="):
    data.sft_dataset(CHAT, tok, seq_len=32, chat_template=no_markers)
  assert len(unpacked(CHAT, tok, chat_template=no_markers, loss_on="all")) == 2


def test_restore_without_saved_iterator_state_touches_nothing(tok, tmp_path):
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=fsdp_jax.FSDPConfig())
  it = data.batches(data.sft_dataset(CHAT * 4, tok, seq_len=32), global_batch=2, mesh=mesh)
  next(it)
  before = it.get_state()
  with fsdp_jax.CheckpointManager(tmp_path / "c") as mngr:
    mngr.save(state)
    with pytest.raises(ValueError, match="saved without data_iterator="):
      mngr.restore(state, data_iterator=it)
    with pytest.raises(TypeError, match="without get_state.*Fix: pass a checkpointable"):
      mngr.save(state.replace(step=state.step + 1), data_iterator=iter([1]), force=True)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]  # nothing written
  assert it.get_state() == before
  with pytest.raises(ValueError, match="saved with global_batch=2, this iterator has "
                     "global_batch=4"):
    data.batches(data.sft_dataset(CHAT * 4, tok, seq_len=32), global_batch=4,
                 mesh=fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])).set_state(before)


# ---------------------------------------------------------------------------
# examples/finetune.py --data


def test_finetune_example_reads_chat_jsonl(tok, tok_dir, tmp_path):
  spec = importlib.util.spec_from_file_location(
      "example_finetune_data", pathlib.Path(__file__).parents[1] / "examples" / "finetune.py")
  finetune = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(finetune)
  path = write_jsonl(tmp_path / "chat.jsonl", CHAT * 10)  # 20 rows: 18 trained, 2 held out
  args = finetune.parse_args(["--data", path, "--tokenizer", tok_dir, "--seq-len", "24",
                              "--eval-batches", "3"])  # 20 + 9 tokens: one a row
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  train, evals, held_ids = finetune.sft_data(args, "no checkpoint", 256, mesh, 2)
  assert len(evals) == 1  # the 2 held-out rows make one batch of 2
  assistant = set(tok(text="five ok bye no <|end|>")["input_ids"])
  for batch in (next(train), evals[0]):
    assert batch["input_ids"].shape == (2, 24) and batch["segment_ids"].sharding.mesh == mesh
    labels, ids = np.asarray(batch["labels"]), np.asarray(batch["input_ids"])
    assert set(ids[labels != -100].tolist()) <= assistant  # the assistant turns only
  assert len(held_ids) == int((np.asarray(evals[0]["segment_ids"]) > 0).sum()) == 29
  with pytest.raises(SystemExit, match="more than the model's vocabulary of 16"):
    finetune.sft_data(args, "no checkpoint", 16, mesh, 2)


# ---------------------------------------------------------------------------
# python -m fsdp_jax.data.inspect


def test_inspect_prints_what_the_data_becomes(tok_dir, tmp_path):
  path = write_jsonl(tmp_path / "chat.jsonl", CHAT + [{"text": "hello " * 40}])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    s = stats.main([path, "--tokenizer", tok_dir, "--seq-len", "24"])
  text = out.getvalue()
  # 20 + 9 tokens: two rows of 24; 'five <|end|> ok bye <|end|>' and 'no <|end|>' in the loss
  assert s["examples"] == 3 and s["too_long"] == 1 and s["rows"] == 2
  assert s["loss_tokens"] == 7 and s["tokens"] == 29 and s["documents_per_row"] == (1.0, 1, 1)
  assert f"padding: {19 / 48:.1%}" in text and "tokens in the loss: 7 of 29" in text
  assert "longer than seq_len: 1 example, first " + path + ":3 (41 tokens)" in text
  assert "[[five <|end|>]]" in text and "[[ok bye <|end|>]]" in text


@pytest.mark.slow
def test_import_fsdp_jax_needs_no_grain():
  code = ("import sys, fsdp_jax\n"
          "fsdp_jax.CheckpointManager, fsdp_jax.shard_train_step, fsdp_jax.models.from_pretrained\n"
          "assert not {'grain', 'transformers', 'tokenizers'} & set(sys.modules)\n"
          "sys.modules['grain'] = None\n"
          "try:\n  import fsdp_jax.data\nexcept ImportError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120, check=True)
  assert "pip install fsdp_jax[data]" in out.stdout, out.stderr
