"""Runs the examples in ``examples/`` the way their users do: as scripts in
fresh processes (and under ``python -m fsdp_jax.launch``), with small
settings and hard timeouts.

* ``train_gpt.py`` with bf16 mixed precision, gradient clipping, gradient
  accumulation and checkpoints: it trains (the loss goes down) and logs loss,
  grad norm, tokens/s, the MFU estimate and bytes per device, and evaluates
  the held-out split with the eval step (loss and perplexity; the same in
  the 2-process run and after a resume);
* the same run on 2 processes x 4 simulated CPU devices: each process feeds
  its half of every global batch, only process 0 prints, and the losses are
  those of the 1-process run;
* a checkpoint round trip: a run resumed with ``--resume`` from the step-3
  checkpoint continues exactly like the uninterrupted run;
* the same run with ``--offload`` (params and optimizer state in host
  memory): the numbers of the run without it;
* ``train_nnx.py`` (Flax NNX through nnx.split / nnx.merge, nnx.update at the
  end) and ``custom_step.py`` (value_and_grad, clip_grad_norm, EMA inside
  ``shard_map``, checked against ``shard_train_step``);
* ``finetune.py`` without ``--checkpoint``: it writes a small random
  Llama (and, with ``--family qwen3 --scan --context 2``, a Qwen3 run with
  stacked layers, each row split over a context axis), loads it shard by shard, fine-tunes it (the loss goes down, and the
  held-out loss the eval step prints), samples continuations from
  ``reshard_params`` weights on a tensor mesh with a KV cache (greedy and
  top-p), and saves it in Hugging Face's layout, which loads again; with ``--lora``
  (rank, alpha, targets in PEFT's names, dropout) and ``--qlora`` (NF4 base):
  the loss goes down, the plan reports the adapters, the memory per device
  drops where LoRA says it does, and the PEFT adapter written to
  ``--out/adapter`` has PEFT's tensor names, shapes and config; PEFT's
  ``PeftModel.from_pretrained`` over the base gives the merged model's
  logits (where torch and peft are installed);
* ``--help`` and argument errors of every example, in this process.

The subprocesses start together (module fixture) so that they overlap; every
one is killed with its process group on the way out. They share the test
run's persistent compilation cache: a resumed run loads the programs the run
it resumes compiled. All runs use
``--platform cpu`` so the numbers compared do not depend on the machine.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from fsdp_jax import pretrained
from helpers import Background, compile_cache_env, subprocess_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="uses Linux process groups")]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
GPT = str(EXAMPLES / "train_gpt.py")

# A small GPT, 6 steps, every feature on; checkpoints at steps 3 and 6.
GPT_ARGS = ["--platform", "cpu", "--steps", "6", "--log-every", "1", "--layers", "1",
            "--d-model", "32", "--seq-len", "32", "--batch-size", "16",
            "--sample-chars", "8", "--precision", "bf16", "--max-norm", "1.0",
            "--accumulate", "2", "--save-every", "3", "--eval-every", "3", "--eval-batches", "1"]
TIMEOUT_S = 300  # per subprocess; they normally take 15-60 s on 2 cores

# finetune.py's LoRA and QLoRA runs (the full run's settings).
FINETUNE_ARGS = ["--steps", "6", "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3",
                 "--eval-every", "0", "--sample-tokens", "0"]

EVAL_LINE = re.compile(r"^eval\s+(\d+)\s+held-out loss (\S+)\s+perplexity (\S+)$", re.M)
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)(?:\s+grad_norm (\S+))?", re.M)
FIRST_FINAL = re.compile(r"first (?:data )?loss (\S+) -> final (?:data )?loss (\S+)")


def Job(name: str, cmd: list[str], log_dir: Path, timeout: float = TIMEOUT_S) -> Background:
  """An example run in the background, output to ``log_dir/name.log``."""
  return Background(cmd, log_dir / f"{name}.log", timeout, name=name,
                    env=subprocess_env(FSDP_JAX_SHUTDOWN_TIMEOUT="60",  # bound a stuck exit
                                       **compile_cache_env()))


def eval_lines(output: str) -> dict[int, str]:
  """``{step: held-out loss}`` as printed (strings, for exact checks); the
  perplexity printed is exp(loss)."""
  out = {}
  for m in EVAL_LINE.finditer(output):
    assert abs(float(m.group(3)) - math.exp(float(m.group(2)))) < 0.01 * float(m.group(3))
    out[int(m.group(1))] = m.group(2)
  return out


def step_lines(output: str) -> dict[int, tuple[str, str | None]]:
  """``{step: (loss, grad_norm)}`` as printed (strings, for exact checks)."""
  out = {}
  for m in STEP_LINE.finditer(output):
    assert int(m.group(1)) not in out, f"step {m.group(1)} printed twice:\n{output}"
    out[int(m.group(1))] = (m.group(2), m.group(3))
  return out


def first_final(output: str) -> tuple[float, float]:
  m = FIRST_FINAL.search(output)
  assert m, f"no 'first loss -> final loss' line in:\n{output}"
  return float(m.group(1)), float(m.group(2))


class Jobs:
  """The example runs of this module, started together."""

  def __init__(self, tmp: Path):
    self.tmp = tmp
    py = sys.executable
    self.gpt = Job("gpt", [py, GPT, *GPT_ARGS, "--checkpoint-dir", str(tmp / "ckpt")], tmp)
    self.gpt_mp = Job("gpt_2proc", [
        py, "-m", "fsdp_jax.launch", "--nproc", "2", "--devices-per-proc", "4",
        "--platform", "cpu", GPT, *GPT_ARGS,
        "--checkpoint-dir", str(tmp / "ckpt_2proc")], tmp)
    self.gpt_offload = Job("gpt_offload", [py, GPT, *GPT_ARGS, "--offload", "--eval-every", "0"],
                           tmp)
    self.nnx = Job("nnx", [py, str(EXAMPLES / "train_nnx.py"), "--platform", "cpu",
                           "--steps", "40", "--log-every", "10"], tmp)
    self.custom = Job("custom", [py, str(EXAMPLES / "custom_step.py"), "--platform", "cpu",
                                 "--steps", "40", "--log-every", "10", "--verify"], tmp)
    self.finetune = Job("finetune", [
        py, str(EXAMPLES / "finetune.py"), "--platform", "cpu", "--steps", "6",
        "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3", "--eval-every", "3",
        "--eval-batches", "1", "--sample-tokens", "6", "--out", str(tmp / "tuned")], tmp)
    self.finetune_qwen3 = Job("finetune_qwen3", [
        py, str(EXAMPLES / "finetune.py"), "--platform", "cpu", *FINETUNE_ARGS, "--family",
        "qwen3", "--scan", "--context", "2", "--out", str(tmp / "qwen3")], tmp)
    self.finetune_lora = Job("finetune_lora", [
        py, str(EXAMPLES / "finetune.py"), "--platform", "cpu", *FINETUNE_ARGS,
        "--lora", "--rank", "4", "--alpha", "8", "--lora-dropout", "0.1",
        "--targets", "q_proj,v,o_proj,down", "--out", str(tmp / "lora")], tmp)
    self.finetune_qlora = Job("finetune_qlora", [
        py, str(EXAMPLES / "finetune.py"), "--platform", "cpu", *FINETUNE_ARGS,
        "--qlora", "--out", str(tmp / "qlora")], tmp)
    self._resume = None

  def resume(self) -> Background:
    """Resumes from a copy of the gpt run's checkpoints without step 6 (so
    from step 3) up to step 6; started once the gpt run is done."""
    if self._resume is None:
      self.gpt.ok()
      src, dst = self.tmp / "ckpt", self.tmp / "ckpt_resume"
      shutil.copytree(src, dst)
      shutil.rmtree(dst / "6")  # CheckpointManager: one sub-directory per step
      self._resume = Job("gpt_resume", [sys.executable, GPT, *GPT_ARGS,
                                        "--checkpoint-dir", str(dst), "--resume"], self.tmp)
    return self._resume

  def kill_all(self) -> None:
    for job in (self.gpt, self.gpt_mp, self.gpt_offload, self.nnx, self.custom,
                self.finetune, self.finetune_qwen3, self.finetune_lora, self.finetune_qlora,
                self._resume):
      if job is not None:
        job.kill()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  j = Jobs(tmp_path_factory.mktemp("examples"))
  yield j
  j.kill_all()


# --------------------------------------------------------------------------
# train_gpt.py


def test_train_gpt_features(jobs):
  out = jobs.gpt.ok()
  jobs.resume()  # start the round trip now, while the other runs finish
  assert "devices: 8 x cpu (cpu)\n" in out
  assert "(flat parameters, bf16)" in out
  steps = step_lines(out)
  assert sorted(steps) == [1, 2, 3, 4, 5, 6]
  assert all(norm is not None and float(norm) > 0 for _, norm in steps.values())
  first, final = first_final(out)
  assert final < first - 0.3, out
  # The log line: loss, grad norm, tokens/s, the MFU estimate, bytes/device.
  line = next(l for l in out.splitlines() if l.startswith("step    6"))
  assert re.search(r"tokens/s  MFU~\d+\.\d+%  state [\d,]+ bytes/device$", line), line
  assert "MFU is an estimate" in out and "(--peak-tflops)" in out
  assert "first step: includes compilation" in out  # step 1's rate
  assert re.search(r"MFU~\d+\.\d+% \(estimate\)", out)
  assert f"checkpoint: saved steps [3, 6] in {jobs.tmp / 'ckpt'} (kept: [3, 6])" in out
  assert (jobs.tmp / "ckpt" / "3").is_dir() and (jobs.tmp / "ckpt" / "6").is_dir()
  assert "sample (greedy): 'def " in out
  assert re.search(r"^text: .*: [\d,]+ characters \([\d,]+ held out for evaluation\), "
                   r"vocabulary \d+$", out, re.M), out
  evals = eval_lines(out)
  assert sorted(evals) == [3, 6], out
  assert float(evals[6]) < float(evals[3]), out  # the held-out loss goes down too


def test_train_gpt_two_processes(jobs):
  out = jobs.gpt_mp.ok()
  one = step_lines(jobs.gpt.ok())
  # Only process 0 prints, and it reports the 2-process set-up.
  assert out.count("devices: 8 x cpu (cpu) in 2 processes (4 each)") == 1, out
  assert out.count("first loss") == 1 and out.count("sample (greedy)") == 1
  two = step_lines(out)  # asserts no step is printed twice
  assert sorted(two) == sorted(one)
  # Each process fed its half of the same global batches: the numbers are
  # those of one process with 8 devices (bf16: reduction order aside).
  for s in one:
    assert abs(float(two[s][0]) - float(one[s][0])) < 2e-3, (s, one, two)
    assert abs(float(two[s][1]) - float(one[s][1])) < 2e-2 * float(one[s][1]), (s, one, two)
  # A checkpoint written by both processes together.
  assert f"checkpoint: saved steps [3, 6] in {jobs.tmp / 'ckpt_2proc'}" in out
  # The eval step on each process's rows of the held-out batches: one run's loss.
  evals, evals_one = eval_lines(out), eval_lines(jobs.gpt.ok())
  assert sorted(evals) == [3, 6]
  for s in evals:
    assert abs(float(evals[s]) - float(evals_one[s])) < 2e-3, (evals, evals_one)


def test_train_gpt_resume_round_trip(jobs):
  full = step_lines(jobs.gpt.ok())
  out = jobs.resume().ok()
  assert f"resumed from step 3 in {jobs.tmp / 'ckpt_resume'}, next batch 4" in out
  resumed = step_lines(out)
  assert sorted(resumed) == [4, 5, 6]
  # Same state, same batches (the data position is in the checkpoint), same
  # schedule: the resumed steps print exactly the numbers of the
  # uninterrupted run.
  for s in resumed:
    assert resumed[s] == full[s], (s, resumed, full)
  assert eval_lines(out) == {6: eval_lines(jobs.gpt.ok())[6]}
  assert f"checkpoint: saved steps [6] in {jobs.tmp / 'ckpt_resume'} (kept: [3, 6])" in out


def test_train_gpt_preemption(jobs, tmp_path):
  """SIGTERM mid-training: the example saves the step it stops after (with
  the data position) and exits 75; the same command resumes there."""
  import signal

  from fsdp_jax import CheckpointManager

  ckpt = tmp_path / "ckpt"
  cmd = [sys.executable, GPT, "--platform", "cpu", "--steps", "40", "--log-every", "1",
         "--layers", "1", "--d-model", "32", "--seq-len", "32", "--batch-size", "16",
         "--sample-chars", "0", "--eval-every", "0", "--save-every", "100",
         "--checkpoint-dir", str(ckpt),
         "--resume"]
  job = Job("gpt_preempt", cmd, tmp_path)
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not re.search(r"^step\s+3\s", job.output(), re.M):
      assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-4000:]
      time.sleep(0.05)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait()
  finally:
    job.kill()
  out = job.output()
  assert job.returncode == 75, out[-4000:]
  m = re.search(r"preempted \(SIGTERM\): saved step (\d+) in (\S+); exiting with status 75", out)
  assert m and m.group(2) == str(ckpt), out[-4000:]
  stopped = int(m.group(1))
  assert 3 <= stopped < 40 and max(step_lines(out)) == stopped
  with CheckpointManager(ckpt, read_only=True) as mngr:
    assert mngr.all_steps() == [stopped]
    assert mngr.data_state(stopped) == {"next_batch": stopped + 1}
  again = Job("gpt_preempt_resume", cmd, tmp_path).ok()
  assert f"resumed from step {stopped} in {ckpt}, next batch {stopped + 1}" in again
  assert sorted(step_lines(again)) == list(range(stopped + 1, 41))


def test_train_gpt_offload(jobs):
  out = jobs.gpt_offload.ok()
  assert "(flat parameters, bf16, params and optimizer state offloaded to host memory)" in out
  line = next(l for l in out.splitlines() if l.startswith("step    6"))
  assert re.search(r"state [\d,]+ host bytes/device$", line), line
  assert re.search(r"bytes per device \(global arrays: [\d,]+ bytes\), in host memory", out)
  # Only where the state lives and the optimizer runs differ: the same numbers
  # as without offload (up to the last printed digit).
  one, off = step_lines(jobs.gpt.ok()), step_lines(out)
  assert sorted(off) == sorted(one)
  for s in one:
    assert abs(float(off[s][0]) - float(one[s][0])) <= 1.5e-4, (s, one, off)
    assert abs(float(off[s][1]) - float(one[s][1])) <= 1.5e-4, (s, one, off)


# --------------------------------------------------------------------------
# train_nnx.py and custom_step.py


def test_train_nnx(jobs):
  out = jobs.nnx.ok()
  assert "FSDP plan: FULL_SHARD" in out  # the plan is printed
  for i in range(3):  # ModuleWrapPolicy({Block}) through module_classes(model)
    assert re.search(rf"^  blocks\.{i}\s+6\s", out, re.M), out
  first, final = first_final(out)
  assert final < 0.6 * first, out
  m = re.search(r"nnx\.update: .* held-out loss (\S+) -> (\S+), accuracy (\S+) -> (\S+)", out)
  assert m, out
  loss_before, loss_after, acc_before, acc_after = map(float, m.groups())
  assert loss_after < 0.6 * loss_before and acc_after > acc_before + 0.3, out


def test_custom_step(jobs):
  out = jobs.custom.ok()
  assert "units ['l1', 'l2', 'l3']" in out
  first, final = first_final(out)
  assert final < 0.5 * first, out
  assert re.search(r"l2 loss \d\.\d+\s+grad_norm \d", out)
  m = re.search(r"held-out MSE: weights (\S+), EMA weights (\S+) \(initial (\S+)\)", out)
  assert m, out
  raw, ema, initial = map(float, m.groups())
  assert raw < 0.5 * initial and ema < 0.5 * initial, out
  m = re.search(r"max \|param difference\| = (\S+)", out)
  assert m and float(m.group(1)) < 1e-5, out


# --------------------------------------------------------------------------
# finetune.py


def test_finetune_loads_tunes_and_saves(jobs):
  from fsdp_jax import models

  out = jobs.finetune.ok()
  assert "no --checkpoint: wrote a small random Llama" in out, out
  assert re.search(r"loaded \S+ in [\d.]+ s onto 8 device\(s\), FULL_SHARD", out), out
  m = re.search(r"^loss (\S+) -> (\S+) after 6 steps$", out, re.M)
  assert m, out
  first, last = map(float, m.groups())
  assert last < first - 0.1, out
  # The held-out split, before training and every 3 steps: its loss goes down.
  evals = {int(k): (float(l), float(p)) for k, l, p in re.findall(
      r"eval at step (\d+): held-out loss (\S+), perplexity (\S+)$", out, re.M)}  # after tqdm's bar
  assert sorted(evals) == [0, 3, 6], out
  assert evals[6][0] < evals[0][0] - 0.1, out
  assert all(abs(p - math.exp(l)) < 0.01 * p for l, p in evals.values())
  # Continuations of 2 held-out prompts, greedy and sampled, from the
  # reshard_params weights on a tensor mesh (SMALL: 4 heads, 2 key/value heads).
  assert len(re.findall(r"^sample \(greedy\): '.*' -> '.*'$", out, re.M)) == 2, out
  assert len(re.findall(r"^sample \(temperature 0\.8, top-p 0\.9\): ", out, re.M)) == 2, out
  assert "sampled from reshard_params weights on mesh {'shard': 4, 'tensor': 2}" in out, out
  memory = memory_line(out)
  assert memory["grads"] == memory["params"] > 0, out  # every parameter trains
  assert memory["optimizer"] > 2 * memory["params"], out  # AdamW's two moments
  assert "LoRA" not in out and not (jobs.tmp / "tuned" / "adapter").exists()
  m = re.search(r"^saved (\d+) file\(s\) to (\S+) ", out, re.M)
  assert m and Path(m.group(2)) == jobs.tmp / "tuned", out
  tuned = jobs.tmp / "tuned"
  assert (tuned / "config.json").exists()
  assert len(list(tuned.glob("*.safetensors"))) == int(m.group(1))
  model = models.from_pretrained(tuned)
  source = pretrained.load(str(tuned), model.weight_map)  # strict: every tensor mapped
  assert source.bytes_read == 0  # headers only


def test_finetune_any_family_with_scan(jobs):
  """--family qwen3 --scan --context 2: a random Qwen3 (q/k norms, stacked
  layers, each row split over a context axis of 2) tunes and saves a
  directory fsdp_jax.models reads back."""
  from fsdp_jax import models

  out = jobs.finetune_qwen3.ok()
  assert "no --checkpoint: wrote a small random qwen3" in out, out
  assert "model: CausalLM(qwen3: 2 layers" in out and ", scan)" in out, out
  # --context 2: each row over a context axis, the stacked layers scanned.
  assert ("context parallelism: each 32-token row split into 2 chunks of 16 over 'context' "
          "(mesh {'shard': 4, 'context': 2}); the weights sharded over shard x context") in out, out
  m = re.search(r"^loss (\S+) -> (\S+) after 6 steps$", out, re.M)
  assert m and float(m.group(2)) < float(m.group(1)) - 0.1, out
  model = models.from_pretrained(jobs.tmp / "qwen3", scan=True)
  assert model.config.qk_norm and pretrained.load(str(jobs.tmp / "qwen3"), model.weight_map)


MEMORY_LINE = re.compile(r"^memory per device \(bytes\): params ([\d,]+), grads ([\d,]+), "
                         r"optimizer state ([\d,]+); compiled step peak ([\d,]+) "
                         r"\(temporaries ([\d,]+)\)$", re.M)


def memory_line(output: str) -> dict[str, int]:
  m = MEMORY_LINE.search(output)
  assert m, f"no memory line in:\n{output}"
  return dict(zip(("params", "grads", "optimizer", "peak", "temp"),
                  (int(g.replace(",", "")) for g in m.groups())))


def _checked_lora_run(job, out_dir: Path, *, mode: str, rank: int, alpha: float,
                      dropout: float, modules: list[str]):
  """The checks both LoRA runs share; returns (output, adapter tensors,
  adapter config, base checkpoint directory)."""
  import json

  from safetensors.numpy import load_file

  out = job.ok()
  kernels = 2 * len(modules)  # two layers
  assert f"{mode.upper()}: targets " in out and f"; {kernels} kernels adapted" in out, out
  drop = f", dropout {dropout:g}" if dropout else ""
  base = "frozen base quantized (nf4, blocks of 64)" if mode == "qlora" else "frozen base"
  assert f"plan: LoRA rank {rank}, alpha {alpha:g} (scale {alpha / rank:g}){drop}; {base}: " \
         f"{kernels} targets; trainable " in out, out
  assert f"plan: adapter path x @ W + scale * (x @ A) @ B: {kernels} of {kernels} targets" in out
  assert "merged weight" not in out, out  # every target is used as a matmul operand
  m = re.search(r"^loss (\S+) -> (\S+) after 6 steps$", out, re.M)
  assert m, out
  first, last = map(float, m.groups())
  assert last < first - 0.1, out
  curve = re.search(r"^loss curve: (.*)$", out, re.M)
  assert curve and len(curve.group(1).split()) == 6, out

  # The merged model, in Hugging Face's layout; the adapter beside it.
  assert (out_dir / "config.json").exists() and list(out_dir.glob("*.safetensors"))
  adapter = out_dir / "adapter"
  assert f"saved the PEFT adapter to {adapter} " in out, out
  assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]
  config = json.loads((adapter / "adapter_config.json").read_text())
  checkpoint = re.search(r"^no --checkpoint: wrote a small random Llama to (\S+)$", out,
                         re.M).group(1)
  assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
  assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (rank, alpha, dropout)
  assert config["target_modules"] == sorted(modules)
  assert config["base_model_name_or_path"] == checkpoint
  assert not config["modules_to_save"] and not config["use_dora"] and not config["use_rslora"]
  tensors = load_file(str(adapter / "adapter_model.safetensors"))
  # SMALL: hidden 128, MLP 256, 4 heads of 32 and 2 key/value heads.
  io = {"q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64),
        "o_proj": (128, 128), "gate_proj": (128, 256), "up_proj": (128, 256),
        "down_proj": (256, 128)}
  expected = {}
  for i in range(2):
    for name in modules:
      where = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
      key = f"base_model.model.model.layers.{i}.{where}.{name}"
      d_in, d_out = io[name]
      expected[f"{key}.lora_A.weight"] = (rank, d_in)
      expected[f"{key}.lora_B.weight"] = (d_out, rank)
  assert {k: v.shape for k, v in tensors.items()} == expected
  assert all(tensors[k].any() for k in expected), "untrained (all-zero) factors"
  return out, tensors, config, checkpoint


def _merged_minus_adapters(out_dir: Path, checkpoint: str, tensors: dict, scale: float):
  """``{checkpoint tensor: (base, merged - scale * lora_B @ lora_A)}``."""
  from safetensors.numpy import load_file

  base = {}
  for f in Path(checkpoint).glob("*.safetensors"):
    base.update(load_file(str(f)))
  merged = {}
  for f in out_dir.glob("*.safetensors"):
    merged.update(load_file(str(f)))
  assert sorted(merged) == sorted(base)
  out = {}
  for name, w in base.items():
    module = "base_model.model." + name[:-len(".weight")]
    m = merged[name]
    if f"{module}.lora_A.weight" in tensors:
      m = m - scale * (tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"])
    out[name] = (w, m)
  return out


def test_finetune_lora(jobs):
  """--lora with PEFT's module names: the adapters train, the plan says
  so, the gradients and optimizer state shrink to the adapters', and PEFT
  loads the adapter over the base with the merged model's logits."""
  import numpy as np

  modules = ["q_proj", "v_proj", "o_proj", "down_proj"]
  out, tensors, _, checkpoint = _checked_lora_run(
      jobs.finetune_lora, jobs.tmp / "lora", mode="lora", rank=4, alpha=8.0, dropout=0.1,
      modules=modules)
  full, lora = memory_line(jobs.finetune.ok()), memory_line(out)
  assert lora["params"] > full["params"]  # the base, plus the adapters
  assert lora["grads"] * 10 < full["grads"], (lora, full)
  assert lora["optimizer"] * 10 < full["optimizer"], (lora, full)
  # Only the adapted kernels changed, each by exactly scale * lora_B @ lora_A.
  for name, (w, rest) in _merged_minus_adapters(jobs.tmp / "lora", checkpoint, tensors,
                                                2.0).items():
    np.testing.assert_allclose(rest, w, rtol=0, atol=1e-6, err_msg=name)

  try:
    import peft
    import torch
    import transformers
  except ImportError:
    pytest.skip("PeftModel.from_pretrained needs torch, transformers and peft, which the test "
                "extra installs on Python 3.11 only (torch's CPU build)")
  tokens = torch.tensor(np.random.default_rng(0).integers(0, 256, (2, 16)))
  with torch.no_grad():
    base = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    base_logits = base(tokens).logits.numpy()
    tuned = peft.PeftModel.from_pretrained(base, str(jobs.tmp / "lora" / "adapter")).eval()
    peft_logits = tuned(tokens).logits.numpy()
    merged = transformers.LlamaForCausalLM.from_pretrained(str(jobs.tmp / "lora")).eval()
    merged_logits = merged(tokens).logits.numpy()
  np.testing.assert_allclose(peft_logits, merged_logits, rtol=0, atol=1e-4)
  assert np.abs(peft_logits - base_logits).max() > 1e-2  # the adapter changed the model


