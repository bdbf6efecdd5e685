"""RL launcher pieces (``ferrule train``): config, tasks, rewards, advantages, metrics, plots.

Submodules are imported on demand (``from ferrule.rl.config import load_config``); this package
imports nothing heavy.
"""
