"""The `pagoda` command line. Flags carry vLLM's names where they mean what vLLM's mean."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from dataclasses import asdict, fields
from pathlib import Path

from cluster.tool_parsers import TOOL_CALL_PARSERS
from engine import envs
from engine.arg_utils import add_engine_args, engine_args
from engine.config import EngineArgs, resolve_device

# checkpoints.tiny.TINY_ARCHES' keys (not imported here: it brings torch; a test keeps the two equal)
TINY_ARCH_NAMES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                   "deepseek_v2"]
_DEFAULT_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "import os\nimport sys\n"]

# One ingress process parses, validates and streams every request; on an H200, 256 streams all at once gave
# 20.3k total tok/s through 1 ingress replica, 24.3k-25.6k through 4 and 22.2k-22.5k through 8.
GPU_INGRESS_REPLICAS = 4
START_ATTEMPTS = 3  # a port HAProxy needs may be taken between choosing it and binding it: start again


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(**asdict(engine_args(args)))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or _DEFAULT_PROMPTS
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- {out.prompt!r}\n{out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")
    llm.shutdown()
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from checkpoints.tiny import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint to {args.dir}")
    return 0


def serve_app_args(args: argparse.Namespace) -> dict:
    """`pagoda serve` flags → the args of cluster.app:build_app (the same shape as deploy/serve.yaml's)."""
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    engine = engine_args(args)
    model = {k: v for k, v in asdict(engine).items() if v != defaults[k]}
    if args.served_model_name:
        model["served_model_name"] = args.served_model_name[0] if len(args.served_model_name) == 1 \
            else args.served_model_name
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (Pagoda turns tool_choice 'auto' on "
                         "whenever a parser is set or the chat template implies one)")
    for name in ("replica_num_cpus", "stream_interval_s", "max_ongoing_requests", "max_queued_requests",
                 "accelerator_type", "replica_resources", "tool_call_parser"):
        if getattr(args, name) is not None:
            model[name] = getattr(args, name)
    if args.engine_in_replica:
        model["engine_process"] = False
    if args.lora_modules:
        model["lora_modules"] = args.lora_modules
    scaling = {k: v for k, v in (("min_replicas", args.min_replicas), ("max_replicas", args.max_replicas),
                                 ("target_ongoing_requests", args.target_ongoing_requests)) if v is not None}
    if scaling and args.num_replicas is not None:
        raise ValueError("give --num-replicas or --min-replicas/--max-replicas/--target-ongoing-requests, not both")
    if scaling:
        scaling.setdefault("max_replicas", max(scaling.get("min_replicas", 1), 1))
        if args.autoscaling_policy:
            scaling["policy"] = args.autoscaling_policy
        model["autoscaling_config"] = scaling
    else:
        model["num_replicas"] = 1 if args.num_replicas is None else args.num_replicas
    ingress_replicas = args.ingress_replicas
    if ingress_replicas is None:
        ingress_replicas = GPU_INGRESS_REPLICAS if resolve_device(engine.device) == "cuda" else 1
    app = {"models": [model], "api_key": api_key(args),
           "ingress_replicas": ingress_replicas}
    if args.default_max_tokens is not None:
        app["default_max_tokens"] = args.default_max_tokens
    if args.ingress_resources:
        app["ingress_resources"] = args.ingress_resources
    if args.allow_runtime_lora_updating:
        app["allow_runtime_lora_updating"] = True
    return app


def lora_module(text: str) -> dict:
    """One --lora-modules item, as vLLM takes it: name=path, or a JSON object with name, path and optionally
    base_model_name."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if not isinstance(value, dict) or not {"name", "path"} <= value.keys() \
                or not value.keys() <= {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f"{text!r}: a JSON item has name, path and optionally base_model_name")
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not name=path (or a JSON object)")
    return {"name": name, "path": path}


def check_models(app_args: dict) -> None:
    """Reads every model's checkpoint config (and its draft model's, its --lora-modules adapters) here, before Ray
    starts: a missing or unreadable one is an error naming it, not a failed deployment after Ray has started (its
    replicas read them again where they run)."""
    from cluster.app import parse_args
    from cluster.lora_registry import adapter_id
    from engine.lora import LoRARequest, read_adapter

    for m in parse_args(app_args).models:
        config = m.engine.create_engine_config()
        for a in m.lora_modules or ():
            try:
                read_adapter(LoRARequest(a.name, adapter_id(a.name, a.path), a.path), config.model.hf_config,
                             config.lora.max_lora_rank)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {getattr(e, 'message', e)}") from None


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file's key, else --api-key's (which `ps` shows to every user of the machine), else $PAGODA_API_KEY."""
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return args.api_key or envs.get("PAGODA_API_KEY") or None
    try:
        key = Path(args.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"--api-key-file: {args.api_key_file} must hold one key, on one line")
    return key


