"""Shared fixtures: small random models that run in milliseconds on a CPU."""

import numpy as np
import pytest
from hypothesis import Phase, settings

from minillm import GPT, GPTConfig


@pytest.fixture
def tiny_config():
    return GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture
def tiny_model(tiny_config):
    return GPT.init(tiny_config, seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# Hypothesis's "explain" phase (with the patch file it writes) takes ~40 s per failing property test
# here, which a student edition hits at once; the shrunk failing example is what a reader needs.
settings.register_profile("minillm", phases=[p for p in Phase if p is not Phase.explain])
settings.load_profile("minillm")