def test_finetune_qlora(jobs):
  """--qlora (every projection, NF4 base in blocks of 64): it trains,
  stores the base in about a sixth of the bytes, and the merged model is
  the base's NF4 round trip plus exactly the adapter's update; everything
  else is the checkpoint's, bit for bit."""
  import numpy as np

  modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  out, tensors, _, checkpoint = _checked_lora_run(
      jobs.finetune_qlora, jobs.tmp / "qlora", mode="qlora", rank=8, alpha=16.0, dropout=0.0,
      modules=modules)
  full, qlora = memory_line(jobs.finetune.ok()), memory_line(out)
  assert qlora["params"] * 2 < full["params"], (qlora, full)
  assert qlora["grads"] * 10 < full["grads"] and qlora["optimizer"] * 10 < full["optimizer"]
  adapted = 0
  for name, (w, rest) in _merged_minus_adapters(jobs.tmp / "qlora", checkpoint, tensors,
                                                2.0).items():
    module = "base_model.model." + name[:-len(".weight")]
    if f"{module}.lora_A.weight" not in tensors:
      np.testing.assert_array_equal(rest, w, err_msg=name)
      continue
    adapted += 1
    # NF4's levels are at most 0.31 of a block's absmax apart: rounding to
    # the nearest is off by at most 0.16 of it.
    err = np.abs(rest - w).max()
    assert 0 < err <= 0.16 * np.abs(w).max() + 1e-6, (name, err)
  assert adapted == 14


