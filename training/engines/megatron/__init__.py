"""The Megatron train backend (``engines.train: megatron``; ``pip install -e ".[megatron]"``).

Modules: :mod:`~training.engines.megatron.compat` (the CPU compatibility layer, the only code that
patches megatron), :mod:`~training.engines.megatron.convert` (HF ↔ megatron weights and config),
:mod:`~training.engines.megatron.rank` (one rank: model shard, optimizer, checkpoints) and
:mod:`~training.engines.megatron.engine` (:class:`MegatronTrainEngine`, the driver-side
TrainEngine over Ray rank actors). Importing this package does not import megatron-core.
"""
