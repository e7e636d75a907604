"""PLANNER.md from ``benchmarks/planner.json`` (``python -m benchmarks planner``)."""

from __future__ import annotations

GiB, MiB = 1 << 30, 1 << 20

# Published per-GPU memory of the same models (cited in the text).
PUBLISHED = [
    ("torchtitan", "Llama 3.1 8B, full fine-tuning (pre-training), 8 H100 (96 GB HBM2e), FSDP, "
     "local batch 2 x 8192 tokens, selective activation checkpointing, bf16",
     "82.4 GiB", "torchtitan docs/performance.md, Table 1 (FSDP, no torch.compile)"),
    ("torchtitan", "Llama 3.1 8B, the same on 128 H100 (global batch 256)", "67.0 GiB",
     "torchtitan docs/performance.md, Table 3 (FSDP)"),
    ("torchtitan", "Llama 3.1 70B, 256 H100 (FSDP 32 x TP 8), local batch 16 x 8192, full "
     "activation checkpointing, Float8", "71.9 GiB",
     "torchtitan docs/performance.md, Table 4 (2D)"),
    ("Answer.AI FSDP-QLoRA", "Llama 2 70B QLoRA on 2 x 24 GB GPUs with gradient checkpointing "
     "and CPU offload", "fits in 24 GB",
     "answer.ai/posts/2024-03-06-fsdp-qlora (\"train a 70b model on two 24GB GPUs\")"),
]


def _accuracy(rows) -> list:
  out = ["| configuration | devices | mesh | compiled peak MiB | estimate MiB | error | "
         "peak | modelled MiB | modelled error | estimate s | compile s |",
         "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    out.append(f"| {r['name']} | {r['devices']} | {mesh} | {r['truth'] / MiB:.2f} | "
               f"{r['estimate'] / MiB:.2f} | {100 * r['error']:+.2f}% | "
               f"{'compiled' if r.get('compiled') else 'modelled'} | "
               f"{r['modelled'] / MiB:.2f} | {100 * r['modelled_error']:+.2f}% | "
               f"{r['estimate_s']:.0f} | {r['compile_s']:.0f} |")
  for key, what in (("error", "estimates"), ("modelled_error", "modelled peaks")):
    errs = [abs(r[key]) for r in rows]
    if errs:
      within = sum(e <= 0.05 for e in errs)
      out.append("")
      out.append(f"{what.capitalize()}: {within} of {len(errs)} configurations within 5% of "
                 f"the compiled peak; largest error {100 * max(errs):.2f}%, mean absolute "
                 f"{100 * sum(errs) / len(errs):.2f}%.")
  return out


def _time(rows) -> list:
  out = ["| configuration (8 simulated devices) | measured ms | predicted ms (\"cpu\") | "
         "measured / predicted |", "|---|---:|---:|---:|"]
  for r in rows:
    out.append(f"| {r['name']} | {r['measured_s'] * 1e3:.0f} | {r['predicted_s'] * 1e3:.0f} | "
               f"{r['ratio']:.2f} |")
  return out


def _fits(rows) -> list:
  out = ["| model | fine-tuning | H100s | best configuration | memory / GPU GiB | peak | "
         "predicted tokens/s / GPU |", "|---|---|---:|---|---:|---|---:|"]
  for r in rows:
    mem = f"{r['memory_gib']:.1f}" if r["memory_gib"] is not None else "-"
    tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-"
    how = {True: "compiled", False: "modelled"}.get(r.get("compiled"), "-")
    out.append(f"| Llama 3 {r['model']} | {r['mode']} | {r['devices']} | {r['best']} | {mem} | "
               f"{how} | {tps} |")
  return out


