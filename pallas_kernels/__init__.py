"""Attention kernels in Pallas: arrays and static flags in, arrays out.

* :mod:`pallas_kernels.flash`: flash attention (Triton lowering), float16
  and float32 precision allocations and PASA's float16 softmax;
* :mod:`pallas_kernels.quantized`: quantized flash attention (Triton
  lowering), int8/int4 QK and int8/fp8/fp16/uint8 PV;
* :mod:`pallas_kernels.mosaic`: the warp-specialised Hopper kernel (Pallas
  Mosaic GPU) for 16-bit, int8 and fp8 QK/PV and PASA;
* :mod:`pallas_kernels.quantizers`: one-pass quantizers that make the
  quantized kernels' operands;
* :mod:`pallas_kernels.key_shift`: one-pass block-shifted float16 keys
  (PASA's shifted keys).

The kernels know no attention method and import nothing from ``jaxattn``:
``jaxattn.backends`` maps each method's configuration to their flags.
Without a GPU they run in interpret mode (Mosaic GPU's interpreter for the
Hopper kernel), which is how the CPU tests exercise them.
"""
