"""Generate the PyTorch-FSDP golden reference files in ``tests/golden/*.json``.

This script is *not* part of the library or the test suite: it is the committed
recipe that produced the JSON files the JAX tests read.  torch is imported lazily
(only when the script is run), so importing this module (e.g. by pytest's
``--doctest-modules``) does not need torch.

How it was run
--------------
    python tests/golden/make_goldens.py            # writes tests/golden/*.json

on a CPU-only Linux machine (2 cores) with

    torch 2.13.0+cpu, Python 3.11.7

using real ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1) with the
gloo backend on CPU, one OS process per rank (``torch.multiprocessing`` spawn,
rendezvous on ``tcp://127.0.0.1:<free port>``).  Total runtime was 1.5-2 minutes
(one spawn per world size 2/3/4); re-running reproduces the JSON files byte for
byte.  See ``tests/golden/README.md`` for the exact semantics of every number.

Known CPU/gloo limitations respected here (measured with torch 2.13):
``device_id=torch.device("cpu")`` is passed; ``_HYBRID_SHARD_ZERO2`` gives wrong
gradients on CPU and is not used; ``offload_to_cpu=True`` in state-dict /
summon_full_params configs crashes on CPU, so ``offload_to_cpu=False``;
``CPUOffload(offload_params=True)``, ``sync_module_states=True`` and the
fp16/bf16 compress comm hooks do not run on CPU and are not used.

Options: ``--only NAME`` (repeatable) to regenerate a subset of
{mixed_precision_bf16, clip_grad_norm, no_sync, strategies}; ``--out DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
import warnings

D_IN, D, D_OUT, N_BLOCKS = 5, 7, 3, 3
LR = 1e-2
INIT_SEED = 0
PARAM_NAMES = ["inp.w"] + [f"blocks.{i}.{k}" for i in range(N_BLOCKS) for k in ("w", "b")] + ["out.w"]
JOIN_TIMEOUT_S = 300  # per spawned process group
PG_TIMEOUT_S = 120  # gloo collective timeout


# --------------------------------------------------------------------------------------
# Model, init and data (shared by the FSDP workers and the single-device references)
# --------------------------------------------------------------------------------------


def _build_model(init):
    """The MLP; ``init`` maps JAX-style names to (in, out)-oriented float32 tensors."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, h):
            return torch.tanh(self.lin(h))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D_IN, D, bias=False)
            self.blocks = nn.ModuleList([Block() for _ in range(N_BLOCKS)])
            self.out = nn.Linear(D, D_OUT, bias=False)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for blk in self.blocks:
                h = blk(h)
            return self.out(h)

    model = MLP()
    with torch.no_grad():
        model.inp.weight.copy_(init["inp.w"].T)
        for i, blk in enumerate(model.blocks):
            blk.lin.weight.copy_(init[f"blocks.{i}.w"].T)
            blk.lin.bias.copy_(init[f"blocks.{i}.b"])
        model.out.weight.copy_(init["out.w"].T)
    return model, Block


def _torch_sd_to_jax(sd):
    """PyTorch state dict (possibly FSDP full state dict) -> {jax name: nested list (in, out)}."""
    out = {}
    for k, v in sd.items():
        k = k.replace("_fsdp_wrapped_module.", "").replace("_flat_param", "")
        if k == "inp.weight":
            out["inp.w"] = v.detach().float().T
        elif k == "out.weight":
            out["out.w"] = v.detach().float().T
        elif k.startswith("blocks.") and k.endswith(".lin.weight"):
            out[f"blocks.{k.split('.')[1]}.w"] = v.detach().float().T
        elif k.startswith("blocks.") and k.endswith(".lin.bias"):
            out[f"blocks.{k.split('.')[1]}.b"] = v.detach().float()
        else:
            raise KeyError(k)
    assert sorted(out) == sorted(PARAM_NAMES), sorted(out)
    return {n: out[n].tolist() for n in PARAM_NAMES}


