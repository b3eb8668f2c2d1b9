"""The serving KV path: where the engine's running rows keep their keys and values.

- ``layout``: the ``KVLayout`` protocol the engine's runner drives.
- ``dense``: a contiguous working set per layer (the default).
- ``paged``: the pool's blocks as the memory, read through block tables (``--kv-layout paged``).
- ``step``: the per-layer ``StepCache`` an mlx_lm model writes to and reads from in a decode step.
- ``attention``: ragged attention for rows of different lengths, and the routing of a model's
  attention to ``PagedKV.attend`` (``--paged-attention fused``).
- ``paged_attention``: that attention through the block tables (a CUDA kernel; MLX ops
  elsewhere).
- ``codec``, ``quantized``, ``mixed``: KV stored quantized (``--kv-format``), a format per
  request (``--kv-formats``); ``quantized_attention``: quantized decode attention in one CUDA
  kernel a layer (``--quantized-attention``; MLX ops elsewhere); ``quantized_check``: the
  start check of a quantized route against the dequantized attention.
- ``room``: room in a prompt's stock mlx_lm caches for the whole prompt (prefill, scoring).

Imports MLX; imports neither the engine nor the seed's caches (``veloxquant_mlx.cache``).
Engine thread only.
"""
