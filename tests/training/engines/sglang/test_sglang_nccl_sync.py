"""NCCL weight sync, run on CPU with gloo: the trainer's broadcaster against two stand-in engines
(real HTTP servers in their own processes that record every request and play SGLang 0.5.23's
side: join the group at their rank offset the way SGLang's ``init_custom_process_group`` does —
TCP rendezvous, a store prefixed by the group name, torch's process-group helper — and, only
inside a ``/begin_weight_update`` … ``/end_weight_update`` session, receive each bucket's tensors
by broadcast in list order).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

from training.engines.ports import free_port
from training.engines.sglang.nccl_sync import (
    NcclSyncError,
    NcclWeightSync,
    bucket_by_bytes,
    init_group_payload,
    rank_offsets,
    update_payload,
)

FAKE_ENGINE = textwrap.dedent('''
    import datetime, json, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    requests, received, state = [], {}, {"session": False}

    def join(address, port, rank, world_size, group_name, backend):
        # the engine's side as SGLang builds it (not asyncrl's helper, which is under test)
        timeout = datetime.timedelta(seconds=60)
        store, rank, world_size = next(dist.rendezvous(
            f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store,
                                               group_name=group_name, timeout=timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._answer({})
            self._answer({"requests": requests, "received": received,
                          "version": state.get("version")})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            requests.append({"path": self.path, "body": body})
            if self.path == "/init_weights_update_group":
                state["group"] = join(
                    body["master_address"], body["master_port"], body["rank_offset"],
                    body["world_size"], body["group_name"], body["backend"])
                return self._answer({"success": True, "message": "joined"})
            if self.path in ("/begin_weight_update", "/end_weight_update"):
                opening = self.path == "/begin_weight_update"
                ok = state["session"] != opening
                state["session"] = opening if ok else state["session"]
                return self._answer({"success": ok, "message": "session"})
            if self.path == "/update_weights_from_distributed":
                if not state["session"]:  # SGLang refuses, and never joins the broadcast
                    return self._answer({"success": False, "message": "no session"})
                tensors = [torch.empty(s, dtype=getattr(torch, d))
                           for d, s in zip(body["dtypes"], body["shapes"])]
                for t in tensors:  # in list order, like SGLang's model runner
                    dist.broadcast(t, src=0, group=state["group"])
                for name, t in zip(body["names"], tensors):
                    received[name] = {"dtype": str(t.dtype), "values": t.float().flatten().tolist()}
                if body.get("weight_version") is not None:
                    state["version"] = body["weight_version"]
                return self._answer({"success": True, "message": "loaded"})
            self.send_response(404)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("ready", flush=True)
    server.serve_forever()
''')


@pytest.fixture
def engines(tmp_path):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, str(script), str(p)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "fake engine did not start"
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_payloads_rank_offsets_and_buckets():
    assert init_group_payload("10.0.0.1", 29500, 1, 5, "g", "nccl") == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
        "world_size": 5, "group_name": "g", "backend": "nccl"}
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        init_group_payload("h", 1, 0, 3)
    assert update_payload(["a", "b"], ["bfloat16"] * 2, [(2, 3), (4,)], "g", 7, True) == {
        "names": ["a", "b"], "dtypes": ["bfloat16", "bfloat16"], "shapes": [[2, 3], [4]],
        "group_name": "g", "flush_cache": True, "weight_version": "7"}
    assert "weight_version" not in update_payload(["a"], ["bfloat16"], [(1,)], "g", None, False)
    assert rank_offsets([2, 2, 1]) == ([1, 3, 5], 6)  # engine e's TP ranks follow the trainer
    assert bucket_by_bytes([("a", 40), ("b", 40), ("c", 200), ("d", 10)], 100) == [
        ["a", "b"], ["c"], ["d"]]


def test_broadcast_reaches_every_engine_in_buckets(engines):
    gen = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(6, 4, generator=gen),
             "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=gen),
             "model.norm.weight": torch.randn(4, generator=gen)}
    sync = NcclWeightSync(engines, 1, master_address="127.0.0.1", master_port=free_port(),
                          group_name="test-weights", backend="gloo", timeout_s=30,
                          bucket_bytes=112)  # bf16: 48 + 64 bytes, then 8 → 2 buckets
    try:
        sync.init_group()
        report = sync.push(state, version=7)
        assert (report.tensors, report.buckets, report.version) == (3, 2, 7)
        assert report.bytes == (24 + 32 + 4) * 2
    finally:
        sync.close()

    for offset, url in zip((1, 2), engines, strict=True):
        seen = httpx.get(url + "/recorded").json()
        paths = [r["path"] for r in seen["requests"]]
        assert paths == ["/init_weights_update_group", "/begin_weight_update",
                         "/update_weights_from_distributed", "/update_weights_from_distributed",
                         "/end_weight_update"]
        init = seen["requests"][0]["body"]
        assert init["rank_offset"] == offset and init["world_size"] == 3
        assert init["group_name"] == "test-weights" and init["backend"] == "gloo"
        first, last = (r["body"] for r in seen["requests"][2:4])
        assert first["names"] == ["model.embed_tokens.weight",
                                  "model.layers.0.mlp.down_proj.weight"]
        assert first["shapes"] == [[6, 4], [4, 8]] and first["dtypes"] == ["bfloat16"] * 2
        assert "weight_version" not in first and first["flush_cache"] is False
        assert last["names"] == ["model.norm.weight"] and last["weight_version"] == "7"
        assert last["flush_cache"] is True
        assert seen["version"] == "7"
        for name, tensor in state.items():
            got = seen["received"][name]
            assert got["dtype"] == "torch.bfloat16"
            assert got["values"] == tensor.to(torch.bfloat16).float().flatten().tolist()
    json.dumps(report.__dict__)  # plain numbers, loggable as metrics


def test_a_refused_session_closes_the_others_and_the_next_push_works(engines):
    """Engine B still has a session open (as after a crash mid-push): the push fails at once,
    naming B, and closes the session A opened, so a later push is not refused by A."""
    state = {"model.norm.weight": torch.arange(4, dtype=torch.float32)}
    a, b = engines
    sync = NcclWeightSync(engines, 1, master_address="127.0.0.1", master_port=free_port(),
                          group_name="test-refused", backend="gloo", timeout_s=30)
    try:
        sync.init_group()
        assert httpx.post(b + "/begin_weight_update", json={}).json()["success"]
        with pytest.raises(NcclSyncError, match=r"^begin_weight_update failed on 1/2 engines: "
                                                 + re.escape(b)):
            sync.push(state, version=3)
        paths = [r["path"] for r in httpx.get(a + "/recorded").json()["requests"]]
        assert paths[-2:] == ["/begin_weight_update", "/end_weight_update"]
        assert httpx.post(b + "/end_weight_update", json={}).json()["success"]
        assert sync.push(state, version=4).version == 4
    finally:
        sync.close()
    for url in engines:
        seen = httpx.get(url + "/recorded").json()
        assert seen["version"] == "4"
        assert seen["received"]["model.norm.weight"]["values"] == [0.0, 1.0, 2.0, 3.0]
