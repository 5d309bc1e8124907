"""Shared fixtures: small random models that run in milliseconds on a CPU."""

import numpy as np
import pytest

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
