"""CPU offload of params and optimizer state: what the compiled step keeps in
device memory and in host memory, and what it costs in step time.

Builds the benchmark GPT (``benchmarks/models.py``, 25.5M parameters, one
FSDP unit per ``Block``) with FULL_SHARD in fp32 and Adam on 8 simulated CPU
devices, twice: without offload and with
``FSDPConfig(cpu_offload=CPUOffload(offload_params=True))``. For each compiled
step it reports, per device:

* the argument and output bytes in device memory and in host memory, read
  from the entry layout of the compiled HLO (host buffers carry ``S(5)``;
  ``fsdp_jax.hlo.entry_memory_bytes``), because the CPU backend's
  ``memory_analysis()`` counts host and device buffers together (its
  ``host_*`` fields are 0);
* ``memory_analysis()``'s temporary bytes;

and the step time of both, measured in the same process: warm-up steps, then
rounds that run one step of each (alternating which goes first), the ratio
offload / no offload taken per round; the median over rounds is reported.
Writes the table to ``benchmarks/OFFLOAD.md`` (``--out``) and prints it.

    python benchmarks/offload.py [--rounds 9] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import fsdp_jax  # noqa: E402  (does not start a JAX backend)

MiB = 2 ** 20


def _mib(b: int) -> str:
  return f"{b:,} ({b / MiB:.2f} MiB)"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--batch-per-device", type=int, default=1)
  ap.add_argument("--rounds", type=int, default=9)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--out", default=os.path.join(HERE, "OFFLOAD.md"))
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  fsdp_jax.simulate_cpu_devices(args.devices)

  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks import models
  from benchmarks.common import GPTConfig, make_batch
  from fsdp_jax._src.offload import entry_memory_bytes

  def log(msg):
    print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

  cfg = GPTConfig()
  _, init_fn, loss_fn = models.make_model(cfg)
  rng = jax.random.key(0)
  classes = fsdp_jax.module_classes(lambda r: init_fn(r), rng)
  params = jax.device_get(jax.jit(init_fn)(rng))  # host copy: fresh buffers per variant
  n_params = models.count_params(params)
  world = args.devices
  batch_np = make_batch(cfg, args.batch_per_device * world)
  optimizer = optax.adam(1e-3)
  mesh = fsdp_jax.make_mesh(shard=world, devices=jax.devices()[:world])
  batch = jax.device_put(batch_np, NamedSharding(mesh, P("shard")))
  log(f"model: {n_params:,} parameters; {world} devices")

  runs = {}
  for offloaded in (False, True):
    config = fsdp_jax.FSDPConfig(
        auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({models.Block}),
        cpu_offload=fsdp_jax.CPUOffload(offload_params=True) if offloaded else None)
    state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh,
                                      config=config, module_classes=classes)
    step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    t_compile = time.perf_counter() - t0
    text = compiled.as_text()
    mem = entry_memory_bytes(text)
    ops = re.findall(r"=\s+\S+\s+([a-z][a-z0-9\-]*)\(", text)
    ma = compiled.memory_analysis()
    leaves = jax.tree.leaves((state.params, state.opt_state))
    kinds = sorted({x.sharding.memory_kind for x in leaves})
    state_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                      for x in leaves)
    runs[offloaded] = dict(compiled=compiled, state=state, mem=mem, ma=ma, kinds=kinds,
                           state_bytes=state_bytes, times=[], cpu=[], t_compile=t_compile,
                           n_ops=len(ops), n_copies=sum(o in ("copy", "copy-start") for o in ops),
                           s5_in_body=sum("S(5)" in l for l in text.splitlines()
                                          if not l.startswith("HloModule")))
    log(f"{'offload' if offloaded else 'no offload'}: compiled in {t_compile:.1f}s; "
        f"params/opt_state in {kinds}; device args {mem.argument_device_bytes:,} B, "
        f"host args {mem.argument_host_bytes:,} B, temp {ma.temp_size_in_bytes:,} B")

  def one_step(r):
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    r["state"], metrics = r["compiled"](r["state"], batch)
    loss = float(metrics["loss"])  # waits for the step
    dt = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    r["cpu"].append((c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime))
    return dt, loss

  losses = {}
  for offloaded, r in runs.items():
    for _ in range(args.warmup):
      _, loss = one_step(r)
    losses[offloaded] = [loss]
  for r in runs.values():
    r["cpu"].clear()  # warm-up steps are not counted
  load_before = os.getloadavg()
  ratios, cpu_ratios = [], []
  for k in range(args.rounds):
    order = (False, True) if k % 2 == 0 else (True, False)
    dt = {}
    for offloaded in order:
      dt[offloaded], loss = one_step(runs[offloaded])
      runs[offloaded]["times"].append(dt[offloaded])
      losses[offloaded].append(loss)
    ratios.append(dt[True] / dt[False])
    cpu_ratios.append(runs[True]["cpu"][-1] / runs[False]["cpu"][-1])
    log(f"round {k + 1}/{args.rounds}: no offload {dt[False] * 1e3:.0f} ms, "
        f"offload {dt[True] * 1e3:.0f} ms, ratio {ratios[-1]:.3f}")
  load_after = os.getloadavg()
  same = np.allclose(losses[True], losses[False], rtol=1e-5, atol=1e-6)
  final_kinds = sorted({x.sharding.memory_kind for x in
                        jax.tree.leaves((runs[True]["state"].params, runs[True]["state"].opt_state))})

  base, off = runs[False], runs[True]
  drop = base["mem"].argument_device_bytes - off["mem"].argument_device_bytes
  lines = []
  w = lines.append
  w("# CPU offload: device vs host bytes and step time\n")
  w("Measured with `python benchmarks/offload.py` "
    f"({time.perf_counter() - t_start:.0f} s). Machine: {os.cpu_count()}-core "
    f"{platform.machine()} CPU, {world} simulated CPU devices "
    f"(`fsdp_jax.simulate_cpu_devices({world})`: every \"device\" and the \"host\" are the "
    f"same RAM and cores), jax {jax.__version__}, Python {platform.python_version()}.\n")
  w(f"Model: the benchmark GPT (`benchmarks/models.py`), {n_params:,} fp32 parameters, "
    f"one FSDP unit per `Block`; FULL_SHARD, fp32, `optax.adam`; global batch "
    f"{batch_np['inputs'].shape[0]} x {cfg.seq_len} tokens. Bytes are per device. Device/host "
    "bytes are read from the compiled step's entry layout (host buffers are marked `S(5)`; "
    "`fsdp_jax.hlo.entry_memory_bytes`); temp bytes from `memory_analysis()`, which on "
    "the CPU backend does not split host from device (its `host_*` fields are 0).\n")
  w("| per device | no offload | offload |")
  w("|---|---:|---:|")
  rows = [
      ("params + optimizer state stored in", lambda r: ", ".join(r["kinds"])),
      ("params + optimizer state bytes", lambda r: _mib(r["state_bytes"])),
      ("argument bytes in device memory", lambda r: _mib(r["mem"].argument_device_bytes)),
      ("argument bytes in host memory (S(5))", lambda r: _mib(r["mem"].argument_host_bytes)),
      ("output bytes in device memory", lambda r: _mib(r["mem"].output_device_bytes)),
      ("output bytes in host memory (S(5))", lambda r: _mib(r["mem"].output_host_bytes)),
      ("temp bytes (`memory_analysis()`)", lambda r: _mib(int(r["ma"].temp_size_in_bytes))),
      ("`memory_analysis()` argument bytes (host + device)",
       lambda r: _mib(int(r["ma"].argument_size_in_bytes))),
      ("instructions in the compiled step (of which copies)",
       lambda r: f"{r['n_ops']:,} ({r['n_copies']})"),
      ("compile time", lambda r: f"{r['t_compile']:.1f} s"),
      ("step time, median", lambda r: f"{statistics.median(r['times']) * 1e3:.0f} ms"),
      ("step CPU time (this process, user + sys), median",
       lambda r: f"{statistics.median(r['cpu']) * 1e3:.0f} ms"),
  ]
  for name, f in rows:
    w(f"| {name} | {f(base)} | {f(off)} |")
  w("")
  w(f"- Device-resident argument bytes drop by {drop:,} bytes per device: "
    f"{'exactly' if drop == off['state_bytes'] else 'not exactly (!)'} the params + "
    f"optimizer state bytes ({off['state_bytes']:,}). What stays on the device is the "
    "batch and the step counter.")
  w(f"- Step time offload / no offload: **{statistics.median(ratios):.3f}** (median of "
    f"{args.rounds} per-round ratios, after {args.warmup} warm-up steps each; range "
    f"{min(ratios):.3f}-{max(ratios):.3f}); in CPU time {statistics.median(cpu_ratios):.3f} "
    f"(range {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}). Load average of the machine "
    f"(1 min) {load_before[0]:.1f} before the timed rounds and {load_after[0]:.1f} after: "
    "other processes shared the 2 cores, so single steps vary; the per-round ratio pairs "
    "steps taken back to back.")
  temp_off, temp_base = off["ma"].temp_size_in_bytes, base["ma"].temp_size_in_bytes
  w(f"- On the CPU backend host and device memory are the same RAM: the compiled offload "
    f"step has {off['n_ops']:,} instructions ({off['n_copies']} copies) against "
    f"{base['n_ops']:,} ({base['n_copies']}), and {temp_off / temp_base:.3f}x the temp bytes "
    f"({temp_off - temp_base:+,} B). Besides the copies (elided here), the offload program "
    "differs in two ways: the gradient is taken with respect to zeros added to each unit's "
    "device copy (so that it stays in device memory), and the host arrays stay out of the "
    "barrier on the backward pass's inputs; "
    + ("`S(5)` appears only on the entry parameters and results. " if off["s5_in_body"] == 0
       else f"`S(5)` appears on {off['s5_in_body']} lines of the program body. ")
    + "The "
    "host-device transfers a GPU or TPU would make (each unit's parameter shards to the "
    "device at its gather, the gradient shards back, over PCIe) are therefore not in this "
    "program and not in this time: the ratio shows what offload adds on CPU, not what it "
    "costs on an accelerator.")
  w(f"- Losses of the {args.warmup + args.rounds} steps equal without and with offload: "
    f"{'yes' if same else 'no'}; after them the offloaded state is still in "
    f"{', '.join(final_kinds)}.")
  text = "\n".join(lines) + "\n"
  with open(args.out, "w") as fh:
    fh.write(text)
  print(text)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
