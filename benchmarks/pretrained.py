#!/usr/bin/env python
"""Loading and saving pretrained weights: host memory, time and bytes read.

    python benchmarks/pretrained.py                 # writes benchmarks/PRETRAINED.md
    python benchmarks/pretrained.py --hidden 256 --layers 2 --vocab 2048 --out /tmp/p.md  # small

A random Llama (``examples/llama.py``; fp32, about 0.6 GB by default) is
written in Hugging Face's layout (safetensors shards and an index). Each
measurement runs in a fresh process on 8 simulated CPU devices, where device
memory is host memory:

* **fsdp_jax load**: ``pretrained.load`` + ``init_train_state(init_fn=...,
  pretrained=...)`` (FULL_SHARD, flat layout, plain SGD so that the state is
  the parameters alone): each device's shard read from the files as slices;
* **load whole, then shard**: ``safetensors.numpy.load_file`` of every file,
  the transforms applied to the whole dict, then ``init_train_state(params=...)``;
* **load_file + device_put**: ``safetensors.numpy.load_file`` and
  ``jax.device_put`` of every tensor, the floor for reading the files;
* **fsdp_jax save** (``pretrained.save``) and **gather, then save**
  (``summon_full_params``, the inverse transforms, ``save_file``).

Host memory grown is the process's peak resident set (``ru_maxrss``) minus
its resident set just before the measured call, against the checkpoint's
bytes. Then 2 processes x 4 devices (``python -m fsdp_jax.launch``) load the
same checkpoint: the tensor bytes each process reads, counted by the reader,
and the bytes of the file pages those lie in.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from benchmarks import fresh  # noqa: E402  pylint: disable=wrong-import-position

MODES = ("fsdp_load", "whole_load", "floor_load", "fsdp_save", "whole_save")
KEYS = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "shard_size")


def _rss() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  return 0


def _peak() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(args):
  import llama  # pylint: disable=import-outside-toplevel
  return llama.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


def make_checkpoint(args, directory: str) -> int:
  """Writes the random Llama to ``directory``; returns its tensor bytes."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  import llama  # pylint: disable=import-outside-toplevel
  from fsdp_jax import pretrained  # pylint: disable=import-outside-toplevel
  cfg = _config(args)
  model = llama.Llama(cfg)
  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32)), rng=jax.random.key(0),
      optimizer=optax.sgd(0.0), mesh=mesh, config=fsdp_jax.FSDPConfig())
  pretrained.save(state, directory, llama.weight_map(cfg), max_shard_size=args.shard_size,
                  overwrite=True)
  return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
             if f.endswith(".safetensors"))


def _start(args):
  """The child's JAX: ``args.devices`` simulated CPU devices, or the GPUs."""
  if args.platform == "cpu":
    return fresh.start_jax(args.devices)
  import jax  # pylint: disable=import-outside-toplevel
  return jax


def _device_peak(jax) -> int:
  """The largest ``peak_bytes_in_use`` of the process's devices (0 where the
  backend keeps no statistics)."""
  return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())


def child(args) -> None:
  jax = _start(args)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  import llama  # pylint: disable=import-outside-toplevel
  from fsdp_jax import pretrained  # pylint: disable=import-outside-toplevel
  cfg = _config(args)
  model = llama.Llama(cfg)
  wm = llama.weight_map(cfg)
  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["params.layers_*"]))
  init_fn = lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32))
  files = sorted(os.path.join(args.checkpoint, f) for f in os.listdir(args.checkpoint)
                 if f.endswith(".safetensors"))
  jax.eval_shape(init_fn, jax.random.key(0))  # warm the tracing machinery
  jax.block_until_ready(jax.device_put(np.zeros(8)))

  def block(tree):
    jax.block_until_ready(tree)
    return tree

  result = {}
  if args.mode in ("fsdp_save", "whole_save"):
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                      optimizer=optax.sgd(0.1), mesh=mesh, config=config,
                                      pretrained=pretrained.load(args.checkpoint, wm))
  rss0, t0 = _rss(), time.perf_counter()
  if args.mode == "fsdp_load":
    source = pretrained.load(args.checkpoint, wm)
    state = block(fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                            optimizer=optax.sgd(0.1), mesh=mesh,
                                            config=config, pretrained=source))
    result["bytes_read"] = source.bytes_read
  elif args.mode == "whole_load":
    tensors = {}
    for f in files:
      tensors.update(load_file(f))
    leaves = {}
    for name, x in tensors.items():
      rule, values = wm.checkpoint_rule(name)
      if rule.param is not None:
        leaves[rule.param_name(values)] = rule.chain.to_model(x)
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    paths = jax.tree_util.tree_flatten_with_path(abstract)[0]
    names = [".".join(str(getattr(k, "key", k)) for k in p)[len("params."):] for p, _ in paths]
    params = jax.tree_util.tree_unflatten(jax.tree.structure(abstract),
                                          [leaves[n] for n in names])
    state = block(fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                            config=config))
  elif args.mode == "floor_load":
    arrays = []
    for f in files:
      arrays += [jax.device_put(x) for x in load_file(f).values()]
    block(arrays)
  elif args.mode == "fsdp_save":
    pretrained.save(state, args.target, wm, max_shard_size=args.shard_size)
  elif args.mode == "whole_save":
    full = jax.tree.map(np.asarray, fsdp_jax.summon_full_params(state))
    flat = jax.tree_util.tree_flatten_with_path(full)[0]
    out = {}
    for path, x in flat:
      name = ".".join(str(getattr(k, "key", k)) for k in path)
      rule, values = wm.param_rule(name[len("params."):])
      stack = rule.stack_axis_name
      out[rule.checkpoint_name(values)] = np.ascontiguousarray(
          rule.chain.to_checkpoint(x, rule.chain.checkpoint_shape(x.shape)))
      assert stack is None
    os.makedirs(args.target, exist_ok=True)
    save_file(out, os.path.join(args.target, "model.safetensors"), metadata={"format": "pt"})
  result.update(seconds=time.perf_counter() - t0, rss_before=rss0, peak=_peak(),
                device_peak=_device_peak(jax))
  fresh.report(result)


