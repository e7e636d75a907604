#!/usr/bin/env python
"""GPU benchmark: a ~1B-parameter GPT in bf16 with fsdp_jax FULL_SHARD on the
local GPUs, next to plain ``jax.jit`` on one GPU.

    python benchmarks/gpu.py                      # 1B GPT: benchmarks/gpu_runs/gpu-1b-default.{md,json}
    python benchmarks/gpu.py --size tiny --steps 2 --out /tmp/gpu.md   # smoke run (CPU works)

Both programs train the same model with the same dtype policy: fp32 master
parameters and AdamW state, bf16 compute (fsdp_jax:
``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``; plain jit: the loss
casts the parameters to bf16), one FSDP unit per transformer block. On one
GPU both run on that GPU with the same batch; on several, fsdp_jax shards
over all of them and the plain baseline runs on GPU 0 with the per-device
batch, so per-device throughput compares.

Reported per program: step time (median of timed steps, the two programs
alternating), tokens/s per device, MFU, peak memory, and for fsdp_jax the
share of collective time hidden behind compute.

* MFU = model FLOPs per second / the device's peak dense bf16 FLOP/s, with
  model FLOPs per step = 6 * params * tokens + 12 * layers * d_model *
  seq_len * tokens (the matmuls of forward and backward plus attention; no
  rematerialization counted). Peaks (dense bf16): H100 SXM 989 TFLOP/s,
  H100 PCIe 756, H200 989, A100 312, L4 121, A10G 70 (matched on
  ``device_kind``; an unknown device gives no MFU).
* Peak memory: ``compiled.memory_analysis()`` (arguments + temporaries +
  outputs - aliased) and, on GPU, ``memory_stats()["peak_bytes_in_use"]``.
* Hidden collective share: a ``jax.profiler`` trace of a few steps; the
  device events whose names are collectives (all-gather, reduce-scatter,
  all-reduce, NCCL kernels) against all other device kernels: the share of
  collective time during which a compute kernel ran too. Where the trace
  has no device events (the CPU backend), the report says it could not be
  measured.

Targets (from the project's plan): on 1 GPU, fsdp_jax at most 3% slower than
plain jit; MFU of 50% or more on an H100.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SIZES = {  # name -> (d_model, layers, heads, vocab, seq_len, batch per device)
    "1b": (2048, 20, 16, 32768, 1024, 4),
    "350m": (1024, 24, 16, 32768, 1024, 8),
    "tiny": (64, 2, 4, 256, 32, 2),
}
PEAK_BF16 = {  # device_kind substring -> dense bf16 FLOP/s
    "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12,
    "L4": 121e12, "A10G": 70e12,
}
# XLA options MaxText runs FSDP with on H100s (its GPU recipe): the
# latency-hiding scheduler, all-gathers combined up to 128 MiB and
# reduce-scatters up to 64 MiB, pipelined collectives, double-buffered while
# loops. ``--xla-options maxtext`` compiles both programs with the ones this
# XLA accepts (each is probed; the report lists any dropped).
MAXTEXT_GPU_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 67108864,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
}
COLLECTIVE_WORDS = ("all-gather", "allgather", "reduce-scatter", "reducescatter",
                    "all-reduce", "allreduce", "nccl", "collective-permute", "all-to-all")


def peak_flops(kind: str):
  for key, value in PEAK_BF16.items():  # longest keys first where they overlap
    if key in kind:
      return value
  return None


def model_flops(params: int, layers: int, d_model: int, seq_len: int, tokens: int) -> float:
  return 6.0 * params * tokens + 12.0 * layers * d_model * seq_len * tokens


def _intervals(events):
  out = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
  merged = []
  for a, b in out:
    if merged and a <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], b)
    else:
      merged.append([a, b])
  return merged


def _json_kernels(trace_dir: str):
  """Device kernel events ``(name, start us, duration us)`` from the
  profile's perfetto JSON, or None when it has none."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    return None
  with gzip.open(sorted(files)[-1], "rt") as f:
    trace = json.load(f)
  events = trace.get("traceEvents", [])
  names = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
  device_pids = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n.upper()}
  kernels = [(e["name"], e["ts"], e["dur"]) for e in events
             if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]
  return kernels or None


