"""Numerics: Tessera dtypes, precision policies, rounding and quantization."""