def render(results: dict) -> str:
  m = results.get("machine", {})
  lines = [
      "# The planner against the compiled step",
      "",
      f"`python -m benchmarks planner` ({m.get('date', '?')}, jax {m.get('jax', '?')}, Python "
      f"{m.get('python', '?')}, a shared 2-core {m.get('cpu', '?')} machine). Raw numbers: "
      "`benchmarks/planner.json`. docs/planner.md explains the model.",
      "",
  ]
  missing = [title for key, title in (("accuracy", "memory accuracy"), ("time", "CPU step time"),
                                      ("cost", "cost"), ("fits", "what fits"))
             if key not in results]
  if missing:
    lines += [f"Not measured yet: {', '.join(missing)} (`--only` ran the rest).", ""]
  if "accuracy" in results:
    lines += [
        "## Memory: estimate against the compiled step's peak",
        "",
        "The truth: the real step (`shard_train_step`) compiled on "
        "`jax.eval_shape(init_train_state(...))` in a fresh process with that many simulated "
        "CPU devices, `memory_analysis()` argument + temp + output - alias per device (with CPU "
        "offload the device-resident arguments and results, since the CPU backend counts host "
        "buffers as arguments). The estimate: `fsdp_jax.estimate` in a process with 8 simulated "
        "devices, which never builds the configuration's mesh: its peak is the step's own "
        "per-device program compiled on one local device with its collectives replaced by "
        "local stand-ins (`peak`: compiled; for the remat what-if, the step of the loss "
        "rewritten with a `jax.checkpoint` around each block, against the truth of the model "
        "written with `nn.remat` per block); `modelled`: the same estimate with "
        "`compile_step=False` (the units' "
        "programs in the step's order, what a program too large to compile by default "
        "gets). Model: examples/llama.py's "
        "Llama (RMSNorm, rotary, grouped-query attention, SwiGLU), hidden 256, intermediate 768, "
        "8 heads / 4 key-value heads, vocabulary 4096, 4 layers (2 on 256 devices), 2 sequences "
        "of 256 tokens per device, AdamW; one unit per block (or `nn.scan` over stacked "
        "blocks); LoRA / QLoRA: rank 8 on every projection, nf4 in blocks of 64; TP: Megatron's "
        "rules on the projections; `policy full` / `dots` / `offload`: "
        "`FSDPConfig(activation_checkpointing=ActivationCheckpointing(policy))` (on the CPU "
        "backend `\"offload\"` moves nothing: its truth and compiled estimate count the "
        "offloaded activations as device memory, its modelled peak counts them as host "
        "memory, as on a GPU). The model's loss is unblocked (float32 logits), as before "
        "the families' blocked loss; with checkpointed units the modelled peak counts the "
        "two logits-sized buffers XLA keeps while it defers the head's kernel gradient to "
        "the end of the backward (docs/planner.md, \"Where it is approximate\"; without "
        "them it was 14% to 22% under the compiled peak: `remat (nn.remat)` -19.7%, `remat "
        "64` -21.7%, `remat what-if` -13.2%, `policy full` / `dots` / `offload` -14.2% / "
        "-7.7% / -17.9%, and on 64 devices -14.9% / -8.4% / -19.9%). The rows of "
        "checkpointed units were measured last (09:25 to 09:45 UTC, load average 15), after "
        "the other rows.",
        "",
    ] + _accuracy(results["accuracy"]) + [""]
  if "time" in results:
    lines += [
        "## Time on this CPU: measured / predicted",
        "",
        "Median step time of the real step on 8 simulated devices (which share two busy "
        "cores: their collectives are memory copies and their compute is serialised) against "
        "the estimate with the `\"cpu\"` DeviceSpec. A ratio only: the 15% target is for a GPU "
        "(see below).",
        "",
    ] + _time(results["time"]) + [""]
  if "cost" in results:
    c = results["cost"]
    e, s = c["estimate"], c["search"]
    lines += [
        "## Cost",
        "",
        f"- `estimate` of a 70B-shaped Llama 3 (80 layers, hidden 8192, bf16 compute) on 64 "
        f"devices, 4096 tokens per device: **{e['seconds']:.0f} s**, peak resident memory "
        f"grown by **{e['rss_growth'] / MiB:.0f} MiB** (process peak "
        f"{e['rss_peak'] / MiB:.0f} MiB, JAX and 8 simulated devices included), in a fresh "
        "process.",
    ] + ([
        f"- The same on `{{\"shard\": 8, \"tensor\": 8}}` (Megatron's rules on the projections): "
        f"**{c['estimate_tp']['seconds']:.0f} s**, peak resident memory grown by "
        f"**{c['estimate_tp']['rss_growth'] / MiB:.0f} MiB** (process peak "
        f"{c['estimate_tp']['rss_peak'] / MiB:.0f} MiB); before the update program was "
        "compiled on the distinct leaves and the segments one at a time (the memory XLA "
        "freed handed back), 567 to 594 MiB.",
    ] if "estimate_tp" in c else []) + [
        f"- `search` over the same model on 64 devices: **{s['estimated']} configurations "
        f"estimated in {s['seconds']:.0f} s** ({s['fit']} fit; best: {s['best']}), peak "
        f"resident memory grown by {s['rss_growth'] / MiB:.0f} MiB.",
        "",
    ]
  if "fits" in results:
    lines += [
        "## What fits: Llama 3 8B and 70B on H100s",
        "",
        f"`search` with the `\"H100-80GB\"` preset, AdamW, bf16 compute over fp32 master "
        f"weights, one unit per block, {results['fits'][0]['seq']} tokens per sequence and one "
        "sequence per GPU per step (global batch = GPUs); meshes: one data-parallel axis, and "
        "for the HYBRID strategies shards within a node of 8; LoRA rank 8 on every projection, "
        "QLoRA nf4. The best (fastest predicted) configuration that fits; `peak`: whether "
        "its memory is the step compiled per device (the search confirms its best that way "
        "when the loss's program has at most 5,000 equations: 8B's 32 blocks, 4,859) or "
        "modelled (70B's 80 blocks, 12,059 equations):",
        "",
    ] + _fits(results["fits"]) + [
        "",
        "Published per-GPU memory of comparable runs (their setups differ: read the row):",
        "",
        "| source | run | memory per GPU | where |",
        "|---|---|---|---|",
    ] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in PUBLISHED] + [""]
  if "long_context" in results:
    lines += _long_context(results["long_context"])
  return "\n".join(lines)


