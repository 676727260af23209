"""Helpers of the cluster tests (imported by them and by conftest.py)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "platform" / "local-cluster.sh"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of ``pid``'s child processes (/proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        if ppid == pid:
            out.append((int(stat.parent.name), name))
    return out


class Cluster:
    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.dir = directory
        self.env = env
        self.pids = [int(p) for p in (directory / "pids").read_text().split()]

    def python(self, code: str) -> object:
        """Run ``code`` connected to the cluster in a fresh process; its last stdout line is
        JSON."""
        prelude = ("import json, os, ray\nray.init(address=os.environ['RAY_ADDRESS'], "
                   "logging_level='ERROR', log_to_driver=False)\n")
        res = subprocess.run([sys.executable, "-c", prelude + code], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    def nodes(self) -> dict[str, dict[str, float]]:
        """node id → resources, live nodes only."""
        return self.python("print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() "
                           "if n['Alive']}))")

    def actors(self) -> list[dict]:
        """Every actor the cluster has had (live or dead), from Ray's state API (the head's
        dashboard): id, class, node, state."""
        return self.python(
            "from ray.util.state import list_actors\n"
            "acts = list_actors(address=os.environ['RAY_DASHBOARD'], detail=True, limit=10000,"
            " raise_on_missing_output=False)\n"
            "print(json.dumps([{'id': a.actor_id, 'cls': a.class_name, 'node': a.node_id, "
            "'state': a.state} for a in acts]))")

    def train(self, home: Path, recipe: dict, run_dir: Path, *, wait: bool = True,
              extra: tuple[str, ...] = ()) -> subprocess.Popen | subprocess.CompletedProcess:
        path = home / f"{recipe['name']}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        cmd = [sys.executable, "-m", "ui.cli", "train", str(path), "--out", str(run_dir),
               "--ray-address", self.env["RAY_ADDRESS"], "--checkpoint-every", "1", *extra]
        env = {**self.env, "ASYNCRL_HOME": str(home)}
        if wait:
            return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=600)
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def raylet_of(self, node: int) -> int:
        """The raylet PID of node ``node`` (0 = head), a child of its `ray start --block`."""
        (pid,) = [p for p, name in children(self.pids[node]) if name == "raylet"]
        return pid


def process_tree(pid: int) -> set[int]:
    out = {pid}
    for child, _ in children(pid):
        out |= process_tree(child)
    return out


def listening_addresses() -> dict[str, str]:
    """socket inode → 'address:port' of every listening TCP socket (/proc/net/tcp, tcp6)."""
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            hexaddr, port = f[1].split(":")
            # each 32-bit word in host (little-endian) order
            raw = b"".join(bytes.fromhex(hexaddr[i:i + 8])[::-1] for i in range(0, width, 8))
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
            out[f[9]] = f"{ip}:{int(port, 16)}"
    return out
