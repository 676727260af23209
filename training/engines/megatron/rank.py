"""One rank of the Megatron train engine: a megatron-core GPTModel shard and its optimizer.

:class:`MegatronRank` is what runs inside each rank process (a Ray actor, or the calling process
for an in-process world of size 1). The driver-side :class:`~training.engines.megatron.engine.
MegatronTrainEngine` calls the same method on every rank and returns rank 0's answer; every
method that communicates is therefore entered by all ranks in the same order.

How it departs from the embedded engine (:mod:`training.engines.embedded.trainer`, whose
semantics it follows: versions, snapshots, R2 route cache, skipped non-finite steps):

* **Model.** megatron-core's GPTModel, fp32 — or bf16 (``Parallelism.precision``: bf16 weights and
  activations in megatron's ``Float16Module``, fp32 master weights, gradient reduction and Adam
  state in its mixed-precision optimizer; snapshots hold the bf16 weights, HF exports their fp32
  values) — TransformerEngine's layer spec where TE and a GPU exist, else the local spec
  (``convert.default_layout``; checkpoints record it and the precision, and refuse another) —
  wrapped in megatron's DistributedDataParallel; weights converted from / to HF by
  :mod:`training.engines.megatron.convert`. The logits are gathered over tensor-parallel ranks
  and padded vocabulary rows dropped, then the log-prob/entropy maths and the whole loss path are
  :mod:`training.engines.objective` — the embedded engine's code.
* **Routing.** MoE routes are recorded and replayed with megatron's ``RouterReplay`` (RECORD /
  REPLAY_FORWARD, ``moe_enable_routing_replay=True``); SGLang-layout routes (P+O−1, L, k) become
  per layer ``[S·B, k]`` indices in megatron's sequence-major token order. The router instances are
  driven one by one (never through RouterReplay's process-global list, which would mix models).
* **Data parallelism.** ``train_step`` gives the i-th micro-batch with loss tokens to DP rank
  i mod DP (:class:`Rounds`); gradients are *summed* over DP (``calculate_per_token_loss``)
  because every micro-batch loss already carries its share of the global normaliser. Log-prob
  passes with more than one micro-batch are shared out the same way and their results
  all-gathered; a single micro-batch runs on every rank.
* **Optimizer.** ``get_megatron_optimizer`` (torch AdamW underneath on machines without apex /
  TransformerEngine; the FP32 optimizer — in bf16 Float16OptimizerWithFloat16Params — or the
  DistributedOptimizer); learning rate and weight decay (× megatron's per-group ``wd_mult``: no
  decay on 1-D weights) are set before each step from the OptimConfig schedule; gradient clipping
  by megatron's global norm.
* **Checkpoints.** ``dist_checkpointing`` (model + optimizer) in ``megatron/``, plus an HF export
  of the current weights (so the directory is also an HF model directory), ``trainer_state.pt``
  and per-rank RNG / snapshot files. Everything is read and validated, and the sharded tensors are
  loaded into copies, before the live weights change; every rank agrees on the outcome.

* **Expert parallelism.** EP splits the experts over the data-parallel ranks (megatron: expert
  TP = TP, so EP must divide DP). The allgather token dispatcher gathers every rank's tokens over
  the expert group, so ranks of that group must forward (and backward) the same shapes at the same
  time: micro-batches are shared out in :class:`Rounds` and padded to the round's largest; a rank
  without a micro-batch in the last round runs a dummy with zero loss.

* **Pipeline parallelism.** Stage s holds layers s·L/PP … (s+1)·L/PP − 1 (the first stage the
  embedding, the last the final norm and output layer; ``convert.to_stage``). Each forward is
  passed stage to stage with point-to-point sends and the last stage broadcasts the log-probs, so
  the objective code runs unchanged on every stage; backward returns the activation gradients the
  same way (:class:`_PipeGrad`). Micro-batches go through the pipeline one at a time (GPipe
  without overlap: simple and exact; megatron's 1F1B schedule would overlap stages).

Limits: MoE with tensor_parallel > 1 is refused (megatron trains it only with sequence
parallelism, which this engine does not run: use expert_parallel); checkpoints written with
different parallel sizes are refused.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from training.algorithms.is_correction import EWMAConfig, EWMAState, ewma_update
from training.engines.hf_io import (
    CheckpointError,
    check_hf_dir,
    move_into_place,
    read_meta,
    read_model_config,
    read_state_dict,
    save_hf_dir,
)
from training.engines.megatron.compat import cpu_device_mode, install_cpu_shims, on_cpu
from training.engines.megatron.convert import (
    default_layout,
    from_stages,
    gpt_model_kwargs,
    hf_to_megatron,
    megatron_to_hf,
    stage_layers,
    to_stage,
    transformer_config,
)
from training.engines.model import CausalLM, ModelConfig
from training.engines.objective import (
    PolicyObjective,
    accumulate_gradients,
    check_train_inputs,
    log_probs_per_token_version,
    merge_loss_metrics,
    micro_batch_log_probs,
    response_log_probs,
    step_metrics,
)
from training.engines.ports import free_port
from training.engines.retained import (
    TRAINER_STATE_FILE,
    RetainedState,
    SnapshotStore,
    optim_config_state,
    optim_from_state,
    read_routes,
    read_weights,
    rng_state,
    set_rng_state,
)
from training.engines.routes import RouteCache, RouteReplay, pad_routes
from training.engines.train import (
    DEFAULT_STEP_CONFIG,
    LogProbResult,
    OptimConfig,
    SnapshotUnavailableError,
    StepConfig,
    TokenBatch,
    check_temperature,
    lr_multiplier,
    micro_batch_slices,
    sequence_key,
)
from training.tasks.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from training.engines.sglang.nccl_sync import PushReport, WeightGroup

__all__ = ["MEGATRON_DIR", "TRAINER_STATE_FILE", "MegatronRank", "Parallelism"]

MEGATRON_DIR = "megatron"
RANKS_DIR = "ranks"
ROUTE_CACHE_FILE = "r2_routes.safetensors"
STATE_FORMAT = 1
STATE_KIND = "asyncrl.megatron_trainer"

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Parallelism:
    """How the model is split over ranks (world size = TP × PP × DP)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    data_parallel: int = 1
    distributed_optimizer: bool = False
    precision: str = "fp32"  # or "bf16" (module docstring, Model)

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"engines.megatron.precision={self.precision!r}; use fp32 or bf16")
        if min(self.tensor_parallel, self.pipeline_parallel, self.expert_parallel,
               self.data_parallel) < 1:
            raise ValueError("every parallel size must be >= 1")
        if self.data_parallel % self.expert_parallel:
            # megatron's expert layout: expert-TP (= TP) × EP × expert-DP × PP = world, so the
            # experts are split over the data-parallel ranks
            raise ValueError(f"engines.megatron.expert_parallel={self.expert_parallel} must "
                             f"divide data_parallel={self.data_parallel} (experts are split "
                             "over the data-parallel ranks); set data_parallel to a multiple "
                             "of expert_parallel")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter and activation dtype."""
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def sizes(self) -> dict[str, int]:
        return {"tensor_parallel": self.tensor_parallel,
                "pipeline_parallel": self.pipeline_parallel,
                "expert_parallel": self.expert_parallel, "data_parallel": self.data_parallel}


def check_model_fits(cfg: ModelConfig, parallel: Parallelism) -> None:
    """ValueError naming the fix unless ``parallel`` can run ``cfg``: the sizes divide the model
    (``convert.check_parallel_sizes``), and no MoE under tensor parallelism (megatron trains MoE
    layers under TP only with sequence parallelism, which this engine does not run)."""
    from training.engines.megatron.convert import check_parallel_sizes

    check_parallel_sizes(cfg, parallel.tensor_parallel, parallel.expert_parallel,
                         parallel.pipeline_parallel)
    if cfg.is_moe and parallel.tensor_parallel > 1:
        raise ValueError(f"engines.megatron.tensor_parallel={parallel.tensor_parallel} with an MoE "
                         "model: megatron trains MoE layers under TP only with sequence "
                         "parallelism, which asyncrl does not run; split the experts with "
                         "expert_parallel (and data_parallel) instead")


@dataclass(frozen=True)
class Pipe:
    """This rank's place in its pipeline (PP > 1): stage ``stage`` of ``size``; global ranks of
    the previous / next / last stage; the pipeline's process group."""

    size: int
    stage: int
    group: Any
    prev: int
    next: int
    last_rank: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1


