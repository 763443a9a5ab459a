"""``elastic_ddp.driver.local_ray``: the listener check sees what ``ss -ltn`` sees, a plain
``ray.init(address="local")`` fails it, and ``init_local_ray`` passes it with its
workers running. Other users' Ray instances on the machine are never looked at: only
this process and its descendants.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from elastic_ddp.driver.local_ray import (is_loopback, listeners, listeners_outside_loopback,
                                   ray_session_pids)


def test_listener_check_finds_sockets_by_address():
    """Sockets of this process on 127.0.0.1, 127.0.0.2, ::1 count as loopback, on
    0.0.0.0 and :: not; a socket that is not listening is no listener."""
    socks = []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.2"),
                             (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1"),
                             (socket.AF_INET6, "::")):
            s = socket.socket(family)
            s.bind((host, 0))
            s.listen()
            socks.append((host, s.getsockname()[1], s))
        idle = socket.socket()
        idle.bind(("0.0.0.0", 0))  # bound, not listening
        socks.append(("idle", idle.getsockname()[1], idle))
        mine = {(addr, port) for pid, _, addr, port in listeners([os.getpid()])}
        for host, port, _ in socks[:-1]:
            assert (host, port) in mine, (host, port, mine)
        assert not any(port == socks[-1][1] for _, port in mine)
        # Only the sockets opened here: earlier tests in this process may have left
        # listeners of their own (a gloo store, say).
        by_port = {port: host for host, port, _ in socks}
        outside = [int(o.rsplit(":", 1)[1]) for o in listeners_outside_loopback([os.getpid()])]
        assert sorted(by_port[p] for p in outside if p in by_port) == ["0.0.0.0", "::"]
    finally:
        for *_, s in socks:
            s.close()


@pytest.mark.parametrize("addr,loop", [("127.0.0.1", True), ("127.9.8.7", True), ("::1", True),
                                       ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False),
                                       ("192.0.2.2", False), ("::ffff:192.0.2.2", False)])
def test_is_loopback(addr, loop):
    assert is_loopback(addr) is loop


def test_listener_check_agrees_with_ss():
    """The /proc reading and ``ss -ltn`` list the same listening sockets of this process."""
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
        if out.returncode == 0:  # iproute2 present: cross-check
            assert f"0.0.0.0:{port}" in out.stdout
        assert f"pid {os.getpid()} " in " ".join(listeners_outside_loopback([os.getpid()]))
    finally:
        s.close()


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_init_local_ray_listens_on_loopback_only():
    """Plain ``ray.init(address="local")`` (what the launcher and the fixtures do today)
    listens outside loopback; ``init_local_ray`` does not, with workers running, and the
    process's environment is left as it was."""
    import ray

    from elastic_ddp.driver.local_ray import init_local_ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=True,
             logging_level="WARNING")
    try:
        before = listeners_outside_loopback()
    finally:
        ray.shutdown()
    assert before, "plain ray.init listened on loopback only: the check would prove nothing"

    env_before = dict(os.environ)
    init_local_ray(num_cpus=2, configure_logging=True, logging_level="WARNING")
    try:
        assert dict(os.environ) == env_before

        @ray.remote
        def where() -> str:
            return ray.util.get_node_ip_address()

        assert set(ray.get([where.remote() for _ in range(2)])) == {"127.0.0.1"}
        names = {name for _, name, _, _ in listeners(ray_session_pids())}
        assert {"gcs_server", "raylet"} <= names  # the check saw Ray's own processes
        assert listeners_outside_loopback() == []
    finally:
        ray.shutdown()
