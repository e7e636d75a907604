"""Writes a small fsdp_jax checkpoint under the installed jax, for
``tests/test_checkpoint_versions.py`` (a checkpoint saved with one jax
restores under another).

Not part of the library or the test suite: the committed recipe that made the
directories in ``tests/golden/version_checkpoints/``. Run it once per jax at
each end of the supported range, e.g.

    python tests/golden/make_version_checkpoint.py                # jax 0.10, Python 3.11
    /path/to/py313-venv/bin/python tests/golden/make_version_checkpoint.py   # jax 0.12

Each run writes ``version_checkpoints/jax-<version>/<layout>/`` for two
layouts: ``flat`` (FULL_SHARD, flat parameters, 4 devices) and ``orig``
(SHARD_GRAD_OP, original parameters, 2 devices). Each holds:

* ``ckpt/``: a :class:`fsdp_jax.checkpoint.CheckpointManager` directory
  with step 3 (three Adam steps of a small MLP);
* ``expected.npz``: the full parameters (``params/<name>``) and the full
  optimizer state dict (``state/<name>/<slot>``, ``param_groups/<i>/<key>``)
  read from the state that was saved, by the public
  :func:`fsdp_jax.summon_full_params` / :func:`fsdp_jax.full_optim_state_dict`
  (layout-independent, so the test does not depend on ``state.opt_state``'s
  in-memory layout);
* ``meta.json``: the jax, jaxlib, Python and orbax versions and the config.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "version_checkpoints"

LAYOUTS = {
    # name: (sharding strategy, use_orig_params, devices)
    "flat": ("FULL_SHARD", False, 4),
    "orig": ("SHARD_GRAD_OP", True, 2),
}
STEPS = 3


def model_params():
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(7)
  f32 = lambda *shape: (0.4 * rng.standard_normal(shape)).astype(np.float32)
  return {"inp": {"w": f32(5, 7), "b": f32(7)},
          "blocks": [{"w": f32(7, 7), "b": f32(7)} for _ in range(2)],
          "out": {"w": f32(7, 3)}}


def loss_fn(params, batch):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  h = jnp.tanh(batch["x"] @ params["inp"]["w"] + params["inp"]["b"])
  for blk in params["blocks"]:
    h = h + jnp.tanh(h @ blk["w"] + blk["b"])
  return jnp.mean((h @ params["out"]["w"] - batch["y"]) ** 2)


def batch(step: int):
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(100 + step)
  return {"x": rng.standard_normal((8, 5)).astype(np.float32),
          "y": rng.standard_normal((8, 3)).astype(np.float32)}


def config(layout: str):
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  strategy, orig, _ = LAYOUTS[layout]
  return fsdp_jax.FSDPConfig(sharding_strategy=fsdp_jax.ShardingStrategy[strategy],
                             use_orig_params=orig,
                             auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks.*"]))


def optimizer():
  import optax  # pylint: disable=import-outside-toplevel
  return optax.adam(1e-2)


def mesh(n: int):
  import jax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  return fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])


def expected_arrays(state) -> dict:
  """``{key: numpy array}`` of the full params and full optimizer state dict."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  out = {}
  params = fsdp_jax.summon_full_params(state)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    out["params/" + jax.tree_util.keystr(path)] = np.asarray(x)
  osd = fsdp_jax.full_optim_state_dict(state, rank0_only=False)
  for name, slots in osd["state"].items():
    for slot, x in slots.items():
      out[f"state/{name}/{slot}"] = np.asarray(x)
  for i, group in enumerate(osd["param_groups"]):
    for key, x in group.items():
      if key != "params":
        out[f"param_groups/{i}/{key}"] = np.asarray(x)
  return out


def write(layout: str, root: pathlib.Path) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src.checkpoint import CheckpointManager  # pylint: disable=import-outside-toplevel

  _, _, n = LAYOUTS[layout]
  cfg, opt, m = config(layout), optimizer(), mesh(n)
  state = fsdp_jax.init_train_state(params=model_params(), optimizer=opt, mesh=m, config=cfg)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=m, config=cfg)
  for i in range(STEPS):
    state, _ = step(state, batch(i))
  d = root / layout
  if d.exists():
    shutil.rmtree(d)
  d.mkdir(parents=True)
  with CheckpointManager(d / "ckpt", enable_async_checkpointing=False) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()
  np.savez(d / "expected.npz", **expected_arrays(state))
  meta = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": sys.version.split()[0], "orbax_checkpoint": ocp.__version__,
          "layout": layout, "sharding_strategy": LAYOUTS[layout][0],
          "use_orig_params": LAYOUTS[layout][1], "devices": n, "steps": STEPS}
  (d / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
  print(f"wrote {d} ({sum(f.stat().st_size for f in d.rglob('*') if f.is_file())} bytes)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args()
  sys.path.insert(0, str(HERE.parent.parent))
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  fsdp_jax.simulate_cpu_devices(8)
  import jax  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(args.out) / f"jax-{jax.__version__}"
  for layout in LAYOUTS:
    write(layout, root)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