class _PipeGrad(torch.autograd.Function):
    """On a stage before the last: the response log-probs / entropy (values broadcast by the last
    stage) as functions of this stage's output. Backward receives the gradient of that output from
    the next stage — whatever loss the caller took of the log-probs, the next stage backwarded the
    same loss — and autograd carries it on through this stage's layers."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, next_rank: int, lp: torch.Tensor,
                ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.next_rank, ctx.shape, ctx.dtype, ctx.device = next_rank, out.shape, out.dtype, \
            out.device
        return lp.clone(), ent.clone()

    @staticmethod
    def backward(ctx: Any, *_: Any) -> tuple[Any, ...]:
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, src=ctx.next_rank)
        return grad, None, None, None


@dataclass(frozen=True)
class Rounds:
    """Micro-batches spread over the data-parallel ranks: round k gives ``slices[k·dp + d]`` to
    DP rank d.

    ``shapes[k]`` is the (rows, width) of the longest micro-batch of round k: with expert
    parallelism every rank of round k pads its forward to it (the MoE token all-gather needs
    the same token count on every rank of the expert group). ``mine[k]`` is this rank's slice
    of round k, None where the last round has none for it: it then runs a padded dummy forward
    (and backward) so the collectives of all ranks still pair up.
    """

    rounds: tuple[tuple[slice, ...], ...]
    shapes: tuple[tuple[int, int], ...]
    mine: tuple[slice | None, ...]

    @classmethod
    def of(cls, batch: TokenBatch, slices: Sequence[slice], dp: int, dp_rank: int) -> Rounds:
        rounds = tuple(tuple(slices[k: k + dp]) for k in range(0, len(slices), dp))
        shapes = tuple((max(s.stop - s.start for s in r),
                        max(max(int(batch.total_lens[s].max()), 1) for s in r)) for r in rounds)
        mine = tuple(r[dp_rank] if dp_rank < len(r) else None for r in rounds)
        return cls(rounds, shapes, mine)

    def pad_of(self, s: slice) -> tuple[int, int]:
        """The padded shape of the round holding ``s``."""
        for r, shape in zip(self.rounds, self.shapes, strict=True):
            if s in r:
                return shape
        raise KeyError(s)


class MegatronRank(RetainedState, RouteReplay):
    """The model shard, optimizer, snapshots and route cache of one rank (module docstring).

    Lifecycle: ``init_distributed`` (or ``init_in_process``), then ``load_pretrained`` or
    ``load_checkpoint_fresh``; then the TrainEngine methods.
    """

    def __init__(self, rank: int, parallel: Parallelism, seed: int = 0) -> None:
        self.rank = int(rank)
        self.parallel = parallel
        self.seed = int(seed)
        self.cfg: ModelConfig | None = None
        self.tokenizer: CharTokenizer | None = None
        self.optim = OptimConfig()
        self._version = 0
        self._step = 0
        self._snapshots = SnapshotStore(0)
        self._routes = RouteCache(0)
        self._shadow: Any = None
        self._shadow_version: int | None = None
        self._cpu_group: Any = None
        self._pipe: Pipe | None = None  # set in _init_parallel_state when PP > 1
        self._ewma: EWMAState | None = None  # old_logprob: ewma (this rank's shard)
        self._pusher: Any = None  # rank 0: TrainerNcclPusher of weight_sync nccl
        # the layer spec (convert.LAYOUTS): TransformerEngine's where TE and a GPU exist, else
        # the local one; _init_parallel_state makes every rank take rank 0's
        self.layout = default_layout()

    # --- process group ------------------------------------------------------------------------
    def master_address(self) -> tuple[str, int]:
        """(host, free port) for the TCP rendezvous; asked of rank 0."""
        import ray

        # probed on every interface, where torch's TCPStore will listen
        return ray.util.get_node_ip_address(), free_port("")

    def init_distributed(self, host: str, port: int) -> int:
        """Join the world (gloo on CPU, nccl on GPU) and build megatron's parallel groups."""
        install_cpu_shims()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU(s) as CUDA_VISIBLE_DEVICES
        else:
            torch.set_num_threads(1)
        backend = "gloo" if on_cpu() else "nccl"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.parallel.world_size)
        self._init_parallel_state()
        return self.rank

    def init_in_process(self) -> None:
        """World size 1 in the calling process (tests, ``launcher='local'``); reuses a process
        group this process already set up with the same sizes."""
        install_cpu_shims()
        from megatron.core import parallel_state

        if self.parallel.world_size != 1:
            raise ValueError("an in-process megatron engine has world size 1; use "
                             "launcher='ray' for tensor/data parallelism")
        if dist.is_initialized():
            if dist.get_world_size() != 1 or not parallel_state.model_parallel_is_initialized():
                raise RuntimeError("torch.distributed is already initialised in this process "
                                   "with another world; run the engine with launcher='ray'")
            self._cpu_group = dist.new_group(backend="gloo")
            return
        store = Path(tempfile.gettempdir()) / f"asyncrl-megatron-{uuid.uuid4().hex}"
        backend = "gloo" if on_cpu() else "nccl"
        if torch.cuda.is_available():
            torch.cuda.set_device(torch.cuda.current_device())
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        self._init_parallel_state()

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        p = self.parallel
        layouts: list[str] = [self.layout]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(layouts, src=0)
        self.layout = layouts[0]
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel,
            pipeline_model_parallel_size=p.pipeline_parallel,
            expert_model_parallel_size=p.expert_parallel)
        model_parallel_cuda_manual_seed(self.seed)
        if p.pipeline_parallel > 1:
            self._pipe = Pipe(
                size=p.pipeline_parallel, stage=parallel_state.get_pipeline_model_parallel_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
                prev=parallel_state.get_pipeline_model_parallel_prev_rank(),
                next=parallel_state.get_pipeline_model_parallel_next_rank(),
                last_rank=parallel_state.get_pipeline_model_parallel_last_rank())
        # object collectives (metrics, routes, checkpoint names) go over gloo on every machine
        self._cpu_group = dist.new_group(backend="gloo")

    @property
    def device(self) -> torch.device:
        if on_cpu():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _coords(self) -> tuple[int, int, int, int]:
        """(TP, EP, DP, PP) rank."""
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())

    def _dp(self) -> tuple[int, int, Any]:
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
                ps.get_data_parallel_group_gloo())

    @property
    def _lockstep(self) -> bool:
        """Whether every forward must have the same shape on all data-parallel ranks (expert
        parallelism: :class:`Rounds`)."""
        return self.parallel.expert_parallel > 1

    def _agree(self, error: str | None, exc: type[Exception] = CheckpointError) -> None:
        """Raise ``exc`` on every rank if any rank has an error (first one wins), so no rank
        enters a collective the others skip."""
        errors: list[str | None] = [error]
        if dist.get_world_size() > 1:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error, group=self._cpu_group)
        first = next((e for e in errors if e), None)
        if first:
            raise exc(first)

    def _barrier(self) -> None:
        if dist.get_world_size() > 1:
            dist.barrier(group=self._cpu_group)

    # --- model --------------------------------------------------------------------------------
    def _build_model(self, cfg: ModelConfig) -> Any:
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.moe.router_replay import RouterReplay

        p = self.parallel
        tf = transformer_config(cfg, tp=p.tensor_parallel, pp=p.pipeline_parallel,
                                ep=p.expert_parallel, on_cpu=on_cpu(), precision=p.precision)
        # the random init (overwritten right after) must not consume the caller's RNG streams
        with cpu_device_mode(), torch.random.fork_rng(devices=[]):
            kwargs = gpt_model_kwargs(cfg, self.parallel.tensor_parallel, layout=self.layout)
            if self._pipe is not None:  # a stage: its share of the layers (convert.to_stage)
                kwargs.update(pre_process=self._pipe.first, post_process=self._pipe.last)
            model = GPTModel(config=tf, **kwargs)
        if p.precision == "bf16":
            # params_dtype does not reach every parameter (the local spec builds its RMSNorm
            # weights fp32): cast all, as Float16Module does for the live model, so a snapshot's
            # (unwrapped) shadow model is the same bf16 model
            model.bfloat16()
        if not on_cpu():
            # without apex megatron builds the local spec's norms (and the MoE router) as plain
            # torch modules on the CPU; Megatron-LM's trainer moves the model with .cuda() after
            # building it, and so do we (found by benchmarks/gpu_megatron_check.py on an H200)
            model.cuda(torch.cuda.current_device())
        # this engine drives each router's RouterReplay itself; drop them from megatron's
        # process-global list so models built in one process never share replay state
        mine = {id(r) for r in _router_replays(model)}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
        return model

    def _setup(self, cfg: ModelConfig, tokenizer: CharTokenizer, optim: OptimConfig,
               snapshot_budget_bytes: int, route_cache_sequences: int) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        check_model_fits(cfg, self.parallel)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {cfg.vocab_size}")
        self.cfg, self.tokenizer, self.optim = cfg, tokenizer, optim
        self.module = self._build_model(cfg)
        dist_opt = self.parallel.distributed_optimizer
        bf16 = self.parallel.precision == "bf16"
        inner = self.module
        if bf16:
            from megatron.core.transformer.module import Float16Module

            # megatron's bf16 wrapper (Megatron-LM wraps before DDP alike): fp32 logits out.
            # self.module stays the bare GPTModel: its parameter names are convert.py's
            inner = Float16Module(self.module.config, self.module)
        with cpu_device_mode():
            self.ddp = DistributedDataParallel(
                config=self.module.config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                    use_distributed_optimizer=dist_opt),
                module=inner)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=optim.lr, min_lr=0.0, weight_decay=optim.weight_decay,
                    adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
                    clip_grad=optim.grad_clip or 0.0, use_distributed_optimizer=dist_opt,
                    params_dtype=self.parallel.dtype, bf16=bf16, fp16=False),
                [self.ddp])
        # every rank must retain the same versions (a forward of an old version is collective),
        # but pipeline stages hold shards of different sizes: all count the largest one
        unit = torch.tensor([sum(p.numel() * p.element_size()
                                 for p in self.module.parameters())], dtype=torch.int64)
        if dist.get_world_size() > 1:
            dist.all_reduce(unit, op=dist.ReduceOp.MAX, group=self._cpu_group)
        self._snapshots = SnapshotStore(snapshot_budget_bytes, unit_bytes=int(unit))
        self._routes = RouteCache(route_cache_sequences)

    def _local_weights(self) -> Weights:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.module.named_parameters()}

    def _copy_into(self, model: Any, weights: Weights, source: str) -> None:
        params = dict(model.named_parameters())
        if set(params) != set(weights):
            missing, extra = sorted(set(params) - set(weights))[:3], sorted(
                set(weights) - set(params))[:3]
            raise CheckpointError(f"{source} does not match the megatron model (missing "
                                  f"{missing}, unexpected {extra}); check config.json")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(p.shape) != tuple(weights[name].shape):
                    raise CheckpointError(f"{source}: {name} has shape "
                                          f"{tuple(weights[name].shape)}, the model expects "
                                          f"{tuple(p.shape)}")
                p.copy_(weights[name].to(p.device, p.dtype))

    def _load_weights(self, weights: Weights, source: str) -> None:
        self._copy_into(self.module, weights, source)
        with cpu_device_mode():
            self.optimizer.reload_model_params()  # DistributedOptimizer: main params ← model

    def load_pretrained(self, directory: str, optim: OptimConfig, snapshot_budget_bytes: int,
                        route_cache_sequences: int) -> tuple[int, int]:
        """Warm start from an HF directory (every rank reads it); returns (version, step)."""
        err, loaded = None, None
        try:
            d = check_hf_dir(directory)
            cfg = read_model_config(d)
            hf = read_state_dict(d)
            meta = read_meta(d)
            tokenizer = CharTokenizer.load(d)
            loaded = (cfg, hf, meta, tokenizer)
        except CheckpointError as e:
            err = str(e)
        except (FileNotFoundError, OSError, ValueError) as e:
            err = f"{directory}: tokenizer is unreadable ({e}); re-export the checkpoint"
        self._agree(err)
        assert loaded is not None
        cfg, hf, meta, tokenizer = loaded
        self._setup(cfg, tokenizer, optim, snapshot_budget_bytes, route_cache_sequences)
        tp, ep, _, pp = self._coords()
        try:
            local = to_stage(hf_to_megatron(hf, cfg, tp=self.parallel.tensor_parallel, tp_rank=tp,
                                            layout=self.layout,
                                            ep=self.parallel.expert_parallel, ep_rank=ep),
                             cfg, pp=self.parallel.pipeline_parallel, pp_rank=pp)
        except KeyError as e:
            raise CheckpointError(f"{directory} lacks weight {e} the model needs; check "
                                  "config.json") from None
        self._load_weights(local, str(directory))
        self._version, self._step = int(meta["weight_version"]), 0
        return self.state()

    def load_checkpoint_fresh(self, directory: str, snapshot_budget_bytes: int,
                              route_cache_sequences: int) -> tuple[int, int]:
        """Build the model from a trainer checkpoint's config, then restore it exactly."""
        err, cfg, tokenizer = None, None, None
        try:
            d = _check_trainer_dir(directory)
            cfg = read_model_config(d)
            tokenizer = CharTokenizer.load(d)
            state = _read_trainer_state(d)
            optim = optim_from_state(state, d)
            # build the layer spec the checkpoint was written with (before the TE spec: local);
            # the local spec runs everywhere, the TE one only where TE and a GPU exist
            layout = state.get("layout", "local")
            if layout == "te" and default_layout() != "te":
                raise CheckpointError(f"checkpoint {d} holds megatron weights of "
                                      "TransformerEngine's layer spec, which needs TE and a GPU; "
                                      "resume it there, or warm start from its HF weights (the "
                                      "checkpoint directory is also an HF model directory)")
            self.layout = layout
        except CheckpointError as e:
            err = str(e)
        except (FileNotFoundError, OSError, ValueError) as e:
            err = f"tokenizer of {directory} is unreadable ({e}); re-save the checkpoint"
        self._agree(err)
        assert cfg is not None and tokenizer is not None
        self._setup(cfg, tokenizer, optim, snapshot_budget_bytes, route_cache_sequences)
        self.load_checkpoint(directory)
        return self.state()

    def state(self) -> tuple[int, int]:
        return self._version, self._step

    def config(self) -> ModelConfig:
        assert self.cfg is not None
        return self.cfg

    # --- snapshots ----------------------------------------------------------------------------
    # snapshot_versions / snapshot_info / drop_snapshots: RetainedState (embedded trainer)
    def close(self) -> None:
        if self._pusher is not None:
            pusher, self._pusher = self._pusher, None
            pusher.close()
        super().close()

    def _model_at(self, version: int) -> Any:
        if version > self._version:
            raise ValueError(f"weight version {version} does not exist yet (current "
                             f"{self._version})")
        if version == self._version:
            return self.ddp
        weights = self._snapshot(version)
        if self._shadow_version != version:
            self._load_shadow(weights, f"snapshot v{version}")
            self._shadow_version = version
        return self._shadow

    def _load_shadow(self, weights: Weights, source: str) -> Any:
        """The second (no-grad) model, built on first use, holding ``weights`` (this rank's
        shard); it then holds no version until :meth:`_model_at` sets one."""
        if self._shadow is None:
            self._shadow = self._build_model(self.config())
            self._shadow.requires_grad_(False)
        self._shadow_version = None
        self._copy_into(self._shadow, weights, source)
        return self._shadow

    # --- forward ------------------------------------------------------------------------------
    def _forward(self, model: Any, batch: TokenBatch, replay: Sequence[torch.Tensor] | None,
                 temperature: float, with_entropy: bool, pad_to: tuple[int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """Response log-probs (b, T), entropy and per-sequence routes (:meth:`_forward_stats`
        without Σ_v π_v²)."""
        lp, entropy, _, routes = self._forward_stats(model, batch, replay, temperature,
                                                     with_entropy, pad_to)
        return lp, entropy, routes

    def _forward_stats(self, model: Any, batch: TokenBatch,
                       replay: Sequence[torch.Tensor] | None, temperature: float,
                       with_entropy: bool, pad_to: tuple[int, int] | None = None,
                       with_sum_pi_squared: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                  tuple[torch.Tensor, ...] | None]:
        """Response log-probs (b, T), entropy, Σ_v π_v² (``with_sum_pi_squared``) and
        per-sequence routes of ``batch`` (the input trimmed to its longest sequence, like the
        embedded engine).

        ``pad_to=(rows, width)`` forwards a larger input: extra rows and columns are padding no
        real token attends to (their outputs are dropped). Expert parallelism needs it: the MoE
        token all-gather requires the same token count on every rank of the expert group.

        Pipeline parallelism: every stage of the pipeline enters this call for the same batch.
        A stage receives the previous stage's hidden states, runs its layers and sends its output
        on; the last stage computes the log-probs and entropy and broadcasts them over the
        pipeline, so every stage returns the same values (and the same loss follows on every
        stage). With gradients on, a stage's returned values depend on its output through
        :class:`_PipeGrad` and its received input sends its gradient back in backward, so the
        caller's ``loss.backward()`` on every stage is one pipelined backward. Recorded routes
        are all-gathered over the stages (each records its own layers).
        """
        cfg = self.config()
        dev = self.device
        b = batch.batch_size
        real_width = max(int(batch.total_lens.max()), 1)
        rows, width = (b, real_width) if pad_to is None else pad_to
        if rows < b or width < real_width:
            raise ValueError(f"pad_to={pad_to} is smaller than the batch ({b}, {real_width})")
        ids = torch.zeros(rows, width, dtype=batch.input_ids.dtype, device=dev)
        attn = torch.zeros(rows, width, dtype=torch.bool, device=dev)
        ids[:b, :real_width] = batch.input_ids[:, :real_width].to(dev)
        attn[:b, :real_width] = batch.attention_mask[:, :real_width].to(dev)
        # explicit mask (megatron: True = not attended): causal ∧ real keys; a row with nothing to
        # attend sees itself (as the embedded model). megatron's default mask lives on 'cuda'.
        allowed = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None] \
            & attn[:, None, :]
        eye = torch.eye(width, dtype=torch.bool, device=dev)[None]
        allowed = allowed | (eye & ~allowed.any(-1, keepdim=True))
        positions = torch.arange(width, device=dev)[None].expand(rows, width)
        pipe = self._pipe
        grad = torch.is_grad_enabled()
        if pipe is not None and not pipe.first:
            hidden = torch.empty(width, rows, cfg.hidden_size, dtype=self.parallel.dtype,
                                 device=dev)
            dist.recv(hidden, src=pipe.prev)
            if grad:
                hidden.requires_grad_(True)
                hidden.register_hook(lambda g: dist.send(g.contiguous(), dst=pipe.prev))
            (self.module if model is self.ddp else model).set_input_tensor(hidden)
        routers = _router_replays(model)
        if routers:
            targets = None
            if replay is not None:
                targets = _pack_routes(batch, replay, width, cfg, rows)
                if pipe is not None:  # this stage's layers
                    layers = stage_layers(cfg, pipe.size, pipe.stage)
                    targets = targets[layers.start: layers.stop]
            _arm_routers(routers, targets)
        try:
            out = model(ids, positions, ~allowed[:, None])
            recorded = [r.recorded_topk_idx for r in routers] if replay is None else None
        finally:
            _disarm_routers(routers)
        if pipe is None or pipe.last:
            # drop the padding rows / columns and the vocabulary padding of TP
            logits = out[:b, :real_width, : cfg.vocab_size]
            lp, entropy, sum_sq = response_log_probs(logits, batch, temperature, with_entropy,
                                                     with_sum_pi_squared)
            if pipe is not None:
                for t in (lp, entropy, sum_sq):
                    if t is not None:
                        dist.broadcast(t.detach().contiguous(), src=pipe.last_rank,
                                       group=pipe.group)
        else:
            dist.send(out.detach().contiguous(), dst=pipe.next)
            shape = (b, batch.response_len)
            lp = torch.empty(shape, dtype=torch.float32, device=dev)
            entropy = torch.empty(shape, dtype=torch.float32, device=dev) if with_entropy \
                else None
            sum_sq = torch.empty(shape, dtype=torch.float32, device=dev) \
                if with_sum_pi_squared else None
            for t in (lp, entropy, sum_sq):
                if t is not None:
                    dist.broadcast(t, src=pipe.last_rank, group=pipe.group)
            if grad:
                if entropy is None:
                    raise ValueError("a pipelined forward with gradients needs with_entropy")
                lp, entropy = _PipeGrad.apply(out, pipe.next, lp, entropy)
        per_seq = None
        if routers:
            if recorded is not None:
                if pipe is not None:  # every stage's layers, in stage order
                    mine = torch.stack(recorded).contiguous()
                    every = [torch.empty_like(mine) for _ in range(pipe.size)]
                    dist.all_gather(every, mine, group=pipe.group)
                    recorded = [r for stage in every for r in stage]
                # [S·B, k] per layer, sequence-major → (B, S, L, k)
                routes = torch.stack([r.view(width, rows, -1).transpose(0, 1)[:b]
                                      for r in recorded], dim=2)
                per_seq = tuple(routes[i, : int(batch.total_lens[i]) - 1].to("cpu", torch.int32)
                                for i in range(b))
            else:
                assert replay is not None
                per_seq = tuple(r.to(torch.int32) for r in replay)
        return lp, entropy, sum_sq, per_seq

    # --- routing (shared with the embedded engine: training.engines.routes.RouteReplay) ------
    # Every rank holds the same route cache (log-prob passes run the whole batch everywhere;
    # train steps share what they record), so every rank takes the same R2 branch.
    def _route_config(self) -> ModelConfig:
        return self.config()

    def _prepare_route_model(self, model: Any) -> None:
        model.eval()

    # --- log-probs ----------------------------------------------------------------------------
    def compute_log_probs(self, batch: TokenBatch, *, routing: str = "free",
                          version: int | torch.Tensor | None = None, temperature: float = 1.0,
                          with_entropy: bool = True, r2_version: int | None = None,
                          micro_batch_size: int | None = None) -> LogProbResult:
        check_temperature(temperature)
        if isinstance(version, torch.Tensor):
            return log_probs_per_token_version(
                self.compute_log_probs, batch, version, routing=routing, temperature=temperature,
                with_entropy=with_entropy, r2_version=r2_version,
                micro_batch_size=micro_batch_size)
        v = self._version if version is None else int(version)
        # routes first: recording R2 routes of another version may load its snapshot into the
        # shadow model that version v's snapshot is then loaded into
        replay = self._replay_for(batch, routing, v, r2_version)
        model = self._model_at(v)
        result = self._log_probs_of(model, batch, replay, temperature, with_entropy,
                                    micro_batch_size, v)
        if result.routes and replay is None:
            self._remember_routes(batch, v, result.routes)
        return result

    def _log_probs_of(self, model: Any, batch: TokenBatch,
                      replay: Sequence[torch.Tensor] | None, temperature: float,
                      with_entropy: bool, micro_batch_size: int | None,
                      version: int | None) -> LogProbResult:
        """One no-grad pass of ``model`` over ``batch`` (shared out over DP when it has several
        micro-batches); the result is labelled ``version``."""
        v = version
        model.eval()

        def forward(s: slice, pad_to: tuple[int, int] | None = None) -> Any:
            return self._forward_stats(model, batch.select(s),
                                       None if replay is None else replay[s], temperature,
                                       with_entropy, pad_to,
                                       with_sum_pi_squared=with_entropy)

        dp, dp_rank, dp_group = self._dp()
        slices = micro_batch_slices(batch.batch_size, micro_batch_size)
        with torch.no_grad():
            if dp > 1 and len(slices) > 1:
                # the micro-batches are shared out over the DP ranks and the results gathered
                rounds = Rounds.of(batch, slices, dp, dp_rank)
                done: list[tuple[int, Any]] = []
                for r, shape, s in zip(rounds.rounds, rounds.shapes, rounds.mine, strict=True):
                    pad = shape if self._lockstep else None
                    if s is not None:
                        lp, ent, sq, routes = forward(s, pad)
                        done.append((s.start, (lp.cpu(), None if ent is None else ent.cpu(),
                                               None if sq is None else sq.cpu(), routes)))
                    elif self._lockstep:
                        forward(r[0], pad)  # a dummy matching the other ranks' collectives
                shared: list[Any] = [None] * dp
                dist.all_gather_object(shared, done, group=dp_group)
                table = {start: out for part in shared for start, out in part}
                result = micro_batch_log_probs(
                    lambda s: table[s.start], batch, micro_batch_size=micro_batch_size,
                    with_entropy=with_entropy, is_moe=self.config().is_moe, weight_version=v)
            else:
                result = micro_batch_log_probs(
                    forward, batch, micro_batch_size=micro_batch_size,
                    with_entropy=with_entropy, is_moe=self.config().is_moe, weight_version=v)
        return result

    # --- the EWMA reference of old_logprob: ewma ----------------------------------------------
    def ewma_update(self, config: EWMAConfig, mask_frac: float | None = None) -> tuple[bool, int]:
        """One revised PPO-EWMA step on this rank's shard — ``ref ← β·ref + (1−β)·θ`` or a reset
        to θ (:func:`~training.algorithms.is_correction.ewma_update`; the first call initialises
        ref = θ). The decision depends only on the update count and ``mask_frac``, so every rank
        takes the same one. Returns (reset, updates since the last reset)."""
        # blended in fp32: bf16 would round small updates away (the shadow model casts back)
        current = {n: w.float() for n, w in self._local_weights().items()}
        self._ewma, reset = ewma_update(self._ewma, current, config, mask_frac=mask_frac)
        return reset, self._ewma.updates_since_reset

    def compute_log_probs_ewma(self, batch: TokenBatch, *, routing: str = "free",
                               temperature: float = 1.0, with_entropy: bool = False,
                               r2_version: int | None = None,
                               micro_batch_size: int | None = None) -> LogProbResult:
        """Log-probs of ``batch`` under the EWMA reference (the embedded engine's
        ``compute_log_probs_with_weights`` with the reference it would be given); no version,
        routes chosen here are not remembered."""
        check_temperature(temperature)
        if self._ewma is None:
            raise ValueError("no EWMA reference yet; call ewma_update first")
        if routing == "r2" and r2_version is None:
            raise ValueError("routing='r2' with the EWMA weights needs r2_version (the version "
                             "whose routes to replay): the reference is no version")
        # routes first: recording R2 routes may load a snapshot into the shadow model
        replay = self._replay_for(batch, routing, -1, r2_version)
        assert isinstance(self._ewma.reference, dict)
        model = self._load_shadow(self._ewma.reference, "the EWMA reference")
        return self._log_probs_of(model, batch, replay, temperature, with_entropy,
                                  micro_batch_size, None)

    # --- training -----------------------------------------------------------------------------
    def train_step(self, batch: TokenBatch, advantages: torch.Tensor,
                   old_log_prob: torch.Tensor, *,
                   rollout_is_weights: torch.Tensor | None = None,
                   r2_version: int | None = None,
                   config: StepConfig = DEFAULT_STEP_CONFIG,
                   ref_log_prob: torch.Tensor | None = None,
                   lr_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step (``TrainEngine.train_step``; the same metrics as the embedded
        engine)."""
        from megatron.core.distributed import finalize_model_grads

        t0 = time.perf_counter()
        check_train_inputs(batch, advantages, old_log_prob, rollout_is_weights, ref_log_prob,
                           lr_scale)
        dev = self.device
        objective = PolicyObjective.build(batch, advantages, old_log_prob, rollout_is_weights,
                                          config, device=dev, ref_log_prob=ref_log_prob)
        version = self._version
        replay = self._replay_for(batch, config.routing, version, r2_version)
        record = replay is None and self.config().is_moe
        recorded: list[tuple[str, torch.Tensor]] = []

        dp, dp_rank, dp_group = self._dp()
        # the micro-batches with loss tokens, shared out over the DP ranks in rounds
        slices = micro_batch_slices(batch.batch_size, config.micro_batch_size)
        rounds = Rounds.of(batch, [s for s in slices if bool(objective.mask[s].any())], dp,
                           dp_rank)
        owned = {s.start for s in rounds.mine if s is not None}

        def forward(s: slice, grad: bool):
            # backward passes are this rank's own round slices: padded like the round's peers
            # under expert parallelism; no-grad passes (full_batch) run on every rank alike
            pad = rounds.pad_of(s) if grad and self._lockstep else None
            with torch.set_grad_enabled(grad):
                mb = batch.select(s)
                lp, ent, routes = self._forward(self.ddp, mb, None if replay is None
                                                else replay[s], config.temperature, True, pad)
            if record and routes is not None:
                self._remember_routes(mb, version, routes)
                recorded.extend((sequence_key(mb, i), r) for i, r in enumerate(routes))
            return lp, ent

        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        acc = accumulate_gradients(
            batch, objective, forward, config=config, device=dev,
            owned=None if dp == 1 else (lambda i: slices[i].start in owned))
        if self._lockstep:
            # a rank without a slice in the last round still enters its collectives: a padded
            # forward of a peer's rows and a backward of zero (no gradient, same communication)
            for r, shape, s in zip(rounds.rounds, rounds.shapes, rounds.mine, strict=True):
                if s is None:
                    lp, ent, _ = self._forward(self.ddp, batch.select(r[0]),
                                               None if replay is None else replay[r[0]],
                                               config.temperature, True, shape)
                    (lp.sum() * 0.0 + ent.sum() * 0.0).backward()
        loss, pg_loss, parts, entropies = acc.loss, acc.pg_loss, acc.parts, acc.entropies
        assert entropies is not None
        if dp > 1:
            shared: list[Any] = [None] * dp
            dist.all_gather_object(shared, (loss, pg_loss, parts, entropies.cpu(), recorded),
                                   group=dp_group)
            if config.accumulation == "scaled":
                loss = sum(x[0] for x in shared)
                pg_loss = sum(x[1] for x in shared)
                parts = [p for x in shared for p in x[2]]
                entropies = sum(x[3] for x in shared).to(dev)
            else:  # every rank evaluated the full-batch loss; any rank that ran one reports it
                first = next((x for x in shared if x[2]), shared[0])
                loss, pg_loss, parts = first[0], first[1], first[2]
            for x in shared:
                for key, r in x[4]:
                    self._routes.put(version, key, r)
        metrics = merge_loss_metrics(parts)
        with cpu_device_mode():
            finalize_model_grads([self.ddp])  # data-parallel all-reduce (a sum, see above)
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if self.optim.grad_clip is not None:
                _clip_by_total_norm(self.optimizer, self.optim.grad_clip, grad_norm)
            lr = self.optim.lr * lr_multiplier(self.optim, self._step) * lr_scale
            skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
            if not skipped:
                if self._snapshots.budget_bytes > 0:
                    self._snapshots.put(version, self._local_weights())
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                    group["weight_decay"] = self.optim.weight_decay * group.get("wd_mult", 1.0)
                self.optimizer.step_with_ready_grads()
                self._step += 1
                self._version += 1
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad(set_to_none=True)
        metrics.update(step_metrics(
            batch, loss=loss, pg_loss=pg_loss, entropies=entropies, mask=objective.mask,
            grad_norm=grad_norm, lr=lr, skipped=skipped, weight_version=self._version,
            step=self._step, micro_batches=acc.micro_batches,
            elapsed=time.perf_counter() - t0))
        return metrics

    # --- weights out --------------------------------------------------------------------------
    def _gather_hf(self, weights: Weights) -> Weights | None:
        """Full HF weights from every rank's local ``weights`` (collective); rank 0 gets them,
        the others None."""
        mine = (*self._coords(), weights)
        if dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
            dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0,
                               group=self._cpu_group)
        else:
            gathered = [mine]
        if self.rank != 0:
            return None
        stages: dict[tuple[int, int], dict[int, Weights]] = {}
        for t, e, _, pp, w in gathered:  # one copy of each shard (DP ranks hold equal ones)
            stages.setdefault((t, e), {}).setdefault(pp, w)
        shards = {key: from_stages(by_stage, self.config(), pp=self.parallel.pipeline_parallel)
                  for key, by_stage in stages.items()}
        return megatron_to_hf(shards, self.config(), layout=self.layout,
                              tp=self.parallel.tensor_parallel,
                              ep=self.parallel.expert_parallel)

    def _weights_of(self, version: int | None) -> tuple[int, Weights]:
        v = self._version if version is None else int(version)
        if v > self._version:
            raise ValueError(f"weight version {v} does not exist yet (current {self._version})")
        return v, (self._local_weights() if v == self._version else self._snapshot(v))

    def _snapshot(self, version: int) -> Weights:
        """This rank's snapshot of ``version``; SnapshotUnavailableError on every rank if any
        rank lacks it (collective: no rank may start a forward the others skip)."""
        err, weights = None, None
        try:
            weights = self._snapshots.get(version)
        except SnapshotUnavailableError as e:
            err = str(e)
        self._agree(err, SnapshotUnavailableError)
        assert weights is not None
        return weights

    def hf_state_dict(self, version: int | None = None) -> Weights | None:
        """HF-named full (TP-merged) fp32 CPU weights of the current (or a retained) version on
        rank 0; None on the other ranks. Collective."""
        _, weights = self._weights_of(version)
        return self._gather_hf(weights)

    def export_weights(self, directory: str, version: int | None = None,
                       meta: dict[str, Any] | None = None) -> int:
        """Rank 0 writes the HF directory (hf_io format, ``weight_version`` in asyncrl.json)."""
        v, weights = self._weights_of(version)
        hf = self._gather_hf(weights)
        if self.rank == 0:
            assert hf is not None and self.tokenizer is not None
            info = {"source": "asyncrl.megatron_trainer", "trainer_step": self._step,
                    **(meta or {})}
            save_hf_dir(directory, _config_only(self.config()), self.tokenizer,
                        weight_version=v, meta=info, state_dict=hf)
        self._barrier()
        return v

    # --- weight sync by broadcast (engines.sglang.weight_sync: nccl) ---------------------------
    def init_weight_sync(self, urls: Sequence[str], tp_size: int | Sequence[int],
                         group_name: str, master_address: str | None = None,
                         master_port: int | None = None,
                         backend: str = "nccl") -> WeightGroup | None:
        """Rank 0 (re)makes the weight group with the rollout engines as its rank 0, from its
        own device (its cuda device for nccl, cpu for gloo); the other ranks do nothing and
        return None. Not a collective."""
        if self.rank != 0:
            return None
        from training.engines.sglang.nccl_sync import TrainerNcclPusher

        device: str | None = "cpu"
        if backend == "nccl":
            # this rank's own GPU; None lets the pusher refuse clearly when it sees no GPU
            device = None if on_cpu() else str(self.device)
        if self._pusher is None:
            self._pusher = TrainerNcclPusher()
        return self._pusher.init(list(urls), tp_size if isinstance(tp_size, int)
                                 else list(tp_size), group_name, master_address, master_port,
                                 backend=backend, device=device)

    def push_weights(self, version: int) -> PushReport | None:
        """Every rank takes part in the HF gather; rank 0 broadcasts the full weights to the
        engines as ``version`` and returns the :class:`PushReport` (None elsewhere).
        Collective."""
        from training.engines.sglang.nccl_sync import NcclSyncError

        missing = (self.rank == 0 and (self._pusher is None or self._pusher.sync is None))
        # agree first, so no rank waits in the gather for a rank 0 that will not push
        self._agree("no weight group: call init_weight_sync first" if missing else None,
                    NcclSyncError)
        hf = self.hf_state_dict()
        if self.rank != 0:
            return None
        assert hf is not None and self._pusher is not None and self._pusher.sync is not None
        return self._pusher.sync.push(hf, int(version))

    # --- checkpoints --------------------------------------------------------------------------
    def _has_optimizer_state(self) -> bool:
        """False before the first optimizer step (Adam has no moments yet; nothing to save)."""
        return any(len(inner.optimizer.state) for inner in _inner_optimizers(self.optimizer))

    def _sharded_state(self, loading: bool, with_optimizer: bool) -> dict[str, Any]:
        model_sd = self.module.sharded_state_dict()
        if not with_optimizer:
            return {"model": model_sd}
        # DistributedOptimizer: megatron 0.16.1's default format ("fully_sharded_model_space")
        # needs ShardedTensor.flattened_range, which its own dist_checkpointing no longer accepts
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                               metadata=meta)}

    def save_checkpoint(self, directory: str, include_snapshots: bool = True) -> str:
        """Exact-resume checkpoint (module docstring), written under a temporary name and renamed
        into place by rank 0. Collective; every rank must see the same filesystem."""
        from megatron.core import dist_checkpointing

        target = Path(directory)
        name = [f".{target.name}.ckpt-{uuid.uuid4().hex[:8]}"]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(name, src=0, group=self._cpu_group)
        tmp = target.parent / name[0]
        try:
            hf = self._gather_hf(self._local_weights())
            if self.rank == 0:
                assert hf is not None and self.tokenizer is not None
                target.parent.mkdir(parents=True, exist_ok=True)
                save_hf_dir(tmp, _config_only(self.config()), self.tokenizer,
                            weight_version=self._version, state_dict=hf,
                            meta={"source": "asyncrl.megatron_trainer",
                                  "kind": "trainer_checkpoint", "trainer_step": self._step})
                (tmp / MEGATRON_DIR).mkdir()
                (tmp / RANKS_DIR).mkdir()
            self._barrier()
            with_optimizer = self._has_optimizer_state()
            with cpu_device_mode():
                dist_checkpointing.save(self._sharded_state(False, with_optimizer),
                                        str(tmp / MEGATRON_DIR))
            snaps = self._snapshots.items() if include_snapshots else []
            rank_dir = tmp / RANKS_DIR / f"rank{self.rank}"
            rank_dir.mkdir()
            for v, weights in snaps:
                save_file(weights, str(rank_dir / f"v{v}.safetensors"))
            torch.save({"rng": rng_state(), "tracker": _tracker_states(),
                        "coords": list(self._coords())}, rank_dir / "rng.pt")
            if self.rank == 0:
                if len(self._routes):
                    save_file(self._routes.tensors(), str(tmp / ROUTE_CACHE_FILE))
                torch.save({
                    "format": STATE_FORMAT, "kind": STATE_KIND, "step": self._step,
                    "weight_version": self._version,
                    "optim_config": optim_config_state(self.optim),
                    "parallel": self.parallel.sizes(),
                    "layout": self.layout,
                    "distributed_optimizer": self.parallel.distributed_optimizer,
                    "precision": self.parallel.precision,
                    "world_size": self.parallel.world_size,
                    "snapshot_versions": [v for v, _ in snaps],
                    "optimizer_state": with_optimizer,
                }, tmp / TRAINER_STATE_FILE)
            self._barrier()
            if self.rank == 0:
                move_into_place(tmp, target)
            self._barrier()
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(target)

    def load_checkpoint(self, directory: str) -> tuple[int, int]:
        """Restore a :meth:`save_checkpoint` directory exactly. Everything is validated and the
        sharded tensors are loaded into copies first; any problem → :class:`CheckpointError` on
        every rank with the live engine unchanged."""
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException

        err, staged = None, None
        try:
            staged = self._stage_checkpoint(Path(directory))
        except CheckpointError as e:
            err = str(e)
        self._agree(err)
        assert staged is not None
        state, snapshots, routes, rank_state, optim = staged
        with_optimizer = bool(state["optimizer_state"])
        was_empty = [not inner.optimizer.state for inner in _inner_optimizers(self.optimizer)]
        if with_optimizer:
            _init_empty_adam_state(self.optimizer)
        sharded = self._sharded_state(True, with_optimizer)
        _replace_sharded_data_with_copies(sharded)
        err, loaded = None, None
        try:
            with cpu_device_mode():
                loaded = dist_checkpointing.load(sharded, str(Path(directory) / MEGATRON_DIR))
        # many types for bad / partial directories; torch's CheckpointException is a
        # BaseException, not an Exception
        except (Exception, CheckpointException) as e:
            err = (f"{Path(directory) / MEGATRON_DIR} is unreadable ({type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}); the checkpoint is corrupt or "
                   "incomplete — resume from an earlier one")
        if err:  # an optimizer that had no state gets none back
            for inner, empty in zip(_inner_optimizers(self.optimizer), was_empty, strict=True):
                if empty:
                    inner.optimizer.state.clear()
        self._agree(err)
        assert loaded is not None
        # commit
        with cpu_device_mode(), torch.no_grad():
            self.module.load_state_dict(loaded["model"], strict=True)
            if with_optimizer:  # restores the (fp32) main params too
                self.optimizer.load_state_dict(loaded["optimizer"])
                _adam_steps_from_param_groups(self.optimizer)
            else:
                for inner in _inner_optimizers(self.optimizer):
                    inner.optimizer.state.clear()
                # main params ← model; never after a load above: in bf16 it would round the
                # restored fp32 master weights to the model's bf16
                self.optimizer.reload_model_params()
        self.optim = optim
        self._step, self._version = int(state["step"]), int(state["weight_version"])
        self._restore_retained(snapshots, routes)
        set_rng_state(rank_state["rng"])
        _set_tracker_states(rank_state["tracker"])
        return self.state()

    def _stage_checkpoint(self, d: Path) -> tuple[Any, ...]:
        """Read and validate everything this rank needs from ``d`` (no engine change)."""
        d = _check_trainer_dir(d)
        state = _read_trainer_state(d)
        cfg = read_model_config(d)
        if cfg != self.config():
            raise CheckpointError(f"checkpoint {d} holds a different architecture ({cfg}) than "
                                  f"this engine ({self.config()}); build the engine with "
                                  "MegatronTrainEngine.from_checkpoint")
        if state["parallel"] != self.parallel.sizes() or bool(
                state["distributed_optimizer"]) != self.parallel.distributed_optimizer:
            raise CheckpointError(f"checkpoint {d} was written with {state['parallel']} "
                                  f"(distributed_optimizer={state['distributed_optimizer']}), "
                                  f"this engine runs {self.parallel.sizes()} "
                                  f"(distributed_optimizer={self.parallel.distributed_optimizer})"
                                  "; resume with the same engines.megatron sizes")
        written = state.get("layout", "local")  # checkpoints before the TE spec: local
        if written != self.layout:
            raise CheckpointError(f"checkpoint {d} holds megatron weights of the {written!r} layer "
                                  f"spec, this machine builds the {self.layout!r} one (Transformer"
                                  "Engine present or not); warm start from its HF weights "
                                  "instead: the checkpoint directory is also an HF model "
                                  "directory")
        precision = state.get("precision", "fp32")  # checkpoints before bf16: fp32
        if precision != self.parallel.precision:
            raise CheckpointError(f"checkpoint {d} was trained in {precision}, this engine runs "
                                  f"{self.parallel.precision}; resume with engines.megatron."
                                  f"precision: {precision}, or warm start from its HF weights "
                                  "(the checkpoint directory is also an HF model directory)")
        optim = optim_from_state(state, d)
        rank_dir = d / RANKS_DIR / f"rank{self.rank}"
        try:
            rank_state = torch.load(rank_dir / "rng.pt", map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for missing / truncated files
            raise CheckpointError(f"{rank_dir / 'rng.pt'} is missing or unreadable "
                                  f"({type(e).__name__}); the checkpoint is incomplete — resume "
                                  "from an earlier one") from None
        coords = list(rank_state.get("coords", []))
        if len(coords) == 3:  # written before pipeline parallelism: PP rank 0
            coords.append(0)
        if coords != list(self._coords()):
            raise CheckpointError(f"{rank_dir} belongs to another rank layout; resume with the "
                                  "same engines.megatron sizes")
        snapshots = [(int(v), read_weights(rank_dir / f"v{int(v)}.safetensors"))
                     for v in state["snapshot_versions"]]
        routes = read_routes(d / ROUTE_CACHE_FILE)
        if not (d / MEGATRON_DIR / "metadata.json").is_file():
            raise CheckpointError(f"{d / MEGATRON_DIR} holds no dist_checkpointing metadata; the "
                                  "checkpoint is incomplete — resume from an earlier one")
        return state, snapshots, routes, rank_state, optim


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _router_replays(model: Any) -> list[Any]:
    """The RouterReplay of every MoE layer of ``model`` (DDP-wrapped or not), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.router_replay for m in model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]


def _pack_routes(batch: TokenBatch, routes: Sequence[torch.Tensor], width: int,
                 cfg: ModelConfig, rows: int | None = None) -> list[torch.Tensor]:
    """SGLang-layout routes → per layer ``[width·rows, k]`` long indices in megatron's token
    order (sequence-major: token s of row b is s·rows + b); padded as :func:`pad_routes`, and
    padding rows beyond the batch (``rows`` > b) get experts 0..k−1 too."""
    k, b = cfg.num_experts_per_tok, batch.batch_size
    rows = b if rows is None else rows
    out = pad_routes(batch, routes, width, cfg)
    if rows > b:
        out = torch.cat([out, torch.arange(k).expand(rows - b, width, cfg.num_layers, k)])
    return [out[:, :, layer].transpose(0, 1).reshape(width * rows, k).contiguous()
            for layer in range(cfg.num_layers)]


def _arm_routers(routers: list[Any], targets: list[torch.Tensor] | None) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for i, r in enumerate(routers):
        r.clear_indices()
        if targets is None:
            r.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            r.set_target_indices(targets[i])
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _disarm_routers(routers: list[Any]) -> None:
    for r in routers:
        r.clear_router_replay_action()
        r.clear_indices()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The FP32 / Distributed optimizers inside a megatron optimizer (MoE models get a chain:
    one for dense and one for expert parameters)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _init_empty_adam_state(optimizer: Any) -> None:
    """Give every parameter of an optimizer without state zero Adam moments and step 0, the
    structure a checkpoint load fills in (the DistributedOptimizer's state_dict asserts one
    common step, which an empty state does not have)."""
    for inner in _inner_optimizers(optimizer):
        opt = inner.optimizer
        if opt.state:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p] = {"step": torch.tensor(0.0),
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(
                                    p, memory_format=torch.preserve_format)}


