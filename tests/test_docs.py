"""Runs the code in the README and in ``docs/*.md``, so doc examples stay true.

For every Markdown file, its fenced ```` ```python ```` and ```` ```pycon ````
blocks run in order, in one namespace (like a notebook), in a fresh Python
process with an environment stripped of the pytest process's JAX/XLA settings
(``XLA_FLAGS`` holds only the tests' compile-time flag, ``TEST_XLA_FLAGS``):

* a block with ``>>>`` prompts is a doctest: its printed output must match
  (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on);
* any other block is executed and must not raise.

Blocks in other languages are shown, not run: ```` ```py ```` for PyTorch
code next to its fsdp_jax equivalent in ``docs/migration.md``, ```` ```bash ````,
```` ```text ````. A block directly preceded by the line
``<!-- test_docs: skip -->`` is not run either (for code that needs a cluster).

Every example runs as written: each file defines what its blocks use in an
earlier block of the same file (its set-up: a small model, random batches,
the mesh, simulated CPU devices), and a block that continues an earlier one
says so in its first line (``# Continues the example above (state, step).``)
or the file says that its blocks run top to bottom. Files write into
``tempfile.mkdtemp()`` or relative paths, which the test's working directory
(a temporary directory) holds. The test adds nothing before or between the
blocks; ``CONTEXTS`` below only holds checks run after a file's last block
(``epilogue``), which read what the examples computed.

``docs/api.md`` is generated from the public docstrings (already doctested by
``--doctest-modules``): it is not run here, but it must be up to date with
``python docs/gen_api.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from helpers import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_LANGS = ("python", "pycon")
SKIP_MARK = "<!-- test_docs: skip -->"
TIMEOUT_S = 600
NOT_RUN = {"api.md"}  # generated; see test_api_md_is_up_to_date

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


@dataclasses.dataclass
class Block:
  lang: str
  code: str
  line: int     # 1-based line of the first code line in the file
  skip: bool

  @property
  def doctest(self) -> bool:
    return any(l.lstrip().startswith(">>>") for l in self.code.splitlines())


def code_blocks(text: str) -> list[Block]:
  """Fenced code blocks of a Markdown text (CommonMark fences)."""
  lines = text.splitlines()
  out, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, info, indent = m.group("fence"), m.group("info").strip(), len(m.group("indent"))
    lang = info.split()[0].lower() if info else ""
    skip = i > 0 and lines[i - 1].strip() == SKIP_MARK
    body, j = [], i + 1
    while j < len(lines):
      close = lines[j].strip()
      if close.startswith(fence[0] * len(fence)) and not close.strip(fence[0]):
        break
      body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
      j += 1
    out.append(Block(lang, "\n".join(body) + "\n", i + 2, skip))
    i = j + 1
  return out


# Checks run after a file's blocks (the examples themselves define everything
# they use). They only read what the examples left behind.

CONTEXTS = {
    # The checkpoint block restores the state saved after the usage example's step.
    "README.md": dict(
        epilogue="assert sorted(full) == ['l1.w', 'l2.w'] and int(state.step) == 1",
    ),
    # Three steps, saved every 1000: the first save is written; restored as HYBRID.
    "checkpointing.md": dict(
        epilogue="""
