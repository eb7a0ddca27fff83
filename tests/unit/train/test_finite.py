"""FiniteGuard: the first non-finite loss, gradient or weight stops the run, read back only at check()."""

from __future__ import annotations

import pytest
import torch

from dflash_train.errors import TrainingError
from dflash_train.train.finite import FiniteGuard


def _step(model, guard, step, scale=1.0, last=True):
    model.zero_grad()
    loss = (model(torch.ones(1, 4)) * scale).sum()
    loss.backward()
    guard.observe(step, loss, model if last else None)


def test_finite_steps_pass_and_read_nothing_until_check():
    model = torch.nn.Linear(4, 3)
    guard = FiniteGuard(torch.device("cpu"), lr=6e-4, grad_clip=1.0)
    for step in range(1, 6):
        _step(model, guard, step)
    guard.check()
    guard.check_weights(5, model)
    assert guard.first_bad.device.type == "cpu" and guard.first_bad.dtype == torch.int64


def test_first_bad_step_and_kind_are_reported_after_later_steps():
    model = torch.nn.Linear(4, 3)
    guard = FiniteGuard(torch.device("cpu"), lr=0.5, grad_clip=0.0)
    _step(model, guard, 1)
    _step(model, guard, 2, scale=float("inf"))  # inf loss (and NaN/inf gradients)
    _step(model, guard, 3)
    _step(model, guard, 4, scale=float("nan"))
    with pytest.raises(TrainingError, match=r"the loss is NaN or inf at step 2; lower optim.lr \(now 0.5\) or "
                                            r"set optim.grad_clip \(now off\)"):
        guard.check()


def test_gradients_alone_can_be_the_first_bad_value():
    model = torch.nn.Linear(4, 3)
    guard = FiniteGuard(torch.device("cpu"), lr=1e-3, grad_clip=1.0)
    _step(model, guard, 1)
    model.weight.grad[0, 0] = float("nan")  # e.g. an overflow inside the backward only
    guard.observe(7, torch.tensor(2.0), model)
    with pytest.raises(TrainingError, match=r"the gradient norm is NaN or inf at step 7"):
        guard.check()
    # a micro-batch that is not the step's last does not look at the (partial) gradients
    fresh = FiniteGuard(torch.device("cpu"), lr=1e-3, grad_clip=1.0)
    fresh.observe(7, torch.tensor(2.0), None)
    fresh.check()


def test_weights_made_non_finite_by_an_update_are_named():
    model = torch.nn.Linear(4, 3)
    guard = FiniteGuard(torch.device("cpu"), lr=float("inf"), grad_clip=1.0)
    _step(model, guard, 1)
    torch.optim.SGD(model.parameters(), lr=float("inf")).step()
    guard.check()  # the loss and gradients of step 1 were finite
    with pytest.raises(TrainingError, match=r"weights are NaN or inf after step 1 \(first: `weight`\).*"
                                            r"lower optim.lr \(now inf\)"):
        guard.check_weights(1, model)


def test_the_optimizers_clip_norm_is_the_gradient_check_when_it_computes_one():
    """The loop folds DeviceAdamW's own clip norm instead of a second pass over the gradients; without a
    clip the optimizer computes none and the guard's own pass stays."""
    from dflash_train.train.optimizer import DeviceAdamW

    model = torch.nn.Linear(4, 3)
    opt = DeviceAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                      fp32_masters=False)
    assert opt.computes_grad_norm and opt.grad_norm is None
    guard = FiniteGuard(torch.device("cpu"), lr=1e-3, grad_clip=1.0)
    guard.observe_grad_norm(1, opt.grad_norm)  # before any step: nothing to fold
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    guard.observe_grad_norm(1, opt.grad_norm)
    guard.check()
    model(torch.ones(2, 4)).sum().backward()
    model.bias.grad[1] = float("inf")
    opt.step()
    guard.observe_grad_norm(2, opt.grad_norm)
    with pytest.raises(TrainingError, match=r"the gradient norm is NaN or inf at step 2"):
        guard.check()
    assert not DeviceAdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0,
                           grad_clip=0.0, fp32_masters=False).computes_grad_norm
