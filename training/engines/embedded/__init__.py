"""Embedded (CPU, plain torch) engines: the rollout server and the fp32 trainer."""