assert int(state.step) == 1, int(state.step)  # saved: the first step only
assert state.plan.config.sharding_strategy is fsdp_jax.ShardingStrategy.HYBRID_SHARD
""",
    ),
    # Two losses and an EMA written from the building blocks.
    "custom_step.md": dict(epilogue="assert np.isfinite(float(loss)) and float(norm) > 0"),
    # train.py run as one process (``python train.py``), then the preemption loop.
    "multihost.md": dict(epilogue="assert int(state.step) == 4 and jax.process_count() == 1"),
}


def doc_files() -> list[pathlib.Path]:
  return [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_RUN)


def runnable(path: pathlib.Path) -> list[Block]:
  return [b for b in code_blocks(path.read_text()) if b.lang in RUN_LANGS and not b.skip]


RUNNER = r'''
import doctest, json, sys, traceback
spec = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in spec["blocks"]:
  where = f"{spec['file']}:{b['line']}" if b["line"] else f"{spec['file']}: {b['name']}"
  sys.stdout.flush()
  if b["doctest"]:
    test = doctest.DocTestParser().get_doctest(b["code"], ns, where, spec["file"], b["line"] - 1)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, clear_globs=False)
    ns.update(test.globs)  # DocTest copies its globals: keep what the block defined
    if runner.failures:
      print(f"FAILED: doctest block at {where}", flush=True)
      sys.exit(1)
  else:
    # Pad so that tracebacks show the line numbers of the Markdown file.
    code = "\n" * (b["line"] - 1) + b["code"]
    try:
      exec(compile(code, spec["file"] if b["line"] else where, "exec"), ns)
    except BaseException:
      traceback.print_exc()
      print(f"FAILED: block at {where}", flush=True)
      sys.exit(1)
  print(f"ok: {where}", flush=True)
'''


def _env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and not k.startswith("JAX_") and not k.startswith("FSDP_JAX_")}
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env["MPLBACKEND"] = "Agg"
  env["XLA_FLAGS"] = TEST_XLA_FLAGS  # compile faster; no device set-up (helpers.py)
  return env


def run_doc(path: pathlib.Path, tmp: pathlib.Path) -> subprocess.CompletedProcess:
  ctx = CONTEXTS.get(path.name, {})
  blocks = [{"code": b.code, "line": b.line, "doctest": b.doctest, "name": ""}
            for b in runnable(path)]
  if ctx.get("epilogue"):
    blocks.append({"code": textwrap.dedent(ctx["epilogue"]), "line": 0, "doctest": False,
                   "name": "epilogue (tests/test_docs.py)"})
  spec = tmp / "blocks.json"
  spec.write_text(json.dumps({"file": str(path), "blocks": blocks}))
  runner = tmp / "run_blocks.py"
  runner.write_text(RUNNER)
  return subprocess.run([sys.executable, str(runner), str(spec)], cwd=tmp, env=_env(),
                        capture_output=True, text=True, timeout=TIMEOUT_S)


DOCS_WITH_CODE = [p for p in doc_files() if runnable(p)]


def test_docs_have_examples():
  names = {p.name for p in DOCS_WITH_CODE}
  assert {"README.md", "migration.md", "faq.md"} <= names, names


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS_WITH_CODE, ids=lambda p: p.name)
def test_doc_examples_run(path, tmp_path):
  proc = run_doc(path, tmp_path)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, (
      f"{path.relative_to(ROOT)}: an example failed (blocks run in order in one "
      f"process; line numbers are the file's):\n{out[-6000:]}")
  expected = len(runnable(path)) + bool(CONTEXTS.get(path.name, {}).get("epilogue"))
  assert out.count("ok: ") == expected, out[-3000:]


def test_contexts_only_check():
  """The test adds checks after a file's examples, never code they need."""
  assert all(set(ctx) <= {"epilogue"} for ctx in CONTEXTS.values()), CONTEXTS
  assert set(CONTEXTS) <= {p.name for p in DOCS_WITH_CODE}, sorted(CONTEXTS)


def test_code_blocks_parser():
  text = textwrap.dedent("""\
      intro
      ```python
      x = 1
      ```
      ```py
      torch.nn.Linear(2, 3)
      ```
      <!-- test_docs: skip -->
      ```python
      needs_a_cluster()
      ```
      ````pycon
      >>> print("```")
      ```
      ````
      """)
  blocks = code_blocks(text)
  assert [(b.lang, b.line, b.skip) for b in blocks] == [
      ("python", 3, False), ("py", 6, False), ("python", 10, True), ("pycon", 13, False)]
  assert blocks[0].code == "x = 1\n" and blocks[3].doctest
  assert blocks[3].code == '>>> print("```")\n```\n'


def test_api_md_is_up_to_date():
  """docs/api.md is what docs/gen_api.py generates from the docstrings now."""
  proc = subprocess.run([sys.executable, str(DOCS / "gen_api.py"), "--check"],
                        cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=TIMEOUT_S)
  assert proc.returncode == 0, (
      "docs/api.md is out of date with the public docstrings. Fix: run "
      f"`python docs/gen_api.py` and commit docs/api.md.\n{proc.stdout}{proc.stderr}")