# --------------------------------------------------------------------------
# --help and argument errors, in this process (no backend is started)


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Flax modules are dataclasses: they look it up
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name, flags", [
    ("train_gpt", ["--precision", "--checkpoint-dir", "--save-every", "--resume",
                   "--max-norm", "--accumulate", "--peak-tflops", "--strategy",
                   "--offload", "--eval-every", "--eval-batches"]),
    ("train_nnx", ["--strategy", "--use-orig-params", "--steps"]),
    ("custom_step", ["--max-norm", "--ema-decay", "--l2", "--verify"]),
    ("finetune", ["--checkpoint", "--family", "--text", "--out", "--strategy", "--scan",
                  "--precision", "--lora", "--qlora", "--rank", "--alpha", "--targets",
                  "--lora-dropout", "--eval-every", "--sample-tokens", "--temperature",
                  "--top-p", "--context"]),
])
def test_help(name, flags, capsys):
  with pytest.raises(SystemExit) as e:
    _load(name).main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  assert text.startswith("usage:")
  for flag in flags:
    assert flag in text, (flag, text)
  assert "(default: None)" not in text, text


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--accumulate", "0"], "--accumulate must be at least 1"),
    (["--max-norm", "-1"], "--max-norm must be positive"),
    (["--precision", "fp16"], "invalid choice: 'fp16'"),
])
def test_train_gpt_argument_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    _load("train_gpt").main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rank", "4"], "--rank need(s) --lora or --qlora"),
    (["--alpha", "8", "--targets", "q"], "--alpha, --targets need(s) --lora or --qlora"),
    (["--lora", "--qlora"], "argument --qlora: not allowed with argument --lora"),
    (["--lora", "--rank", "0"], "--rank must be at least 1"),
    (["--qlora", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora", "--targets", ","], "--targets needs at least one pattern"),
    (["--family", "bert"], "argument --family: invalid choice: 'bert'"),
    (["--context", "3", "--seq-len", "32"], "--context 3 needs --seq-len to be a multiple of "
     "it (each device holds seq_len / N tokens of every row); got --seq-len 32, e.g. "
     "--seq-len 33"),
])
def test_finetune_argument_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    _load("finetune").main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err
