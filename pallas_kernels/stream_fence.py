"""A wait on the device for work queued on another CUDA stream.

jax 0.11's PJRT orders a computation after buffers imported on a foreign
stream by blocking the host in the launch until that stream's event is
reached.  This kernel orders it on the device instead: the producer stream
increments ``counter[0]`` after its work (a post), and the computation's
first kernel spins until ``counter[0]`` reaches its own turn,
``counter[1] + 1``, then stores that turn in ``counter[1]``.  Posts and
turns are counted, not flagged, so calls queued back to back each wait for
their own post.  As with ``cudaStreamWaitEvent`` the consumer's stream
waits and the host does not; unlike it, the wait gives up after
:data:`MAX_SPINS` loads.

The caller ties every reader of the guarded buffers to the token
(``lax.optimization_barrier``) and returns the token: XLA drops a kernel
whose output nothing uses, and this one has no side effect it knows of.
Command buffers stay on: with them, calls queued behind 0.1 s of torch
work read every element right on the H200 (jax 0.11.2), and they save
40-200 us of launches a call.  Only the schedule orders the readers after
the wait (the barrier makes no buffer conflict): were a later XLA to
capture the wait into one command buffer with its readers, the GPU test
of ``jaxattn.torch``'s stream order would fail.  A wait launched as an
executable of its own, before the call's, was measured slower on the host
(74 us a call on the H200).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import triton_call
from pallas_kernels.triton_call import tl, triton

# About half an hour of ~1 us volatile loads: a lost post (a bug) stalls
# the device that long, then the computation runs on whatever its inputs
# hold; the token is -1.
MAX_SPINS = (1 << 31) - 1


@triton.jit
def _wait_kernel(counter_ptr, token_ptr, MAX_SPINS: tl.constexpr):
  """counter int32 ``[2]`` (posts, turns taken); token int32 ``[1]``: the
  turn taken, or -1 if the post did not come within ``MAX_SPINS`` loads."""
  turn = tl.load(counter_ptr + 1) + 1
  posted = tl.load(counter_ptr, volatile=True)
  spins = 0
  # (a difference, not a comparison: the counts may wrap around)
  while ((posted - turn) < 0) & (spins < MAX_SPINS):
    posted = tl.load(counter_ptr, volatile=True)
    spins += 1
  tl.store(counter_ptr + 1, turn)
  tl.store(token_ptr, tl.where((posted - turn) < 0, -1, turn))


def wait_for(counter, max_spins: int | None = None):
  """int32 ``[1]`` token of the wait on ``counter`` (int32 ``[2]``, device
  memory that the producer stream posts to; updated in place, outside
  XLA's knowledge, so pass a buffer XLA does not own), at most
  ``max_spins`` loads (default :data:`MAX_SPINS`)."""
  if counter.shape != (2,) or counter.dtype != jnp.int32:
    raise ValueError(f"counter must be int32 [2], got {counter.dtype} "
                     f"{counter.shape}")
  return triton_call.launch(
      _wait_kernel, counter,
      out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(1,),
      num_warps=1, num_stages=1,
      MAX_SPINS=int(MAX_SPINS if max_spins is None else max_spins))
