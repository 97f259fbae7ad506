"""``python -m orchestrator.openai_server --topology FILE --server NAME``: the OpenAI front
of one server of a topology, on that server's address and ``openai_port``."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.config import Topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", required=True, help="the topology.json `epd render` wrote")
    parser.add_argument("--server", required=True, help="the server whose models it calls")
    args = parser.parse_args()
    import uvicorn

    from orchestrator.openai_server.app import create_app

    topology = Topology.model_validate_json(Path(args.topology).read_text())
    spec = topology.servers[args.server]
    if spec.openai_port is None:
        parser.error(f"server {args.server!r} has no openai_port in {args.topology}")
    uvicorn.run(
        create_app(topology, args.server),
        host=spec.bind_address,
        port=spec.openai_port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