def cmd_serve(args: argparse.Namespace) -> int:
    """Starts (or joins) Ray, deploys the app on host:port, serves until Ctrl-C or SIGTERM, then cleans up."""
    import ray

    from cluster.app import build_app, parse_args

    # Every flag is checked before anything starts: Pagoda's own checks, then Serve's and Ray's checks of the
    # deployments' options, which building the app runs (they used to refuse a value after Ray had started)
    _check_host_flags(args)
    app_args = serve_app_args(args)
    try:
        names = ", ".join(n for m in parse_args(app_args).models for n in m.names)
    except ValueError as e:
        raise ValueError(_as_flags(str(e), args.command_parser)) from None
    if not args.address:  # joining a cluster: the model may be on its nodes only (its replicas check it)
        try:
            check_models(app_args)
        except ValueError as e:
            raise ValueError(_as_flags(str(e), args.command_parser)) from None
    try:
        build_app(app_args)
    except (ValueError, TypeError) as e:
        raise ValueError(f"Serve refuses these flags' deployment options: {e}") from None
    # From here on a stop signal ends the server as Ctrl-C does, cleaning up, at any point of its start
    _on_stop_signals(_interrupt)
    if args.address or ray.is_initialized():
        print("pagoda: joining a running cluster: the environment it was started with decides the ingress mode",
              flush=True)
        return _serve(args, build_app(app_args), names, started_ray=False)
    from deploy.serve_env import cluster_env, is_loopback

    for _ in range(START_ATTEMPTS):
        _on_stop_signals(_interrupt)
        # Serve's processes read the environment when they start; a loopback --host keeps all of Ray on loopback
        with cluster_env(args.ingress_mode, args.host, local_only=is_loopback(args.host)):
            try:
                ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, logging_level="WARNING")
                _on_stop_signals(_interrupt)  # ray.init sets its own SIGTERM handler: exit at once
            except KeyboardInterrupt:  # stopped while Ray started
                _on_stop_signals(signal.SIG_IGN)
                ray.shutdown()
                return 0
            try:
                return _serve(args, build_app(app_args), names, started_ray=True)
            except _StartFailed as e:
                print(f"pagoda: start failed ({e.__cause__}); trying again with other ports", file=sys.stderr)
    print(f"pagoda: error: could not start after {START_ATTEMPTS} attempts", file=sys.stderr)
    return 1


def _check_host_flags(args: argparse.Namespace) -> None:
    import socket

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.num_cpus is not None and args.num_cpus < 1:
        raise ValueError(f"--num-cpus must be at least 1, got {args.num_cpus}")
    try:
        socket.getaddrinfo(args.host, args.port)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {args.host!r} is not an address of this machine's resolver: {e}") from None


def _as_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """An app-args error as the flags name them: `models.0.max_queued_requests` is `--max-queued-requests`."""
    def flag(match: re.Match) -> str:
        option = "--" + match.group(1).replace("_", "-")
        return option if option in parser._option_string_actions else match.group(0)

    return re.sub(r"\bmodels\.0\.(?:autoscaling_config\.)?(\w+)", flag, message)