def _child_args(args, mode, target=""):
  out = ["--mode", mode, "--checkpoint", args.checkpoint, "--devices", str(args.devices),
         "--target", target or "-", "--platform", args.platform]
  for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads"):
    out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
  out += ["--shard-size", str(args.shard_size)]
  return out


def two_processes(args) -> list:
  """Each of 2 processes x 4 devices loads the checkpoint; returns what each
  read."""
  out = os.path.join(tempfile.mkdtemp(), "mp")
  script = os.path.join(tempfile.mkdtemp(), "load.py")
  with open(script, "w") as f:
    f.write(f"""
import json, os, sys
sys.path[:0] = {[ROOT, os.path.join(ROOT, "examples"), HERE]!r}
import fsdp_jax
from fsdp_jax import distributed, pretrained
distributed.initialize()
import jax, jax.numpy as jnp, optax, llama
cfg = llama.LlamaConfig(vocab_size={args.vocab}, hidden_size={args.hidden},
    intermediate_size={args.intermediate}, num_hidden_layers={args.layers},
    num_attention_heads={args.heads}, num_key_value_heads={args.kv_heads})
model = llama.Llama(cfg)
source = pretrained.load({args.checkpoint!r}, llama.weight_map(cfg))
state = fsdp_jax.init_train_state(
    init_fn=lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32)), rng=jax.random.key(0),
    optimizer=optax.sgd(0.1), mesh=fsdp_jax.make_mesh(shard=jax.device_count()),
    config=fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["params.layers_*"])),
    pretrained=source)
jax.block_until_ready(state.params)
with open({out!r} + "." + str(jax.process_index()), "w") as f:
  json.dump(dict(bytes_read=source.bytes_read, page_bytes=source.page_bytes_read), f)
distributed.shutdown()
""")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "fsdp_jax.launch", "--nproc", "2",
                         "--devices-per-proc", "4", "--platform", "cpu", script],
                        env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  return [json.load(open(f"{out}.{r}")) for r in (0, 1)]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
  p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
  p.add_argument("--target", default="-", help=argparse.SUPPRESS)
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
  p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                 help="gpu: load into the machine's GPUs (every one), and skip the "
                      "two-process measurement")
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--intermediate", type=int, default=2816)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--shard-size", default="200MB")
  p.add_argument("--repeats", type=int, default=3, help="runs per measurement (best time)")
  p.add_argument("--out", default=os.path.join(HERE, "PRETRAINED.md"))
  args = p.parse_args(argv)
  if args.child:
    return child(args)
  gpu = args.platform == "gpu"

  work = tempfile.mkdtemp(prefix="fsdp_jax_pretrained_bench_")
  args.checkpoint = os.path.join(work, "checkpoint")
  env_flags = "" if gpu else " ".join(__import__("fsdp_jax").custom.CPU_XLA_FLAGS)
  # The checkpoint, written by a child of its own (8 simulated devices).
  proc = subprocess.run([sys.executable, "-c", f"""
import sys; sys.path[:0] = {[ROOT, os.path.join(ROOT, 'examples'), HERE]!r}
import argparse, json, pretrained as b
b._start(argparse.Namespace(platform={args.platform!r}, devices={args.devices}))
args = argparse.Namespace(**{json.dumps({k: getattr(args, k) for k in KEYS})})
print(b.make_checkpoint(args, {args.checkpoint!r}))
"""], env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=env_flags), capture_output=True,
                        text=True, check=False)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  ckpt_bytes = int(proc.stdout.strip().splitlines()[-1])
  print(f"checkpoint: {ckpt_bytes / 2**20:.1f} MiB in {len(os.listdir(args.checkpoint))} files")
  rows = {}
  for mode in MODES:
    best = None
    for k in range(args.repeats):
      target = os.path.join(work, f"{mode}-{k}")
      r = fresh.run_child(__file__, _child_args(args, mode, target), label=mode,
                          xla_flags=env_flags)
      r["grown"] = r["peak"] - r["rss_before"]
      if best is None or r["seconds"] < best["seconds"]:
        best = r
    rows[mode] = best
    print(f"{mode}: {best['seconds']:.2f} s, host memory grown "
          f"{best['grown'] / ckpt_bytes:.2f}x the checkpoint, device peak "
          f"{best['device_peak'] / ckpt_bytes:.2f}x")
  mp = [] if gpu else two_processes(args)
  for r, res in enumerate(mp):
    print(f"process {r}: read {res['bytes_read'] / ckpt_bytes:.3f}x the checkpoint "
          f"(pages {res['page_bytes'] / ckpt_bytes:.3f}x)")
  names = {"fsdp_load": "fsdp_jax: `pretrained.load` + `init_train_state(pretrained=)`",
           "whole_load": "load every file whole (`load_file`), then `init_train_state(params=)`",
           "floor_load": "`load_file` + `jax.device_put` of every tensor (floor)",
           "fsdp_save": "fsdp_jax: `pretrained.save`",
           "whole_save": "`summon_full_params`, then `save_file` of the whole dict"}
  if gpu:
    import jax  # pylint: disable=import-outside-toplevel
    where = (f"{jax.device_count()} x {jax.devices()[0].device_kind} (jax "
             f"{jax.__version__})")
    table = ["| measurement | seconds | host memory grown / checkpoint "
             "| device peak / checkpoint |", "|---|---|---|---|"]
    for mode in MODES:
      r = rows[mode]
      table.append(f"| {names[mode]} | {r['seconds']:.2f} | {r['grown'] / ckpt_bytes:.2f} "
                   f"| {r['device_peak'] / ckpt_bytes:.2f} |")
  else:
    where = f"{args.devices} simulated CPU devices (device memory is host memory)"
    table = ["| measurement | seconds | host memory grown / checkpoint |", "|---|---|---|"]
    for mode in MODES:
      r = rows[mode]
      table.append(f"| {names[mode]} | {r['seconds']:.2f} | {r['grown'] / ckpt_bytes:.2f} |")
  ratio = rows["fsdp_load"]["seconds"] / rows["floor_load"]["seconds"]
  text = [
      "# Pretrained weights: loading and saving",
      "",
      f"`python benchmarks/pretrained.py` ({' '.join(sys.argv[1:]) or 'defaults'}): a random "
      f"Llama ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}) in fp32, "
      f"{ckpt_bytes / 2**20:.1f} MiB in Hugging Face's layout "
      f"({sum(f.endswith('.safetensors') for f in os.listdir(args.checkpoint))} safetensors "
      f"files of at most {args.shard_size}), {where}, FULL_SHARD, one unit per block, flat "
      f"layout. Each row is the best of {args.repeats} fresh processes. Host memory grown: "
      "peak resident set minus the resident set before the call.",
      "",
      *table,
      "",
      f"fsdp_jax's load takes {ratio:.2f}x the floor's time (target: at most 1.5x) and grows "
      f"host memory by {rows['fsdp_load']['grown'] / ckpt_bytes:.2f}x the checkpoint "
      f"(target: at most 1.3x{'' if gpu else '; the loaded shards are 1x'}), against "
      f"{rows['whole_load']['grown'] / ckpt_bytes:.2f}x for loading it whole first.",
      ""]
  if mp:
    text += [
        "Two processes x 4 devices (`python -m fsdp_jax.launch`), each loading the same "
        "checkpoint: tensor bytes each read (target: at most 0.6x):",
        "",
        "| process | tensor bytes read / checkpoint "
        "| bytes of the pages they lie in / checkpoint |",
        "|---|---|---|",
        *[f"| {r} | {res['bytes_read'] / ckpt_bytes:.3f} | {res['page_bytes'] / ckpt_bytes:.3f} |"
          for r, res in enumerate(mp)],
        "",
        "Tensor bytes read: the slices the reader asked for (a contiguous slice through a "
        "memory map of its pages, a strided one through `preadv`). The pages they lie in "
        f"({mmap.PAGESIZE} bytes each, counted once per read): what storage moves. A process "
        "that reads half the columns of a row-major tensor (the transposed projections, "
        "sharded along PyTorch's input axis) touches every page whose rows are shorter "
        "than two pages, as this model's are (1024 fp32 = one page per row); a row of "
        "4096 fp32 spans four pages, half of whose columns lie in two of them.",
        ""]
  text = "\n".join(text)
  print(text)
  with open(args.out, "w") as f:
    f.write(text)
  return rows


if __name__ == "__main__":
  main()
