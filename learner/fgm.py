"""Fast Gradient Method (FGM) adversarial training on the shared input embedding (docs/design.md, "The method", step 4).

The original targeted its embedding by a parameter-name string that did not exist in the model, so its
FGM silently did nothing. Here the parameter is found by identity: `model.get_input_embeddings().weight`,
which for BART is `model.model.shared.weight`, the very object tied into the encoder's and decoder's
`embed_tokens` and `lm_head`. Perturbing it perturbs every place it is used.

A train step:

    loss = model(**batch).loss
    loss.backward()
    with fgm.perturbed():                 # attack() ... restore()
        model(**batch).loss.backward()    # adversarial gradient adds to the clean one
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def input_embedding_parameter(model: torch.nn.Module) -> torch.nn.Parameter:
    """The weight of `model.get_input_embeddings()` ([V, d_model]); unwraps DDP/FSDP-style `.module`."""
    target = model
    if not hasattr(target, "get_input_embeddings") and hasattr(target, "module"):
        target = target.get_submodule("module")
    get_embeddings = getattr(target, "get_input_embeddings", None)
    if get_embeddings is None:
        raise TypeError(
            f"model ({type(model).__name__}) has no get_input_embeddings(); FGM needs a transformers model"
        )
    embeddings = get_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        raise TypeError(f"model.get_input_embeddings() ({type(embeddings).__name__}) has no weight Parameter")
    return weight


class FGM:
    """Adds r = epsilon · g / ‖g‖ to the input embedding matrix W, where g is W.grad and ‖g‖ its Frobenius
    norm over the whole [V, d_model] matrix, and puts W back afterwards.

    Because the direction is normalised, a constant gradient scale (AMP's GradScaler) does not change r;
    a gradient with a zero or non-finite norm (an overflowed AMP step) makes `attack()` a no-op.
    """

    def __init__(self, model: torch.nn.Module, epsilon: float = 1.0) -> None:
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        self.param = input_embedding_parameter(model)
        self.epsilon = float(epsilon)
        self._backup: torch.Tensor | None = None
        self._attacked = False

    def attack(self) -> bool:
        """Perturb W along its current gradient; return whether it did (False when ‖g‖ is 0 or non-finite).

        Call after the clean backward pass; must be followed by `restore()` (also when it returned False).
        """
        if self._attacked:
            raise RuntimeError(
                "FGM.attack() called twice without restore(); the original weights would be lost"
            )
        grad = self.param.grad
        if grad is None:
            raise RuntimeError(
                "FGM.attack(): the input embedding has no gradient; call loss.backward() before attack() "
                "(and do not zero the gradients in between)"
            )
        self._attacked = True
        norm = torch.linalg.vector_norm(grad.float())
        if norm == 0 or not torch.isfinite(norm):
            return False
        self._backup = self.param.detach().clone()
        # In-place under no_grad (not via .data) bumps the version counter, so a backward through a graph
        # built before attack() or restore() fails loudly instead of using the wrong weights.
        with torch.no_grad():
            self.param.add_((grad.float() * (self.epsilon / norm)).to(self.param.dtype))
        return True

    def restore(self) -> None:
        """Put back the exact (bitwise) weights saved by `attack()`."""
        if not self._attacked:
            raise RuntimeError("FGM.restore() called without a preceding attack()")
        if self._backup is not None:
            with torch.no_grad():
                self.param.copy_(self._backup)
        self._backup = None
        self._attacked = False

    @contextmanager
    def perturbed(self) -> Iterator[bool]:
        """`attack()` on entry, `restore()` on exit (also on error); yields what `attack()` returned."""
        perturbed = self.attack()
        try:
            yield perturbed
        finally:
            self.restore()
