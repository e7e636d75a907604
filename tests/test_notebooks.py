"""Runs every notebook in ``notebooks/`` top to bottom in a fresh kernel.

Each notebook executes with nbclient in its own ``python3`` kernel (ipykernel,
from the ``test`` extra), started with an environment stripped of the pytest
process's JAX/XLA settings (``JAX_*``; ``XLA_FLAGS`` holds only the tests'
compile-time flag, ``TEST_XLA_FLAGS``): a notebook has to set
up its devices itself in its first code cell, as a user's fresh kernel would.
Cells run under a timeout; any error fails the test, and each notebook's key
outputs are checked (the plan printout, the plots, the equality checks).

The notebooks are stored without outputs; a separate test keeps it that way.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time

import nbclient  # from the test extra, with nbformat and ipykernel
import nbformat
import pytest

from helpers import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
EXPECTED = {"quickstart.ipynb", "strategies.ipynb", "checkpoint_resharding.ipynb",
            "finetune.ipynb"}
CELL_TIMEOUT_S = 300     # per cell; each notebook takes well under a minute
STARTUP_TIMEOUT_S = 120  # kernel start on a loaded machine


def _notebooks():
  return sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def _kernel_env() -> dict:
  """The environment of a fresh kernel: no device set-up inherited from the
  pytest process (conftest.py simulates devices and sets XLA_FLAGS here)."""
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and not k.startswith("JAX_") and k != "MPLBACKEND"}
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env.setdefault("PYTHONHASHSEED", "0")
  env["XLA_FLAGS"] = TEST_XLA_FLAGS  # compile faster; no device set-up (helpers.py)
  return env


def _text_outputs(nb) -> str:
  out = []
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    for o in cell.get("outputs", []):
      if o.get("output_type") == "stream":
        out.append(o.get("text", ""))
      elif o.get("output_type") in ("execute_result", "display_data"):
        out.append(o.get("data", {}).get("text/plain", ""))
  return "".join(out)


def _images(nb) -> int:
  return sum("image/png" in o.get("data", {})
             for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _on_cpu() -> bool:
  """The notebooks simulate 8 CPU devices unless nvidia-smi lists >= 2 GPUs."""
  return shutil.which("nvidia-smi") is None


def test_every_notebook_is_here():
  assert EXPECTED <= set(_notebooks()), (
      f"missing notebooks: {sorted(EXPECTED - set(_notebooks()))} in {NOTEBOOKS}")


@pytest.mark.parametrize("name", _notebooks())
def test_notebook_is_stored_clean(name):
  """Saved without outputs, with a python3 kernelspec, devices set up first."""
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, f"{name} has no code cell"
  for i, c in enumerate(code):
    assert not c.get("outputs") and c.get("execution_count") is None, (
        f"{name}: code cell {i} has stored outputs; clear them before saving "
        "(Jupyter: Edit > Clear All Outputs, or `jupyter nbconvert "
        "--clear-output --inplace`).")
  first = code[0].source
  assert "simulate_cpu_devices(" in first and "nvidia-smi" in first, (
      f"{name}: the first code cell must set up devices before JAX starts "
      "(fsdp_jax.simulate_cpu_devices(8) when there is no GPU).")


# What each notebook must have printed or shown, beyond running without error.
CHECKS = {
    "quickstart.ipynb": dict(
        text=["FSDP plan: FULL_SHARD, flat parameters", "collectives per step",
              "max |parameter difference|",
              "context parallelism: max |parameter difference| from one device"],
        images=0),
    "strategies.ipynb": dict(
        text=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
              "all strategies train identically", "ZeRO++ (all three)",
              "quantized runs within 2% of the exact final loss"],
        images=4),
    "checkpoint_resharding.ipynb": dict(
        text=["identical parameters and optimizer state",
              "restored in a separate process"],
        images=0),
    "finetune.ipynb": dict(
        text=["== full fine-tuning", "== LoRA", "== QLoRA",
              "LoRA rank 8, alpha 16 (scale 2); frozen base: 14 targets",
              "frozen base quantized (nf4, blocks of 64): 14 targets",
              "adapter path x @ W + scale * (x @ A) @ B: 14 of 14 targets",
              "adapter_model.safetensors", "adapter_config.json", "'peft_type': 'LORA'",
              "load_adapter: the same merged weights: True"],
        images=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", _notebooks())
def test_notebook_runs(name, tmp_path):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=CELL_TIMEOUT_S, startup_timeout=STARTUP_TIMEOUT_S,
      kernel_name="python3", allow_errors=False,
      extra_arguments=["--InteractiveShell.colors=NoColor"],  # readable tracebacks
      resources={"metadata": {"path": str(NOTEBOOKS)}})
  start = time.perf_counter()
  try:
    client.execute(env=_kernel_env())
  finally:
    # Keep the executed copy for inspection when something fails.
    nbformat.write(nb, tmp_path / name)
  elapsed = time.perf_counter() - start
  print(f"{name}: executed in {elapsed:.1f} s (executed copy: {tmp_path / name})",
        file=sys.stderr)
  text = _text_outputs(nb)
  checks = CHECKS.get(name, {})
  for needle in checks.get("text", ()):
    assert needle in text, f"{name}: expected {needle!r} in the outputs:\n{text[-3000:]}"
  assert _images(nb) >= checks.get("images", 0), (
      f"{name}: expected at least {checks['images']} plots, got {_images(nb)}")
  if _on_cpu():
    assert "8 devices" in text, f"{name}: the kernel did not get 8 simulated devices"
