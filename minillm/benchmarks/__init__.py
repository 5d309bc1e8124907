"""The benchmarks, one module per chapter: ``python -m minillm bench <topic>`` runs ``TOPICS[topic].main``.

Every run starts, once its options are checked, with one line saying what the numbers are measured
on: the backend, the BLAS threads, the cores and the load average, with a warning when other work
is using the CPU (``common.parse_args``).
"""

from __future__ import annotations

import importlib

TOPICS = {
    "kv-cache": "minillm.benchmarks.kv_cache",
    "attention": "minillm.benchmarks.attention",
    "speculative": "minillm.benchmarks.speculative",
    "speculation-zoo": "minillm.benchmarks.speculation_zoo",
    "paged": "minillm.benchmarks.paged",
    "batch-speculative": "minillm.benchmarks.batch_speculative",
    "threads": "minillm.benchmarks.threads",
    "serving": "minillm.benchmarks.serving",
    "real-model": "minillm.benchmarks.real_model",
    "training-curves": "minillm.benchmarks.training",
    "lookahead": "minillm.benchmarks.lookahead",
    "verify-cost": "minillm.benchmarks.verify_cost",
    "device-calls": "minillm.benchmarks.device_calls",
}


def run(topic: str, argv: list[str]) -> int:
    """Run one benchmark topic: its module's ``main(argv)``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown benchmark {topic!r}; choose from {', '.join(TOPICS)}")
    return importlib.import_module(TOPICS[topic]).main(argv)
