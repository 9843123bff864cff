"""An Envoy bootstrap for N cbd replicas: session calls by affinity, the rest to the least loaded replica.

Routes (gRPC over HTTP/2, on one listener):
- a call with the `x-cbd-affinity` header (every call about a session, see proto/cbd/v1/cbd.proto,
  "Affinity") goes to cluster `cbd_sessions`: RING_HASH on that header, so all calls of a session, and its
  forks, reach the replica that holds its KV. Envoy's ring gives each replica a share of a fixed-size
  ring, so when one leaves the others get more points and some keys move between them too: therefore
  Envoy also names the replica it chose in the response header `x-cbd-replica` (its stateful-session
  filter), clients send it back with the key's later calls, and those go to that replica while it is
  healthy whatever the ring does; if it is gone, the ring decides again and the header names the new one;
- any other call goes to cluster `cbd_any`: LEAST_REQUEST (where there is room).
Both clusters hold the same replicas, health-checked with grpc.health.v1 (a draining or loading replica
answers NOT_SERVING and is taken out), with outlier detection on consecutive errors; a call whose
connection to a replica fails (it died and is not taken out yet) is retried on another one. Routes and streams
have no timeout (a long stream is normal); the client's deadline governs.

    python deploy/envoy.py --listen 127.0.0.1:50051 unix:/run/cbd-0/cbd.sock unix:/run/cbd-1/cbd.sock > envoy.yaml
    envoy -c envoy.yaml
"""

from __future__ import annotations

import argparse
import json
from typing import Any

AFFINITY_HEADER = "x-cbd-affinity"
REPLICA_HEADER = "x-cbd-replica"


def _address(address: str) -> dict[str, Any]:
    if address.startswith("unix:"):
        return {"pipe": {"path": address.removeprefix("unix:").removeprefix("//")}}
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


_POLICIES: dict[str, dict[str, Any]] = {
    "RING_HASH": {
        "name": "envoy.load_balancing_policies.ring_hash",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash",
                         "minimum_ring_size": 1024},
    },
    "LEAST_REQUEST": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
        },
    },
}  # fmt: skip


def _cluster(name: str, policy: str, replicas: list[str], health_interval: float) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": _POLICIES[policy]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 100000}},
            }
        },
        "health_checks": [
            {
                # A replica whose CPU is saturated may answer late: one slow answer does not take it
                # out (a dead one fails at once, twice in a row within two intervals).
                "timeout": "5s",
                "interval": f"{health_interval}s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "no_traffic_interval": f"{health_interval}s",
                "grpc_health_check": {},
            }
        ],  # fmt: skip
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 100,
        },  # fmt: skip
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(a)}} for a in replicas]}],
        },
    }
    return cluster


# A call that never ran on a replica is sent to another: the connection to it failed (the replica is gone
# and its health checks have not noticed yet), or it refused the call at its door with UNAVAILABLE (it is
# loading or draining: a trailers-only answer, before any response, which is all Envoy retries). Nothing
# else is retried (a call that reached a replica and was answered may have run).
_RETRY = {
    "retry_on": "connect-failure,unavailable",
    "num_retries": 2,
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }
    ],
    "host_selection_retry_max_attempts": 5,
}  # fmt: skip


def bootstrap(listen: str, replicas: list[str], admin_port: int = 0, health_interval: float = 1.0) -> dict[str, Any]:
    route = {"timeout": "0s", "idle_timeout": "0s", "retry_policy": _RETRY}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "cbd",
        "codec_type": "AUTO",
        "stream_idle_timeout": "0s",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "cbd",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/", "headers": [{"name": AFFINITY_HEADER, "present_match": True}]},
                            "route": {
                                **route,
                                "cluster": "cbd_sessions",
                                "hash_policy": [{"header": {"header_name": AFFINITY_HEADER}}],
                            },
                        },
                        {"match": {"prefix": "/"}, "route": {**route, "cluster": "cbd_any"}},
                    ],
                }
            ]
        },  # fmt: skip
        "http_filters": [
            {
                "name": "envoy.filters.http.stateful_session",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
                    "session_state": {
                        "name": "envoy.http.stateful_session.header",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
                            "name": REPLICA_HEADER,
                        },
                    },
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],  # fmt: skip
    }
    listener = {
        "name": "cbd",
        "address": _address(listen),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],  # fmt: skip
    }
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [listener],
            "clusters": [
                _cluster("cbd_sessions", "RING_HASH", replicas, health_interval),
                _cluster("cbd_any", "LEAST_REQUEST", replicas, health_interval),
            ],  # fmt: skip
        }
    }
    if admin_port:
        config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT or unix:/path Envoy listens on")
    parser.add_argument("--admin-port", type=int, default=0, help="Envoy's admin interface on 127.0.0.1 (0: none)")
    parser.add_argument("replicas", nargs="+", help="each replica's gRPC address (unix:/path or HOST:PORT)")
    args = parser.parse_args()
    print(json.dumps(bootstrap(args.listen, args.replicas, args.admin_port), indent=1))  # JSON is YAML


if __name__ == "__main__":
    main()
