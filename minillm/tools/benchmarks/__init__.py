"""The benchmarks, one module per chapter: ``python -m minillm bench <topic>`` runs ``TOPICS[topic].main``.

Every run starts, once its options are checked, with one line saying what the numbers are measured
on: the backend, the BLAS threads, the cores and the load average, with a warning when other work
is using the CPU (``common.parse_args``).
"""

from __future__ import annotations

import importlib

TOPICS = {
    "kv-cache": "minillm.tools.benchmarks.kv_cache",
    "attention": "minillm.tools.benchmarks.attention",
    "speculative": "minillm.tools.benchmarks.speculative",
    "speculation-zoo": "minillm.tools.benchmarks.speculation_zoo",
    "paged": "minillm.tools.benchmarks.paged",
    "batch-speculative": "minillm.tools.benchmarks.batch_speculative",
    "threads": "minillm.tools.benchmarks.threads",
    "serving": "minillm.tools.benchmarks.serving",
    "real-model": "minillm.tools.benchmarks.real_model",
    "training-curves": "minillm.tools.benchmarks.training",
    "lookahead": "minillm.tools.benchmarks.lookahead",
    "verify-cost": "minillm.tools.benchmarks.verify_cost",
    "real-speculation": "minillm.tools.benchmarks.real_speculation",
    "device-calls": "minillm.tools.benchmarks.device_calls",
    "serve-load": "minillm.tools.benchmarks.serve_load",
    "serve-speculation": "minillm.tools.benchmarks.serve_speculation",
    "quantized": "minillm.tools.benchmarks.quantized",
    "quant-quality": "minillm.tools.benchmarks.quant_quality",
    "chat-speculation": "minillm.tools.benchmarks.chat_speculation",
}


def run(topic: str, argv: list[str]) -> int:
    """Run one benchmark topic: its module's ``main(argv)``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown benchmark {topic!r}; choose from {', '.join(TOPICS)}")
    return importlib.import_module(TOPICS[topic]).main(argv)