def _adam_steps_from_param_groups(optimizer: Any) -> None:
    """The DistributedOptimizer restores Adam's step count into ``param_group['step']`` (what
    apex / TransformerEngine's fused Adam reads); torch's AdamW — megatron's optimizer where
    neither is installed, e.g. on CPUs — reads ``state[p]['step']``. Copy it there, or the
    resumed bias correction restarts from step 0."""
    for inner in _inner_optimizers(optimizer):
        opt = inner.optimizer
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if p in opt.state and "step" in opt.state[p]:
                    opt.state[p]["step"] = torch.tensor(float(group["step"]))


def _clip_by_total_norm(optimizer: Any, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) — megatron's clipping with
    the global norm over all (chained) optimizers, as ChainedOptimizer.step does."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for inner in _inner_optimizers(optimizer):
        params = inner.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm)


def _replace_sharded_data_with_copies(sharded: dict[str, Any]) -> None:
    """Point every ShardedTensor of ``sharded`` at a fresh tensor, so dist_checkpointing.load
    (which fills the given tensors in place) never writes into the live model or optimizer."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def fresh(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and x.data is not None:
            x.data = torch.empty_like(x.data)
        return x

    dict_list_map_inplace(fresh, sharded)


def _config_only(cfg: ModelConfig) -> CausalLM:
    """A weightless model carrying ``cfg`` for :func:`save_hf_dir` (weights come separately)."""
    with torch.device("meta"):
        return CausalLM(cfg)


def _tracker_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def _set_tracker_states(states: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(dict(states))


def _check_trainer_dir(directory: str | Path) -> Path:
    d = check_hf_dir(directory)
    if not (d / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(f"{d} is a model directory but not a megatron trainer checkpoint "
                              f"(no {TRAINER_STATE_FILE}); to warm start from its weights use "
                              "MegatronTrainEngine.from_pretrained")
    return d


_STATE_KEYS = ("format", "kind", "step", "weight_version", "optim_config", "parallel",
               "distributed_optimizer", "snapshot_versions", "optimizer_state")


def _read_trainer_state(d: Path) -> dict[str, Any]:
    path = d / TRAINER_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / garbage files
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}); the checkpoint is "
                              "corrupt or truncated — resume from an earlier one") from None
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS) \
            or state.get("kind") != STATE_KIND:
        raise CheckpointError(f"{path} is not a megatron trainer state (written by another "
                              "engine?); resume it with the engine that wrote it")
    if state["format"] != STATE_FORMAT:
        raise CheckpointError(f"{path} has format {state['format']}, this asyncrl reads "
                              f"{STATE_FORMAT}")
    return state
