"""Weight sync by broadcast (``engines.sglang.weight_sync: nccl``): trainer rank 0 → every engine.

SGLang's protocol (0.5.x, ``/init_weights_update_group`` + ``/update_weights_from_distributed``):

1. Once: the trainer asks every engine to join a new process group — ``{master_address,
   master_port, rank_offset, world_size, group_name, backend}`` — while it joins as rank 0 itself.
   Engine e's tensor-parallel rank t becomes rank ``rank_offset_e + t``; ``world_size`` = 1 + the
   GPUs of all engines. Each HTTP call returns only once the group is formed, so the calls are
   sent concurrently with the trainer's own join.
2. Per sync: ``/begin_weight_update`` opens a weight-update session on every engine (SGLang
   0.5.23 refuses ``/update_weights_from_distributed`` outside one, and the sender's broadcast
   would then wait for nobody); per bucket of tensors the trainer posts ``{names, dtypes, shapes,
   group_name, weight_version, flush_cache}`` to every engine; each engine allocates those
   tensors and receives them by ``broadcast(src=0)`` **in list order**, then loads them by their
   HF names; the trainer broadcasts the same tensors in the same order, then reads the answers
   (``{success, message}``). ``weight_version`` and ``flush_cache`` go with the last bucket, so the
   engine reports the new version only once every tensor is in. ``/end_weight_update`` closes
   the session, also after a failure (an engine left with an open session refuses the next).

The trainer side takes full, HF-named tensors (the Megatron engine's ``hf_state_dict()``: TP/PP
shards gathered on rank 0), casts them to the engine dtype (bf16: half the bytes of fp32), and
broadcasts over a group separate from the trainer's own default group (NCCL on GPUs; gloo works
the same way on CPU, which is how this module is tested).

The group is created with ``torch.distributed``'s rendezvous and process-group helper over a
store prefixed by the group name, the same calls an SGLang engine makes on its side
(``init_custom_process_group``), so both ends agree on the store keys and the NCCL id exchange;
that helper is private to torch (``_new_process_group_helper``), which is why the trainer and
the engines must run the same torch (the ``gpu`` extra pins it through SGLang).

:class:`TrainerNcclPusher` is what the trainer actor holds: (re)make the group with the engines,
push the train engine's current weights (:func:`hf_weights_of`). The embedded rollout server
implements the engines' side with gloo, so the whole path runs on CPU (the runtime's
``weight_sync_backend = "gloo"``). On GPUs the process that pushes needs a GPU of its own that no
engine rank uses (NCCL refuses two ranks of one group on one device).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from training.engines.rollout import weight_version_label

__all__ = [
    "NcclSyncError", "NcclWeightSync", "PushReport", "TrainerNcclPusher", "WeightGroup",
    "bucket_by_bytes", "hf_weights_of", "init_group_payload", "new_weight_group",
    "update_payload",
]

DEFAULT_GROUP = "asyncrl_weight_sync"


class NcclSyncError(RuntimeError):
    """An engine refused or failed a group init or a weight update; the message names it."""


# --- HTTP bodies (pure) ---------------------------------------------------------------------------


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict[str, Any]:
    """The ``/init_weights_update_group`` body for one engine."""
    if not 1 <= rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}) "
                         "(rank 0 is the trainer)")
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}


def update_payload(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                   group_name: str = DEFAULT_GROUP, weight_version: int | None = None,
                   flush_cache: bool = True) -> dict[str, Any]:
    """The ``/update_weights_from_distributed`` body for one bucket (``weight_version`` None:
    not the last bucket, the engine keeps reporting its old version)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                            "shapes": [[int(d) for d in s] for s in shapes],
                            "group_name": group_name, "flush_cache": bool(flush_cache)}
    if weight_version is not None:
        body["weight_version"] = weight_version_label(int(weight_version))
    return body


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """(rank offset of each engine, world size): the trainer is rank 0, engine e's GPUs follow."""
    offsets, nxt = [], 1
    for tp in tp_sizes:
        if tp < 1:
            raise ValueError(f"tp size {tp} must be >= 1")
        offsets.append(nxt)
        nxt += tp
    return offsets, nxt


def bucket_by_bytes(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so that each group's bytes stay under ``bucket_bytes`` (a tensor
    larger than that is a bucket of its own); order is kept."""
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


# --- process group -------------------------------------------------------------------------


def new_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                     group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                     timeout_s: float = 600.0) -> Any:
    """Join a process group of its own (not the default group, which Megatron uses) by TCP
    rendezvous at master_address:master_port — the engines' side of the protocol does the same."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(
        f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # SGLang's engines key their half of the exchange under the group name: without the same
    # prefix both sides would wait on different keys until the timeout
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store,
                                           group_name=group_name, timeout=timeout)
    # broadcast(src=...) translates global ranks through this map; the group's ranks are global
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


# --- trainer side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightGroup:
    """The broadcast group a trainer made with the engines: its name, the rendezvous address and
    port (rank 0, the trainer), the ranks in it (1 + the engines' GPUs), the backend and how
    many engines joined."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    backend: str
    engines: int


@dataclass(frozen=True)
class PushReport:
    """What one sync did: tensors and bytes sent, buckets, seconds (total and broadcasting)."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    broadcast_seconds: float


