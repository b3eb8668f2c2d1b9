"""The seed's caches on the pool (``veloxquant_mlx.memory`` re-exports them): pool-backed mlx_lm
caches (``pool_backed``, ``pool_backed_batch``), VeloxQuant's compressed caches on the pool
(``pooled``, ``veloxquant/``) and block storage (``block_storage``). The server does not use
them; its KV path is ``veloxquant_mlx.kv``. Import the module you need: this package imports
nothing, so importing it registers nothing with mlx_lm (``pool_backed.register_with_mlx_lm``).
"""
