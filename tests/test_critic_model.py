"""The critic's value model has no dropout: the values it trains on (train mode) must be the values
`compute_values` gives (eval mode), or the clipped value loss compares noisy values with clean old ones."""

from __future__ import annotations

import torch

from roll_core.config.clusters import ModelArgs
from workers.strategies.loading import load_value_model


def test_critic_values_in_train_mode_equal_eval_mode(tiny_model):
    model = load_value_model(ModelArgs(model_name_or_path=str(tiny_model)))
    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()
        clean = model(input_ids=ids).logits
        model.train()
        torch.manual_seed(1)
        trained = model(input_ids=ids).logits
    assert torch.equal(trained, clean)
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
