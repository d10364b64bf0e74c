"""An engine of disaggregated prefill in a process of its own (another "node").

``python -m tests.engine.peer_producer CHECKPOINT CONFIG_JSON READY_PATH``:
a producer (``kv_role`` in the config) computes the prompts of
``tests.engine.test_disagg_prefill`` (one token each), writes ``READY_PATH``
and serves their KV until its stdin closes (at most ``LIFETIME_S``), then
shuts down; a consumer generates them and then writes ``READY_PATH``.
"""

from __future__ import annotations

import json
import select
import sys
from pathlib import Path

LIFETIME_S = 110.0


def main() -> None:
    checkpoint, config, ready = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    from mpexec import LLM, SamplingParams
    from tests.engine.test_disagg_prefill import PROMPTS, params

    with LLM(checkpoint, executor_backend="uni", num_threads=1, max_num_batched_tokens=64,
             block_size=4, kv_transfer_config=config) as llm:
        if config["kv_role"] == "kv_consumer":
            llm.generate(PROMPTS, params())
            ready.write_text("done")
            return
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        ready.write_text("ready")
        select.select([sys.stdin], [], [], LIFETIME_S)


if __name__ == "__main__":
    main()
