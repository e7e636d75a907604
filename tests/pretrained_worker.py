"""One process of tests/test_pretrained.py's 2-process run: loads the Llama
checkpoint into FULL_SHARD over both processes' devices, reports the bytes it
read and the logits of the loaded model, and saves the model back."""

import json
import os
import sys

import jax  # importing JAX starts no backend: distributed.initialize() comes first
import jax.numpy as jnp
import numpy as np
import optax

import fsdp_jax
from fsdp_jax import distributed, pretrained

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import llama  # noqa: E402  pylint: disable=wrong-import-position

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)


def main(spec: dict) -> None:
  distributed.initialize()
  config = llama.LlamaConfig.from_pretrained(spec["checkpoint"])
  model = llama.Llama(config)
  wm = llama.weight_map(config)
  source = pretrained.load(spec["checkpoint"], wm)
  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32)), rng=jax.random.key(0),
      optimizer=optax.adam(1e-3), mesh=mesh,
      config=fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({llama.Block})),
      pretrained=source)
  read = source.bytes_read
  params = jax.tree.map(np.asarray, fsdp_jax.summon_full_params(state))
  logits = np.asarray(model.apply(params, TOKENS))
  pretrained.save(state, spec["save"], wm, max_shard_size="100KB")
  with open(f"{spec['out']}.{jax.process_index()}", "w") as f:
    json.dump({"bytes_read": read, "logits": logits.tolist()}, f)
  distributed.shutdown()


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
