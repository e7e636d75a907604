"""What the measurements that run each configuration in a fresh process
share (XLA reads its flags, and JAX keeps its caches, once per process):
starting the child's JAX, the benchmark GPT, running a child and reading
its result, and writing the table. Importing this module starts no backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT = "RESULT "


def start_jax(devices: int):
  """In a child: ``devices`` simulated CPU devices (the process's
  ``XLA_FLAGS`` as the parent set them); returns ``jax``."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", devices)
  jax.config.update("jax_platforms", "cpu")
  return jax


def gpt(args, layers: int, **model_kwargs):
  """``(cfg, init_fn, loss_fn)`` of the benchmark GPT sized by ``args``
  (``d_model``, ``heads``, ``seq_len``) with ``layers`` blocks."""
  from benchmarks.common import GPTConfig  # pylint: disable=import-outside-toplevel
  from benchmarks.models import make_model  # pylint: disable=import-outside-toplevel
  cfg = GPTConfig(d_model=args.d_model, num_layers=layers, num_heads=args.heads,
                  seq_len=args.seq_len)
  _, init_fn, loss_fn = make_model(cfg, **model_kwargs)
  return cfg, init_fn, loss_fn


def report(result: dict) -> None:
  """In a child: hands ``result`` to the parent."""
  print(RESULT + json.dumps(result), flush=True)


def run_child(script: str, args: list, *, label: str, xla_flags: str = "",
              extra_env: dict | None = None) -> dict:
  """Runs ``python script --child *args`` in a fresh process with exactly
  ``xla_flags`` as ``XLA_FLAGS`` (and ``extra_env``; a None value unsets
  the variable) and returns what it reported."""
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags)
  for k, v in (extra_env or {}).items():
    if v is None:
      env.pop(k, None)
    else:
      env[k] = v
  proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args], env=env,
                        capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    raise RuntimeError(f"{label}: {proc.stderr[-3000:]}")
  return json.loads(lines[0][len(RESULT):])


def write_table(path: str, text: str) -> str:
  """Writes the measurement's markdown, prints it and returns it."""
  with open(path, "w") as f:
    f.write(text)
  print(text)
  return text