def make_init():
    import torch

    torch.manual_seed(INIT_SEED)
    shapes = {"inp.w": (D_IN, D), "out.w": (D, D_OUT)}
    for i in range(N_BLOCKS):
        shapes[f"blocks.{i}.w"] = (D, D)
        shapes[f"blocks.{i}.b"] = (D,)
    init = {}
    for n in PARAM_NAMES:  # fixed generation order = PARAM_NAMES order
        if n.endswith(".b"):
            init[n] = torch.full(shapes[n], 0.1, dtype=torch.float32)
        else:
            init[n] = torch.randn(shapes[n], dtype=torch.float32) * 0.5
    return init


def make_dataset(seed, steps, global_batch):
    """Teacher-student regression data (float32), drawn from ``torch.Generator().manual_seed(seed)``:

    A = randn(5, 8); B = randn(8, 3) * 0.05; x = randn(steps, gb, 5);
    y = tanh(x @ A) @ B + 0.005 * randn(steps, gb, 3).
    The small target scale makes the initial-weights error dominate, so losses decrease
    visibly over a few Adam steps even though every step sees a fresh batch.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(D_IN, 8, generator=g)
    b = torch.randn(8, D_OUT, generator=g) * 0.05
    x = torch.randn(steps, global_batch, D_IN, generator=g)
    y = torch.tanh(x @ a) @ b + 0.005 * torch.randn(steps, global_batch, D_OUT, generator=g)
    return {"x": x.float(), "y": y.float()}


# --------------------------------------------------------------------------------------
# FSDP worker (one process per rank); runs a list of cases in one process group
# --------------------------------------------------------------------------------------


def _predivide_factor(world_size):
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def _fsdp_case(rank, world, case, init, data):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        FullStateDictConfig,
        FullyShardedDataParallel as FSDP,
        MixedPrecision,
        ShardingStrategy,
        StateDictType,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, block_cls = _build_model(init)
    kw = dict(
        auto_wrap_policy=ModuleWrapPolicy({block_cls}),
        device_id=torch.device("cpu"),
        sharding_strategy=getattr(ShardingStrategy, case["strategy"]),
    )
    mp = case.get("mixed_precision")
    if mp is not None:
        kw["mixed_precision"] = MixedPrecision(
            param_dtype=getattr(torch, mp["param_dtype"]),
            reduce_dtype=getattr(torch, mp["reduce_dtype"]),
            keep_low_precision_grads=mp.get("keep_low_precision_grads", False),
        )
    if case["strategy"] == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", tuple(case["mesh"]), mesh_dim_names=("replicate", "shard"))
    fsdp = FSDP(model, **kw)
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)

    def full_params():
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, cfg):
            sd = fsdp.state_dict()
        if rank != 0:
            return None, None
        dtypes = sorted({str(v.dtype) for v in sd.values()})
        return _torch_sd_to_jax(sd), dtypes

    gb = data["x"].shape[1]
    lb = gb // world
    k = case.get("accum_k", 1)
    assert lb % k == 0
    mb = lb // k
    rec = {"local_losses": [], "total_norms": [], "total_norm_dtype": None, "total_norms_fp32_recomputed": []}
    for step in range(data["x"].shape[0]):
        if case.get("clip") is not None:
            # Parameters entering each step, so a consumer can check its clip
            # norm on exactly PyTorch's trajectory (teacher forcing).
            rec.setdefault("params_before_step", []).append(full_params()[0])
        x = data["x"][step, rank * lb : (rank + 1) * lb]
        y = data["y"][step, rank * lb : (rank + 1) * lb]
        opt.zero_grad(set_to_none=True)
        micro_losses = []
        for j in range(k):
            xj, yj = x[j * mb : (j + 1) * mb], y[j * mb : (j + 1) * mb]

            def fwd_bwd():
                pred = fsdp(xj)
                loss = ((pred - yj) ** 2).mean()
                rec.setdefault("pred_dtype", str(pred.dtype))
                rec.setdefault("loss_dtype", str(loss.dtype))
                (loss / k).backward()
                return loss.detach().float()

            if j < k - 1:
                with fsdp.no_sync():
                    micro_losses.append(fwd_bwd())
            else:
                micro_losses.append(fwd_bwd())
        local = torch.stack(micro_losses).mean()  # mean of microbatch losses (before /k)
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, local)
        rec["local_losses"].append([float(t) for t in gathered])
        rec.setdefault("grad_dtype", str(next(p for p in fsdp.parameters() if p.grad is not None).grad.dtype))
        if case.get("clip") is not None:
            max_norm, norm_type = case["clip"]["max_norm"], case["clip"]["norm_type"]
            # fp32 recomputation of the pre-clip norm from the local grad shards (for reference).
            grads = [p.grad for p in fsdp.parameters() if p.grad is not None]
            if norm_type == math.inf:
                t = torch.stack([g.detach().float().abs().max() for g in grads]).max()
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            else:
                t = sum((g.detach().float() ** 2).sum() for g in grads)
                dist.all_reduce(t)
                t = t.sqrt()
            rec["total_norms_fp32_recomputed"].append(float(t))
            tn = fsdp.clip_grad_norm_(max_norm, norm_type)
            rec["total_norms"].append(float(tn))
            rec["total_norm_dtype"] = str(tn.dtype)
        for p in fsdp.parameters():  # bf16 grads (keep_low_precision_grads) -> fp32 for Adam
            if p.grad is not None and p.grad.dtype != p.dtype:
                p.grad = p.grad.to(p.dtype)
        opt.step()
        if step == 0:
            rec["params_after_step1"], _ = full_params()
    rec["final_params"], rec["state_dict_dtypes"] = full_params()
    if case["strategy"] == "HYBRID_SHARD":
        # Shard-group size of this rank's FSDP instance (sanity record).
        rec["shard_group_size"] = dist.get_world_size(fsdp.process_group)
    dist.barrier()
    return rec


def _worker(rank, world, port, jobs, init, datasets, result_path):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1 deprecation noise
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        results = {}
        for key, case in jobs:
            results[key] = _fsdp_case(rank, world, case, init, datasets[case["dataset"]])
        if rank == 0:
            torch.save(results, result_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp_group(world, jobs, init, datasets):
    """Spawn ``world`` processes, run ``jobs`` [(key, case)], return {key: record}."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "res.pt")
        ctx = mp.spawn(
            _worker,
            args=(world, _free_port(), jobs, init, datasets, path),
            nprocs=world,
            join=False,
        )
        deadline = time.time() + JOIN_TIMEOUT_S
        try:
            while not ctx.join(timeout=5):
                if time.time() > deadline:
                    raise TimeoutError(f"world={world} group did not finish in {JOIN_TIMEOUT_S}s")
        finally:
            for p in ctx.processes:  # only the processes this function started
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        return torch.load(path)


