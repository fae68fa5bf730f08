"""The process group's rendezvous address is the IP Ray knows the node by, not the host name's address (127.0.1.1
on stock Debian and Ubuntu hosts, which no other node can reach)."""

from __future__ import annotations

import socket

import ray

from workers.base import Worker


def test_a_multi_rank_group_meets_at_rays_node_ip(monkeypatch):
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.20.30.40")
    ip, port = Worker(name="actor_train", rank=0, world_size=2, seed=0, torch_threads=1).address()
    assert ip == "10.20.30.40" and 0 < port < 65536


def test_a_single_rank_or_a_group_outside_ray_stays_on_loopback(monkeypatch):
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.20.30.40")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert Worker(name="critic", rank=0, world_size=1, seed=0, torch_threads=1).address()[0] == "127.0.0.1"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert Worker(name="critic", rank=0, world_size=2, seed=0, torch_threads=1).address()[0] == "127.0.0.1"
