"""Checkpoint file formats: safetensors reading and sharded writing
(:mod:`ferrule.formats.safetensors_io`), block-scaled FP8 / MXFP8 weights read dequantized
(:mod:`ferrule.formats.quantized_weights`) and NVFP4 experts (:mod:`ferrule.formats.nvfp4`).

Importing this package imports nothing; the modules import torch inside their functions.
"""