# --------------------------------------------------------------------------------------
# Single-device references (one process, no FSDP)
# --------------------------------------------------------------------------------------


def run_single_device(case, init, data, emulate_world=None):
    """Plain PyTorch, full global batch, same math.

    fp32 cases: one forward/backward over the whole global batch (the FSDP gradient
    is the average of per-rank local-mean gradients = the global-mean gradient).

    Mixed-precision cases (``emulate_world`` = W): FSDP's low-precision math cannot be
    reproduced by one big batch (bf16 rounding depends on which rows are together), so
    we emulate it exactly in one process: a bf16 copy of the fp32 master params, a
    forward/backward per virtual rank on its local rows, grads cast to reduce_dtype,
    divided by the pre-divide factor, summed over ranks, divided by the post-divide
    factor (the same sequence FSDP uses, only the cross-rank summation order may
    differ), then clip/Adam on fp32 masters.
    """
    import torch

    model, _ = _build_model(init)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=LR)
    mp = case.get("mixed_precision")
    steps, gb = data["x"].shape[0], data["x"].shape[1]
    rec = {"losses": [], "total_norms": []}
    for step in range(steps):
        x, y = data["x"][step], data["y"][step]
        opt.zero_grad(set_to_none=True)
        if mp is None:
            pred = model(x)
            loss = ((pred - y) ** 2).mean()
            loss.backward()
            rec["losses"].append(float(loss.detach()))
        else:
            W = emulate_world
            pdt, rdt = getattr(torch, mp["param_dtype"]), getattr(torch, mp["reduce_dtype"])
            pre, post = _predivide_factor(W), W / _predivide_factor(W)
            lb = gb // W
            acc = [None] * len(params)
            local_losses = []
            for r in range(W):
                low_params = [p.detach().to(pdt).requires_grad_(True) for p in params]
                pred = torch.func.functional_call(
                    model, {n: lp for (n, _), lp in zip(model.named_parameters(), low_params)}, (x[r * lb : (r + 1) * lb].to(pdt),)
                )
                loss = ((pred - y[r * lb : (r + 1) * lb]) ** 2).mean()
                loss.backward()
                local_losses.append(float(loss.detach()))
                for i, lp in enumerate(low_params):
                    g = lp.grad.to(rdt) / pre
                    acc[i] = g if acc[i] is None else acc[i] + g
            grads = [(g / post).to(rdt) for g in acc]
            rec["losses"].append(sum(local_losses) / W)
            if case.get("clip") is not None:
                # FSDP.clip_grad_norm_ math on the (possibly bf16) reduced grads: per-grad
                # norms in fp32, norm of the stacked norms in fp32, coef in fp32 cast to
                # the grad dtype; the returned norm is cast to the grad dtype.
                max_norm, nt = case["clip"]["max_norm"], case["clip"]["norm_type"]
                tn = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g, nt, dtype=torch.float32) for g in grads]),
                    nt, dtype=torch.float32,
                )
                coef = torch.clamp(max_norm / (tn + 1e-6), max=1.0)
                grads = [g * coef.to(g.dtype) for g in grads]
                rec["total_norms"].append(float(tn.to(grads[0].dtype)))
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
        if mp is None and case.get("clip") is not None:
            tn = torch.nn.utils.clip_grad_norm_(params, case["clip"]["max_norm"], case["clip"]["norm_type"])
            rec["total_norms"].append(float(tn))
        opt.step()
        if step == 0:
            rec["params_after_step1"] = _torch_sd_to_jax(model.state_dict())
    rec["final_params"] = _torch_sd_to_jax(model.state_dict())
    if not rec["total_norms"]:
        del rec["total_norms"]
    return rec


