"""The benchmarks, one module per chapter: ``python -m minillm bench <topic>`` runs ``TOPICS[topic].main``.

Every run starts with one line saying what the numbers were measured on: the backend, the BLAS
threads, the cores and the load average (``backend.runtime_summary``), with a warning when other
work is using the CPU.
"""

from __future__ import annotations

import importlib

from ..backend import runtime_summary

TOPICS = {
    "kv-cache": "minillm.benchmarks.kv_cache",
    "attention": "minillm.benchmarks.attention",
    "speculative": "minillm.benchmarks.speculative",
    "paged": "minillm.benchmarks.paged",
    "batch-speculative": "minillm.benchmarks.batch_speculative",
    "threads": "minillm.benchmarks.threads",
    "serving": "minillm.benchmarks.serving",
    "real-model": "minillm.benchmarks.real_model",
    "training-curves": "minillm.benchmarks.training",
}


def run(topic: str, argv: list[str]) -> int:
    """Run one benchmark topic: its module's ``main(argv)``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown benchmark {topic!r}; choose from {', '.join(TOPICS)}")
    module = importlib.import_module(TOPICS[topic])
    print(runtime_summary(), flush=True)
    return module.main(argv)
