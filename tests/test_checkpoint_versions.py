"""Checkpoints cross jax versions: one saved under jax 0.10 restores under
jax 0.12 and the other way round.

``tests/golden/version_checkpoints/jax-<version>/<layout>/`` were written by
``tests/golden/make_version_checkpoint.py`` under jax 0.10.2 (Python 3.11)
and jax 0.12.0.1 (Python 3.13): a :class:`~fsdp_jax.checkpoint.CheckpointManager`
directory after three Adam steps, and the full parameters and full optimizer
state dict read from the saved state (``expected.npz``). Whatever jax runs
this test restores every one of them, into the layout it was saved from and
into the other one, and must get those values back bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest

import fsdp_jax
from fsdp_jax import CheckpointManager

# Restoring stored checkpoints of every layout and training on is slow.
GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
ROOT = GOLDEN / "version_checkpoints"

_spec = importlib.util.spec_from_file_location("make_version_checkpoint",
                                               GOLDEN / "make_version_checkpoint.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

SAVED = sorted(p for p in ROOT.glob("jax-*/*") if (p / "meta.json").exists())


def test_both_ends_of_the_supported_range_are_committed():
  versions = {json.loads((p / "meta.json").read_text())["jax"] for p in SAVED}
  assert any(v.startswith("0.10.") for v in versions), versions
  assert any(v.startswith("0.12.") for v in versions), versions
  assert {p.name for p in SAVED} == set(gen.LAYOUTS)


@pytest.mark.parametrize("target_layout", list(gen.LAYOUTS))
@pytest.mark.parametrize("saved", SAVED, ids=lambda p: f"{p.parent.name}-{p.name}")
@pytest.mark.slow
def test_restores_bitwise(saved, target_layout):
  meta = json.loads((saved / "meta.json").read_text())
  _, _, n = gen.LAYOUTS[target_layout]
  cfg, opt, mesh = gen.config(target_layout), gen.optimizer(), gen.mesh(n)
  target = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=gen.model_params(), optimizer=opt, mesh=mesh, config=cfg))
  with CheckpointManager(saved / "ckpt", read_only=True) as mngr:
    assert mngr.all_steps() == [meta["steps"]]
    state = mngr.restore(target)
  assert int(state.step) == meta["steps"]
  expected = dict(np.load(saved / "expected.npz"))
  got = gen.expected_arrays(state)
  assert sorted(got) == sorted(expected)
  assert any(k.startswith("state/") for k in got) and any(k.startswith("params/") for k in got)
  for key, want in expected.items():
    assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
    np.testing.assert_array_equal(got[key], want, err_msg=f"{saved}: {key}")
  # It trains on: one more step from the restored state runs.
  step = fsdp_jax.shard_train_step(gen.loss_fn, opt, mesh=mesh, config=cfg)
  state, metrics = step(state, gen.batch(meta["steps"]))
  assert np.isfinite(float(metrics["loss"]))