def xplane_events(trace_dir: str, plane_prefix: str = "/device:GPU"):
  """Events ``(name, start us, duration us)`` of the profile's planes whose
  name starts with ``plane_prefix`` (a GPU's planes hold one line per stream
  of kernels), read from the ``.xplane.pb`` with ``jax.profiler.ProfileData``;
  None when there is no such plane."""
  import jax  # pylint: disable=import-outside-toplevel  (starts no backend)
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(sorted(files)[-1])
  out = [(ev.name, ev.start_ns / 1e3, ev.duration_ns / 1e3)
         for plane in data.planes if plane.name.startswith(plane_prefix)
         for line in plane.lines for ev in line.events if ev.duration_ns > 0]
  return out or None


def hidden_share(kernels):
  """(share of collective time overlapped by compute, collective us, how)
  from device kernel events ``(name, start us, duration us)``."""
  is_coll = lambda name: any(w in name.lower() for w in COLLECTIVE_WORDS)
  as_event = lambda k: {"ts": k[1], "dur": k[2]}
  coll = _intervals([as_event(k) for k in kernels if is_coll(k[0])])
  comp = _intervals([as_event(k) for k in kernels if not is_coll(k[0])])
  total = sum(b - a for a, b in coll)
  if not total:
    return None, 0.0, f"no collective kernels among {len(kernels)} device kernels"
  hidden, j = 0.0, 0
  for a, b in coll:
    while j < len(comp) and comp[j][1] <= a:
      j += 1
    k = j
    while k < len(comp) and comp[k][0] < b:
      hidden += max(0.0, min(b, comp[k][1]) - max(a, comp[k][0]))
      k += 1
  return hidden / total, total, f"{len(kernels)} device kernels"


def trace_kernels(trace_dir: str):
  """``(kernels, source)``: the device kernel events of a jax.profiler trace
  directory (the perfetto JSON's, else the xplane's GPU planes) and where
  they were read, or ``(None, None)`` when it has none."""
  kernels = _json_kernels(trace_dir)
  if kernels is not None:
    return kernels, "perfetto JSON"
  kernels = xplane_events(trace_dir)
  return (kernels, "xplane") if kernels is not None else (None, None)


def top_kernels(kernels, k: int = 12):
  """``[(name, total us, count)]`` of the ``k`` kernels that took longest."""
  total: dict = {}
  for name, _, dur in kernels:
    t, c = total.get(name, (0.0, 0))
    total[name] = (t + dur, c + 1)
  ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:k]
  return [(name, round(t, 1), c) for name, (t, c) in ranked]


def hidden_collective_share(trace_dir: str):
  """(share of collective time overlapped by compute, collective us, how) from
  a jax.profiler trace directory, or (None, None, why) when it has no device
  events. Reads the perfetto JSON's device kernels, else the xplane's GPU
  planes."""
  kernels, source = trace_kernels(trace_dir)
  if kernels is None:
    return None, None, "the trace has no device (GPU) kernel events"
  share, total, how = hidden_share(kernels)
  return share, total, f"{how} ({source})"


def accepted_options(options: dict, platform: str):
  """``(accepted, dropped)``: the options this XLA compiles a program with on
  ``platform``, and the names of those it refuses."""
  from fsdp_jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  ok = {k: v for k, v in options.items() if mesh_lib._probe(platform, k, v)}  # pylint: disable=protected-access
  return ok, sorted(set(options) - set(ok))


