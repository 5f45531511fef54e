"""Pallas GPU kernels for jaxattn (Triton lowering; interpret mode on CPU), to
be added by the kernel issues."""
