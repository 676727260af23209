"""Make megatron-core 0.16.1 run on a machine without CUDA (FACTS.md, "megatron-core on CPU").

megatron-core is written for GPUs: it allocates with ``device=torch.cuda.current_device()`` or
``device='cuda'``, keeps CUDA RNG states for tensor-parallel dropout, moves optimizer state with
``.cuda()`` and synchronises streams while checkpointing. On a CPU-only torch build every one of
those raises. This module is the *only* place in asyncrl that patches megatron or torch for it:

* :func:`install_cpu_shims` — idempotent; does nothing to CUDA behaviour when a GPU is present.
  It patches ``torch.cuda.current_device`` / ``torch.cuda.synchronize`` and installs a CPU RNG
  tracker in ``megatron.core.tensor_parallel.random``. It also repairs one megatron bug that is not
  about CPUs (``moe_utils.te_general_gemm`` undefined without TransformerEngine), on any machine
  where TransformerEngine is absent, because MoE routing crashes without it there too.
* :func:`cpu_device_mode` — a context manager the engine holds around megatron calls: on CPU it
  maps ``device='cuda'`` arguments to the CPU, makes ``Tensor.cuda()`` a no-op and reports a CPU
  tensor's ``type()`` string as its CUDA twin (megatron's optimizer, gradient clipping and DDP
  buffers write / assert those literally); with a GPU it does nothing.

Everything else (the explicit causal attention mask, ``moe_token_dispatcher_type='allgather'``,
no grouped GEMM) is configuration, chosen in :mod:`training.engines.megatron.convert`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CpuRNGStatesTracker", "cpu_device_mode", "install_cpu_shims", "on_cpu"]

_lock = threading.Lock()
_installed = False


def on_cpu() -> bool:
    """True when the shims apply: this torch sees no CUDA device."""
    return not torch.cuda.is_available()


class CpuRNGStatesTracker:
    """megatron's CudaRNGStatesTracker API over *CPU* generator states.

    Why: megatron forks a named CUDA RNG state around tensor-parallel dropout and weight init
    (``get_cuda_rng_tracker().fork()``); with no CUDA the stock tracker fails in
    ``torch.cuda.get_rng_state``. Here each named state is a CPU ``torch`` generator state, swapped
    in and out of the default CPU generator, so forking leaves the caller's RNG stream untouched.
    """

    def __init__(self, *_: Any, **__: Any) -> None:
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` → CPU and ``Tensor.cuda()`` → identity (see the module
    docstring); every other torch call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts `grad.type() == 'torch.cuda.FloatTensor'` before clipping; report
            # a CPU tensor's type string as its CUDA twin (the query form only, no conversion)
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Hold around megatron calls that name 'cuda' literally (optimizer construction and step,
    gradient clipping, DDP buffers, checkpoint load). A no-op when CUDA is available."""
    if not on_cpu():
        yield
        return
    with _CudaToCpuMode():
        yield


def _current_device_cpu() -> str:
    # Why: megatron allocates parameters, buffers and activations with
    # device=torch.cuda.current_device(); "cpu" makes those allocations land on the CPU.
    return "cpu"


def _synchronize_noop(device: Any = None) -> None:
    # Why: dist_checkpointing and parallel_state call torch.cuda.synchronize() around saves and
    # barriers; CPU work is already synchronous.
    return None


def _fix_moe_utils_without_te() -> None:
    """megatron-core 0.16.1 bug: ``moe_utils.router_gating_linear`` tests ``te_general_gemm is not
    None`` but the name is only bound when TransformerEngine imports, so every MoE router forward
    raises NameError without TE (on CPUs *and* on GPUs without TE). Binding it to None selects
    megatron's own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install_cpu_shims() -> None:
    """Apply the compatibility layer once per process (idempotent, thread-safe).

    Always: the TransformerEngine-less MoE fix (:func:`_fix_moe_utils_without_te`). Only when
    ``torch.cuda.is_available()`` is False: ``torch.cuda.current_device`` → "cpu",
    ``torch.cuda.synchronize`` → no-op, megatron's model-parallel RNG tracker → a
    :class:`CpuRNGStatesTracker`. Call it before building any megatron module.
    """
    global _installed
    with _lock:
        if _installed:
            return
        _fix_moe_utils_without_te()
        if on_cpu():
            torch.cuda.current_device = _current_device_cpu
            torch.cuda.synchronize = _synchronize_noop
            from megatron.core.tensor_parallel import random as mp_random

            # Why: the stock tracker keeps CUDA generator states (see CpuRNGStatesTracker);
            # marking it initialised stops initialize_rng_tracker() from replacing it.
            mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        _installed = True