def _long_context(rows) -> list:
  """``python -m fsdp_jax.plan --seq T`` for Llama 3 8B and 70B on 8 H100s:
  what the search picked, the context size with it
  (``benchmarks/planner_cli.py --record``'s runs)."""
  out = [
      "## Long sequences: what the search picks",
      "",
      "`python -m fsdp_jax.plan --hf-config <Llama 3 8B or 70B config.json> --devices 8 "
      "--device H100-80GB --seq T --global-batch 8` (`python -m benchmarks.planner_cli "
      "[--model 70b] --record benchmarks/planner.json`, a fresh process; full fine-tuning, "
      "AdamW, bf16 compute over fp32 master weights, one unit per block): the search tries "
      "the activation checkpointing policies, CPU offload, gradient accumulation and context "
      "sizes 1, 2, 4 and 8 (per configuration the smallest that fits). `command` names the "
      "options the run narrowed the search with; `wall s` is the command's time on this "
      "shared 2-core machine at the load average given.",
      "",
      "| Llama 3 | tokens / sequence | command | best configuration | context | "
      "memory / GPU GiB | peak | predicted tokens/s / GPU | configurations that fit | "
      "wall s | load | date |",
      "|---|---:|---|---|---:|---:|---|---:|---:|---:|---|---|"]
  order = lambda r: (int(r.get("model", "8b")[:-1]), r["seq"])
  for r in sorted(rows, key=order):
    mem = f"{r['memory_gib']:.1f}" if r.get("memory_gib") is not None else "-"
    tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") is not None else "-"
    how = {True: "compiled", False: "modelled"}.get(r.get("compiled"), "-")
    out.append(f"| {r.get('model', '8b').upper()} | {r['seq']:,} | "
               f"`{r['command'] or 'every strategy and layout'}` | "
               f"{r['best'] or 'nothing fits'} | {r.get('context') or '-'} | {mem} | {how} | "
               f"{tps} | {r['fitting']} | {r['wall_seconds']:.0f} | {r['load']} | "
               f"{r.get('date', '-')} |")
  return out + [""]
