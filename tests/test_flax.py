"""jaxattn.flax: jaxattn methods as the attention_fn of flax's nnx and linen
multi-head attention layers, against the same layers with flax's default
attention, and the per-layer configuration."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402
import flax.linen as nn  # noqa: E402

import jaxattn  # noqa: E402
import jaxattn.flax as jflax  # noqa: E402
from jaxattn import metrics  # noqa: E402

BATCH, T, FEATURES, HEADS = (2, 2), 48, 64, 4  # two batch dims: flattened
LENGTHS = [[48, 30], [17, 5]]                   # valid keys per sequence

# Measured on this layer (seed 0, CPU, reference implementation), both
# flax APIs: max |diff| and 1 - cosine similarity to flax's default
# attention.  Tolerances sit a little above the measured numbers.
TOLERANCES = {
    # method, dtype: (atol, 1 - cos)
    ("fp32", "float32"): (2e-6, 1e-12),    # measured 4.8e-7, 1e-14
    ("fp32", "bfloat16"): (0.04, 3e-5),    # measured 0.0156 (1 ulp), 9.7e-6
    ("sage", "float32"): (0.15, 1e-3),     # measured 0.076, 4.5e-4
    ("sage", "bfloat16"): (0.15, 1e-3),    # measured 0.094, 4.6e-4
}


def _inputs(dtype):
  """x: [2, 2, 48, 64] in dtype; mask: causal and key padding, bool
  [2, 2, 1, 48, 48]."""
  x = jax.random.normal(jax.random.key(0), (*BATCH, T, FEATURES)).astype(dtype)
  keep_key = jnp.arange(T) < jnp.asarray(LENGTHS)[..., None]
  mask = nnx.combine_masks(
      nnx.make_causal_mask(jnp.ones((*BATCH, T))),
      nnx.make_attention_mask(jnp.ones((*BATCH, T), bool), keep_key))
  return x, mask


def _nnx_layer(dtype, attention_fn=None, **kwargs):
  if attention_fn is not None:
    kwargs["attention_fn"] = attention_fn
  return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES,
                                decode=False, dtype=dtype, rngs=nnx.Rngs(0),
                                **kwargs)


def _check_close(out, ref, method, dtype):
  atol, one_minus_cos = TOLERANCES[(method, jnp.dtype(dtype).name)]
  assert out.shape == ref.shape == (*BATCH, T, FEATURES)
  assert out.dtype == ref.dtype == dtype
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  assert float(jnp.abs(out - ref).max()) < atol
  assert 1.0 - float(metrics.cosine_similarity(out, ref)) < one_minus_cos


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("method", ["fp32", "sage"])
def test_nnx_layer_matches_flax_default(method, dtype):
  x, mask = _inputs(dtype)
  fn = jflax.make_attention_fn(method, implementation="reference")
  out = _nnx_layer(dtype, fn)(x, mask=mask)
  ref = _nnx_layer(dtype)(x, mask=mask)
  _check_close(out, ref, method, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("method", ["fp32", "sage"])
def test_linen_layer_matches_flax_default(method, dtype):
  x, mask = _inputs(dtype)
  fn = jflax.make_attention_fn(method, implementation="reference")
  ref_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=dtype)
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=dtype,
                                          attention_fn=fn)
  params = ref_layer.init(jax.random.key(1), x, mask=mask)
  out = jax.jit(layer.apply)(params, x, mask=mask)
  ref = ref_layer.apply(params, x, mask=mask)
  _check_close(out, ref, method, dtype)


def test_nnx_is_causal_and_grouped_query_heads():
  """nnx passes ``is_causal``; 4 query heads share 2 key/value heads."""
  x, _ = _inputs(jnp.float32)
  kwargs = dict(num_kv_heads=2, dtype=jnp.float32)
  fn = jflax.make_attention_fn("fp32", implementation="reference")
  out = _nnx_layer(attention_fn=fn, **kwargs)(x, is_causal=True)
  ref = _nnx_layer(**kwargs)(x, is_causal=True)
  non_causal = _nnx_layer(**kwargs)(x)
  assert float(jnp.abs(out - ref).max()) < 2e-6  # measured 4.8e-7
  assert float(jnp.abs(non_causal - ref).max()) > 0.1


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_attention_fn_batch_dims_bias_dtype(batch):
  """The function alone against ``nnx.dot_product_attention``: no, one and
  two batch dims, a float bias without batch dims, a float 0/1 mask (flax
  casts it to bool) with batch dims, and ``dtype`` setting the output."""
  # numpy's generator: jax.random's would compile once per shape
  rng = np.random.default_rng(2)
  q, k, v, bias = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((*batch, 20, 4, 16), (*batch, 24, 4, 16),
                                 (*batch, 24, 4, 16), (4, 20, 24)))
  mask = (jnp.arange(24) < 19).astype(jnp.float32)
  mask = jnp.broadcast_to(mask, (*batch, 1, 1, 24))
  # jitted: flax's function run eagerly compiles each of its ops apart
  fn = jax.jit(jflax.make_attention_fn("fp32", implementation="reference"),
               static_argnames="dtype")
  nnx_fn = jax.jit(nnx.dot_product_attention, static_argnames="dtype")
  out = fn(q, k, v, bias=bias, mask=mask, dtype=jnp.bfloat16)
  ref = nnx_fn(q, k, v, bias=bias, mask=mask.astype(bool), dtype=jnp.bfloat16)
  assert out.shape == ref.shape == (*batch, 20, 4, 16)
  assert out.dtype == jnp.bfloat16
  # measured 0.0156: one bfloat16 ulp at |out| in [2, 4)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(ref, np.float32), atol=0.035)
  out32 = fn(q, k, v, bias=bias, mask=mask)
  ref32 = nnx_fn(q, k, v, bias=bias, mask=mask.astype(bool))
  assert out32.dtype == jnp.float32
  assert float(jnp.abs(out32 - ref32).max()) < 2e-6  # measured ~5e-7


def test_dropout_raises_and_deterministic_runs():
  x, mask = _inputs(jnp.float32)
  fn = jflax.make_attention_fn("fp32", implementation="reference")
  layer = _nnx_layer(jnp.float32, fn, dropout_rate=0.1)
  with pytest.raises(ValueError, match="no attention dropout"):
    layer(x, mask=mask, deterministic=False)
  out = layer(x, mask=mask, deterministic=True)
  ref = _nnx_layer(jnp.float32, dropout_rate=0.1)(x, mask=mask,
                                                  deterministic=True)
  assert float(jnp.abs(out - ref).max()) < 2e-6

  linen_layer = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, dropout_rate=0.1, attention_fn=fn)
  params = linen_layer.init(jax.random.key(1), x, mask=mask,
                            deterministic=True)
  with pytest.raises(ValueError, match="no attention dropout"):
    linen_layer.apply(params, x, mask=mask, deterministic=False,
                      rngs={"dropout": jax.random.key(3)})
  # the same call with dropout off is fine
  assert linen_layer.apply(params, x, mask=mask, deterministic=True).shape == x.shape


def test_aqt_einsums_rejected_and_options_checked_early():
  q = jnp.ones((1, 8, 2, 16))
  fn = jflax.make_attention_fn("fp32", implementation="reference")
  with pytest.raises(ValueError, match="computes Q K"):
    fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(TypeError, match="unknown option"):
    jflax.make_attention_fn("sage", bogus=1)
  with pytest.raises(ValueError):
    jflax.make_attention_fn("no_such_method")


def _calibration():
  """Three layers' (q, k, v) [1, 64, 2, 32]; layer_1's keys have one
  channel 20x larger, which hurts int4 the most."""
  ks = jax.random.split(jax.random.key(4), 9)
  calib = {}
  for i in range(3):
    q, k, v = (jax.random.normal(ks[3 * i + j], (1, 64, 2, 32))
               for j in range(3))
    if i == 1:
      k = k.at[..., 0].mul(20.0)
    calib[f"layer_{i}"] = (q, k, v)
  return calib


def test_per_layer_config_from_choose_precision():
  calib = _calibration()
  choice = jaxattn.choose_precision(calib, xi_percent=33,
                                         implementation="reference")
  # accuracy (cos * (1 - rel L1)) of sage2-4b, measured: 0.80, 0.36, 0.78
  assert choice == {"layer_0": "sage2-4b", "layer_1": "sage2-8b",
                    "layer_2": "sage2-4b"}
  config = {**choice, "layer_2": "pasa", "layer_3": {"method": "int8",
                                                     "pv_dtype": "fp16"}}
  fns = jflax.attention_fns(config, default="fp32", implementation="reference")

  for name, spec in config.items():
    options = jflax.layer_options(spec)
    assert fns[name].method == options.pop("method")
    assert fns[name].options == options
  assert fns["layer_2"].method == "pasa"
  assert fns["layer_9"].method == "fp32"       # not configured: the default
  assert "layer_9" not in fns

  # Each layer's function computes exactly the direct call it stands for.
  q, k, v = calib["layer_1"]
  outs = {name: fns[name](q, k, v) for name in [*config, "layer_9"]}
  direct = {
      "layer_0": jaxattn.sage_attention(q, k, v, preset=choice["layer_0"],
                                        implementation="reference"),
      "layer_1": jaxattn.sage_attention(q, k, v, preset=choice["layer_1"],
                                        implementation="reference"),
      "layer_2": jaxattn.pasa_attention(q, k, v, implementation="reference"),
      "layer_3": jaxattn.int8_attention(q, k, v, pv_dtype="fp16",
                                        implementation="reference"),
      "layer_9": jaxattn.fp32_attention(q, k, v, implementation="reference"),
  }
  for name, out in outs.items():
    np.testing.assert_array_equal(np.asarray(out), np.asarray(direct[name]))
  # ... and the methods do differ, the 4-bit preset the most.
  exact = outs["layer_9"]
  errors = {name: float(jnp.abs(out - exact).max())
            for name, out in outs.items()}
  assert errors["layer_9"] == 0.0
  assert min(errors["layer_0"], errors["layer_1"],
             errors["layer_2"], errors["layer_3"]) > 0.0
  # measured max |diff|: sage2-4b 2.16, sage2-8b 0.25, int8 0.25, pasa 0.0097
  assert errors["layer_0"] > 4 * errors["layer_1"]
  assert errors["layer_2"] < 0.02


def test_per_layer_fns_in_an_nnx_model():
  """A two-layer nnx model whose layers take their attention_fn from the
  configuration by name: its output equals the same model built with the
  direct ``make_attention_fn`` calls, and differs from all-fp32."""

  class Encoder(nnx.Module):
    def __init__(self, fns, rngs):
      self.layers = nnx.List([
          nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES,
                                 decode=False, rngs=rngs,
                                 attention_fn=fns[f"layer_{i}"])
          for i in range(2)])

    def __call__(self, x):
      for layer in self.layers:
        x = x + layer(x)
      return x

  x, _ = _inputs(jnp.float32)
  fns = jflax.attention_fns({"layer_1": {"preset": "sage2-4b"}},
                            default={"method": "pasa"},
                            implementation="reference")
  assert fns["layer_1"].method == "sage"
  assert fns["layer_1"].options == {"preset": "sage2-4b"}
  direct = [jflax.make_attention_fn("pasa", implementation="reference"),
            jflax.make_attention_fn("sage", preset="sage2-4b",
                                    implementation="reference")]
  all_fp32 = [jflax.make_attention_fn("fp32", implementation="reference")] * 2
  out = Encoder(fns, nnx.Rngs(0))(x)
  out_direct = Encoder({f"layer_{i}": fn for i, fn in enumerate(direct)},
                       nnx.Rngs(0))(x)
  out_fp32 = Encoder({f"layer_{i}": fn for i, fn in enumerate(all_fp32)},
                     nnx.Rngs(0))(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_direct))
  # measured: max |diff| 0.26, 1 - cos 1.0e-3 (int4 QK on random inputs)
  assert float(jnp.abs(out - out_fp32).max()) > 0.01
  assert 1.0 - float(metrics.cosine_similarity(out, out_fp32)) < 3e-3


def test_per_layer_config_errors():
  with pytest.raises(KeyError, match="no attention configured"):
    jflax.attention_fns({"a": "fp32"})["b"]
  with pytest.raises(ValueError, match="unknown attention"):
    jflax.attention_fns({"a": "sage3"})
  with pytest.raises(TypeError, match="unknown option"):
    jflax.attention_fns({"a": {"method": "pasa", "preset": "sage2-4b"}})
  with pytest.raises(TypeError, match="str or a mapping"):
    jflax.attention_fns({"a": 8})


def _train_losses(attention_fn, steps=40):
  """A two-block causal transformer (nnx) trained with Adam to predict the
  next token of sequences that repeat with period 5: the loss per step."""
  import optax
  vocab, t, d = 11, 16, 32

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.MultiHeadAttention(
          num_heads=2, in_features=d, decode=False, rngs=rngs,
          **({"attention_fn": attention_fn} if attention_fn else {}))
      self.mlp = nnx.Linear(d, d, rngs=rngs)
      self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(
          d, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.norm1(x), mask=mask)
      return x + nnx.gelu(self.mlp(self.norm2(x)))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (t, d)))
      self.blocks = nnx.List([Block(rngs) for _ in range(2)])
      self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.pos[...][:tokens.shape[-1]]
      mask = nnx.make_causal_mask(tokens)
      for block in self.blocks:
        x = block(x, mask)
      return self.head(x)

  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  starts = jax.random.randint(jax.random.key(1), (8, 1), 0, vocab)
  tokens = (starts + jnp.arange(t) % 5) % vocab

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return np.array([float(step(model, optimizer, tokens))
                   for _ in range(steps)])


@pytest.mark.parametrize("method", ["fp32", "sage"])
def test_nnx_training_step_loss_falls_as_with_jax_nn(method):
  """jax.grad through jaxattn inside an nnx model trained with optax: the
  loss falls as with flax's default attention (3.88 to 0.010 in 40 steps).
  fp32 tracks it to float32 rounding (measured max relative difference
  1.2e-6); sage's quantized forward with the straight-through backward
  stays within 5% of it at every step (measured 3.8%, at the last steps,
  where the loss is 0.01)."""
  fn = jflax.make_attention_fn(method, implementation="reference")
  ours, ref = _train_losses(fn), _train_losses(None)
  assert ref[-1] < 0.2 * ref[0]           # the task is learnt
  assert ours[-1] < 0.2 * ours[0]
  rel = np.abs(ours - ref) / ref
  assert rel.max() < (1e-4 if method == "fp32" else 0.05), rel.max()


@pytest.mark.parametrize("method", ["fp32", "sage"])
def test_sequence_mask_matches_flax_dense_mask(method):
  """A packed, padded batch through ``SequenceMask`` (indices, computed in
  the kernels) equals flax's default attention with the equivalent dense
  mask; a sliding window from ``make_attention_fn`` too."""
  x = jax.random.normal(jax.random.key(1), (*BATCH, T, FEATURES))
  starts = jnp.asarray([[[20, 31], [7, 40]], [[48, 48], [1, 2]]])  # segments
  segments = (jnp.arange(T) >= starts[..., :1]).astype(jnp.int32) + (
      jnp.arange(T) >= starts[..., 1:])
  lengths = jnp.asarray([[48, 45], [40, 40]])  # every row sees a key
  keep_key = jnp.arange(T) < lengths[..., None]
  window = 9
  pos = jnp.broadcast_to(jnp.arange(T), (*BATCH, T))
  dense = nnx.combine_masks(
      nnx.make_causal_mask(jnp.ones((*BATCH, T))),
      nnx.make_attention_mask(segments, segments, jnp.equal),
      nnx.make_attention_mask(jnp.ones((*BATCH, T), bool), keep_key),
      nnx.make_attention_mask(pos, pos, lambda i, j: i - j <= window))
  fn = jflax.make_attention_fn(method, implementation="reference",
                               local_window_size=(window, 0))
  sequence_mask = jflax.SequenceMask(
      q_segment_ids=segments, key_value_seq_lengths=lengths)
  with jax.default_matmul_precision("highest"):   # no TF32 on a GPU
    out = _nnx_layer(jnp.float32, fn)(x, mask=sequence_mask, is_causal=True)
    ref = _nnx_layer(jnp.float32)(x, mask=dense)
  _check_close(out, ref, method, jnp.float32)
  with pytest.raises(ValueError, match="local_window_size"):
    jflax.make_attention_fn(method, local_window_size=-1)
  with pytest.raises(ValueError, match="causal_alignment"):
    jflax.make_attention_fn(method, causal_alignment="left")
