"""`stoker router`: one OpenAI endpoint in front of several `stoker serve` (docs/router.md).

Flag names follow the routers users know: `--worker-urls`, `--policy`, `--cache-threshold`,
`--balance-abs-threshold`, `--balance-rel-threshold` (SGLang's router and vllm-router),
`--prefill`/`--decode` (vllm-router's and vLLM's proxy examples' disaggregated mode),
`--max-local-prefill-length` and `--max-prefill-queue-size` (Dynamo's conditional
disaggregation). Registration is argparse only; FastAPI and uvicorn load in `run`.
"""

from __future__ import annotations

import argparse

from stoker.router.policy import POLICIES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router",
        help="OpenAI-compatible router: load- and prefix-aware balancing over several servers, or "
             "disaggregated prefill/decode",
        description="Without --prefill: a balancer over --worker-urls. With --prefill and --decode: disaggregated "
                    "serving over vLLM's kv_transfer_params protocol. docs/router.md.",
    )
    p.add_argument("--worker-urls", nargs="+", default=[], action="extend", metavar="URL",
                   help="servers of the balancer's pool (http://host:port)")
    p.add_argument("--prefill", nargs="+", default=[], action="extend", metavar="URL",
                   help="prefill servers (started with --kv-transfer-config); turns on disaggregated mode")
    p.add_argument("--decode", nargs="+", default=[], action="extend", metavar="URL",
                   help="decode servers: they stream the answers; without --prefill the same as --worker-urls")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="replica choice within a pool (default cache_aware: prefix affinity unless out of balance)")
    p.add_argument("--cache-threshold", type=float, default=0.3,
                   help="share of the prompt a replica must have seen for prefix affinity to pick it (default 0.3)")
    p.add_argument("--balance-abs-threshold", type=float, default=64,
                   help="load gap (requests) beyond which the least loaded replica is taken (default 64)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="and load ratio beyond which (default 1.5)")
    p.add_argument("--prefix-chunk-chars", type=int, default=64,
                   help="resolution of the prefix index in characters (default 64)")
    p.add_argument("--max-local-prefill-length", type=int, default=1000,
                   help="prompts with at most this many uncached tokens are prefilled on the decode server "
                        "(default 1000)")
    p.add_argument("--max-prefill-queue-size", type=float, default=2,
                   help="prefill on the decode server while every prefill server has at least this many waiting "
                        "requests (default 2)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="count prompt tokens with this local tokenizer instead of the decode server's /tokenize")
    p.add_argument("--metrics-interval-secs", type=float, default=1.0,
                   help="how often each server's /metrics is scraped for its load (default 1)")
    p.add_argument("--health-check-interval-secs", type=float, default=2.0,
                   help="how often an unhealthy server's /health is checked (default 2)")
    p.add_argument("--prefill-timeout-secs", type=float, default=600.0,
                   help="the prefill leg's deadline; past it the client gets 504 (default 600)")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20,
                   help="larger bodies get 413 (default 16 MiB, as stoker serve)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> "RouterConfig":  # noqa: F821 (imported lazily)
    from stoker.router.config import RouterConfig

    return RouterConfig(
        workers=tuple(args.worker_urls), prefill=tuple(args.prefill), decode=tuple(args.decode), policy=args.policy,
        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold, prefix_chunk_chars=args.prefix_chunk_chars,
        max_local_prefill_length=args.max_local_prefill_length, max_prefill_queue_size=args.max_prefill_queue_size,
        tokenizer=args.tokenizer, metrics_interval_s=args.metrics_interval_secs,
        health_check_interval_s=args.health_check_interval_secs, prefill_timeout_s=args.prefill_timeout_secs,
        max_request_body_bytes=args.max_request_body_bytes)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from stoker.router.app import create_app

    cfg = config_from_args(args)  # ValueError -> one line, exit 2 (stoker/cli.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = (f"disaggregated: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode" if cfg.disaggregated
            else f"balancer over {len(cfg.pool_urls)} servers")
    logging.getLogger("stoker.router").info("stoker router on http://%s:%d (%s, policy %s)", args.host, args.port,
                                            mode, cfg.policy)
    # No X-Forwarded-For rewriting (proxy_headers): the router reads no client address, and the
    # middleware is one more coroutine per request.
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False,
                proxy_headers=False)
    return 0
