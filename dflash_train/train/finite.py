"""Stopping a run at its first non-finite loss or gradient, without a host sync per micro-batch.

`observe` folds `isfinite` of each micro-batch's loss sum and, before the optimizer step, of the
accumulated gradients' norm (or, `observe_grad_norm`, the norm the optimizer computed for its clip)
into one int64 tensor on the device: the first bad (step, kind) as `step * 4 + kind`, a large
sentinel while all is well. Nothing is read back until `check`, which the loop calls before it logs,
validates or saves (one read; ranks agree by a MIN all-reduce), so no metric, checkpoint or final
drafter is ever written from a diverged step. `check_weights` catches the one case the loss and
gradients miss: an update (lr inf, say) that turns finite gradients into non-finite weights; it runs
before every save.
"""

from __future__ import annotations

import torch

from dflash_train.errors import TrainingError

NEVER = 2**62
LOSS, GRADIENTS = 1, 2
KINDS = {LOSS: "the loss", GRADIENTS: "the gradient norm"}


class FiniteGuard:
    def __init__(self, device: torch.device, lr: float, grad_clip: float):
        self.first_bad = torch.full((), NEVER, dtype=torch.long, device=device)
        self.lr, self.grad_clip = lr, grad_clip

    def _fold(self, step: int, kind: int, value: torch.Tensor) -> None:
        code = torch.where(torch.isfinite(value).all(), NEVER, step * 4 + kind)
        self.first_bad = torch.minimum(self.first_bad, code.to(self.first_bad.device))

    def observe(self, step: int, loss_sum: torch.Tensor, module: torch.nn.Module | None = None) -> None:
        """Record step `step`'s micro-batch loss; with `module`, its accumulated gradients too (call that
        after the step's last backward, before the optimizer step). Device work only."""
        self._fold(step, LOSS, loss_sum.detach())
        if module is not None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]  # none under ZeRO-2/3
            if grads:
                self._fold(step, GRADIENTS, torch.nn.utils.get_total_norm(grads))

    def observe_grad_norm(self, step: int, norm: torch.Tensor | None) -> None:
        """Record step `step`'s gradient norm as an optimizer computed it (DeviceAdamW's, for its clip)."""
        if norm is not None:
            self._fold(step, GRADIENTS, norm.detach())

    def _advice(self) -> str:
        clip = f"tighten optim.grad_clip (now {self.grad_clip:g})" if self.grad_clip else "set optim.grad_clip (now off)"
        return (f"lower optim.lr (now {self.lr:g}) or {clip}; nothing from this step on was saved "
                "(the newest checkpoint, if any, is from before it)")

    def check(self) -> None:
        """Raise TrainingError naming the first step whose loss or gradients were not finite."""
        import torch.distributed as dist

        first = self.first_bad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        code = int(first)
        if code < NEVER:
            step, kind = divmod(code, 4)
            raise TrainingError(f"training stopped: {KINDS[kind]} is NaN or inf at step {step}; {self._advice()}")

    def check_weights(self, step: int, module: torch.nn.Module) -> None:
        """Raise TrainingError when a weight about to be saved is not finite."""
        from dflash_train.model.checks import all_finite

        bad = next((n for n, p in module.named_parameters() if not all_finite(p.detach())), None)
        if bad is None:
            return
        raise TrainingError(f"training stopped: the weights are NaN or inf after step {step} (first: `{bad}`) "
                            f"although the loss and gradients were finite; {self._advice()}")
