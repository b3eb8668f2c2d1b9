"""Load generator for OpenAI-compatible servers (ours, mlx_lm.server, vLLM, llama.cpp)."""
