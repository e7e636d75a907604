"""Runs the code in the README and in ``docs/*.md``, so doc examples stay true.

For every Markdown file, its fenced ```` ```python ```` and ```` ```pycon ````
blocks run in order, in one namespace (like a notebook), in a fresh Python
process with an environment stripped of the pytest process's JAX/XLA settings:

* a block with ``>>>`` prompts is a doctest: its printed output must match
  (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on);
* any other block is executed and must not raise.

Blocks in other languages are shown, not run: ```` ```py ```` for PyTorch
code next to its fsdp_jax equivalent in ``docs/migration.md``, ```` ```bash ````,
```` ```text ````. A block directly preceded by the line
``<!-- test_docs: skip -->`` is not run either (for code that needs a cluster).

Files whose examples are fragments of a larger program (they use a ``state``
or ``step`` built earlier in the prose) get a small set-up defining those
names (``CONTEXTS`` below: a prelude, code inserted before the first block
that uses a name, a closing check); absolute output paths in them are
redirected into a temporary directory. Everything else must run as written,
device set-up included: the README's usage example, and the guides written as
runnable tutorials (``migration.md``, ``faq.md``).

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


# ---------------------------------------------------------------------------
# Preludes for the docs whose examples continue a program the prose describes.
# ``{tmp}`` is replaced by the test's temporary directory.

_SMALL_RUN = """
import fsdp_jax
fsdp_jax.simulate_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import PartitionSpec as P

rng = np.random.default_rng(0)
params = {"inp": {"w": rng.normal(size=(5, 7)).astype(np.float32)},
          "blocks": [{"w": rng.normal(size=(7, 7)).astype(np.float32),
                      "b": np.zeros(7, np.float32)} for _ in range(3)],
          "out": {"w": rng.normal(size=(7, 3)).astype(np.float32)}}

def loss_fn(params, batch):
  x = jnp.tanh(batch["x"] @ params["inp"]["w"])
  for blk in params["blocks"]:
    x = jnp.tanh(x @ blk["w"] + blk["b"])
  return jnp.mean((x @ params["out"]["w"] - batch["y"]) ** 2)

batch = {"x": rng.normal(size=(16, 5)).astype(np.float32),
         "y": rng.normal(size=(16, 3)).astype(np.float32)}
data = [batch] * 3
mesh = fsdp_jax.make_mesh(shard=8)
config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({"blocks.*"}))
opt = optimizer = optax.adam(1e-3)
state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
"""

CONTEXTS = {
    # The checkpoint snippet continues the usage example with a restore target.
    "README.md": dict(
        replace={'"/tmp/ckpt"': '"{tmp}/ckpt"'},
        insert_before={"target_state": """
target_state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
    params=params, optimizer=optimizer, mesh=mesh, config=config))
"""},
        epilogue="assert sorted(full) == ['l1.w', 'l2.w'] and int(state.step) == 1",
    ),
    # A training loop, then a checkpoint restored onto another mesh/strategy.
    "checkpointing.md": dict(
        prelude=_SMALL_RUN,
        replace={"/ckpt/run1": "{tmp}/run1", "/ckpt/run2": "{tmp}/run2"},
        epilogue="""
assert int(state.step) == 1, int(state.step)  # saved: the first step only
assert state.plan.config.sharding_strategy is fsdp_jax.ShardingStrategy.HYBRID_SHARD
""",
    ),
    # Two losses and an EMA written from the building blocks.
    "custom_step.md": dict(
        prelude=_SMALL_RUN + """
main_loss = loss_fn
def reg_loss(p, batch):
  return 1e-3 * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))
""",
        epilogue="assert np.isfinite(float(loss)) and float(norm) > 0",
    ),
    # A profile of a few steps.
    "profiling.md": dict(prelude=_SMALL_RUN, replace={"/tmp/fsdp-trace": "{tmp}/fsdp-trace"}),
    # train.py run as one process (``python train.py``), 4 simulated devices.
    "multihost.md": dict(
        prelude="""
import os
os.environ["FSDP_JAX_DEVICES_PER_PROC"] = "4"
import numpy as np, jax.numpy as jnp   # importing jax does not start it
rng = np.random.default_rng(0)
params = {"w1": rng.normal(size=(6, 8)).astype(np.float32),
          "w2": rng.normal(size=(8, 2)).astype(np.float32)}
def loss_fn(params, batch):
  return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)
global_batch_size = 16
batches = [{"x": rng.normal(size=(16, 6)).astype(np.float32),
            "y": rng.normal(size=(16, 2)).astype(np.float32)} for _ in range(2)]
""",
        epilogue="assert int(state.step) == 4 and jax.device_count() == 4",
    ),
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
  return env


def run_doc(path: pathlib.Path, tmp: pathlib.Path) -> subprocess.CompletedProcess:
  ctx = CONTEXTS.get(path.name, {})
  blocks = []
  if ctx.get("prelude"):
    blocks.append({"code": textwrap.dedent(ctx["prelude"]).replace("{tmp}", str(tmp)),
                   "line": 0, "doctest": False, "name": "prelude (tests/test_docs.py)"})
  pending = dict(ctx.get("insert_before", {}))
  for b in runnable(path):
    for needle in [n for n in pending if n in b.code]:
      blocks.append({"code": textwrap.dedent(pending.pop(needle)), "line": 0,
                     "doctest": False, "name": f"set-up for {needle!r} (tests/test_docs.py)"})
    code = b.code
    for old, new in ctx.get("replace", {}).items():
      code = code.replace(old, new.replace("{tmp}", str(tmp)))
    blocks.append({"code": code, "line": b.line, "doctest": b.doctest, "name": ""})
  assert not pending, f"{path.name}: no block uses {sorted(pending)}; update CONTEXTS"
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
  ctx = CONTEXTS.get(path.name, {})
  expected = (len(runnable(path)) + bool(ctx.get("prelude")) + bool(ctx.get("epilogue"))
              + len(ctx.get("insert_before", {})))
  assert out.count("ok: ") == expected, out[-3000:]


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
