"""Off-policy LLM RL math (temporary minimal __init__ while modules are being written)."""
