"""Several "hosts" on one machine, for tests of what crosses a network.

Two ways, chosen at run time:

* ``netns`` (preferred, needs root and ``ip``): each host is a network namespace with its own
  interfaces, joined to the test process by a veth pair on a private bridge and subnet made
  for the test (10.213.N.0/24, N picked at random, nothing else on it). A host's processes
  see only its own address and 127.0.0.1 of their own namespace; cutting a host takes its
  link down, exactly what a pulled cable looks like (no FIN, no RST, packets just vanish).
* ``loopback`` (fallback): distinct loopback addresses (127.0.0.2, 127.0.0.3, ...) with
  ``--bind-host``/``--advertise-host``; cutting a host stops its processes (SIGSTOP), which
  is how a hung machine looks from outside.

``TURNOUT_TEST_HOSTS=loopback`` forces the fallback. Every process is started through
``Hosts.spawn`` and killed by ``Hosts.close``, which also removes the namespaces.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Host:
    name: str
    address: str
    #: ``ip netns`` name (netns mode), or None (loopback mode).
    netns: str | None = None
    #: The root-side end of the host's veth pair (netns mode).
    link: str | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []


class Hosts:
    """Named hosts (``fe``, ``w1``, ...) with an address each; see the module docstring."""

    def __init__(self, names: Sequence[str], tmp: Path) -> None:
        self.tmp = tmp
        self.hosts: dict[str, Host] = {}
        self._bridge: str | None = None
        forced = os.environ.get("TURNOUT_TEST_HOSTS")
        self.mode = "loopback"
        if forced != "loopback" and _can_make_netns():
            try:
                self._make_netns(names)
                self.mode = "netns"
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
                self._remove_netns()
        if self.mode == "loopback":
            for i, name in enumerate(names):
                self.hosts[name] = Host(name, f"127.0.0.{i + 2}")

    def _make_netns(self, names: Sequence[str]) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        subnet = f"10.213.{random.randrange(16, 250)}"
        self._bridge = f"tb{tag}"
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, name in enumerate(names):
            netns, outer, inner = f"turnout-{tag}-{name}", f"tv{tag}{i}", f"tp{tag}{i}"
            host = Host(name, f"{subnet}.{i + 11}", netns=netns, link=outer)
            self.hosts[name] = host
            _ip("netns", "add", netns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", netns)
            _ip("link", "set", outer, "master", self._bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", inner)
            _ip("-n", netns, "link", "set", inner, "up")
            _ip("-n", netns, "link", "set", "lo", "up")

    def _remove_netns(self) -> None:
        for host in self.hosts.values():
            if host.netns:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("netns", "del", host.netns)
            if host.link:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("link", "del", host.link)
        if self._bridge:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("link", "del", self._bridge)
        self.hosts.clear()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def spawn(self, name: str, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        """Run ``argv`` on host ``name``; output goes to ``<tmp>/<log_name>.log``."""
        host = self.hosts[name]
        with open(self.tmp / f"{log_name}.log", "ab") as log:
            proc = subprocess.Popen(
                [*host.prefix(), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        host.procs.append(proc)
        return proc

    def cut(self, name: str) -> None:
        """Take host ``name`` off the network (netns) or freeze it (loopback)."""
        host = self.hosts[name]
        if host.link:
            _ip("link", "set", host.link, "down")
        else:
            self._signal(host, signal.SIGSTOP)

    def restore(self, name: str) -> None:
        host = self.hosts[name]
        if host.link:
            _ip("link", "set", host.link, "up")
        else:
            self._signal(host, signal.SIGCONT)

    @staticmethod
    def _signal(host: Host, sig: signal.Signals) -> None:
        for proc in host.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def stop_processes(self, name: str | None = None) -> None:
        """Kill the processes of one host (or of all)."""
        for host in [self.hosts[name]] if name else list(self.hosts.values()):
            for proc in host.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGCONT)
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            host.procs.clear()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )

    def close(self) -> None:
        self.stop_processes()
        self._remove_netns()


def _can_make_netns() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"turnout-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.SubprocessError, OSError):
        return False
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _ip("netns", "del", probe)
    return True
