"""A model family's ``config.json`` read into one :class:`ModelConfig`: the
options of the one decoder every family shares (norms, rotary variants,
attention scaling and soft-caps, sliding and full layers, biases, tied
heads), with each family's defaults for the fields a ``config.json`` may
leave out (those of transformers' config classes).

Nothing here needs transformers: the values are the ones its modeling code
reads, checked against it in ``tests/test_families.py``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

import numpy as np

from fsdp_jax._src.pretrained.files import ADAPTER_CONFIG, check_local

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary embedding of one kind of layer: ``inv_freq`` (float32, one per
  rotated pair) times the position, ``attention_scaling`` on cos and sin;
  LongRoPE has a second set, ``long_inv_freq``, used when the sequence
  reaches past ``original_max`` (transformers' ``dynamic_rope_update``)."""

  rotary_dim: int
  inv_freq: tuple
  attention_scaling: float = 1.0
  long_inv_freq: Optional[tuple] = None
  original_max: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The decoder's options, read from ``config.json`` (:func:`read_config`).

  ``layer_types[i]`` is ``"full"`` or ``"sliding"`` (attention over the last
  ``sliding_window`` positions); ``rope`` maps each layer type to its
  :class:`Rope` (None: learned positions, GPT-2). ``norm`` is ``"rms"``
  (Llama: ``w * x``), ``"rms1p"`` (Gemma: ``(1 + w) * x`` in float32) or
  ``"layer"`` (GPT-2's LayerNorm with a bias).

  Example:
    >>> import json, os, tempfile
    >>> from fsdp_jax import models
    >>> d = tempfile.mkdtemp()
    >>> json.dump({"model_type": "gemma2", "vocab_size": 64, "hidden_size": 16,
    ...            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    ...            "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4},
    ...           open(os.path.join(d, "config.json"), "w"))
    >>> c = models.from_pretrained(d).config
    >>> c.layer_types, c.norm, c.attn_softcap, c.final_softcap, c.tie_word_embeddings
    (('sliding', 'full'), 'rms1p', 50.0, 30.0, True)
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  norm: str
  norm_eps: float
  activation: str
  gated_mlp: bool
  qkv_bias: bool
  o_bias: bool
  mlp_bias: bool
  qk_norm: bool
  sandwich_norms: bool
  tie_word_embeddings: bool
  embed_scale: Optional[float]
  attn_scale: float
  attn_softcap: Optional[float]
  final_softcap: Optional[float]
  sliding_window: Optional[int]
  layer_types: tuple
  rope: Optional[dict]
  max_positions: int
  initializer_range: float
  raw: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)

  @property
  def mixed_layers(self) -> bool:
    """Whether sliding and full layers differ in anything (window, rotary)."""
    return len(set(self.layer_types)) > 1

  def window(self, layer_type: str) -> Optional[int]:
    return self.sliding_window if layer_type == "sliding" else None


def _unsupported_type(model_type, directory: str) -> ValueError:
  hint = ""
  if model_type == "gemma3":
    hint = (" (Gemma 3's multimodal checkpoint: its text model is model_type 'gemma3_text'; "
            "use a text-only checkpoint such as gemma-3-1b)")
  return ValueError(
      f"{directory}/config.json has model_type {model_type!r}{hint}, which "
      f"fsdp_jax.models does not have. Supported: {', '.join(FAMILIES)}. Fix: use a "
      "checkpoint of one of these families, or write the model and its "
      "fsdp_jax.pretrained.WeightMap yourself (docs/pretrained.md).")


def load_json(directory: str) -> tuple:
  """``(config.json, generation_config.json or None)`` of a local
  checkpoint directory, with errors that say what the directory is."""
  directory = os.fspath(directory)
  check_local(directory, "model directory")
  if os.path.isfile(directory):
    directory = os.path.dirname(directory) or "."
  if not os.path.isdir(directory):
    raise FileNotFoundError(
        f"{directory}: no such directory. Fix: pass the directory holding the model's "
        "config.json (what save_pretrained writes).")
  path = os.path.join(directory, "config.json")
  if not os.path.exists(path):
    if os.path.exists(os.path.join(directory, ADAPTER_CONFIG)):
      check_local(directory)  # the adapter's message
    raise FileNotFoundError(
        f"{directory} holds no config.json ({sorted(os.listdir(directory))[:8]}). Fix: pass "
        "a Hugging Face model directory (config.json and safetensors files).")
  with open(path) as f:
    config = json.load(f)
  gen = None
  gen_path = os.path.join(directory, "generation_config.json")
  if os.path.exists(gen_path):
    with open(gen_path) as f:
      gen = json.load(f)
  return config, gen


def _get(d: dict, key: str, default):
  value = d.get(key)
  return default if value is None else value


def _given(d: dict, key: str, default):
  """``d[key]`` where the key is there (None included: a feature turned
  off), else ``default``."""
  return d[key] if key in d else default


def _float(x) -> Optional[float]:
  return None if x is None else float(x)


def _inv_freq(theta: float, dim: int) -> np.ndarray:
  """``1 / theta ** (arange(0, dim, 2) / dim)`` in float32, as transformers
  computes it with torch."""
  exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def _rope(params: dict, head_dim: int, max_positions: int, config: dict, where: str) -> Rope:
  """transformers' ``ROPE_INIT_FUNCTIONS`` for the supported types."""
  kind = params.get("rope_type", params.get("type", "default")) or "default"
  if kind not in ROPE_TYPES:
    raise ValueError(
        f"{where}: rope type {kind!r} is not supported by fsdp_jax.models (supported: "
        f"{', '.join(ROPE_TYPES)}). Fix: use a checkpoint with one of these, or write the "
        "model yourself.")
  theta = float(params.get("rope_theta", 10000.0))
  factor_p = float(params.get("partial_rotary_factor", 1.0) or 1.0)
  dim = int(head_dim * factor_p)
  inv = _inv_freq(theta, dim)
  if kind == "default":
    return Rope(dim, tuple(inv.tolist()))
  if kind == "linear":
    return Rope(dim, tuple((inv / np.float32(params["factor"])).astype(np.float32).tolist()))
  if kind == "llama3":
    factor = np.float32(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old = float(params.get("original_max_position_embeddings") or max_positions)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
              ).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return Rope(dim, tuple(np.where(medium, smoothed, scaled).astype(np.float32).tolist()))
  # longrope (Phi-3): short factors up to the original length, long past it.
  original = int(config.get("original_max_position_embeddings")
                 or params.get("original_max_position_embeddings") or max_positions)
  factor = params.get("factor") or max_positions / original
  attention = params.get("attention_factor")
  if attention is None:
    attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
  exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  base = np.power(np.float32(theta), exponent).astype(np.float32)
  short = np.float32(1.0) / (np.asarray(params["short_factor"], np.float32) * base)
  long = np.float32(1.0) / (np.asarray(params["long_factor"], np.float32) * base)
  return Rope(dim, tuple(short.astype(np.float32).tolist()), float(attention),
              tuple(long.astype(np.float32).tolist()), original)


def _rope_params(config: dict, model_type: str) -> dict:
  """``{"full": params, "sliding": params}`` from ``rope_parameters``
  (transformers 5, nested by layer type for Gemma 3) or ``rope_scaling``
  plus ``rope_theta`` (older configs)."""
  given = config.get("rope_parameters") or config.get("rope_scaling") or {}
  given = dict(given) if isinstance(given, dict) else {}
  nested = {"full_attention", "sliding_attention"} & set(given)
  partial = config.get("partial_rotary_factor")
  if model_type == "gemma3_text":
    full = dict(given.get("full_attention") or {}) if nested else dict(given)
    if not nested and config.get("rope_scaling"):
      full = dict(config["rope_scaling"])
    sliding = dict(given.get("sliding_attention") or {}) if nested else {}
    full.setdefault("rope_theta", _get(config, "rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", _get(config, "rope_local_base_freq", 10_000.0))
    sliding.setdefault("rope_type", "default")
    return {"full": full, "sliding": sliding}
  if nested:
    out = {}
    for key, kind in (("full_attention", "full"), ("sliding_attention", "sliding")):
      p = dict(given.get(key) or given.get("full_attention") or {})
      p.setdefault("rope_theta", _get(config, "rope_theta", 10_000.0))
      out[kind] = p
    return out
  p = dict(given)
  p.setdefault("rope_theta", _get(config, "rope_theta", 10_000.0))
  if partial is not None:
    p.setdefault("partial_rotary_factor", partial)
  if model_type == "phi3" and p.get("rope_type", p.get("type")) in ("su", "yarn"):
    p["rope_type"] = "longrope"  # Phi-3's older names, as transformers maps them
  return {"full": p, "sliding": p}


def _layer_types(config: dict, model_type: str, n: int, window: Optional[int]) -> tuple:
  given = config.get("layer_types")
  if given:
    if len(given) != n:
      raise ValueError(f"config.json: layer_types has {len(given)} entries for "
                       f"num_hidden_layers {n}.")
    bad = sorted(set(given) - {"full_attention", "sliding_attention"})
    if bad:
      raise ValueError(f"config.json: layer types {bad} are not supported (full_attention, "
                       "sliding_attention).")
    out = tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    return out if window is not None else ("full",) * n
  if window is None:
    return ("full",) * n
  if model_type in ("mistral", "phi3"):
    return ("sliding",) * n
  if model_type in ("qwen2", "qwen3"):
    first = int(_get(config, "max_window_layers", 28))
    return tuple("sliding" if i >= first else "full" for i in range(n))
  if model_type == "gemma2":
    return tuple("sliding" if (i + 1) % 2 else "full" for i in range(n))
  if model_type == "gemma3_text":
    every = int(_get(config, "sliding_window_pattern", 6))
    return tuple("sliding" if (i + 1) % every else "full" for i in range(n))
  return ("full",) * n


def _window(config: dict, model_type: str) -> Optional[int]:
  if model_type in ("llama", "gpt2"):
    return None
  if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
    return None
  default = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096,
             "gemma3_text": 4096, "phi3": None}[model_type]
  window = config.get("sliding_window", default) if "sliding_window" in config else default
  return None if window is None else int(window)


def read_config(config: dict, where: str = "config.json") -> ModelConfig:
  """The :class:`ModelConfig` of a ``config.json`` dict, or a ``ValueError``
  naming the unsupported setting."""
  model_type = config.get("model_type")
  if model_type not in FAMILIES:
    raise _unsupported_type(model_type, os.path.dirname(where) or ".")
  if model_type == "gpt2":
    return _gpt2(config, where)
  d = int(config.get("hidden_size", 4096))
  heads = int(config.get("num_attention_heads", 32))
  kv = int(_get(config, "num_key_value_heads", {"mistral": 8, "gemma2": 4,
                                                  "gemma3_text": 4}.get(model_type, heads)))
  default_head = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256}.get(model_type, d // heads)
  head_dim = int(_get(config, "head_dim", default_head))
  n = int(config.get("num_hidden_layers", 32))
  gemma = model_type in ("gemma2", "gemma3_text")
  if gemma and config.get("use_bidirectional_attention"):
    raise ValueError(f"{where}: use_bidirectional_attention is set: not a causal language "
                     "model. fsdp_jax.models builds causal decoders only.")
  act_name = config.get("hidden_activation" if gemma else "hidden_act") or (
      "gelu_pytorch_tanh" if gemma else "silu")
  if act_name not in ACTIVATIONS:
    raise ValueError(f"{where}: activation {act_name!r} is not supported (supported: "
                     f"{', '.join(ACTIVATIONS)}).")
  max_pos = int(_get(config, "max_position_embeddings", 2048))
  window = _window(config, model_type)
  types = _layer_types(config, model_type, n, window)
  ropes = _rope_params(config, model_type)
  rope = {kind: _rope(p, head_dim, max_pos, config, where) for kind, p in ropes.items()
          if kind in types}
  bias = bool(config.get("attention_bias", False))
  if model_type == "qwen2":
    qkv_bias, o_bias = True, False
  elif model_type in ("mistral", "phi3"):
    qkv_bias = o_bias = False
  else:
    qkv_bias = o_bias = bias
  scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else head_dim ** -0.5
  default_eps = 1e-5 if model_type == "phi3" else 1e-6
  return ModelConfig(
      model_type=model_type, vocab_size=int(config.get("vocab_size", 32000)), hidden_size=d,
      intermediate_size=int(config.get("intermediate_size", 11008)), num_hidden_layers=n,
      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
      norm="rms1p" if gemma else "rms", norm_eps=float(_get(config, "rms_norm_eps", default_eps)),
      activation=ACTIVATIONS[act_name], gated_mlp=True, qkv_bias=qkv_bias, o_bias=o_bias,
      mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
      qk_norm=model_type in ("qwen3", "gemma3_text"), sandwich_norms=gemma,
      tie_word_embeddings=bool(_get(config, "tie_word_embeddings", gemma)),
      embed_scale=float(d) ** 0.5 if gemma else None, attn_scale=scale,
      attn_softcap=_float(_given(config, "attn_logit_softcapping", 50.0)
                          if model_type == "gemma2" else None),
      final_softcap=_float(_given(config, "final_logit_softcapping",
                                  30.0 if model_type == "gemma2" else None) if gemma else None),
      sliding_window=window if "sliding" in types else None, layer_types=types, rope=rope,
      max_positions=max_pos, initializer_range=float(_get(config, "initializer_range", 0.02)),
      raw=config)


def _gpt2(config: dict, where: str) -> ModelConfig:
  for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
    if config.get(key):
      raise ValueError(f"{where}: GPT-2's {key} is set, which fsdp_jax.models does not "
                       "implement. Fix: use a checkpoint without it.")
  if config.get("scale_attn_weights", True) is False:
    raise ValueError(f"{where}: GPT-2's scale_attn_weights=False is not implemented.")
  act_name = config.get("activation_function", "gelu_new")
  if act_name not in ACTIVATIONS:
    raise ValueError(f"{where}: activation {act_name!r} is not supported.")
  d = int(config.get("n_embd", 768))
  heads = int(config.get("n_head", 12))
  n = int(config.get("n_layer", 12))
  return ModelConfig(
      model_type="gpt2", vocab_size=int(config.get("vocab_size", 50257)), hidden_size=d,
      intermediate_size=int(_get(config, "n_inner", 4 * d)), num_hidden_layers=n, num_attention_heads=heads,
      num_key_value_heads=heads, head_dim=d // heads, norm="layer",
      norm_eps=float(_get(config, "layer_norm_epsilon", 1e-5)),
      activation=ACTIVATIONS[act_name], gated_mlp=False, qkv_bias=True, o_bias=True,
      mlp_bias=True, qk_norm=False, sandwich_norms=False,
      tie_word_embeddings=bool(_get(config, "tie_word_embeddings", True)), embed_scale=None,
      attn_scale=(d // heads) ** -0.5, attn_softcap=None, final_softcap=None,
      sliding_window=None, layer_types=("full",) * n, rope=None,
      max_positions=int(config.get("n_positions", 1024)),
      initializer_range=float(_get(config, "initializer_range", 0.02)), raw=config)
