"""``siesta serve``: settings from the command line, then uvicorn until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from siesta.config import EngineConfig
from siesta.entrypoints.server.app import build_app, engine_starter
from siesta.entrypoints.server.state import API_KEY_ENV, ServerConfig, dev_mode_from_env

# Streams still open at Ctrl-C get this long before the server closes them.
GRACEFUL_SHUTDOWN_S = 5


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        dev_mode=args.dev_mode or dev_mode_from_env(),
        model_path=args.model,
        max_request_fanout=args.max_request_fanout,
        max_request_body_bytes=args.max_request_body_bytes,
    )


def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = server_config(args)
    if config.dev_mode:
        logging.getLogger(__name__).warning("dev mode: the control routes (/sleep, /pause, ...) are enabled")
    app = build_app(config, engine_starter(engine_config))
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run()
    code = getattr(app.state, "exit_code", 0)
    if code:
        sys.exit(code)  # the engine core died: a supervisor restarts the server
