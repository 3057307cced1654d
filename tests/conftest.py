import pytest
import torch

from tests import tiny

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return tiny.qwen2(seed=0)


@pytest.fixture(scope="session")
def drafts(target_model):
    """Three drafts per target: unrelated random, identical, and a noisy copy."""
    return {
        "random": tiny.qwen2(seed=1, hidden=32, layers=1),
        "same": target_model,
        "noisy": tiny.noisy_copy(target_model, scale=0.02, seed=2),
    }