class NcclWeightSync:
    """Trainer rank 0's end of the broadcast (module docstring).

    Args:
        engine_urls: the engines' base URLs.
        tp_sizes: GPUs of each engine (one int for all).
        master_address: an address of the trainer's node the engines can reach.
        master_port: a free port there for the rendezvous.
        group_name / backend: the group (``nccl`` on GPUs; ``gloo`` for CPU tests).
        device: where tensors are broadcast from (``cuda`` for nccl; cpu for gloo).
        dtype: the engine dtype tensors are cast to (default bfloat16, SGLang's ``--dtype``).
        bucket_bytes: tensors per HTTP call are grouped up to this size.
        timeout_s: rendezvous and HTTP timeout.
        http: an ``httpx.Client`` to use (tests); one is made otherwise.
    """

    def __init__(self, engine_urls: Sequence[str], tp_sizes: Sequence[int] | int, *,
                 master_address: str, master_port: int, group_name: str = DEFAULT_GROUP,
                 backend: str = "nccl", device: str | None = None, dtype: Any = None,
                 bucket_bytes: int = 512 * 2**20, timeout_s: float = 600.0,
                 http: httpx.Client | None = None) -> None:
        import torch

        self.urls = [u.rstrip("/") for u in engine_urls]
        if not self.urls:
            raise ValueError("NcclWeightSync needs at least one engine URL")
        tps = [tp_sizes] * len(self.urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(tps) != len(self.urls):
            raise ValueError("one tp size per engine URL")
        self.offsets, self.world_size = rank_offsets(tps)
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name, self.backend = group_name, backend
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.dtype = dtype if dtype is not None else torch.bfloat16
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s
        self._http = http or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.urls)),
                                        thread_name_prefix="nccl-sync-http")
        self.group: Any = None

    def init_group(self) -> None:
        """Ask every engine to join (concurrently) and join as rank 0; raises
        :class:`NcclSyncError` naming the engines that failed."""
        calls = {url: self._post(url, "/init_weights_update_group", init_group_payload(
                     self.master_address, self.master_port, off, self.world_size,
                     self.group_name, self.backend))
                 for url, off in zip(self.urls, self.offsets, strict=True)}
        try:
            self.group = new_weight_group(self.master_address, self.master_port, 0,
                                          self.world_size, self.group_name, self.backend,
                                          self.timeout_s)
        finally:
            self._check("init_weights_update_group", calls)

    def push(self, state_dict: Mapping[str, Any], version: int,
             on_bucket: Callable[[list[str]], None] | None = None) -> PushReport:
        """Broadcast ``state_dict`` (HF name → full tensor) to every engine as ``version``,
        inside one weight-update session per engine (module docstring)."""
        import torch

        if self.group is None:
            raise NcclSyncError("init_group() first: the engines have not joined the group")
        t0 = time.monotonic()
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        names = list(state_dict)
        buckets = bucket_by_bytes(((n, state_dict[n].numel() * itemsize) for n in names),
                                  self.bucket_bytes)
        sent_bytes, bcast_s = 0, 0.0
        self._open_sessions()
        try:
            for i, bucket in enumerate(buckets):
                sent, seconds = self._push_bucket(state_dict, bucket, version,
                                                  last=i == len(buckets) - 1)
                sent_bytes, bcast_s = sent_bytes + sent, bcast_s + seconds
                if on_bucket is not None:
                    on_bucket(bucket)
        except BaseException:
            # close the sessions still open, but report the failure that stopped the push
            with contextlib.suppress(NcclSyncError):
                self._all("end_weight_update")
            raise
        self._all("end_weight_update")
        return PushReport(version=int(version), tensors=len(names), bytes=sent_bytes,
                          buckets=len(buckets), seconds=time.monotonic() - t0,
                          broadcast_seconds=bcast_s)

    def _push_bucket(self, state_dict: Mapping[str, Any], bucket: list[str], version: int,
                     last: bool) -> tuple[int, float]:
        """Post one bucket's update to every engine and broadcast its tensors → (bytes sent,
        seconds broadcasting). The version and the cache flush go with the last bucket."""
        import torch
        import torch.distributed as dist

        tensors = [state_dict[n].detach().to(self.device, self.dtype).contiguous()
                   for n in bucket]
        body = update_payload(bucket, [str(self.dtype).removeprefix("torch.")] * len(bucket),
                              [list(t.shape) for t in tensors], self.group_name,
                              weight_version=version if last else None, flush_cache=last)
        calls = {url: self._post(url, "/update_weights_from_distributed", body)
                 for url in self.urls}
        tb = time.monotonic()
        try:
            for t in tensors:  # the engines receive in list order
                dist.broadcast(t, src=0, group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            seconds = time.monotonic() - tb
            self._check("update_weights_from_distributed", calls)
        return sum(t.numel() * t.element_size() for t in tensors), seconds

    def _all(self, endpoint: str) -> None:
        """POST ``/endpoint`` {} to every engine at once; raise naming those that refused."""
        self._check(endpoint, {url: self._post(url, f"/{endpoint}", {}) for url in self.urls})

    def _open_sessions(self) -> None:
        """``/begin_weight_update`` on every engine; when one refuses (dead, or a session left
        open), the sessions the others opened are closed again before raising, so the next push
        (e.g. after the group is re-made without a dead engine) is not refused."""
        calls = {url: self._post(url, "/begin_weight_update", {}) for url in self.urls}
        try:
            self._check("begin_weight_update", calls)
        except NcclSyncError:
            opened = [url for url, fut in calls.items() if self._refusal(fut) is None]
            with contextlib.suppress(NcclSyncError):
                self._check("end_weight_update", {
                    url: self._post(url, "/end_weight_update", {}) for url in opened})
            raise

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False)
        self._http.close()

    # --- HTTP --------------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict[str, Any]) -> Future:
        return self._pool.submit(self._http.post, url + path, json=body)

    def _check(self, what: str, calls: Mapping[str, Future]) -> None:
        bad = [f"{url}: {why}" for url, fut in calls.items()
               if (why := self._refusal(fut)) is not None]
        if bad:
            raise NcclSyncError(f"{what} failed on {len(bad)}/{len(calls)} engines: "
                                + "; ".join(bad))

    def _refusal(self, fut: Future) -> str | None:
        """Why an engine's answer is not ``{success: true}``; None when it is."""
        try:
            resp = fut.result(timeout=self.timeout_s)
            data = resp.json() if resp.content else {}
            if resp.is_success and bool(data.get("success", False)):
                return None
            return f"HTTP {resp.status_code} {data.get('message', '')}"
        except Exception as e:  # transport error, timeout, unreadable answer
            return f"{type(e).__name__}: {e}"