class _StartFailed(Exception):
    pass


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _on_stop_signals(handler) -> None:
    """Ctrl-C, SIGTERM (systemd, Kubernetes, `kill`) and SIGHUP (a closed terminal) all go to `handler`."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def _is_port_race(e: BaseException) -> bool:
    """HAProxy, or Serve's fallback proxy ("Failed to bind to address ..."), could not bind a port that another
    process took after we chose it."""
    text = str(e).lower()
    return any(m in text for m in ("haproxy", "address already in use", "cannot bind", "failed to bind"))


def _serve(args: argparse.Namespace, app, names: str, started_ray: bool) -> int:
    import time

    import ray
    from ray import serve

    from deploy.serve_env import shutdown_serve

    try:
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            _on_stop_signals(_interrupt)  # again: a ray.init in serve.start (joining a cluster) sets its own
            serve.run(app, name="pagoda", route_prefix="/")
        except Exception as e:
            if started_ray and _is_port_race(e):
                raise _StartFailed() from e
            raise
        print(f"pagoda: serving {names} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # a stop signal (_interrupt), while starting up or serving
        pass
    finally:
        _on_stop_signals(signal.SIG_IGN)  # a second one would cut the shutdown short and leave processes behind
        print("pagoda: shutting down", flush=True)
        try:
            shutdown_serve()
        finally:
            if started_ray:
                ray.shutdown()
    return 0


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve (default: the built-in model)")
    add_engine_args(srv, model_positional=True)
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="the names clients ask for (default: the model as given); several are aliases")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster it starts")
    srv.add_argument("--num-replicas", type=int, default=None)
    srv.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    srv.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    srv.add_argument("--target-ongoing-requests", type=float, default=None, help="autoscaling: per replica")
    srv.add_argument("--replica-num-cpus", type=float, default=None, help="CPUs reserved per replica (default 1)")
    srv.add_argument("--accelerator-type", default=None, help="replicas only on nodes with this accelerator")
    srv.add_argument("--replica-resources", type=json.loads, default=None, metavar="JSON",
                     help='custom Ray resources each replica needs, e.g. \'{"model_slot": 1}\'')
    srv.add_argument("--ingress-resources", type=json.loads, default=None, metavar="JSON",
                     help='custom Ray resources of the ingress replicas, e.g. \'{"head": 1}\' to pin them to the head')
    srv.add_argument("--autoscaling-policy", choices=["pagoda", "ongoing_requests"], default=None,
                     help="pagoda (default): scale on KV-cache use and waiting requests too; ongoing_requests: Serve's")
    srv.add_argument("--max-ongoing-requests", type=int, default=None,
                     help="requests each replica's engine runs or queues (default: 256, or --max-num-seqs if "
                          "more); beyond them requests wait for a replica")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests that may wait for a replica (default 1024); beyond: 429 with Retry-After")
    srv.add_argument("--default-max-tokens", type=int, default=None,
                     help="max_tokens of a chat request that gives none (default: the rest of the context)")
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
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="the model's tool-call format, read for tool_choice 'auto' (default: the one its chat "
                          "template implies, if any)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="vLLM's flag: requires --tool-call-parser ('auto' is on whenever a parser is known)")
    srv.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) served by name, with --enable-lora: name=path or "
                          "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                          "PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (shown by ps: prefer --api-key-file or $PAGODA_API_KEY)")
    srv.add_argument("--api-key-file", default=None, metavar="PATH", help="--api-key, read from this file")
    srv.add_argument("--disable-log-requests", action="store_true",
                     help="accepted for vLLM's users: Pagoda does not log requests")
    srv.set_defaults(func=cmd_serve)


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

    _add_serve_parser(sub)

    tiny = sub.add_parser("make-tiny-model", help="write the built-in tiny checkpoint (random weights) to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=TINY_ARCH_NAMES)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)

    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, sampler, quality, cold-start "
                                         "(`pagoda bench --help`)")
    bench.set_defaults(func=lambda args: _run_bench(args.benchmark_args))
    bench.add_argument("benchmark_args", nargs=argparse.REMAINDER)

    grafana = sub.add_parser("grafana", help="Grafana: push the dashboard")
    grafana_sub = grafana.add_subparsers(dest="grafana_command", required=True)
    from deploy.grafana_push import add_grafana_args, run_grafana_push

    push = grafana_sub.add_parser("push", help="create or update the Pagoda dashboard through Grafana's HTTP API")
    add_grafana_args(push)
    push.set_defaults(func=run_grafana_push)
    for subparser in sub.choices.values():
        subparser.set_defaults(command_parser=subparser)
    grafana.set_defaults(command_parser=grafana)
    push.set_defaults(command_parser=push)
    return parser


def _run_bench(argv: list[str]) -> int:
    """The benchmarks live in benchmarks/ (not in the image): imported only when asked for. They parse their own
    flags, as `pagoda bench`."""
    try:
        from benchmarks.cli import main as bench_main
    except ImportError as e:
        print(f"pagoda: error: the benchmarks are not installed here ({e}); run them from a clone", file=sys.stderr)
        return 2
    try:
        return bench_main(argv, prog="pagoda bench")
    except ValueError as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # straight to the benchmarks' parser: `pagoda bench --help` lists them
        return _run_bench(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # that command's usage
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
