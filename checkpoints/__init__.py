"""What to load: model names -> checkpoint files (`source`), GGUF metadata and tensors (`gguf`), and the checkpoints
Pagoda builds itself: the built-in SmolLM2 (`builtin`), the tiny test model (`tiny`), real-sized presets with random
weights (`presets`).

A leaf package: it imports nothing of Pagoda's but `engine.envs` (stdlib only), for $PAGODA_CACHE.
"""