# --------------------------------------------------------------------------------------
# Golden sets
# --------------------------------------------------------------------------------------


def _max_abs(a, b):
    import numpy as np

    if isinstance(a, dict):
        return max(_max_abs(a[n], b[n]) for n in a)
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def golden_specs():
    fp32 = None
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    bf16_grads = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16", "keep_low_precision_grads": True}
    specs = {}
    specs["mixed_precision_bf16"] = {
        "datasets": {"g24": dict(seed=1, steps=6, global_batch=24)},
        "cases": {
            f"{name}_world{w}": dict(world=w, strategy="FULL_SHARD", mixed_precision=mp, dataset="g24")
            for w in (2, 4)
            for name, mp in (("bf16", bf16), ("fp32", fp32))
        },
    }
    clip_cases = {}
    for w in (3, 4):
        # max_norm chosen so clipping is active in most (not all) steps for both norms.
        for nt, nt_name, mn in ((2.0, "norm2", 0.5), (math.inf, "norminf", 0.12)):
            clip_cases[f"{nt_name}_world{w}"] = dict(
                world=w, strategy="FULL_SHARD", mixed_precision=None, dataset="g24",
                clip={"max_norm": mn, "norm_type": nt},
            )
    clip_cases["bf16grads_norm2_world4"] = dict(
        world=4, strategy="FULL_SHARD", mixed_precision=bf16_grads, dataset="g24",
        clip={"max_norm": 0.5, "norm_type": 2.0},
    )
    specs["clip_grad_norm"] = {"datasets": {"g24": dict(seed=2, steps=6, global_batch=24)}, "cases": clip_cases}
    ns = {}
    for k, ds in ((2, "g24"), (3, "g24"), (4, "g32")):
        ns[f"accum_k{k}_world4"] = dict(world=4, strategy="FULL_SHARD", mixed_precision=None, dataset=ds, accum_k=k)
        ns[f"noaccum_{ds}_world4"] = dict(world=4, strategy="FULL_SHARD", mixed_precision=None, dataset=ds, accum_k=1)
    specs["no_sync"] = {
        "datasets": {"g24": dict(seed=3, steps=4, global_batch=24), "g32": dict(seed=4, steps=4, global_batch=32)},
        "cases": ns,
    }
    st = {f"{s}_world3": dict(world=3, strategy=s, mixed_precision=None, dataset="g24")
          for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}
    st["HYBRID_SHARD_mesh2x2_world4"] = dict(world=4, strategy="HYBRID_SHARD", mesh=[2, 2], mixed_precision=None, dataset="g24")
    specs["strategies"] = {"datasets": {"g24": dict(seed=5, steps=4, global_batch=24)}, "cases": st}
    return specs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--only", action="append", default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    t0 = time.time()
    init = make_init()
    specs = golden_specs()
    names = args.only or list(specs)
    for nm in names:
        if nm not in specs:
            sys.exit(f"unknown golden set {nm!r}; choose from {sorted(specs)}")

    # Build datasets (tensors) per file, keyed "<file>/<ds>" for the workers.
    tensors = {}
    for nm in names:
        for ds, p in specs[nm]["datasets"].items():
            tensors[f"{nm}/{ds}"] = make_dataset(**p)

    # Group every FSDP case of every requested file by world size: one spawn per world.
    by_world = {}
    for nm in names:
        for key, case in specs[nm]["cases"].items():
            c = dict(case, dataset=f"{nm}/{case['dataset']}")
            by_world.setdefault(case["world"], []).append((f"{nm}/{key}", c))
    fsdp_res = {}
    for w, jobs in sorted(by_world.items()):
        t = time.time()
        fsdp_res.update(run_fsdp_group(w, jobs, init, tensors))
        print(f"world={w}: {len(jobs)} FSDP cases in {time.time() - t:.1f}s", flush=True)

    meta = {
        "generator": "tests/golden/make_goldens.py",
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "backend": "gloo on CPU, one process per rank, torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)",
    }
    model_desc = {
        "d_in": D_IN, "d": D, "d_out": D_OUT, "n_blocks": N_BLOCKS,
        "forward": "h = tanh(x @ inp.w); for k in 0..2: h = tanh(h @ blocks.k.w + blocks.k.b); pred = h @ out.w",
        "param_names": PARAM_NAMES,
        "param_orientation": "JAX (in, out): stored w = torch nn.Linear.weight.T",
        "fsdp_wrapping": "ModuleWrapPolicy({Block}) (each block its own FSDP unit) + root FSDP unit (inp.w, out.w)",
        "loss": "((pred - y)**2).mean() over the rank's local (micro)batch",
        "optimizer": {"name": "torch.optim.Adam", "lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        "init": f"torch.manual_seed({INIT_SEED}); for name in param_names: w = torch.randn(in, out) * 0.5, b = 0.1",
    }
    init_json = {n: init[n].tolist() for n in PARAM_NAMES}

    for nm in names:
        spec = specs[nm]
        out = {"meta": meta, "model": model_desc, "init_params": init_json, "datasets": {}, "cases": {}}
        for ds, p in spec["datasets"].items():
            t = tensors[f"{nm}/{ds}"]
            out["datasets"][ds] = dict(p, x=t["x"].tolist(), y=t["y"].tolist())
        single_cache = {}
        for key, case in spec["cases"].items():
            r = fsdp_res[f"{nm}/{key}"]
            data = tensors[f"{nm}/{case['dataset']}"]
            losses = [float(np.mean(np.asarray(l, np.float64))) for l in r["local_losses"]]
            mp = case.get("mixed_precision")
            sk = (case["dataset"], json.dumps(case.get("clip")), json.dumps(mp), case["world"] if mp else None)
            if sk not in single_cache:
                single_cache[sk] = run_single_device(case, init, data, emulate_world=case["world"] if mp else None)
            sd = single_cache[sk]
            c = {
                "config": {
                    "world_size": case["world"],
                    "sharding_strategy": case["strategy"],
                    "device_mesh": case.get("mesh"),
                    "mixed_precision": mp,
                    "clip": None if case.get("clip") is None else {
                        "max_norm": case["clip"]["max_norm"],
                        "norm_type": "inf" if case["clip"]["norm_type"] == math.inf else case["clip"]["norm_type"],
                    },
                    "accum_k": case.get("accum_k", 1),
                    "dataset": case["dataset"],
                    "local_batch": data["x"].shape[1] // case["world"],
                    "steps": data["x"].shape[0],
                },
                "losses": losses,
                "local_losses": r["local_losses"],
                "pred_dtype": r["pred_dtype"],
                "grad_dtype_after_backward": r["grad_dtype"],
                "state_dict_dtypes": r["state_dict_dtypes"],
                "params_after_step1": r["params_after_step1"],
                "final_params": r["final_params"],
            }
            if case.get("clip") is not None:
                c["total_norms"] = r["total_norms"]
                c["total_norm_dtype"] = r["total_norm_dtype"]
                c["clip_active"] = [tn > case["clip"]["max_norm"] for tn in r["total_norms"]]
                c["params_before_step"] = r["params_before_step"]
                if mp is not None:
                    c["total_norms_fp32_recomputed"] = r["total_norms_fp32_recomputed"]
            if "shard_group_size" in r:
                c["shard_group_size"] = r["shard_group_size"]
            c["single_device"] = sd
            c["single_device_kind"] = (
                "fsdp_math_emulation: one process, per-virtual-rank low-precision fwd/bwd on the local rows, "
                "FSDP's cast/pre-divide/sum/post-divide sequence, fp32 master params"
                if mp else "plain: one process, no FSDP, one fwd/bwd over the whole global batch, fp32"
            )
            c["fsdp_vs_single_device_max_abs_diff"] = {
                "losses": _max_abs(losses, sd["losses"]),
                "final_params": _max_abs(r["final_params"], sd["final_params"]),
                **({"total_norms": _max_abs(r["total_norms"], sd["total_norms"])} if "total_norms" in sd else {}),
            }
            out["cases"][key] = c
        # Cross-case summaries.
        cs = out["cases"]
        if nm == "mixed_precision_bf16":
            out["bf16_vs_fp32"] = {
                f"world{w}": {
                    "max_abs_loss_diff": _max_abs(cs[f"bf16_world{w}"]["losses"], cs[f"fp32_world{w}"]["losses"]),
                    "max_abs_final_param_diff": _max_abs(cs[f"bf16_world{w}"]["final_params"], cs[f"fp32_world{w}"]["final_params"]),
                }
                for w in (2, 4)
            }
        if nm == "no_sync":
            out["accum_vs_noaccum"] = {
                f"k{k}": {
                    "compared_with": f"noaccum_{ds}_world4",
                    "max_abs_loss_diff": _max_abs(cs[f"accum_k{k}_world4"]["losses"], cs[f"noaccum_{ds}_world4"]["losses"]),
                    "max_abs_final_param_diff": _max_abs(cs[f"accum_k{k}_world4"]["final_params"], cs[f"noaccum_{ds}_world4"]["final_params"]),
                }
                for k, ds in ((2, "g24"), (3, "g24"), (4, "g32"))
            }
        path = os.path.join(args.out, f"{nm}.json")
        with open(path, "w") as f:
            json.dump(out, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path} ({os.path.getsize(path) / 1024:.1f} KiB)", flush=True)
    print(f"total {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