def hlo_collectives(hlo_text: str):
  """``{kind: {dtype: count}}`` of the collectives in a compiled program."""
  from fsdp_jax import hlo  # pylint: disable=import-outside-toplevel
  out: dict = {}
  for c in hlo.collectives(hlo_text):
    for dtype in c.dtypes:
      by = out.setdefault(c.kind, {})
      by[dtype] = by.get(dtype, 0) + 1
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", choices=sorted(SIZES), default="1b")
  p.add_argument("--steps", type=int, default=10, help="timed steps per program")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--profile-steps", type=int, default=3)
  p.add_argument("--batch-per-device", type=int, default=None)
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--no-plain", action="store_true", help="skip the plain jit baseline")
  p.add_argument("--xla-options", choices=("default", "maxtext"), default="default",
                 help="compile both programs with XLA's defaults or with MaxText's H100 "
                      "options (MAXTEXT_GPU_OPTIONS)")
  p.add_argument("--out", default=None,
                 help="markdown report (default: benchmarks/gpu_runs/gpu-SIZE-OPTIONS.md on a "
                      "GPU, none on CPU); "
                      "the JSON goes next to it")
  args = p.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  if fsdp_jax.distributed.detect_platform() == "cpu":  # starts no backend
    fsdp_jax.simulate_cpu_devices(2)  # a smoke run: two simulated devices
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  from benchmarks.common import GPTConfig, make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block, make_model  # pylint: disable=import-outside-toplevel

  d, layers, heads, vocab, seq, bpd = SIZES[args.size]
  seq = args.seq_len or seq
  bpd = args.batch_per_device or bpd
  cfg = GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, num_layers=layers, num_heads=heads)
  devices = jax.devices()
  n = len(devices)
  kind = devices[0].device_kind
  _, init_fn, loss_fn = make_model(cfg)
  opt = optax.adamw(3e-4, weight_decay=0.1)
  bf16 = jnp.bfloat16

  # fsdp_jax FULL_SHARD, bf16 compute, fp32 reduction, one unit per Block.
  mesh = fsdp_jax.make_mesh(shard=n)
  config = fsdp_jax.FSDPConfig(
      auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}),
      mixed_precision=fsdp_jax.MixedPrecision(param_dtype=bf16, reduce_dtype=jnp.float32))
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                    mesh=mesh, config=config)
  num_params = sum(l.numel for l in state.plan.leaves)
  batch = make_batch(cfg, bpd * n)
  step = fsdp_jax.shard_train_step(loss_fn, opt)
  extra, dropped = {}, []
  if args.xla_options == "maxtext":
    extra, dropped = accepted_options(MAXTEXT_GPU_OPTIONS, devices[0].platform)
    # fsdp_jax's own options for this mesh, plus MaxText's.
    step = step._with_compiler_options(  # pylint: disable=protected-access
        {**fsdp_jax.custom.compiler_options(mesh), **extra})
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = {"fsdp_jax FULL_SHARD": time.perf_counter() - t0}
  collectives = hlo_collectives(compiled.as_text())
  ma = compiled.memory_analysis()
  fsdp_mem = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
              - ma.alias_size_in_bytes)
  box = {"state": state}

  def run_fsdp():
    s, m = step(box["state"], batch)
    jax.block_until_ready((s, m))  # the whole step, the optimizer update included
    box["state"] = s
    return float(m["loss"])

  programs = {"fsdp_jax FULL_SHARD": run_fsdp}
  plain_mem = None
  if not args.no_plain:
    dev = devices[0]
    params = jax.device_put(init_fn(jax.random.key(0)), dev)
    opt_state = opt.init(params)
    local = jax.device_put({k: v[:bpd] for k, v in batch.items()}, dev)

    def plain_loss(p, b):
      return loss_fn(jax.tree.map(lambda x: x.astype(bf16), p), b)

    def plain_step(params, opt_state, b):
      loss, grads = jax.value_and_grad(plain_loss)(params, b)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    t0 = time.perf_counter()
    plain = jax.jit(plain_step, donate_argnums=(0, 1), compiler_options=extra or None).lower(
        params, opt_state, local).compile()
    compile_s["plain jax.jit, 1 device"] = time.perf_counter() - t0
    pm = plain.memory_analysis()
    plain_mem = (pm.argument_size_in_bytes + pm.temp_size_in_bytes + pm.output_size_in_bytes
                 - pm.alias_size_in_bytes)
    pbox = {"p": (params, opt_state)}

    def run_plain():
      p_, s_, loss = plain(*pbox["p"], local)
      jax.block_until_ready((p_, s_, loss))
      pbox["p"] = (p_, s_)
      return float(loss)

    programs["plain jax.jit, 1 device"] = run_plain

  for _ in range(args.warmup):
    for fn in programs.values():
      fn()
  times = {name: [] for name in programs}
  for _ in range(args.steps):
    for name, fn in programs.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)

  trace_dir = tempfile.mkdtemp(prefix="fsdp_jax_gpu_profile_")
  try:  # a profiler that fails (no CUPTI) costs the overlap figure, not the run
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(args.profile_steps):
        run_fsdp()
    hidden, coll_us, how = hidden_collective_share(trace_dir)
    kernels, _ = trace_kernels(trace_dir)
  except Exception as e:  # pylint: disable=broad-except
    hidden, coll_us, how, kernels = None, None, f"the profile failed: {e!r:.300}", None
  top = top_kernels(kernels) if kernels else []
  peak_in_use = None
  stats = getattr(devices[0], "memory_stats", lambda: None)()
  if stats and "peak_bytes_in_use" in stats:
    peak_in_use = int(stats["peak_bytes_in_use"])

  peak = peak_flops(kind)
  tokens_per_device = bpd * seq
  flops_per_device = model_flops(num_params, layers, d, seq, tokens_per_device)
  rows, result = [], {"device_kind": kind, "devices": n, "jax": jax.__version__,
                      "size": args.size, "params": num_params, "seq_len": seq,
                      "batch_per_device": bpd, "xla_options": args.xla_options,
                      "xla_options_applied": extra, "xla_options_dropped": dropped,
                      "compile_s": compile_s, "fsdp_hlo_collectives": collectives,
                      "top_kernels_fsdp": top, "programs": {}}
  for name, ts in times.items():
    t = statistics.median(ts)
    mfu = flops_per_device / t / peak if peak else None
    mem = fsdp_mem if name.startswith("fsdp") else plain_mem
    result["programs"][name] = {"step_s": t, "tokens_per_s_per_device": tokens_per_device / t,
                                "mfu": mfu, "compiled_peak_bytes": mem, "step_times_s": ts}
    rows.append(f"| {name} | {t * 1e3:.1f} | {tokens_per_device / t:,.0f} | "
                f"{f'{mfu:.1%}' if mfu is not None else 'n/a (peak unknown)'} | "
                f"{mem / 2**20:,.1f} |")
  ratio = None
  if len(times) == 2:
    ratio = (statistics.median(times["fsdp_jax FULL_SHARD"])
             / statistics.median(times["plain jax.jit, 1 device"]))
  result.update(fsdp_over_plain=ratio, hidden_collective_share=hidden,
                collective_us_profiled=coll_us, profile_note=how,
                peak_bytes_in_use_device0=peak_in_use)
  hidden_line = (f"{hidden:.1%} of collective time ({coll_us / 1e3:.1f} ms over "
                 f"{args.profile_steps} steps; {how})" if hidden is not None else
                 f"could not be measured: {how}")
  text = "\n".join([
      f"# GPU benchmark: {kind}",
      "",
      f"`python benchmarks/gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
      f" on {n} x {kind}, jax {jax.__version__}. GPT of {num_params:,} parameters "
      f"({layers} blocks, d_model {d}, {heads} heads, vocab {vocab}), sequence {seq}, "
      f"{bpd} sequences per device; AdamW, fp32 master parameters, bf16 compute; median of "
      f"{args.steps} steps after {args.warmup} warm-up, the programs alternating. "
      f"XLA options: {args.xla_options}"
      + (f" ({', '.join(f'{k}={v}' for k, v in extra.items())}"
         f"{'; refused by this XLA: ' + ', '.join(dropped) if dropped else ''})"
         if args.xla_options != "default" else "") + ".",
      "",
      "| program | step ms | tokens/s per device | MFU | compiled peak MiB per device |",
      "|---|---|---|---|---|",
      *rows,
      "",
      f"fsdp_jax / plain jit step time: {f'{ratio:.3f}' if ratio else 'n/a'} "
      "(target on 1 GPU: at most 1.03).",
      f"Collective time hidden behind compute (fsdp_jax): {hidden_line}.",
      f"Device 0 peak bytes in use: "
      f"{f'{peak_in_use / 2**30:.2f} GiB' if peak_in_use else 'not reported by this backend'}.",
      f"Compile seconds: {', '.join(f'{k} {v:.1f}' for k, v in compile_s.items())}.",
      f"Collectives in fsdp_jax's compiled step (kind: dtype x count): "
      f"{json.dumps(collectives) if collectives else 'none'}.",
      f"Trace: {len(kernels) if kernels else 0} device kernel events; longest: "
      + ("; ".join(f"{name[:60]} {us / 1e3:.1f} ms x{c}" for name, us, c in top[:5])
         if top else "none") + ".",
      ""])
  print(text)
  out = args.out
  if out is None and jax.default_backend() == "gpu":
    out = os.path.join(HERE, "gpu_runs", f"gpu-{args.size}-{args.xla_options}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
  if out:
    with open(out, "w") as f:
      f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result


if __name__ == "__main__":
  main()