# --- the trainer actor's side ---------------------------------------------------------------------


def hf_weights_of(engine: Any) -> dict[str, Any]:
    """The current weights of a train engine as full, HF-named tensors: the Megatron engine's
    ``hf_state_dict()`` (TP/PP shards gathered), or the embedded engine's model as its HF export
    writes it (fp32, no ``lm_head.weight`` when tied)."""
    if hasattr(engine, "hf_state_dict"):
        return dict(engine.hf_state_dict())
    model = getattr(engine, "model", None)
    if model is None:
        raise TypeError(f"{type(engine).__name__} exposes no weights to broadcast (neither "
                        "hf_state_dict() nor .model)")
    from training.engines.hf_io import state_dict_for_export

    return state_dict_for_export(model)


class TrainerNcclPusher:
    """What the trainer actor holds for ``engines.sglang.weight_sync: nccl``: one
    :class:`NcclWeightSync` at a time, (re)made by :meth:`init` — again after an engine
    restarted, under a new group name, since the old group lost a member — and used by
    :meth:`push` to broadcast the train engine's current weights.

    Args:
        bucket_bytes / timeout_s / dtype: as :class:`NcclWeightSync`'s.
    """

    def __init__(self, *, bucket_bytes: int = 512 * 2**20, timeout_s: float = 600.0,
                 dtype: Any = None) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.dtype = dtype
        self.sync: NcclWeightSync | None = None

    def init(self, urls: Sequence[str], tp_size: int | Sequence[int], group_name: str,
             master_address: str | None = None, master_port: int | None = None,
             backend: str = "nccl", device: str | None = None) -> WeightGroup:
        """Close the previous group, then have every engine in ``urls`` join a new one named
        ``group_name`` with this process as rank 0, hosting the rendezvous at
        ``master_address:master_port`` (default: this node's address, a free port). ``device``:
        where tensors are broadcast from (default ``cuda`` for nccl, ``cpu`` for gloo).
        Returns the group's description."""
        import torch

        from training.engines.ports import free_port

        self.close()
        if backend == "nccl" and (device or "cuda").startswith("cuda") \
                and not torch.cuda.is_available():
            raise NcclSyncError("weight_sync nccl: the trainer process sees no GPU to broadcast "
                                "from (CUDA_VISIBLE_DEVICES="
                                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        address = master_address or _node_address()
        port = int(master_port) if master_port else free_port(address)
        sync = NcclWeightSync(list(urls), tp_size if isinstance(tp_size, int) else list(tp_size),
                              master_address=address, master_port=port, group_name=group_name,
                              backend=backend, device=device, dtype=self.dtype,
                              bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s)
        try:
            sync.init_group()
        except BaseException:
            sync.close()
            raise
        self.sync = sync
        return WeightGroup(group_name, address, port, sync.world_size, backend, len(sync.urls))

    def push(self, engine: Any, version: int) -> PushReport:
        """Broadcast ``engine``'s current weights (:func:`hf_weights_of`) as ``version``."""
        if self.sync is None:
            raise NcclSyncError("no weight group: call init() first")
        return self.sync.push(hf_weights_of(engine), int(version))

    def close(self) -> None:
        if self.sync is not None:
            sync, self.sync = self.sync, None
            sync.close()


def _node_address() -> str:
    """This node's cluster address (Ray's view), 127.0.0.1 outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # Ray missing or not this process's business
        pass
    return "127.0.0.1"
